"""The size-bucket pool (gpumem.allocator.bucket): buckets, hit rate, max_pooled_per_bucket, clear_pool,
shrink, limits, failure atomicity, bad input, threads, and replays beside the caching allocator."""

from __future__ import annotations

import threading

import pytest

from gpumem import sim
from gpumem.allocator.bucket import (BUCKET_POLICY_NAME, BucketAllocator, BucketPolicy, bucket_nbytes,
                                     is_bucket_policy)
from gpumem.errors import (DeviceLostError, InternalError, InvalidArgumentError, InvalidPointerError,
                           OutOfMemoryError)
from gpumem.allocator import make_allocator
from gpumem.replay import replay_trace
from gpumem.units import KiB, MiB

from allocator_helpers import small_device


@pytest.fixture
def dev():
    d = small_device(256)
    yield d
    d.close()


def state(pool: BucketAllocator):
    st = pool.snapshot_stats()
    return (sorted(pool.live_blocks()), sorted(pool.pooled_blocks()), st.allocated_nbytes, st.requested_nbytes,
            st.reserved_nbytes, st.num_allocs, st.num_frees, st.cache_hits, st.cache_misses)


def test_bucket_sizes():
    assert [bucket_nbytes(n) for n in (1, 511, 512, 513, 1000, 4096, 4097, 3 * MiB)] == [
        512, 512, 512, 1024, 1024, 4096, 8192, 4 * MiB]
    assert bucket_nbytes(1, 4096) == 4096
    with pytest.raises(InvalidArgumentError):
        bucket_nbytes(0)


def test_allocate_free_reuse_and_hit_rate(dev):
    pool = BucketAllocator(dev)
    p = pool.allocate(3000)
    assert pool.block_size(p) == 4096 and pool.allocated_nbytes == 4096 and pool.reserved_nbytes == 4096
    assert dev.n_allocations == 1
    pool.free(p)
    assert pool.allocated_nbytes == 0 and pool.pooled_nbytes == 4096 and pool.reserved_nbytes == 4096
    q = pool.allocate(4000)  # same bucket: from the pool, no device call
    assert q == p and dev.n_allocations == 1 and pool.hit_rate == 0.5
    r = pool.allocate(5000)  # the next bucket: a miss
    assert pool.block_size(r) == 8192 and pool.hit_rate == pytest.approx(1 / 3)
    ps = pool.pool_stats()
    assert (ps.hits, ps.misses, ps.live_blocks, ps.pooled_blocks) == (1, 2, 2, 0)
    assert [(b.bucket_nbytes, b.live_blocks, b.hits, b.misses) for b in ps.buckets] == [(4096, 1, 1, 1), (8192, 1, 0, 1)]
    st = pool.stats
    assert st.peak_requested_nbytes == 9000 and st.peak_reserved_nbytes == 4096 + 8192 and st.device_calls == 2
    pool.check_consistency()
    pool.close()
    assert dev.n_allocations == 0


def test_pools_are_per_stream(dev):
    pool = BucketAllocator(dev)
    p = pool.allocate(1000, stream=0)
    pool.free(p)
    q = pool.allocate(1000, stream=1)
    assert q != p and pool.pool_stats().hits == 0
    assert pool.allocate(1000, stream=0) == p
    pool.close()


def test_max_pooled_per_bucket_returns_the_rest(dev):
    pool = BucketAllocator(dev, max_pooled_per_bucket=2)
    ptrs = [pool.allocate(64 * KiB) for _ in range(5)]
    for p in ptrs:
        pool.free(p)
    ps = pool.pool_stats()
    assert ps.pooled_blocks == 2 and ps.returned_on_free == 3 and dev.n_allocations == 2
    assert pool.reserved_nbytes == 2 * 64 * KiB
    pool.close()
    zero = BucketAllocator(dev, max_pooled_per_bucket=0)
    zero.free(zero.allocate(100))
    assert zero.reserved_nbytes == 0 and dev.n_allocations == 0
    zero.close()


