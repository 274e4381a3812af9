"""Stateful property tests: the caching allocator under random allocate/free/stream/cache traffic.

One Hypothesis state machine, run for every policy (``gpumem`` with virtual memory, ``bestfit``,
``pytorch``, ``cupy``) and for ``gpumem`` on a card without virtual memory (a Jetson-Nano-derived
profile, where it falls back to segments). The device is a small simulated card (384 MiB) so
out-of-memory happens; other tenants create pressure, injected faults make device calls fail.

After every step: live blocks are disjoint and lie in memory the allocator holds (a segment, or
mapped pages), the stats add up and match the device's accounting, the block chains and free
lists are consistent, and every live block still holds the bytes written into it. A failed
allocation changes nothing except that cached memory may have been given back. Freeing
everything and emptying the cache returns every byte to the device.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpumem import sim
from gpumem.allocator import CachingAllocator
from gpumem.errors import DoubleFreeError, OutOfMemoryError, TransientDeviceError
from gpumem.units import KiB, MiB

from allocator_helpers import (
    GRANULE,
    LiveBlock,
    check_allocator,
    check_pattern,
    mapped_pages,
    pages_of,
    small_profile,
    write_pattern,
)

SIZES = st.one_of(
    st.integers(1, 4 * KiB),
    st.integers(1, 1 * MiB),
    st.sampled_from([511, 512, 513, 1 * MiB - 1, 1 * MiB, 1 * MiB + 1, 2 * MiB, 2 * MiB + 1, 10 * MiB - 1,
                     10 * MiB, 20 * MiB]),
    st.integers(1 * MiB, 48 * MiB),
)

PRESSURE = {
    "none": None,
    "step": sim.Step(nbytes=96 * MiB, at_s=0.001, until_s=0.03),
    "spikes": sim.PeriodicSpikes(nbytes=80 * MiB, period_s=0.004, spike_s=0.001),
    "random": sim.RandomArrivals(rate_per_s=2000.0, mean_hold_s=0.001, min_nbytes=2 * MiB, max_nbytes=40 * MiB),
}


class AllocatorMachine(RuleBasedStateMachine):
    policy = "gpumem"
    vmm_profile = True
    exact_device_accounting = True
    """Whether the device's process bytes equal reserved bytes (not for cupy: small mallocs are packed)."""

    def __init__(self) -> None:
        super().__init__()
        self.dev: sim.SimDevice | None = None
        self.alloc: CachingAllocator | None = None
        self.live: dict[int, LiveBlock] = {}
        self.pending: dict[int, int] = {}
        self.freed: list[int] = []
        self.tag = 0

    @initialize(
        seed=st.integers(0, 2**16),
        pressure=st.sampled_from(sorted(PRESSURE)),
        fail_rate=st.sampled_from([0.0, 0.0, 0.05, 0.2]),
        transient=st.frozensets(st.integers(1, 40), max_size=4),
        limit=st.sampled_from([None, None, 0.6, 160 * MiB]),
        gc_threshold=st.sampled_from([None, None, 0.5]),
        record_history=st.booleans(),
    )
    def setup(self, seed, pressure, fail_rate, transient, limit, gc_threshold, record_history):
        self.dev = sim.SimDevice(small_profile(384, vmm=self.vmm_profile), pressure=PRESSURE[pressure],
                                 faults=sim.FaultPlan(malloc_failure_rate=fail_rate, transient_error_calls=transient),
                                 seed=seed)
        self.alloc = CachingAllocator(self.dev, self.policy, limit=limit, gc_threshold=gc_threshold,
                                      record_history=record_history)
        self.record_history = record_history
        assert self.alloc.uses_vmm == (self.policy == "gpumem" and self.vmm_profile)

    # -- helpers ------------------------------------------------------------------------------------------
    def _pick(self, index: int) -> LiveBlock:
        ptrs = sorted(self.live)
        return self.live[ptrs[index % len(ptrs)]]

    def _sync_pending(self) -> None:
        """An allocation that misses the cache makes pending blocks whose other-stream events have
        completed reusable (no work runs in these tests, so all of them), as PyTorch's process_events."""
        still = {b.addr for b in self.alloc._engine._pending}  # noqa: SLF001
        assert still <= set(self.pending)
        self.pending = {p: n for p, n in self.pending.items() if p in still}

    def _observe(self):
        return self.alloc.snapshot_stats(), sorted(self.alloc.live_blocks())

    def _assert_no_cached_memory(self) -> None:
        """What holds right after the allocator gave its cache back (empty_cache, or an OOM's retry)."""
        alloc = self.alloc
        held = list(alloc.live_blocks()) + list(self.pending.items())
        if alloc.uses_vmm:
            touched = {pg for p, n in held for pg in pages_of(p, n, GRANULE)}
            assert mapped_pages(self.dev) == touched
            assert alloc.reserved_nbytes == len(touched) * GRANULE
        else:
            for seg in alloc.backing.segments.values():
                assert any(seg.base <= p < seg.base + seg.nbytes for p, _ in held), \
                    f"segment {seg.base:#x} holds no data but was kept"

    # -- rules ----------------------------------------------------------------------------------------------
    @rule(nbytes=SIZES, stream=st.integers(0, 1))
    def allocate(self, nbytes, stream):
        self._allocate(nbytes, stream)

    @rule(sizes=st.lists(st.one_of(SIZES, st.integers(16 * MiB, 128 * MiB)), min_size=1, max_size=6),
          stream=st.integers(0, 1))
    def allocate_burst(self, sizes, stream):
        for nbytes in sizes:
            self._allocate(nbytes, stream)

    def _allocate(self, nbytes, stream):
        before, blocks_before = self._observe()
        try:
            ptr = self.alloc.allocate(nbytes, stream)
        except (OutOfMemoryError, TransientDeviceError) as exc:
            self._sync_pending()
            event(f"allocation failed: {type(exc).__name__}")
            after, blocks_after = self._observe()
            # Note [A failed allocation changes nothing]: only cached memory may have been given back
            assert blocks_after == blocks_before
            assert after.allocated_nbytes == before.allocated_nbytes
            assert after.requested_nbytes == before.requested_nbytes
            assert after.reserved_nbytes <= before.reserved_nbytes
            assert after.num_allocs == before.num_allocs
            assert after.num_frees == before.num_frees
            assert after.peak_allocated_nbytes == before.peak_allocated_nbytes
            assert after.peak_requested_nbytes == before.peak_requested_nbytes
            assert after.peak_reserved_nbytes == before.peak_reserved_nbytes
            if isinstance(exc, OutOfMemoryError):
                assert after.num_ooms == before.num_ooms + 1
                assert after.num_alloc_retries == before.num_alloc_retries + 1
                assert f"({nbytes} bytes" in str(exc)  # ", rounded up to ..." may follow
                assert exc.requested_nbytes == nbytes
                assert exc.allocated_nbytes == before.allocated_nbytes
                self._assert_no_cached_memory()  # the retry gave the cache back
            else:
                assert after.num_ooms == before.num_ooms
            return
        self._sync_pending()
        assert ptr not in self.live
        self.tag += 1
        block = LiveBlock(ptr, nbytes, stream, self.tag)
        write_pattern(self.dev, block)
        self.live[ptr] = block
        if ptr in self.freed:
            self.freed.remove(ptr)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10**6))
    def free(self, index):
        block = self._pick(index)
        check_pattern(self.dev, block)
        size = self.alloc.block_size(block.ptr)
        self.alloc.free(block.ptr)
        del self.live[block.ptr]
        if block.recorded_streams - {block.stream}:
            event("freed a block used on another stream")
            self.pending[block.ptr] = size
        self.freed.append(block.ptr)

    @precondition(lambda self: any(p not in self.live for p in self.freed))
    @rule(index=st.integers(0, 10**6))
    def double_free(self, index):
        candidates = [p for p in self.freed if p not in self.live]
        ptr = candidates[index % len(candidates)]
        before = self._observe()
        with pytest.raises(DoubleFreeError):
            self.alloc.free(ptr)
        assert self._observe() == before

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10**6), stream=st.integers(0, 2))
    def record_stream(self, index, stream):
        block = self._pick(index)
        self.alloc.record_stream(block.ptr, stream)
        block.recorded_streams.add(stream)

    @rule()
    def synchronize(self):
        self.alloc.synchronize()
        self.pending.clear()

    @rule()
    def empty_cache(self):
        before = self.alloc.reserved_nbytes
        released = self.alloc.empty_cache()
        self.pending.clear()  # empty_cache waits for the events of pending blocks
        assert released == before - self.alloc.reserved_nbytes
        event(f"empty_cache released {'something' if released else 'nothing'}")
        self._assert_no_cached_memory()

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10**6))
    def rewrite(self, index):
        block = self._pick(index)
        self.tag += 1
        block.tag = self.tag
        write_pattern(self.dev, block)

    @rule(seconds=st.one_of(st.just(0.0), st.floats(0.0, 0.01, allow_subnormal=True)))
    def advance(self, seconds):
        # tiny steps too: advance(x) with now + x == now while an event is due at now once made
        # simpy raise ValueError; the simulator now treats it as no time passing
        self.dev.advance(seconds)

    # -- invariants -----------------------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if self.alloc is None:
            return
        check_allocator(self.alloc, self.live, self.pending,
                        exact_device_accounting=self.exact_device_accounting)

    @invariant()
    def data_survives(self):
        for block in self.live.values():
            check_pattern(self.dev, block)

    def teardown(self):
        if self.alloc is None:
            return
        try:
            for block in list(self.live.values()):
                check_pattern(self.dev, block)
                self.alloc.free(block.ptr)
            self.live.clear()
            self.alloc.synchronize()
            self.pending.clear()
            self.alloc.empty_cache()
            st_ = self.alloc.snapshot_stats()
            assert st_.allocated_nbytes == st_.requested_nbytes == st_.active_nbytes == 0
            assert self.alloc.reserved_nbytes == 0
            assert self.dev.process_used_nbytes == 0
            assert self.dev.mapping_ranges() == []
            assert self.dev.n_allocations == 0
            check_allocator(self.alloc, {}, {})
            if self.record_history:
                # the history holds exactly the successful allocations and the frees
                trace = self.alloc.history()
                assert trace.n_allocs == st_.num_allocs and trace.n_frees == st_.num_frees
                assert trace.n_live_at_end == 0
                assert trace.peak_live_nbytes == st_.peak_requested_nbytes
        finally:
            self.alloc.close()
            self.dev.close()


def _machine(policy: str, vmm_profile: bool = True):
    cls = type(f"Machine_{policy}_{'vmm' if vmm_profile else 'novmm'}", (AllocatorMachine,),
               {"policy": policy, "vmm_profile": vmm_profile, "exact_device_accounting": policy != "cupy"})
    test = cls.TestCase
    test.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    return test


TestGpumemVmmMachine = _machine("gpumem")
TestBestfitMachine = _machine("bestfit")
TestPytorchMachine = _machine("pytorch")
TestCupyMachine = _machine("cupy")
TestGpumemWithoutVmmMachine = _machine("gpumem", vmm_profile=False)
