"""Fragmentation reports: replay a trace under several allocator policies on several devices and write
``index.html`` with figures (PNG) and the numbers behind them (JSON, CSV).

>>> from gpumem.report import ReportOptions, build_report
>>> build_report("data/traces/resnet_train.snapshot.pickle.gz", "out/resnet",
...              ReportOptions(policies=("pytorch", "expandable", "gpumem")))

``gpumem report`` is the command line (:mod:`gpumem.commands.report`); ``docs/reports.md`` explains the figures.
:func:`run_sweep` (``gpumem sweep``, ``docs/sweeps.md``) replays every combination of traces, devices,
policies and limits into one table.
"""

from .build import DEFAULT_DEVICES, ReportExistsError, ReportOptions, ReportResult, build_report
from .runs import FitCell, Occupancy, PolicyRun, SegmentLayout, Timeline, occupancy_at, run_policy, smallest_limit
from .sites import Site, SiteTable, live_by_site, snapshot_sites
from .sweep import SweepCase, SweepError, SweepResult, SweepRow, SweepStatus, run_sweep, write_sweep

__all__ = [
    "DEFAULT_DEVICES", "FitCell", "Occupancy", "PolicyRun", "ReportExistsError", "ReportOptions", "ReportResult",
    "SegmentLayout", "Site", "SiteTable", "Timeline", "build_report", "live_by_site", "occupancy_at",
    "run_policy", "smallest_limit", "snapshot_sites",
    "SweepCase", "SweepError", "SweepResult", "SweepRow", "SweepStatus", "run_sweep", "write_sweep",
]
