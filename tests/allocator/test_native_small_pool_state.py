"""The native engine's ``small_pool_state`` (Note [The small pool's state as bytes] in ``gpumem/_native/engine.cpp``),
which the estimate's fast replay compares to find a fixed point of the small pool (Note [The small pool skipped on
the native engine] in ``gpumem/estimate/fastreplay.py``): large ops never change it, and two moments it calls equal
are equal for the Python engine's own reading of its small pool (``SkippingSink._small_state``), run on the same
ops; in segment mode the converse holds too."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpumem import sim
from gpumem.allocator import CachingAllocator
from gpumem.errors import OutOfMemoryError
from gpumem.estimate.fastreplay import SkippingSink
from gpumem.native import load_engine
from gpumem.units import KiB, MiB

from allocator_helpers import small_profile

if load_engine() is None:  # pragma: no cover - the engine is optional
    pytest.skip("the native engine (gpumem._engine) is not built", allow_module_level=True)

SMALL = [512, 1000, 4 * KiB, 64 * KiB, 1 * MiB]
LARGE = [1 * MiB + 512, 3 * MiB, 12 * MiB, 25 * MiB]


@st.composite
def programs(draw):
    """Allocations (mostly small, repeated sizes so that states recur) and frees of live ones."""
    ops, live = [], 0
    for _ in range(draw(st.integers(1, 80))):
        if live and draw(st.integers(0, 2)) == 0:
            ops.append(("free", draw(st.integers(0, live - 1))))
            live -= 1
        else:
            ops.append(("alloc", draw(st.sampled_from(SMALL + SMALL + LARGE))))
            live += 1
    return ops


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.sampled_from(["pytorch", "bestfit", "expandable"]), st.sampled_from([None, 120 * MiB]))
def test_equal_native_states_are_equal_python_states(ops, policy, limit):
    made = {}
    for engine in ("native", "python"):
        made[engine] = CachingAllocator(sim.SimDevice(small_profile(256)), policy, limit=limit, engine=engine)
    native, python = made["native"], made["python"]
    read_python = SkippingSink(python)._small_state
    states, live = [], {"native": [], "python": []}
    for kind, arg in ops:
        before = native._engine._ext.small_pool_state()
        large = False
        for engine, a in made.items():
            try:
                if kind == "alloc":
                    live[engine].append((a.allocate(arg, 0), arg))
                    large = arg > MiB
                elif arg < len(live[engine]):   # an allocation that ran out of memory left fewer live
                    p, n = live[engine].pop(arg)
                    a.free(p)
                    large = n > MiB
            except OutOfMemoryError:
                pass
        assert live["native"] == live["python"]
        retries = native.snapshot_stats().num_alloc_retries
        if large and not retries:  # a retry may give back small segments: then the small pool changes
            assert native._engine._ext.small_pool_state() == before
        states.append((native._engine._ext.small_pool_state(), read_python()))
    equal = 0
    for i, (n_i, p_i) in enumerate(states):
        for n_j, p_j in states[i + 1:]:
            if n_i == n_j:
                equal += 1
                assert p_i == p_j
            elif policy != "expandable":
                assert p_i != p_j
    event("a state recurred" if equal else "no state recurred")