def test_clear_pool_and_shrink_largest_first(dev):
    pool = BucketAllocator(dev)
    keep = pool.allocate(10 * KiB)
    ptrs = [pool.allocate(n) for n in (1 * KiB, 1 * KiB, 16 * KiB, 1 * MiB, 4 * MiB)]
    for p in ptrs:
        pool.free(p)
    assert pool.pooled_nbytes == 2 * KiB + 16 * KiB + 1 * MiB + 4 * MiB
    released = pool.shrink(1 * MiB)  # the 4 MiB block goes; 1 MiB + 18 KiB is still above: the 1 MiB goes too
    assert released == 5 * MiB and pool.pooled_nbytes == 18 * KiB
    assert sorted(s for _, s in pool.pooled_blocks()) == [1 * KiB, 1 * KiB, 16 * KiB]
    assert pool.shrink(10 * MiB) == 0
    assert pool.clear_pool() == 18 * KiB and pool.pooled_nbytes == 0
    assert pool.live_blocks() == [(keep, 16 * KiB)] and dev.n_allocations == 1
    assert pool.empty_cache() == 0
    pool.check_consistency()
    with pytest.raises(InvalidArgumentError):
        pool.shrink(-1)
    with pytest.raises(InvalidArgumentError):
        pool.shrink("1MiB")
    pool.close()


def test_oom_gives_the_pool_back_and_retries(dev):
    pool = BucketAllocator(dev)
    ptrs = [pool.allocate(32 * MiB) for _ in range(6)]
    for p in ptrs:
        pool.free(p)
    assert pool.pooled_nbytes == 192 * MiB
    big = pool.allocate(128 * MiB)  # does not fit beside the pool: the pool goes back, the retry succeeds
    assert pool.pooled_nbytes == 0 and pool.block_size(big) == 128 * MiB
    assert pool.stats.num_alloc_retries == 1
    pool.close()


def test_oom_without_release_changes_nothing(dev):
    pool = BucketAllocator(dev, release_on_oom=False)
    live = pool.allocate(64 * MiB)
    for p in [pool.allocate(32 * MiB) for _ in range(3)]:
        pool.free(p)
    before = state(pool)
    with pytest.raises(OutOfMemoryError) as info:
        pool.allocate(128 * MiB)
    assert state(pool) == before and pool.stats.num_ooms == 1
    assert "128.00 MiB bucket" in str(info.value) and info.value.cached_nbytes == 96 * MiB
    pool.free(live)
    pool.close()


def test_a_request_larger_than_the_device_is_refused_at_once(dev):
    pool = BucketAllocator(dev)
    before = state(pool)
    with pytest.raises(OutOfMemoryError, match="larger than the device") as info:
        pool.allocate(300 * MiB)  # a 512 MiB bucket on a 256 MiB card
    assert state(pool) == before and dev.n_allocations == 0
    # the error's rounded size is the bucket's, as the caching allocator's is its policy's (review rv21a)
    assert info.value.requested_nbytes == 300 * MiB and info.value.rounded_nbytes == 512 * MiB


def test_limit(dev):
    pool = BucketAllocator(dev, limit=8 * MiB)
    a = pool.allocate(4 * MiB)
    b = pool.allocate(2 * MiB)
    pool.free(b)
    c = pool.allocate(3 * MiB)  # 4 MiB bucket: 4 + 4 > 8 with the 2 MiB pooled: the pool goes first, then it fits
    assert pool.pooled_nbytes == 0 and pool.reserved_nbytes == 8 * MiB
    before = state(pool)
    with pytest.raises(OutOfMemoryError, match="limit"):
        pool.allocate(1)
    assert state(pool) == before
    with pytest.raises(OutOfMemoryError, match="larger than the limit"):
        pool.allocate(9 * MiB)
    for p in (a, c):
        pool.free(p)
    pool.close()
    with pytest.raises(InvalidArgumentError):
        BucketAllocator(dev, limit="2.5")


