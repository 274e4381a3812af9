"""Hypothesis strategies shared by the trace tests (imported by name: tests/trace is on sys.path under pytest)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from gpumem.trace import OpKind, Trace

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BASE = 0x7F00_0000_0000
SLOT = 2**41  # address slots far enough apart that no two allocations overlap
STREAMS = [0, 0, 0, 7, 94_000_000_000_000]


@st.composite
def traces(draw: st.DrawFn, max_ops: int = 60) -> Trace:
    """Valid traces whose live allocations never share an address (so every format can hold them).

    Addresses come from 16 slots, so they are reused after frees, and ranges never
    overlap (as in any real trace); sizes span 0..1 TiB;
    times never decrease, with integral and fractional steps, from 0 or an epoch-like start.
    """
    n = draw(st.integers(0, max_ops))
    t = draw(st.one_of(st.just(0.0), st.integers(0, 2 * 10**15).map(float), st.floats(0, 1e12)))
    live: list[tuple[int, int, int]] = []  # (id, nbytes, addr)
    ops: list[tuple[Any, ...]] = []
    next_id = 0
    for _ in range(n):
        t += draw(st.one_of(st.integers(0, 10**7).map(float), st.floats(0, 1e6)))
        stream = draw(st.sampled_from(STREAMS))
        if live and draw(st.booleans()):
            aid, nbytes, addr = live.pop(draw(st.integers(0, len(live) - 1)))
            ops.append((OpKind.FREE, aid, nbytes, stream, t, addr))
        else:
            nbytes = draw(st.one_of(st.integers(0, 4096), st.integers(0, 2**40)))
            addr = BASE + draw(st.integers(0, 15)) * SLOT
            if any(a == addr for _, _, a in live):
                addr = BASE + (16 + next_id) * SLOT  # a fresh slot
            live.append((next_id, nbytes, addr))
            ops.append((OpKind.ALLOC, next_id, nbytes, stream, t, addr))
            next_id += 1
    name = draw(st.sampled_from(["t", "gpt2_train", "naïve name with spaces"]))
    source = draw(st.sampled_from(["recorded", "pytorch-snapshot", "gpumem"]))
    return Trace.from_ops(name, source, ops, n_unmatched_frees=draw(st.integers(0, 3)),
                          n_failed_allocs=draw(st.integers(0, 2)))
