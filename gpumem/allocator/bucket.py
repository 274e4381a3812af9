"""A size-bucket pool: power-of-two buckets of whole device allocations, one more policy beside the caching
allocator so that the two can be compared on the same traces.

>>> import gpumem
>>> from gpumem.allocator.bucket import BucketAllocator
>>> pool = BucketAllocator(gpumem.open_device("sim:t4-16gb"), max_pooled_per_bucket=16)
>>> p = pool.allocate(3000)       # a 4 KiB bucket: one device malloc of 4096 bytes
>>> pool.free(p)                  # pooled, not given back
>>> q = pool.allocate(4000)       # the same bucket: served from the pool, no device call
>>> pool.hit_rate
0.5

This is the pool the seeds describe (and that many inference engines write first): every request is
rounded up to the next power of two (at least ``min_bucket_nbytes``) and served by a block of exactly
that size. A freed block goes to its bucket's pool, unless the pool already keeps
``max_pooled_per_bucket`` blocks, in which case it goes back to the device. Blocks are never split or
merged, so a bucket can only serve requests of its own size class. :meth:`BucketAllocator.clear_pool`
gives every pooled block back; :meth:`BucketAllocator.shrink` gives back the largest ones until the pool
holds at most a given number of bytes.

``gpumem replay --policy bucket`` and ``replay_trace(..., policy="bucket")`` replay a trace through it.

Note [Why buckets hold more]
----------------------------
Rounding to a power of two costs up to half of every block (on average about a quarter for sizes spread
evenly), and a pooled block serves only its own bucket: memory freed by 8 MiB blocks cannot serve a
16 MiB request, so the pool grows while it holds free memory. The caching allocator splits and merges
blocks (and, with virtual memory, maps pages under live data only) and avoids both costs. The pool is
simple, has O(1) hits and a predictable hit rate, which is why engines start with it; the replay
measures what it costs in memory (docs/backends.md has the numbers on the bundled traces).

Note [Failure atomicity of the pool]
------------------------------------
Every operation calls the device first and books the result after: an allocation whose ``malloc`` fails
changes no live block and no counter except ``num_ooms`` (with ``release_on_oom=True``, the default, the
pooled blocks are given back before one retry, as the caching allocator does: that retry only ever turns
free pooled memory into device memory). A ``free`` whose device call fails (it never does for a block this
pool malloc'd, unless the device is lost) leaves the block live. Limits are checked before any device
call. :meth:`BucketAllocator.check_consistency` compares the books with the device's allocations.

Note [Streams in the pool]
--------------------------
Pools are kept per stream, as the caching allocator's free lists are: a block freed on stream A is only
handed out again on stream A, whose later work is ordered after the work that used it. The pool does not
track use on other streams (there is no ``record_stream``): a block used on another stream must outlive
that use. A block goes back to the device (a free over ``max_pooled_per_bucket``, :meth:`~BucketAllocator.shrink`,
the release before an out-of-memory retry) only after its stream's queued work is done
(``stream_synchronize``): ``Device.free`` of memory that queued work still touches is a hazard, as for
``cudaFree``, and with the GPU running behind the CPU (replays' default) that work is often still queued.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

from ..device import Device
from ..validate import check_nbytes, check_pointer, check_stream
from ..errors import DeviceLostError, InternalError, InvalidArgumentError, InvalidPointerError, OutOfMemoryError
from ..units import format_bytes
from ..validate import parse_limit
from .resource import AllocatorContract
from .stats import AllocatorStats, format_summary

log = logging.getLogger(__name__)

BUCKET_POLICY_NAME = "bucket"
"""The policy name ``gpumem replay --policy`` and ``replay_trace(policy=...)`` know the pool by."""

DEFAULT_MIN_BUCKET_NBYTES = 512
"""The smallest bucket: 512 B, the caching allocator's rounding."""


def bucket_nbytes(nbytes: int, min_bucket_nbytes: int = DEFAULT_MIN_BUCKET_NBYTES) -> int:
    """The bucket of a request of ``nbytes``: the next power of two, at least ``min_bucket_nbytes``.

    >>> bucket_nbytes(3000), bucket_nbytes(4096), bucket_nbytes(1)
    (4096, 4096, 512)
    """
    n = check_nbytes(nbytes)
    return max(min_bucket_nbytes, 1 << (n - 1).bit_length())


