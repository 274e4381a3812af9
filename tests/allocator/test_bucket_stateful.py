"""Stateful property test of the size-bucket pool: random allocate / free / clear_pool / shrink traffic on a
small simulated card, with injected faults and limits.

After every step: live and pooled blocks are disjoint, each is exactly one device allocation of at least
its bucket, the device holds nothing else, the byte counts add up (allocated = live buckets, reserved =
allocated + pooled, requested = what was asked), live blocks keep their data, and the pool never keeps more
than ``max_pooled_per_bucket`` blocks of one bucket and stream. A failed allocation changes nothing (with
``release_on_oom``, only pooled memory may have been given back); a bad free changes nothing.
"""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpumem import sim
from gpumem.allocator.bucket import BucketAllocator, bucket_nbytes
from gpumem.errors import InvalidArgumentError, InvalidPointerError, OutOfMemoryError, TransientDeviceError
from gpumem.units import KiB, MiB

from allocator_helpers import small_profile

SIZES = st.one_of(st.integers(1, 4 * KiB), st.integers(1, 1 * MiB), st.integers(1 * MiB, 40 * MiB),
                  st.sampled_from([511, 512, 513, 4095, 4096, 4097, 1 * MiB, 1 * MiB + 1]))


class BucketMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dev: sim.SimDevice | None = None
        self.pool: BucketAllocator | None = None
        self.live: dict[int, tuple[int, bytes]] = {}  # ptr -> (requested, data written at its start)
        self.freed: list[int] = []
        self.tag = 0

    @initialize(seed=st.integers(0, 2**16), fail_rate=st.sampled_from([0.0, 0.0, 0.1]),
                transient=st.frozensets(st.integers(1, 30), max_size=3),
                cap=st.sampled_from([None, 0, 1, 3]), release=st.booleans(),
                limit=st.sampled_from([None, None, 96 * MiB]))
    def setup(self, seed, fail_rate, transient, cap, release, limit):
        self.dev = sim.SimDevice(small_profile(192), seed=seed,
                                 faults=sim.FaultPlan(malloc_failure_rate=fail_rate, transient_error_calls=transient))
        self.pool = BucketAllocator(self.dev, max_pooled_per_bucket=cap, release_on_oom=release, limit=limit)

    def _observe(self):
        st_ = self.pool.snapshot_stats()
        return (sorted(self.pool.live_blocks()), sorted(self.pool.pooled_blocks()), st_.allocated_nbytes,
                st_.requested_nbytes, st_.reserved_nbytes, st_.num_allocs, st_.num_frees)

    @rule(nbytes=SIZES, stream=st.integers(0, 1))
    def allocate(self, nbytes, stream):
        self._allocate(nbytes, stream)

    @rule(sizes=st.lists(SIZES, min_size=1, max_size=8), stream=st.integers(0, 1), free_after=st.booleans())
    def allocate_burst(self, sizes, stream, free_after):
        ptrs = [p for p in (self._allocate(n, stream) for n in sizes) if p is not None]
        if free_after:
            for p in ptrs[::2]:
                self.pool.free(p)
                del self.live[p]
                self.freed.append(p)

    def _allocate(self, nbytes, stream):
        live0, pooled0, alloc0, req0, res0, n0, f0 = before = self._observe()
        try:
            ptr = self.pool.allocate(nbytes, stream)
        except (OutOfMemoryError, TransientDeviceError) as exc:
            event(f"allocation failed: {type(exc).__name__}")
            live1, pooled1, alloc1, req1, res1, n1, f1 = after = self._observe()
            if not self.pool.policy.release_on_oom:
                assert after == before
            else:  # Note [Failure atomicity of the pool]: only pooled blocks may have gone back (also when the
                # retry after giving the pool back, to make room under the limit, meets a transient fault: CI found it)
                assert (live1, alloc1, req1, n1, f1) == (live0, alloc0, req0, n0, f0)
                assert set(pooled1) <= set(pooled0) and res1 <= res0
            return None
        assert ptr not in self.live
        size = bucket_nbytes(nbytes)
        assert self.pool.block_size(ptr) == size
        n = min(nbytes, 64)
        self.tag += 1
        data = bytes((self.tag + i) & 0xFF for i in range(n))
        self.dev.write(ptr, data)
        self.live[ptr] = (nbytes, data)
        return ptr

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10_000))
    def free(self, index):
        ptrs = sorted(self.live)
        ptr = ptrs[index % len(ptrs)]
        self.pool.free(ptr)
        del self.live[ptr]
        self.freed.append(ptr)

    @precondition(lambda self: self.freed)
    @rule(index=st.integers(0, 10_000))
    def bad_free(self, index):
        ptr = self.freed[index % len(self.freed)]
        if ptr in self.live:
            return  # handed out again: not a double free
        before = self._observe()
        try:
            self.pool.free(ptr)
        except InvalidPointerError:
            pass
        else:
            raise AssertionError(f"double free of {ptr:#x} was accepted")
        assert self._observe() == before

    @rule(nbytes=st.one_of(st.just(0), st.integers(-5, -1)))
    def bad_size(self, nbytes):
        before = self._observe()
        try:
            self.pool.allocate(nbytes)
        except InvalidArgumentError:
            pass
        assert self._observe() == before

    @rule()
    def clear(self):
        pooled = self.pool.pooled_nbytes
        live = sorted(self.pool.live_blocks())
        assert self.pool.clear_pool() == pooled
        assert self.pool.pooled_nbytes == 0 and sorted(self.pool.live_blocks()) == live

    @rule(keep=st.integers(0, 64 * MiB))
    def shrink(self, keep):
        pooled = self.pool.pooled_nbytes
        released = self.pool.shrink(keep)
        assert self.pool.pooled_nbytes == pooled - released
        assert self.pool.pooled_nbytes <= keep

    @invariant()
    def books_match_the_device(self):
        if self.pool is None:
            return
        live = self.pool.live_blocks()
        pooled = self.pool.pooled_blocks()
        assert {p for p, _ in live} == set(self.live)
        blocks = sorted(live + pooled)
        for (a, na), (b, _) in zip(blocks, blocks[1:]):
            assert a + na <= b, f"blocks {a:#x}+{na} and {b:#x} overlap"
        dev = dict(self.dev.allocation_ranges())
        assert set(dev) == {p for p, _ in blocks}  # the device holds nothing else
        for p, n in blocks:
            assert dev[p] >= n
        st_ = self.pool.snapshot_stats()
        assert st_.allocated_nbytes == sum(n for _, n in live)
        assert st_.reserved_nbytes == st_.allocated_nbytes + sum(n for _, n in pooled) == self.pool.reserved_nbytes
        assert st_.requested_nbytes == sum(r for r, _ in self.live.values())
        assert st_.peak_reserved_nbytes >= st_.reserved_nbytes
        assert st_.num_allocs - st_.num_frees == len(self.live)
        cap = self.pool.policy.max_pooled_per_bucket
        if cap is not None:
            assert all(b.pooled_blocks <= cap * 2 for b in self.pool.pool_stats().buckets)  # 2 streams
        limit = self.pool.limit_nbytes
        assert limit is None or st_.reserved_nbytes <= limit
        for ptr, (_, data) in self.live.items():
            assert self.dev.read(ptr, len(data)) == data
        self.pool.check_consistency()

    def teardown(self):
        if self.pool is not None:
            self.pool.close()
            assert self.dev.n_allocations == 0
        if self.dev is not None:
            self.dev.close()


TestBucketMachine = BucketMachine.TestCase
TestBucketMachine.settings = settings(max_examples=40, stateful_step_count=50, deadline=None)
