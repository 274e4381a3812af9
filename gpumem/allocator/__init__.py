"""The caching allocator and its policies.

:class:`CachingAllocator` runs on any :class:`gpumem.Device`; a named
:class:`AllocatorPolicy` (``gpumem``, ``bestfit``, ``pytorch``, ``cupy``) decides
rounding, pools, segment sizes, splitting and whether virtual memory backs it.
:func:`make_allocator` builds it (or the size-bucket pool); both are
:class:`~gpumem.allocator.resource.MemoryResource` s.
"""

from .caching import CachingAllocator
from .factory import Allocator, make_allocator
from .policy import DEFAULT_POLICY, POLICIES, AllocatorPolicy, SegmentRule, VmmMode, get_policy
from .resource import AlignmentLayer, MemoryResource
from .stats import AllocatorStats

__all__ = ["CachingAllocator", "AllocatorPolicy", "AllocatorStats", "POLICIES", "DEFAULT_POLICY", "SegmentRule",
           "VmmMode", "get_policy", "make_allocator", "Allocator", "MemoryResource", "AlignmentLayer"]
