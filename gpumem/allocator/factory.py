"""The one allocator factory: replay, managers, reports, sweeps and estimates build their pool here."""

from __future__ import annotations

from typing import Any, Union

from ..device import Device
from ..errors import InvalidArgumentError
from .bucket import BucketAllocator, BucketPolicy, is_bucket_policy
from .caching import CachingAllocator
from .policy import DEFAULT_POLICY, AllocatorPolicy

#: Keyword arguments only the size-bucket pool takes.
BUCKET_ONLY_OPTIONS = frozenset({"max_pooled_per_bucket", "min_bucket_nbytes", "release_on_oom"})
#: Keyword arguments only the caching allocator takes.
CACHING_ONLY_OPTIONS = frozenset({"gc_threshold", "engine"})

#: Either allocator; both are :class:`~gpumem.allocator.resource.MemoryResource` s.
Allocator = Union[CachingAllocator, BucketAllocator]


def make_allocator(device: Device, policy: "str | AllocatorPolicy | BucketPolicy" = DEFAULT_POLICY,
                   **options: Any) -> Allocator:
    """The allocator for ``policy``: the size-bucket pool for ``"bucket"`` (or a
    :class:`~gpumem.allocator.bucket.BucketPolicy`), else a :class:`~gpumem.allocator.CachingAllocator`
    under that policy. ``options`` go to the allocator (``limit=``, ``record_history=`` for both);
    an option the chosen allocator does not take is refused with
    :class:`~gpumem.errors.InvalidArgumentError` naming it, before anything is built.
    """
    bucket = is_bucket_policy(policy)
    foreign = sorted(set(options) & (CACHING_ONLY_OPTIONS if bucket else BUCKET_ONLY_OPTIONS))
    if foreign:
        kind = "the size-bucket pool" if bucket else f"the caching allocator (policy {policy!r})"
        raise InvalidArgumentError(f"{kind} does not take {', '.join(foreign)}")
    if bucket:
        return BucketAllocator(device, policy, **options)  # type: ignore[arg-type]
    return CachingAllocator(device, policy, **options)  # type: ignore[arg-type]


__all__ = ["make_allocator", "Allocator", "BUCKET_ONLY_OPTIONS", "CACHING_ONLY_OPTIONS"]
