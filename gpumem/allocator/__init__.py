"""The caching allocator and its policies.

:class:`CachingAllocator` runs on any :class:`gpumem.Device`; a named
:class:`AllocatorPolicy` (``gpumem``, ``bestfit``, ``pytorch``, ``cupy``) decides
rounding, pools, segment sizes, splitting and whether virtual memory backs it.
"""

from .caching import CachingAllocator
from .policy import DEFAULT_POLICY, POLICIES, AllocatorPolicy, SegmentRule, VmmMode, get_policy
from .stats import AllocatorStats

__all__ = ["CachingAllocator", "AllocatorPolicy", "AllocatorStats", "POLICIES", "DEFAULT_POLICY", "SegmentRule",
           "VmmMode", "get_policy"]
