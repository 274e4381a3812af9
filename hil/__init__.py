"""Hardware-in-the-loop support for gpumem.

* :mod:`hil.runner` - ``python -m hil run --device cuda:0 --out reports/hil/``: every
  device suite, the peer benchmark, the simulator fidelity check and compute-sanitizer runs on a real
  GPU, written as one record (docs/hil.md);
* :mod:`hil.suites`, :mod:`hil.peers`, :mod:`hil.fidelity`,
  :mod:`hil.sanitizer`, :mod:`hil.environment` - its parts;
* :mod:`gpumem.testing` - the pytest plugin (entry point ``gpumem_hil``) that runs the
  device-parametrised suites on simulated profiles or on a real GPU (``pytest --gpumem-device cuda:0``)
  and records single pytest runs (``--gpumem-record DIR``);
* :mod:`hil.probes` - measurement scripts run on real GPUs to calibrate the simulator.

The plugin acts only in projects that opt in (ini key ``gpumem_hil = true``) or runs given
``--gpumem-device``: installing gpumem leaves other projects' pytest runs unchanged.
"""
