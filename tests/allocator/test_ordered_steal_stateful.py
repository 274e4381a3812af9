"""The stream-ordered steal (Note [Stream-ordered steal] in ``gpumem/allocator/backing.py``) under attack:
random workloads with kernels queued over whole blocks on several streams, small chunks that are stolen
often, injected device failures (Ctrl-C included) while old mappings wait on
``VirtualBacking.deferred``, a device lost at a random time, on both engines compared call by call.

Beyond the differential harness: the sanitizer never fires (a ``MemoryHazardError`` is a failure here,
not an outcome to compare), a live block's memory can always be launched on, ``check_consistency``
holds after every step, and ``close`` leaves no physical memory behind on a healthy device."""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import Phase, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpumem import sim
from gpumem.allocator.policy import get_policy
from gpumem.native import load_engine
from gpumem.units import KiB, MiB

from allocator_helpers import small_profile
from test_native_differential import INJECTED, Pair

if load_engine() is None:  # pragma: no cover - the engine is optional
    pytest.skip("the native engine (gpumem._engine) is not built", allow_module_level=True)

_BASE = get_policy("gpumem")
ORDERED_POLICIES = [
    dataclasses.replace(_BASE, name=f"ordered-{page_slack}-{busy_slack}", stream_ordered_steal=True,
                        chunk_max_fraction=1 / 16, chunk_max_nbytes=8 * MiB, page_slack=page_slack,
                        busy_slack=busy_slack)
    for page_slack in (0.0, _BASE.page_slack) for busy_slack in (0.0, 0.05)] + [
    dataclasses.replace(_BASE, name="ordered-ahead", stream_ordered_steal=True, chunk_max_fraction=1 / 16,
                        chunk_max_nbytes=8 * MiB, page_slack=0.1, busy_slack=0.0, grow_ahead_fraction=0.25)] + [
    # waiting on the GPU past the busy_slack bound (Note [Wait on the GPU, not the host]): deferred like the ordered
    # steal, with the ordered steal and without
    dataclasses.replace(_BASE, name=f"wait-on-gpu-{ordered}-{busy_slack}", wait_on_gpu=True,
                        stream_ordered_steal=ordered, chunk_max_fraction=1 / 16, chunk_max_nbytes=8 * MiB,
                        page_slack=0.0, busy_slack=busy_slack)
    for ordered in (False, True) for busy_slack in (0.0, 0.05)]

SIZES = st.one_of(st.integers(1, 3 * MiB), st.integers(3 * MiB, 24 * MiB),
                  st.sampled_from([2 * MiB, 4 * MiB, 6 * MiB, 8 * MiB, 16 * MiB]))
STREAMS = st.sampled_from([0, 0, 0, 7, 9])
SCHEDULES = st.dictionaries(st.integers(1, 16), st.sampled_from(INJECTED), min_size=1, max_size=2)
FAULT_CALLS = ("mem_create", "mem_map", "mem_set_access", "mem_unmap", "mem_release", "event_record",
               "event_query", "event_synchronize", "stream_wait_event")


def _no_hazard(r) -> None:
    assert not (r[0] == "raised" and r[1] == "MemoryHazardError"), f"the sanitizer fired: {r}"


