"""The simulator's view of ``wait_own_stream``: off; on with the steal's order (the rule until 2026-12-01: the
largest idle chunk, then the highest address); on with the oldest fence as measured live on 2026-12-01 (before
attacker 40: any size, a busy chunk's first page fenced alone); and on as the code is now (Note [Wait for the
oldest fence]: the largest chunks, then the oldest fence, every page of a busy chunk fenced when met).
Peak reserved above peak allocated, device calls and the simulated time of the replay, on the traces of
``workloads-today-h200-2026-11-30/run-a`` (with and without their step marks) and the corpus of data/traces.
Python engine (the old order is patched back in there); default GPU timing of each trace.

    PYTHONPATH=. python reports/hil/wait-oldest-h200-2026-12-01/sim_rule.py [--corpus]
"""
import dataclasses
import sys
import warnings
from pathlib import Path

from gpumem.allocator import backing
from gpumem.allocator.policy import get_policy
from gpumem.replay import replay_trace
from gpumem.trace import load_trace
from gpumem.trace.corpus import CHECK, TUNING

ROOT = Path(__file__).resolve().parents[3]
RUN_A = ROOT / "reports/hil/workloads-today-h200-2026-11-30/run-a"
NOW_ORDER = backing.VirtualBacking._chunk_of_stream
NOW_READY = backing.VirtualBacking._chunk_ready


def first_busy_page(self, seg, s, wait, batch, busy=None):
    """_chunk_ready before attacker 40: the pass stops at the first busy page, the others left unfenced."""
    n = seg.chunks[s].nbytes // self.granularity
    return all(self._page_ready(seg, q, wait, batch, busy) for q in range(s, s + n))


def steal_order(self, seg, first, last, max_pages, stream, batch, busy):
    """The rule before 2026-12-01: the first chunk in the steal's order whose other streams' work is done."""
    for _, _, s, other in self._idle_walk(seg, first, last, max_pages):
        pending = self._chunk_fences(other, s, batch)
        if all(st == stream or self._fence_done(st, number, busy) for st, number in pending.items()):
            return other, s, pending
    return None


def oldest_any_size(self, seg, first, last, max_pages, stream, batch, busy):
    """The rule measured live on 2026-12-01: the oldest fence on ``stream`` whatever the chunk's size."""
    if busy is None:
        return steal_order(self, seg, first, last, max_pages, stream, batch, busy)
    best = None
    for _, _, s, other in self._idle_walk(seg, first, last, max_pages):
        pending = self._chunk_fences(other, s, batch)
        if all(st == stream or self._fence_done(st, number, busy) for st, number in pending.items()):
            own = pending.get(stream, -1)
            if best is None or own < best[0]:
                best = (own, (other, s, pending))
    return None if best is None else best[1]


def row(name, part, trace):
    cells = []
    for wait_own, order, ready in ((False, NOW_ORDER, NOW_READY), (True, steal_order, first_busy_page),
                                   (True, oldest_any_size, first_busy_page), (True, NOW_ORDER, NOW_READY)):
        backing.VirtualBacking._chunk_of_stream = order
        backing.VirtualBacking._chunk_ready = ready
        policy = dataclasses.replace(get_policy("gpumem"), wait_own_stream=wait_own)
        r = replay_trace(trace, "sim:h200-141gb", policy, progress=False, engine="python")
        cells.append(f"{r.overhead * 100:.2f} % / {r.stats.device_calls:,} / {r.sim_time_s:.3f} s")
    backing.VirtualBacking._chunk_of_stream = NOW_ORDER
    backing.VirtualBacking._chunk_ready = NOW_READY
    print(f"| {name} | {part} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    warnings.simplefilter("ignore")
    print("| trace | part | off | on, steal order | on, oldest fence (measured live) | on, now |")
    print("|---|---|---|---|---|---|")
    parts = {"gpt2_train_bf16": "tuning", "gpt2_train_fp16_scaler": "-", "moe_train": "tuning",
             "llama_varlen_train": "check", "llama_generate": "check", "multistream_infer": "check"}
    for name, part in parts.items():
        trace = load_trace(RUN_A / f"{name}.gpumem.gmt.gz")
        row(name, part, trace)
        if trace.plan_events:
            row(f"{name}, marks left out", part, dataclasses.replace(trace, plan_events=()))
    if "--corpus" in sys.argv:
        for part, names in (("tuning", TUNING), ("check", CHECK)):
            for name in names:
                row(name, part, load_trace(ROOT / "data/traces" / name))


if __name__ == "__main__":
    main()