@pytest.mark.parametrize("nbytes", [0, -1, 1.5, "1KiB", True, None])
def test_bad_sizes_change_nothing(dev, nbytes):
    pool = BucketAllocator(dev)
    pool.free(pool.allocate(1000))
    before = state(pool)
    with pytest.raises(InvalidArgumentError):
        pool.allocate(nbytes)
    assert state(pool) == before
    pool.close()


def test_bad_frees_and_streams_change_nothing(dev):
    pool = BucketAllocator(dev)
    p = pool.allocate(1000)
    before = state(pool)
    for bad in (p + 8, 12345):
        with pytest.raises(InvalidPointerError):
            pool.free(bad)
    with pytest.raises(InvalidArgumentError):
        pool.free("p")
    with pytest.raises(InvalidArgumentError):
        pool.allocate(10, stream=-1)
    assert state(pool) == before
    pool.free(p)
    before = state(pool)
    with pytest.raises(InvalidPointerError, match="already freed"):
        pool.free(p)  # double free
    assert state(pool) == before
    with pytest.raises(InvalidPointerError):
        pool.block_size(p)
    pool.close()


@pytest.mark.parametrize("kwargs", [{"max_pooled_per_bucket": -1}, {"max_pooled_per_bucket": 1.5},
                                    {"max_pooled_per_bucket": True}, {"min_bucket_nbytes": 1000},
                                    {"min_bucket_nbytes": 0}, {"record_history": True}])
def test_bad_options(dev, kwargs):
    with pytest.raises(InvalidArgumentError):
        BucketAllocator(dev, **kwargs)


def test_bad_policy_and_device(dev):
    with pytest.raises(InvalidArgumentError, match="unknown bucket policy"):
        BucketAllocator(dev, "buckets")
    with pytest.raises(InvalidArgumentError):
        BucketAllocator(dev, 3)
    with pytest.raises(InvalidArgumentError, match="gpumem.Device"):
        BucketAllocator("sim:t4-16gb")
    pool = BucketAllocator(dev, BucketPolicy(max_pooled_per_bucket=3), min_bucket_nbytes=4096)
    assert pool.policy.max_pooled_per_bucket == 3 and pool.policy.min_bucket_nbytes == 4096
    assert is_bucket_policy("bucket") and is_bucket_policy(pool.policy) and not is_bucket_policy("gpumem")


def test_closed_pool_refuses(dev):
    pool = BucketAllocator(dev)
    pool.allocate(1000)
    pool.close()
    pool.close()
    assert dev.n_allocations == 0
    with pytest.raises(InvalidArgumentError, match="closed"):
        pool.allocate(10)
    assert pool.clear_pool() == 0


def test_device_lost_is_remembered():
    dev = small_device(256, faults=sim.FaultPlan(device_lost_at_s=0.0))
    pool = BucketAllocator(dev)
    with pytest.raises(DeviceLostError):
        pool.allocate(1000)
    with pytest.raises(DeviceLostError):
        pool.allocate(1000)
    pool.close()  # gives nothing back to a lost device, does not raise


def test_consistency_check_finds_a_lie(dev):
    pool = BucketAllocator(dev)
    p = pool.allocate(1000)
    pool._pooled_nbytes += 512  # noqa: SLF001 - corrupt the books on purpose
    with pytest.raises(InternalError, match="pooled"):
        pool.check_consistency()
    pool._pooled_nbytes -= 512  # noqa: SLF001
    pool.free(p)
    pool.close()


def test_threads(dev):
    pool = BucketAllocator(dev, max_pooled_per_bucket=4)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            mine = []
            for i in range(300):
                mine.append(pool.allocate(512 * (1 + (seed * 7 + i) % 40)))
                if len(mine) > 5:
                    pool.free(mine.pop(0))
            for p in mine:
                pool.free(p)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.allocated_nbytes == 0 and pool.stats.num_allocs == 1200 == pool.stats.num_frees
    pool.check_consistency()
    pool.close()