@dataclass(frozen=True)
class BucketPolicy:
    """The knobs of a :class:`BucketAllocator`, with a name for reports (``replay`` prints ``name``)."""

    max_pooled_per_bucket: int | None = None
    """Free blocks one bucket (of one stream) keeps; a free beyond that goes back to the device.
    ``None``: no cap (the pool keeps every freed block until :meth:`BucketAllocator.clear_pool`)."""
    min_bucket_nbytes: int = DEFAULT_MIN_BUCKET_NBYTES
    """The smallest bucket (a power of two)."""
    release_on_oom: bool = True
    """When the device is out of memory: give the pooled blocks back and retry once."""
    name: str = BUCKET_POLICY_NAME
    description: str = "size-bucket pool: power-of-two buckets of whole device allocations, no splitting"

    def __post_init__(self) -> None:
        m = self.max_pooled_per_bucket
        if m is not None and (m.__class__ is bool or not isinstance(m, int) or m < 0):
            raise InvalidArgumentError(f"max_pooled_per_bucket must be None or an int >= 0, got {m!r}")
        b = self.min_bucket_nbytes
        if b.__class__ is bool or not isinstance(b, int) or b <= 0 or b & (b - 1):
            raise InvalidArgumentError(f"min_bucket_nbytes must be a positive power of two, got {b!r}")


@dataclass(frozen=True)
class BucketCount:
    """One bucket of :class:`BucketPoolStats`: its size and what it holds now."""

    bucket_nbytes: int
    live_blocks: int
    pooled_blocks: int
    hits: int
    misses: int


@dataclass(frozen=True)
class BucketPoolStats:
    """What :meth:`BucketAllocator.pool_stats` reports: hits and misses, what is pooled, per bucket."""

    hits: int
    misses: int
    pooled_nbytes: int
    pooled_blocks: int
    live_nbytes: int
    live_blocks: int
    returned_on_free: int
    """Frees that went back to the device because their bucket's pool was full."""
    buckets: tuple[BucketCount, ...]

    @property
    def hit_rate(self) -> float:
        """Allocations served from the pool / all allocations (0 before any)."""
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


