"""Hardware-in-the-loop tooling for gpumem: checkout tooling, not installed with the package.

* :mod:`hil.runner` - ``python -m hil run --device cuda:0 --out reports/hil/``: every
  device suite, the peer benchmark, the simulator fidelity check and compute-sanitizer runs on a real
  GPU, written as one record (docs/hil.md);
* :mod:`hil.suites`, :mod:`hil.peers`, :mod:`hil.fidelity`,
  :mod:`hil.sanitizer`, :mod:`hil.environment` - its parts;
* :mod:`hil.probes` - measurements on a real GPU: a kernel reading memory while it is freed, training
  and live workloads under each allocator, PyTorch on gpumem's shim, NVML pressure from a second process.

The suites are plain pytest run with gpumem's plugin, :mod:`gpumem.testing` (entry point ``gpumem_hil``),
which runs the device-parametrised suites on simulated profiles or on a real GPU
(``pytest --gpumem-device cuda:0``) and records single pytest runs (``--gpumem-record DIR``). The
simulator's calibration probe and studies are in the checkout's ``sim/`` (``python -m sim.calibrate``).
"""