class OrderedSteal(RuleBasedStateMachine):

    @initialize(seed=st.integers(0, 2**16), rate=st.sampled_from([0.0, 0.0, 0.05, 0.15]),
                calls=st.sets(st.sampled_from(FAULT_CALLS), min_size=1, max_size=3),
                lost_at=st.sampled_from([None, None, None, 0.002, 0.02]),
                limit=st.sampled_from([None, 96 * MiB, 160 * MiB]), gc=st.sampled_from([None, None, 0.05, 0.3]),
                policy=st.sampled_from(ORDERED_POLICIES))
    def setup(self, seed, rate, calls, lost_at, limit, gc, policy):
        plan = sim.FaultPlan(call_failure_rates={c: rate for c in calls} if rate else {},
                             device_lost_at_s=lost_at)
        self.healthy = not rate and lost_at is None

        def make():
            return sim.SimDevice(small_profile(384), faults=plan, seed=seed)

        self.pair = Pair(make, policy=policy, limit=limit, gc_threshold=gc)
        self.live: list[int] = []
        self.stream_of: dict[int, int] = {}

    def _both(self, op, *args):
        r = self.pair.both(op, *args)
        _no_hazard(r)
        return r

    @rule(size=SIZES, stream=STREAMS)
    def allocate(self, size, stream):
        r = self._both("allocate", size, stream)
        if r[0] == "ok":
            self.live.append(r[1])
            self.stream_of[r[1]] = stream

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6))
    def free(self, i):
        ptr = self.live[i % len(self.live)]
        if self._both("free", ptr)[0] == "ok":
            self.live.remove(ptr)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6), duration=st.sampled_from([1e-3, 1e-2]), size=SIZES)
    def use_free_allocate(self, i, duration, size):
        """A training step's pattern: a kernel on the block's stream, the block freed while the kernel is
        queued, a new block on the same stream (the stream-ordered steal's case)."""
        ptr = self.live[i % len(self.live)]
        stream = self.stream_of[ptr]
        self.pair.on_devices(lambda d: d.launch(stream, duration, touches=[(ptr, self.pair.allocs[0].block_size(ptr))]))
        self.pair.compare("launch")
        self.free(self.live.index(ptr))
        self.allocate(size, stream)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6), stream=STREAMS)
    def record_stream(self, i, stream):
        self._both("record_stream", self.live[i % len(self.live)], stream)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6), stream=STREAMS, duration=st.sampled_from([1e-4, 1e-3, 1e-2]))
    def launch(self, i, stream, duration):
        """A kernel over the whole block (its pages are under queued work until it ends); on another stream
        than the block's only after ``record_stream``, as the allocator's contract asks."""
        ptr = self.live[i % len(self.live)]
        if stream != self.stream_of[ptr] and self._both("record_stream", ptr, stream)[0] != "ok":
            return
        size = self.pair.allocs[0].block_size(ptr)
        results = []
        for d in self.pair.devs:
            try:
                d.launch(stream, duration, touches=[(ptr, size)])
                results.append("ok")
            except Exception as exc:  # noqa: BLE001 - a lost device refuses; a hazard is a failure
                results.append(type(exc).__name__)
        assert "MemoryHazardError" not in results, f"a live block of {size} B at {ptr:#x} is not all mapped"
        assert results[0] == results[1], results
        self.pair.compare("launch")

    @rule(seconds=st.sampled_from([1e-4, 1e-3, 1e-2]))
    def advance(self, seconds):
        self.pair.on_devices(lambda d: d.advance(seconds))
        self.pair.compare("advance")

    @rule()
    def empty_cache(self):
        self._both("empty_cache")

    @rule(schedule=SCHEDULES, size=SIZES, stream=STREAMS)
    def allocate_failing(self, schedule, size, stream):
        r = self.pair.both_failing(schedule, "allocate", size, stream)
        _no_hazard(r)
        if r[0] == "ok":
            self.live.append(r[1])
            self.stream_of[r[1]] = stream

    @precondition(lambda self: self.live)
    @rule(schedule=SCHEDULES, i=st.integers(0, 10**6))
    def free_failing(self, schedule, i):
        ptr = self.live[i % len(self.live)]
        r = self.pair.both_failing(schedule, "free", ptr)
        _no_hazard(r)
        if r[0] == "ok":
            self.live.remove(ptr)

    @rule(schedule=SCHEDULES)
    def empty_cache_failing(self, schedule):
        _no_hazard(self.pair.both_failing(schedule, "empty_cache"))

    @invariant()
    def consistent(self):
        if hasattr(self, "pair"):
            r = self._both("check_consistency")
            assert r[0] == "ok" or r[1] != "InternalError", r  # a lost device may refuse; books never differ
            if self.healthy:
                assert r[0] == "ok", r
            py = self.pair.allocs[0]
            if self.healthy:  # a cached chunk is mapped nowhere (else any stream's next block could take it)
                cached = {id(h) for h in py.backing.unmapped}
                assert not [e for e in py.backing.deferred if id(e[2]) in cached], "a cached chunk is still deferred"
            b = py.backing.held_breakdown()  # the Python reference's (the engine has none)
            assert b.live_nbytes + b.locked_nbytes + b.idle_nbytes + b.cached_nbytes == py.reserved_nbytes, b
            assert b.live_nbytes == py.backing.live_pages * py.backing.granularity, b

    def teardown(self):
        if not hasattr(self, "pair"):
            return
        for ptr in list(self.live):
            _no_hazard(self.pair.both("free", ptr))
        _no_hazard(self.pair.both("close"))
        for d, alloc in zip(self.pair.devs, self.pair.allocs):
            # what close could not give back is what it says it holds (lost device: nothing is held)
            assert alloc.reserved_nbytes == d.process_used_nbytes or bool(d._lost), (  # noqa: SLF001
                f"{alloc.engine}: close says {alloc.reserved_nbytes} B held, the device {d.process_used_nbytes} B")
        if self.healthy:
            for d in self.pair.devs:
                assert not d.mapping_ranges(), "close left memory mapped"
                assert d.process_used_nbytes == 0, f"close left {d.process_used_nbytes} B of chunks held"


OrderedSteal.TestCase.settings = settings(max_examples=int(os.environ.get("GPUMEM_ORDERED_EXAMPLES", "40")),
                                          stateful_step_count=100, deadline=None,
                                          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
TestOrderedSteal = OrderedSteal.TestCase