class BucketAllocator(AllocatorContract):
    """A size-bucket pool over any :class:`~gpumem.Device` (module docstring), with the caching allocator's
    public interface: ``allocate``, ``free``, ``empty_cache``, ``stats``, ``snapshot_stats``,
    ``reserved_nbytes``, ``allocated_nbytes``, ``live_blocks``, ``memory_stats``, ``memory_summary``,
    ``close``; and the pool's own ``clear_pool``, ``shrink``, ``hit_rate`` and ``pool_stats``.

    ``policy`` is a :class:`BucketPolicy` or the name ``"bucket"``; ``max_pooled_per_bucket``,
    ``min_bucket_nbytes`` and ``release_on_oom`` override its fields. ``limit`` caps the bytes the pool
    holds from the device (allocated and pooled), by the rules of ``CachingAllocator(limit=...)``.
    Thread-safe: every field is guarded by ``_lock``.
    """

    engine = "python"
    """The pool runs in Python (reported by replays as the engine)."""
    uses_vmm = False
    """The pool allocates whole ``malloc`` blocks, never virtual memory."""

    def __init__(self, device: Device, policy: "BucketPolicy | str" = BUCKET_POLICY_NAME, *,
                 limit: "int | float | str | None" = None, max_pooled_per_bucket: int | None | Any = ...,
                 min_bucket_nbytes: int | None = None, release_on_oom: bool | None = None,
                 record_history: bool = False) -> None:
        if not isinstance(device, Device):
            raise InvalidArgumentError(f"device must be a gpumem.Device, got {type(device).__name__}")
        if isinstance(policy, str):
            if policy != BUCKET_POLICY_NAME:
                raise InvalidArgumentError(f"unknown bucket policy {policy!r}; the size-bucket pool is "
                                           f"{BUCKET_POLICY_NAME!r}")
            policy = BucketPolicy()
        elif not isinstance(policy, BucketPolicy):
            raise InvalidArgumentError(f"policy must be a BucketPolicy or {BUCKET_POLICY_NAME!r}, "
                                       f"got {type(policy).__name__}")
        overrides: dict[str, Any] = {}
        if max_pooled_per_bucket is not ...:
            overrides["max_pooled_per_bucket"] = max_pooled_per_bucket
        if min_bucket_nbytes is not None:
            overrides["min_bucket_nbytes"] = min_bucket_nbytes
        if release_on_oom is not None:
            overrides["release_on_oom"] = bool(release_on_oom)
        if overrides:
            fields = {k: getattr(policy, k) for k in ("max_pooled_per_bucket", "min_bucket_nbytes",
                                                      "release_on_oom", "name", "description")}
            policy = BucketPolicy(**{**fields, **overrides})
        if record_history:
            raise InvalidArgumentError("the size-bucket pool does not record an allocation history "
                                       "(export a snapshot with a caching policy, e.g. --policy gpumem)")
        self.device = device
        self.policy: BucketPolicy = policy
        self.limit_nbytes: int | None = parse_limit(limit, device.properties().total_nbytes)
        self._defer: Callable[[], ContextManager[Any]] = getattr(device, "deferred_events", contextlib.nullcontext)
        self._lock = threading.Lock()
        # every field below is guarded by _lock
        self._live: dict[int, tuple[int, int, int]] = {}
        """ptr -> (bucket_nbytes, requested_nbytes, stream) of every block handed out."""
        self._pools: dict[tuple[int, int], list[int]] = {}
        """(bucket_nbytes, stream) -> pointers of pooled free blocks (last freed is handed out first)."""
        self._bucket_hits: dict[int, int] = {}
        self._bucket_misses: dict[int, int] = {}
        self._pooled_nbytes = 0
        self._stats = AllocatorStats()
        """allocated/requested/peaks/counts; reserved is derived (allocated + pooled)."""
        self._returned_on_free = 0
        self._closed = False
        self._lost: DeviceLostError | None = None

    # -- the public interface the replay uses ------------------------------------------------------------
    def allocate(self, nbytes: int, stream: int = 0) -> int:
        """Allocate ``nbytes`` on ``stream`` from its bucket; return the device pointer.

        A pooled block of the bucket (and stream) is handed out without a device call; otherwise one
        ``device.malloc`` of the bucket's size. Raises :class:`~gpumem.errors.InvalidArgumentError` for a
        bad size or stream and :class:`~gpumem.errors.OutOfMemoryError` when neither the pool nor the
        device (nor the limit) allows it: Note [Failure atomicity of the pool].
        """
        nbytes = check_nbytes(nbytes)
        stream = check_stream(stream)
        size = max(self.policy.min_bucket_nbytes, 1 << (nbytes - 1).bit_length())
        with self._defer(), self._lock:
            self._check_open()
            pool = self._pools.get((size, stream))
            if pool:
                ptr = pool.pop()
                self._pooled_nbytes -= size
                self._stats.cache_hits += 1
                self._bucket_hits[size] = self._bucket_hits.get(size, 0) + 1
                return self._hand_out(ptr, size, nbytes, stream)
            ptr = self._malloc(size, nbytes)
            self._stats.cache_misses += 1
            self._bucket_misses[size] = self._bucket_misses.get(size, 0) + 1
            return self._hand_out(ptr, size, nbytes, stream)

    def free(self, ptr: int) -> None:
        """Return ``ptr`` to its bucket's pool (or to the device when the pool is full).

        Unknown pointers and double frees raise :class:`~gpumem.errors.InvalidPointerError`, changing nothing.
        """
        ptr = check_pointer(ptr)
        with self._defer(), self._lock:
            self._check_open()
            entry = self._live.get(ptr)
            if entry is None:
                raise InvalidPointerError(f"free of {ptr:#x}: not a live allocation of this bucket pool "
                                          "(never allocated here, or already freed)")
            size, requested, stream = entry
            cap = self.policy.max_pooled_per_bucket
            pool = self._pools.get((size, stream))
            if cap is not None and (0 if pool is None else len(pool)) >= cap:
                self._device_call(self.device.stream_synchronize, stream)  # Note [Streams in the pool]
                self._device_free(ptr)  # device first: on failure the block stays live
                self._returned_on_free += 1
            else:
                if pool is None:
                    pool = self._pools[(size, stream)] = []
                pool.append(ptr)
                self._pooled_nbytes += size
            del self._live[ptr]
            st = self._stats
            st.allocated_nbytes -= size
            st.requested_nbytes -= requested
            st.num_frees += 1

    def clear_pool(self) -> int:
        """Give every pooled (free) block back to the device; return the bytes given back."""
        return self.shrink(0)

    def empty_cache(self) -> int:
        """Same as :meth:`clear_pool` (the caching allocator's name)."""
        return self.shrink(0)

    def shrink(self, max_pooled_nbytes: int = 0) -> int:
        """Give pooled blocks back to the device, largest buckets first, until the pool holds at most
        ``max_pooled_nbytes``; return the bytes given back. Live blocks are never touched.

        Note [Shrinking the largest buckets first]: large blocks are the ones other processes (and other
        buckets) can use, and the fewest device calls give the most memory back; small buckets, which
        serve the most requests, keep their hit rate.
        """
        limit = check_nbytes(max_pooled_nbytes, what="max_pooled_nbytes", allow_zero=True)
        with self._defer(), self._lock:
            if self._closed:
                return 0
            self._check_open()
            return self._release_pooled(limit)

    @property
    def hit_rate(self) -> float:
        """Allocations served from the pool / all allocations (0 before any)."""
        with self._lock:
            n = self._stats.cache_hits + self._stats.cache_misses
            return self._stats.cache_hits / n if n else 0.0

    @property
    def reserved_nbytes(self) -> int:
        """Device memory the pool holds now: live blocks and pooled ones (whole buckets)."""
        with self._lock:
            return self._stats.allocated_nbytes + self._pooled_nbytes

    @property
    def allocated_nbytes(self) -> int:
        """Bytes in live blocks (bucket sizes)."""
        with self._lock:
            return self._stats.allocated_nbytes

    @property
    def pooled_nbytes(self) -> int:
        """Bytes in pooled free blocks."""
        with self._lock:
            return self._pooled_nbytes

    @property
    def stats(self) -> AllocatorStats:
        """The counters as :class:`~gpumem.allocator.AllocatorStats` (a snapshot; :meth:`snapshot_stats`)."""
        return self.snapshot_stats()

    def live_blocks(self) -> list[tuple[int, int]]:
        """``(ptr, bucket size)`` of every live block."""
        with self._lock:
            return [(p, e[0]) for p, e in self._live.items()]

    def pooled_blocks(self) -> list[tuple[int, int]]:
        """``(ptr, bucket size)`` of every pooled free block."""
        with self._lock:
            return [(p, size) for (size, _), pool in self._pools.items() for p in pool]

    def block_size(self, ptr: int) -> int:
        """The bucket size of the live block at ``ptr``."""
        with self._lock:
            entry = self._live.get(ptr)
        if entry is None:
            raise InvalidPointerError(f"{ptr!r} is not a live allocation of this bucket pool")
        return entry[0]

    def snapshot_stats(self) -> AllocatorStats:
        """A copy of the counters with the derived fields filled in: reserved = allocated + pooled; the
        largest free block is the largest pooled bucket; ``device_calls`` counts mallocs and frees."""
        with self._lock:
            st = self._stats.copy()
            st.reserved_nbytes = st.allocated_nbytes + self._pooled_nbytes
            st.active_nbytes = st.allocated_nbytes
            st.num_live_blocks = len(self._live)
            st.num_free_blocks = sum(len(p) for p in self._pools.values())
            st.num_segments = st.num_live_blocks + st.num_free_blocks
            st.largest_free_nbytes = max((size for (size, _), p in self._pools.items() if p), default=0)
            return st

    def pool_stats(self) -> BucketPoolStats:
        """Hits, misses, what is pooled and live, per bucket (:class:`BucketPoolStats`)."""
        with self._lock:
            live: dict[int, int] = {}
            for size, _, _ in self._live.values():
                live[size] = live.get(size, 0) + 1
            pooled: dict[int, int] = {}
            for (size, _), p in self._pools.items():
                pooled[size] = pooled.get(size, 0) + len(p)
            sizes = sorted(set(live) | set(pooled) | set(self._bucket_hits) | set(self._bucket_misses))
            buckets = tuple(BucketCount(s, live.get(s, 0), pooled.get(s, 0), self._bucket_hits.get(s, 0),
                                        self._bucket_misses.get(s, 0)) for s in sizes)
            return BucketPoolStats(
                hits=self._stats.cache_hits, misses=self._stats.cache_misses, pooled_nbytes=self._pooled_nbytes,
                pooled_blocks=sum(pooled.values()), live_nbytes=self._stats.allocated_nbytes,
                live_blocks=len(self._live), returned_on_free=self._returned_on_free, buckets=buckets)

    def memory_stats(self) -> dict[str, int | float]:
        """Counters in the spirit of ``torch.cuda.memory_stats`` (flat names), plus ``hit_rate``."""
        d = self.snapshot_stats().as_dict()
        d["hit_rate"] = self.hit_rate
        return d

    def memory_summary(self) -> str:
        """A text table of the stats, for people (the caching allocator's format)."""
        cap = self.policy.max_pooled_per_bucket
        return format_summary(self.snapshot_stats(), self.policy, self.device.spec,  # type: ignore[arg-type]
                              f"power-of-two buckets, "
                              f"{'no cap on blocks pooled per bucket' if cap is None else f'at most {cap} pooled per bucket'}"
                              f"; hit rate {self.hit_rate:.2%}; python engine")

    def check_consistency(self) -> None:
        """Compare the books with the device's allocations; raise :class:`~gpumem.errors.InternalError`
        listing the differences: every live and pooled block is one device allocation of its bucket's
        size, no block is both, and the byte counts add up."""
        with self._lock:
            problems: list[str] = []
            mine: dict[int, int] = {}
            for p, (size, _, _) in self._live.items():
                mine[p] = size
            pooled_total = 0
            for (size, _), pool in self._pools.items():
                for p in pool:
                    if p in mine:
                        problems.append(f"block {p:#x} is both live and pooled")
                    mine[p] = size
                    pooled_total += size
            if pooled_total != self._pooled_nbytes:
                problems.append(f"pooled blocks hold {pooled_total} B, pooled_nbytes is {self._pooled_nbytes}")
            live_total = sum(e[0] for e in self._live.values())
            if live_total != self._stats.allocated_nbytes:
                problems.append(f"live blocks hold {live_total} B, allocated_nbytes is {self._stats.allocated_nbytes}")
            ranges = getattr(self.device, "allocation_ranges", None)
            if ranges is not None and not self._closed:
                dev = {start: nbytes for start, nbytes in ranges()}
                for p, size in mine.items():
                    if p not in dev:
                        problems.append(f"block {p:#x} is not a device allocation")
                    elif dev[p] < size:
                        problems.append(f"block {p:#x} of {size} B is a device allocation of {dev[p]} B")
            if problems:
                raise InternalError("bucket pool and device disagree: " + "; ".join(problems[:8])
                                    + (f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""))

    def close(self) -> None:
        """Give every block, live and pooled, back to the device. Live pointers become invalid. Idempotent."""
        with self._defer(), self._lock:
            if self._closed:
                return
            try:
                if self._lost is None:
                    self._device_call(self.device.synchronize)  # no block goes back under queued work
                    self._release_pooled(0)
                    for ptr in list(self._live):
                        self._device_free(ptr)
                        size, requested, _ = self._live.pop(ptr)
                        self._stats.allocated_nbytes -= size
                        self._stats.requested_nbytes -= requested
            except DeviceLostError:
                log.warning("%s was lost: the bucket pool closed without giving its memory back", self.device.spec)
            finally:
                self._closed = True

    def __enter__(self) -> "BucketAllocator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"BucketAllocator({self.device.spec}, max_pooled_per_bucket={self.policy.max_pooled_per_bucket}, "
                f"reserved={format_bytes(self.reserved_nbytes)})")

    # -- inside the lock ----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._lost is not None:
            raise DeviceLostError(f"the device was lost: {self._lost}")
        if self._closed:
            raise InvalidArgumentError("the bucket pool is closed")

    def _hand_out(self, ptr: int, size: int, nbytes: int, stream: int) -> int:
        self._live[ptr] = (size, nbytes, stream)
        st = self._stats
        st.count_allocation(size, nbytes, st.allocated_nbytes + size + self._pooled_nbytes)
        return ptr

    def _malloc(self, size: int, nbytes: int) -> int:
        """One device malloc of ``size`` within the limit, giving the pool back and retrying once when the
        device (or the limit) says no and ``release_on_oom``; the out-of-memory error otherwise."""
        total = self.device.properties().total_nbytes
        limit = self.limit_nbytes
        if size > total or (limit is not None and size > limit):
            raise self._oom(nbytes, size, "the bucket is larger than the device's total memory" if size > total
                            else "the bucket is larger than the limit")
        released = False
        while True:
            if limit is not None and self._stats.allocated_nbytes + self._pooled_nbytes + size > limit:
                if self.policy.release_on_oom and not released and self._pooled_nbytes:
                    self._release_pooled(max(0, limit - self._stats.allocated_nbytes - size))
                    released = True
                    self._stats.num_alloc_retries += 1
                    continue
                raise self._oom(nbytes, size, "the limit is reached")
            try:
                ptr = self._device_call(self.device.malloc, size)
            except OutOfMemoryError as exc:
                if self.policy.release_on_oom and not released and self._pooled_nbytes and not exc.injected:
                    # Note [Failure atomicity of the pool]: only free pooled memory goes back before the retry
                    self._release_pooled(0)
                    released = True
                    self._stats.num_alloc_retries += 1
                    continue
                raise self._oom(nbytes, size, "the device is out of memory", cause=exc) from exc
            self._stats.device_calls += 1
            return ptr

    def _oom(self, nbytes: int, size: int, why: str, cause: OutOfMemoryError | None = None) -> OutOfMemoryError:
        self._stats.num_ooms += 1
        if cause is not None:
            free, total = cause.free_nbytes, cause.total_nbytes
        else:
            info = self.device.mem_info()
            free, total = info.free_nbytes, info.total_nbytes
        hint = (f"The size-bucket pool rounds {format_bytes(nbytes)} up to a {format_bytes(size)} bucket; {why}. "
                "Try: clear_pool(), a smaller max_pooled_per_bucket, or a caching policy (gpumem), which splits "
                "and merges blocks.")
        return OutOfMemoryError(nbytes, free, total, device=self.device.spec,
                                allocated_nbytes=self._stats.allocated_nbytes, cached_nbytes=self._pooled_nbytes,
                                limit_nbytes=self.limit_nbytes, hint=hint,
                                injected=bool(cause is not None and cause.injected), rounded_nbytes=size)

    def _device_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except DeviceLostError as exc:
            self._lost = exc
            raise

    def _device_free(self, ptr: int) -> None:
        self._device_call(self.device.free, ptr)
        self._stats.device_calls += 1

    def _release_pooled(self, keep_nbytes: int) -> int:
        """Free pooled blocks, largest bucket first, until at most ``keep_nbytes`` stay pooled.
        Each block leaves the books only after its device free succeeded."""
        released = 0
        if self._pooled_nbytes <= keep_nbytes:
            return 0
        for key in sorted(self._pools, key=lambda k: (-k[0], k[1])):
            size = key[0]
            pool = self._pools[key]
            if pool:
                self._device_call(self.device.stream_synchronize, key[1])  # Note [Streams in the pool]
            while pool and self._pooled_nbytes > keep_nbytes:
                self._device_free(pool[-1])
                pool.pop()
                self._pooled_nbytes -= size
                released += size
            if not pool:
                del self._pools[key]
            if self._pooled_nbytes <= keep_nbytes:
                break
        if released:
            self._stats.num_gc_releases += 1
            log.debug("bucket pool gave %s back to %s", format_bytes(released), self.device.spec)
        return released


def is_bucket_policy(policy: object) -> bool:
    """Whether ``policy`` names the size-bucket pool (``"bucket"`` or a :class:`BucketPolicy`)."""
    return isinstance(policy, BucketPolicy) or policy == BUCKET_POLICY_NAME


__all__ = ["BucketAllocator", "BucketPolicy", "BucketPoolStats", "BucketCount", "BUCKET_POLICY_NAME",
           "bucket_nbytes", "is_bucket_policy"]
