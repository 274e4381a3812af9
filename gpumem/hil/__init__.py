"""Hardware-in-the-loop support for gpumem.

* :mod:`gpumem.hil.plugin` - the pytest plugin (entry point ``gpumem_hil``) that runs the
  device-parametrised suites (``tests/contract``) on simulated profiles or on a real
  GPU (``pytest --gpumem-device cuda:0``) and records runs (``--gpumem-record DIR``);
* :mod:`gpumem.hil.probes` - measurement scripts run on real GPUs to calibrate the simulator.

The plugin acts only in projects that opt in (ini key ``gpumem_hil = true``) or runs given
``--gpumem-device``: installing gpumem leaves other projects' pytest runs unchanged.
"""
