"""Memory managers (issue 8): the controls people program against, over any :class:`gpumem.Device`.

* :mod:`~gpumem.managers.reserve`: the reserve rule and the usable memory;
* :mod:`~gpumem.managers.resource`, :mod:`~gpumem.managers.layers`: RMM-style memory resources and
  the layers that wrap any of them (statistics, tracking, limits, logging, failure callbacks);
* :mod:`~gpumem.managers.config`: :class:`MemoryConfig` (presets, fluent builder, environment);
* :mod:`~gpumem.managers.manager`: :class:`GpuMemoryManager`;
* :mod:`~gpumem.managers.tracker`, :mod:`~gpumem.managers.regions`: buffers, peaks, leaks, regions;
* :mod:`~gpumem.managers.forensics`: snapshot and report on out of memory;
* :mod:`~gpumem.managers.fallback`: :class:`FallbackBuffer` (GPU, or CPU when the GPU is full);
* :mod:`~gpumem.managers.pressure`: :class:`MemoryPressure` levels and the :class:`PressureMonitor`;
* :mod:`~gpumem.managers.multi`: :class:`MultiGpuMemoryManager` (placement over several devices).
"""

from .config import ENV_VARIABLES, MemoryConfig
from .fallback import FallbackBuffer
from .forensics import ForensicsLayer, ForensicsRecord, write_oom_forensics
from .layers import (Counter, FailureCallbackLayer, LimitingLayer, LoggingLayer, ResourceLayer, ResourceStatistics,
                     StatisticsLayer, TrackingLayer)
from .multi import (DeviceMemoryStats, DeviceRefusal, MultiGpuMemoryManager, MultiGpuMemoryStats,
                    MultiGpuOutOfMemoryError)
from .pressure import (MemoryPressure, PressureChange, PressureMonitor, PressureMonitorStats, PressureSample,
                       Releaser, SampleSource)
from .manager import Allocation, GpuMemoryManager, MemoryStats, PoolStats
from .regions import current_region, region
from .reserve import Reserve, compute_reserve, usable_nbytes
from .resource import AlignmentLayer, DeviceResource, MemoryResource, find_layer
from .tracker import (AllocationInfo, AllocationTracker, BufferId, LeakReport, Location, RegionStats, TrackerStats,
                      UnknownBufferError)

__all__ = [
    "MemoryConfig", "ENV_VARIABLES", "FallbackBuffer", "ForensicsLayer", "ForensicsRecord", "write_oom_forensics",
    "FailureCallbackLayer", "LimitingLayer", "LoggingLayer", "ResourceLayer", "ResourceStatistics", "StatisticsLayer",
    "TrackingLayer", "Allocation", "GpuMemoryManager", "MemoryStats", "PoolStats", "current_region", "region",
    "Reserve", "compute_reserve", "usable_nbytes", "AlignmentLayer", "DeviceResource",
    "MemoryResource", "Counter",
    "find_layer", "AllocationInfo", "AllocationTracker", "BufferId", "LeakReport", "Location", "RegionStats",
    "TrackerStats", "UnknownBufferError",
    "DeviceMemoryStats", "DeviceRefusal", "MultiGpuMemoryManager", "MultiGpuMemoryStats", "MultiGpuOutOfMemoryError",
    "MemoryPressure", "PressureChange", "PressureMonitor", "PressureMonitorStats", "PressureSample", "Releaser",
    "SampleSource",
]