def test_memory_summary_and_stats(dev):
    pool = BucketAllocator(dev)
    pool.free(pool.allocate(1000))
    text = pool.memory_summary()
    assert "policy 'bucket'" in text and "hit rate" in text
    assert "no cap on blocks pooled per bucket" in text and "at most no cap" not in text
    capped = BucketAllocator(dev, max_pooled_per_bucket=4)
    assert "at most 4 pooled per bucket" in capped.memory_summary()
    capped.close()
    d = pool.memory_stats()
    assert d["reserved_nbytes"] == 1024 and d["hit_rate"] == 0.0 and d["num_free_blocks"] == 1
    assert "BucketAllocator(" in repr(pool)
    pool.close()


# -- replays -----------------------------------------------------------------------------------------------
def test_make_allocator_picks_the_pool(dev):
    pool = make_allocator(dev, BUCKET_POLICY_NAME, max_pooled_per_bucket=2)
    assert isinstance(pool, BucketAllocator) and pool.policy.max_pooled_per_bucket == 2
    pool.close()


def test_replay_the_resnet_trace_bucket_vs_gpumem():
    from gpumem.trace import load_trace
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "data" / "traces" / "resnet_train.snapshot.pickle.gz"
    trace = load_trace(path)
    bucket = replay_trace(trace, "sim:h200-141gb", "bucket", progress=False)
    gpumem = replay_trace(trace, "sim:h200-141gb", "gpumem", progress=False)
    # the figures docs/backends.md quotes (the replay is deterministic)
    assert bucket.overhead == pytest.approx(1.0564, abs=5e-4) and gpumem.overhead < 0.01
    assert bucket.stats.cache_hits / trace.n_allocs == pytest.approx(0.947, abs=5e-4)
    assert bucket.policy == "bucket" and bucket.completed_ops == trace.n_ops and bucket.ooms == 0
    assert bucket.peak_live_bytes == gpumem.peak_live_bytes == trace.peak_live_nbytes
    # Note [Why buckets hold more]: power-of-two rounding and no splitting cost memory
    assert bucket.peak_reserved_bytes > gpumem.peak_reserved_bytes
    assert bucket.peak_reserved_bytes >= bucket.stats.peak_allocated_nbytes >= bucket.peak_live_bytes
    assert bucket.stats.cache_hits + bucket.stats.cache_misses == trace.n_allocs
    assert bucket.as_json()["policy"] == "bucket" and bucket.extra["engine"] == "python"


def test_replay_on_a_small_card_stops_at_the_first_oom():
    from gpumem.trace import load_trace
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "data" / "traces" / "resnet_train.snapshot.pickle.gz"
    trace = load_trace(path).head(3000)
    dev = small_device(256)
    try:
        result = replay_trace(trace, dev, "bucket", progress=False)
        assert result.ooms == 1 and result.oom_op is not None and result.completed_ops == result.oom_op
        assert isinstance(result.oom_error, OutOfMemoryError)
        assert dev.n_allocations == 0  # the pool was closed: everything went back
    finally:
        dev.close()


