"""How long merging a record_stream log takes (:func:`gpumem.trace.stream_log.merge_stream_uses`) on the
shapes that made it quadratic (review attacker 6, finding 3): one address reused by every block, uses
placed by the allocator's counts; a trace of dense ops, one use whose pointer no block holds, placed by
time (the whole ±TIME_TOLERANCE_US window searched); and many uses placed by time on a reused address.

Prints one table; run it under another gpumem (``PYTHONPATH``) to compare two versions on one machine::

    python -m benchmarks.stream_log_merge --hot 10000 20000 40000 --dense 16000 32000 --by-time 10000 100000
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from gpumem.errors import TraceFormatError
from gpumem.trace import Trace
from gpumem.trace.stream_log import LoggedUse, RecordStreamLog, merge_stream_uses

HOT_ADDR = 0x7F0000000000


def _hot_trace(n_blocks: int) -> Trace:
    """``n_blocks`` 1 MiB blocks made and freed in turn at one address (stream 0), then one on stream 7."""
    kinds = np.r_[np.tile([0, 1], n_blocks), [0]].astype(np.int8)
    ids = np.r_[np.repeat(np.arange(n_blocks), 2), [n_blocks]]
    nbytes = np.r_[np.full(2 * n_blocks, 1 << 20), [512]]
    streams = np.r_[np.zeros(2 * n_blocks, np.int64), [7]]
    times = np.r_[1000 + np.arange(2 * n_blocks) * 1.0, [1000 + 2 * n_blocks]]
    addrs = np.r_[np.full(2 * n_blocks, HOT_ADDR), [0x10000]]
    return Trace("hot", "gpumem", kinds, ids, nbytes, streams, times, addrs)


def hot_by_counts(n_blocks: int) -> tuple[int, float]:
    """One use per 4 blocks, placed by the counts (attacker's ``hot.py``)."""
    trace = _hot_trace(n_blocks)
    uses = tuple(LoggedUse(0, HOT_ADDR, 7, 1000 + 2 * k + 0.5, k + 1, k) for k in range(0, n_blocks, 4))
    t0 = time.perf_counter()
    merge_stream_uses(trace, RecordStreamLog(uses, {0: (0, 0)}))
    return len(uses), time.perf_counter() - t0


def hot_by_time(n_uses: int) -> tuple[int, float]:
    """``n_uses`` uses without counts on the hot address, each 0.5 us after its block's free (so the first
    guess misses and the window is searched), on a trace of ``n_uses`` blocks."""
    trace = _hot_trace(n_uses)
    uses = tuple(LoggedUse(0, HOT_ADDR, 7, 1000 + 2 * k + 1.5) for k in range(n_uses))
    t0 = time.perf_counter()
    merge_stream_uses(trace, RecordStreamLog(uses, {0: (0, 0)}))
    return len(uses), time.perf_counter() - t0


def dense_window(n: int) -> tuple[int, float]:
    """``2 n`` ops 1 ns apart, one use whose pointer no block holds then (refused after the window is searched:
    attacker's ``window.py``). The pointer's one block is made long after (a pointer no block ever holds is
    skipped at once, as PyTorch skips it: review attacker 8)."""
    kinds = np.r_[np.zeros(n, np.int8), np.ones(n, np.int8), [0]].astype(np.int8)
    ids = np.r_[np.arange(n), np.arange(n), [n]]
    addrs = np.r_[0x10000 + np.arange(n) * 512, 0x10000 + np.arange(n) * 512, [0x1]]
    trace = Trace("dense", "gpumem", kinds, ids, np.full(2 * n + 1, 512), np.r_[np.arange(n) % 2, np.arange(n) % 2, [0]],
                  np.r_[1000 + np.arange(2 * n) * 0.001, [1e9]], addrs)
    t0 = time.perf_counter()
    try:
        merge_stream_uses(trace, RecordStreamLog((LoggedUse(0, 0x1, 1, 1000 + n * 0.001),), {0: (0, 0)}))
    except TraceFormatError:
        pass
    return 1, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stream_log_merge", description=__doc__.split("\n\n")[0])
    p.add_argument("--hot", type=int, nargs="*", default=[10000, 20000, 40000], metavar="BLOCKS",
                   help="blocks at one address, uses placed by the counts (default: %(default)s)")
    p.add_argument("--dense", type=int, nargs="*", default=[16000, 32000], metavar="N",
                   help="2 N dense ops, one use searched by time (default: %(default)s)")
    p.add_argument("--by-time", type=int, nargs="*", default=[10000, 100000], metavar="USES",
                   help="uses placed by time on a reused address (default: %(default)s)")
    args = p.parse_args(argv)
    rows = [(f"hot address, {n:,} blocks, by counts", hot_by_counts, n) for n in args.hot]
    rows += [(f"dense ops, {2 * n:,} ops, one use by time", dense_window, n) for n in args.dense]
    rows += [(f"hot address, {n:,} blocks, by time", hot_by_time, n) for n in args.by_time]
    print(f"{'case':<44}{'uses':>9}{'merge s':>10}{'us/use':>10}")
    for label, fn, n in rows:
        n_uses, secs = fn(n)
        print(f"{label:<44}{n_uses:>9,}{secs:>10.3f}{secs / n_uses * 1e6:>10.1f}", flush=True)


if __name__ == "__main__":
    main()
