"""The simulator's calibration and studies: checkout tooling, not installed with gpumem.

The simulator itself is :mod:`gpumem.sim` (replay, reports and the managers open it at run time). This
folder holds what tunes and checks it, run from the checkout's root:

* :mod:`sim.calibrate` - ``python -m sim.calibrate``: the device-call latencies of a real GPU (CuPy and
  cuda-bindings), which :mod:`gpumem.sim.latency` models;
* :mod:`sim.fit_latency` - the latency model fitted to several calibrations of one GPU;
* :mod:`sim.gpu_timing_bench`, :mod:`sim.gpu_timing_live` - the simulated GPU timings against each other
  and against live runs;
* :mod:`sim.predict_live` - every traced live run against each candidate replay setting (GPU timing, sync
  threshold, latency model), split into tuning and check rows: which setting is the default;
* :mod:`sim.growth_sweep` - the growth/move policy swept over the bundled traces;
* :mod:`sim.workspace_scenario` - the workspace scenario on every simulated profile;
* :mod:`sim.soak` - a simulated multi-GPU host under pressure and injected faults.
* :mod:`sim.cli_checks` - checks the studies' command lines share (a ``--json`` target, before the study).
"""