# -- on every --gpumem-device (simulated by default, cuda:0 on a GPU runner) -----------------------------------
def test_patterns_survive_churn_on_the_device(device):
    import random

    rng = random.Random(7)
    sizes = [rng.choice([1, 100, 512, 3000, 64 * KiB, 700 * KiB, 1 * MiB + 1, 3 * MiB]) for _ in range(300)]
    with BucketAllocator(device, max_pooled_per_bucket=8) as pool:
        live: dict[int, bytes] = {}
        for i, n in enumerate(sizes):
            p = pool.allocate(n)
            assert p not in live
            data = (i.to_bytes(4, "little") * (min(n, 4096) // 4 + 1))[:min(n, 4096)]
            device.write(p, data)
            live[p] = data
            if i % 3 == 2:
                victim = rng.choice(sorted(live))
                pool.free(victim)
                del live[victim]
        for p, data in live.items():
            assert device.read(p, len(data)) == data
        assert pool.hit_rate > 0
        pool.check_consistency()
        for p in list(live):
            pool.free(p)
        assert pool.allocated_nbytes == 0
        pool.clear_pool()
        assert pool.reserved_nbytes == 0


def test_device_lost_while_closing_still_closes():
    dev = small_device(256, faults=sim.FaultPlan(device_lost_at_s=0.05))
    pool = BucketAllocator(dev)
    p = pool.allocate(1000)
    dev.launch(0, 0.1, touches=[(p, 1000)])  # simulated time passes beyond the loss while closing waits
    pool.close()  # the loss is logged, not raised; the pool is closed
    pool.close()
    with pytest.raises(DeviceLostError):
        pool.allocate(10)


def test_a_failed_device_free_changes_nothing():
    from gpumem.errors import CudaError

    dev = small_device(256, faults=sim.FaultPlan(fail_calls={"free": frozenset({1, 3})}))
    pool = BucketAllocator(dev, max_pooled_per_bucket=0)
    p = pool.allocate(1000)
    before = state(pool)
    with pytest.raises(CudaError):
        pool.free(p)  # the pool is full (cap 0): the block goes back to the device, whose free fails
    assert state(pool) == before and pool.block_size(p) == 1024
    pool.free(p)  # the second device free succeeds
    assert pool.reserved_nbytes == 0 and dev.n_allocations == 0
    # clear_pool: a failure part way keeps the blocks not yet given back, and the books match the device
    keep = BucketAllocator(dev)
    ptrs = [keep.allocate(n) for n in (4 * KiB, 8 * KiB)]
    for q in ptrs:
        keep.free(q)
    with pytest.raises(CudaError):
        keep.clear_pool()  # the 8 KiB block goes first (fails: third device free)
    assert keep.pooled_nbytes == 12 * KiB
    keep.check_consistency()
    assert keep.clear_pool() == 12 * KiB and dev.n_allocations == 0
    keep.close()
    pool.close()



def _kernel_on(dev, pool, stream):
    """A block of the pool on ``stream`` and a kernel queued there that reads it; the block is freed at once."""
    p = pool.allocate(3 * MiB, stream)
    work = dev.launch(stream, 0.01, touches=[(p, 4 * MiB)], name="reads p")
    return p, work


@pytest.mark.parametrize("stream", [0, 7])
@pytest.mark.parametrize("release", ["free over the cap", "shrink", "clear_pool", "limit retry"])
def test_a_block_goes_back_to_the_device_only_after_the_kernel_reading_it(dev, stream, release):
    """Note [Streams in the pool]: every path that frees a block on the device waits for its stream first
    (``replay_trace(..., policy="bucket", max_pooled_per_bucket=4)``, docs/backends.md, raised
    MemoryHazardError with the GPU running behind the CPU)."""
    pool = BucketAllocator(dev, max_pooled_per_bucket=0 if release == "free over the cap" else None,
                           limit=8 * MiB if release == "limit retry" else None)
    p, work = _kernel_on(dev, pool, stream)
    pool.free(p)
    assert work.done is (release == "free over the cap")  # pooled: nothing waited yet
    if release == "shrink":
        assert pool.shrink(0) == 4 * MiB
    elif release == "clear_pool":
        assert pool.clear_pool() == 4 * MiB
    elif release == "limit retry":
        pool.free(pool.allocate(5 * MiB, stream))  # an 8 MiB bucket: within the limit once p went back
    assert work.done and dev.now_s >= work.end_s, "the block went back before the kernel was done"
    assert not dev.hazards and pool.pooled_nbytes == (8 * MiB if release == "limit retry" else 0)
    pool.check_consistency()
    pool.close()


def test_replay_with_a_capped_pool_and_the_gpu_behind_the_cpu():
    """docs/backends.md's example: a capped pool on a replay whose GPU work runs behind the CPU (the default)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "data" / "traces" / "resnet_train.snapshot.pickle.gz"
    from gpumem.trace import load_trace

    trace = load_trace(path).head(4000)
    r = replay_trace(trace, "sim:h200-141gb", policy="bucket", max_pooled_per_bucket=0, gpu_timing="trace",
                     progress=False)
    assert r.completed_ops == trace.n_ops and r.ooms == 0
