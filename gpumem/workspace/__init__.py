"""GPU workspace sizing for quantized linear layers, from the real device, following memory pressure.

* :func:`calculate_gpu_workspace_size` - the workspace and batch for a layer on a device now;
* :class:`Workspace` - that memory, held through gpumem's allocator, shrinking under pressure and
  growing back (with hysteresis); :class:`WorkspaceSet` - one per device;
* :class:`InsufficientWorkspaceMemoryError` (an :class:`~gpumem.errors.OutOfMemoryError`) and
  :class:`WorkspaceDeviceQueryError`.

See ``docs/workspace.md``.
"""

from .sizing import (
    ABSOLUTE_MAX_BATCH_SIZE,
    MAX_WORKSPACE_NBYTES,
    MIN_WORKSPACE_NBYTES,
    USABLE_FRACTION,
    GpuClass,
    InsufficientWorkspaceMemoryError,
    QType,
    WorkspaceDeviceQueryError,
    WorkspaceSize,
    calculate_gpu_workspace_size,
    six_gb_rule_workspace_size,
    size_workspace,
)
from .workspace import (CLOSE_RELEASE_ATTEMPTS, Hysteresis, Workspace, WorkspaceReleaseError, WorkspaceResizeError,
                        WorkspaceSet, WorkspaceStats)

__all__ = [
    "calculate_gpu_workspace_size", "size_workspace", "six_gb_rule_workspace_size", "QType", "GpuClass",
    "WorkspaceSize", "InsufficientWorkspaceMemoryError", "WorkspaceDeviceQueryError", "Workspace",
    "WorkspaceSet", "WorkspaceStats", "WorkspaceResizeError", "WorkspaceReleaseError", "CLOSE_RELEASE_ATTEMPTS", "Hysteresis", "USABLE_FRACTION", "ABSOLUTE_MAX_BATCH_SIZE",
    "MIN_WORKSPACE_NBYTES", "MAX_WORKSPACE_NBYTES",
]
