"""multistream_infer's memory against its simulated time, over ``busy_slack`` (issue 18): how much memory the
default's host waits save and what they cost, on ``sim:h200-141gb`` with the GPU behind (``gpu_timing="trace"``).

    python reports/multistream-busy-frontier.py

About 10 s on one core; prints the table of reports/multistream-busy-frontier.md."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gpumem.allocator.policy import get_policy
from gpumem.replay import replay_trace
from gpumem.trace import load_trace

TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "multistream_infer_h200.snapshot.pickle.gz"
SETTINGS = [("gpumem, busy_slack 0.05 (the default)", {}), ("gpumem, busy_slack 0.10", {"busy_slack": 0.10}),
            ("gpumem, busy_slack 0.25", {"busy_slack": 0.25}), ("gpumem, busy_slack 1.0", {"busy_slack": 1.0}),
            ("gpumem, wait_on_gpu", {"wait_on_gpu": True})]


def main() -> None:
    trace = load_trace(TRACE)
    pytorch = replay_trace(trace, "sim:h200-141gb", "pytorch", progress=False)
    print("| policy | overhead | simulated time (ms) | vs the pytorch model | device calls |")
    print("|---|---|---|---|---|")
    print(f"| pytorch model | {pytorch.overhead:.2%} | {pytorch.sim_time_s * 1e3:.1f} | | {pytorch.stats.device_calls:,} |")
    for name, knobs in SETTINGS:
        r = replay_trace(trace, "sim:h200-141gb", dataclasses.replace(get_policy("gpumem"), **knobs), progress=False)
        print(f"| {name} | {r.overhead:.2%} | {r.sim_time_s * 1e3:.1f} | {r.sim_time_s / pytorch.sim_time_s - 1:+.1%} "
              f"| {r.stats.device_calls:,} |")


if __name__ == "__main__":
    main()
