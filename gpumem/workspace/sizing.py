"""Workspace sizing for a quantized linear layer, from what the device really has free.

A quantized linear layer (BitNet-style 2-bit weights) needs GPU scratch memory for its kernels:

* the **dequantized weights**: ``in_features * out_features`` values, fp16 for I2S and TL1, fp32 for TL2;
* the **intermediates**: fp32 rows of ``out_features`` values, one per sample of the batch.

:func:`calculate_gpu_workspace_size` asks the device what is free right now, keeps the reserve of
:func:`gpumem.managers.reserve.compute_reserve` free for what allocates outside the workspace (Note
[Which part of the reserve]), takes a share (:data:`USABLE_FRACTION`) of the rest, and fits the largest batch the GPU's class allows:

=====================  ============================
reported total memory  batch cap (:class:`GpuClass`)
=====================  ============================
below 4 GB             64
4 - 8 GB               128
8 - 24 GB              256
24 GB and more         512
=====================  ============================

and never more than :data:`ABSOLUTE_MAX_BATCH_SIZE`. The workspace is ``dequant + batch * per_sample``,
clamped to [:data:`MIN_WORKSPACE_NBYTES`, :data:`MAX_WORKSPACE_NBYTES`] and never above what is usable:
on a card too small for the whole dequantized matrix the workspace is what fits, and the kernel
dequantizes in tiles (:attr:`WorkspaceSize.tiled`). The batch is then recomputed from the clamped
workspace, so it never claims more than the workspace holds (Note [The batch a workspace holds]). When
even the minimum does not fit, :class:`InsufficientWorkspaceMemoryError` says what was required, what was
available and where; a failed device query raises :class:`WorkspaceDeviceQueryError`. Nothing falls back to a constant.

Note [GPU classes by nominal size]
----------------------------------
Cards report less than the size printed on the box (an "RTX 4090 24 GB" reports 24,217 MiB, an
"L4 24 GB" 22,563 MiB, a "GTX 1650 4 GB" 3,904 MiB). The classes are meant by the nominal size, so a
class boundary of B GiB is met by a reported total of at least ``0.9 * B`` GiB
(:data:`NOMINAL_TOLERANCE`): every built-in profile then lands in the class its name says.

Note [Which part of the reserve]
--------------------------------
:func:`gpumem.managers.reserve.compute_reserve` returns a reserve of two parts: ``context_nbytes``, what
the device already showed as used (the CUDA context, the OS on Jetson boards, other tenants), which is
*already missing* from ``mem_info().free_nbytes``, and ``emergency_nbytes``, headroom kept free on purpose
(5 % of the card, within [128 MiB, 2 GiB]; Note [The reserve rule] there). "Free after the reserve" is
therefore ``free - emergency`` (the rule's ``usable_nbytes``, which never raises here: a non-positive
result makes the available memory 0 and the sizing raises its own error). Subtracting the whole reserve
from ``free`` would count the context twice. ``reserve_bytes`` in the results is that emergency part,
and ``reserve_nbytes=`` overrides it.

Note [The batch a workspace holds]
----------------------------------
The batch reported with a workspace is always what that workspace holds, after every clamp
(:func:`batch_for_workspace`, shared by :func:`size_workspace` and :class:`~gpumem.workspace.Workspace`):

* **not tiled** (``workspace >= dequant + per_sample``): ``batch = min(cap, (workspace - dequant) //
  per_sample)``, so ``workspace >= dequant + batch * per_sample`` always;
* **tiled** (``workspace < dequant + per_sample``: the whole dequantized matrix and one sample do not fit,
  because of the memory available or of :data:`MAX_WORKSPACE_NBYTES`): ``batch = 1``; the workspace holds
  one sample's intermediates (``workspace >= per_sample``, the minimum workspace) and the rest is for
  the tiles the kernel dequantizes one after the other.

Note [The usable share]
-----------------------
Only :data:`USABLE_FRACTION` (95 %) of what is free after the reserve is handed to the workspace. The
other 5 % is headroom: the allocator rounds requests up (to 2 MiB pages), and a :class:`Workspace` that
followed free memory exactly would have to shrink at the first page another process takes. With the
headroom a small take by someone else is absorbed by the reserve instead (Note [Hysteresis] in
:mod:`gpumem.workspace.workspace`).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..device import DeviceProperties, MemInfo
from ..errors import GpumemError, InvalidArgumentError, OutOfMemoryError
from ..units import GiB, MiB, format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from ..device import Device

log = logging.getLogger(__name__)

USABLE_FRACTION = 0.95
"""Share of the memory free after the reserve that a workspace may take (Note [The usable share])."""

ABSOLUTE_MAX_BATCH_SIZE = 1024
"""No batch above this, whatever the class or a caller's ``max_batch_size`` says."""

MIN_WORKSPACE_NBYTES = 1 * MiB
"""The smallest workspace worth having (and never less than one sample's intermediates)."""

MAX_WORKSPACE_NBYTES = 64 * GiB
"""The largest workspace one layer gets, whatever the card."""

NOMINAL_TOLERANCE = 0.9
"""A class boundary of B GiB is met by a reported total of at least ``NOMINAL_TOLERANCE * B`` GiB."""

INTERMEDIATE_BYTES = 4
"""Intermediates are fp32 for every quantization type."""


class QType(str, enum.Enum):
    """The quantization type of the layer; decides the dequantized element size."""

    I2S = "i2s"
    """2-bit signed weights, dequantized to fp16."""
    TL1 = "tl1"
    """Table lookup (ARM layout), dequantized to fp16."""
    TL2 = "tl2"
    """Table lookup (x86 layout, larger tables), dequantized to fp32."""

    @property
    def dequant_bytes(self) -> int:
        """Bytes per dequantized weight: 2 (fp16) for I2S and TL1, 4 (fp32) for TL2."""
        return 4 if self is QType.TL2 else 2

    @property
    def intermediate_bytes(self) -> int:
        """Bytes per intermediate value: 4 (fp32) for every type."""
        return INTERMEDIATE_BYTES

    @classmethod
    def parse(cls, value: "QType | str") -> "QType":
        """A :class:`QType` from itself or its name (``"i2s"``, ``"TL2"``...); anything else raises
        :class:`~gpumem.errors.InvalidArgumentError`."""
        if isinstance(value, QType):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        raise InvalidArgumentError(f"qtype must be one of {', '.join(q.value for q in cls)}, got {value!r:.60}")


class GpuClass(enum.Enum):
    """A GPU's class by memory size, with the batch cap it allows (Note [GPU classes by nominal size])."""

    SMALL = ("< 4 GB", 0, 64)
    MEDIUM = ("4-8 GB", 4, 128)
    LARGE = ("8-24 GB", 8, 256)
    XLARGE = (">= 24 GB", 24, 512)

    def __init__(self, label: str, lower_gib: int, max_batch_size: int) -> None:
        self.label = label
        self.lower_gib = lower_gib
        self.max_batch_size = max_batch_size

    @classmethod
    def of(cls, total_nbytes: int) -> "GpuClass":
        """The class of a card that reports ``total_nbytes``."""
        chosen = cls.SMALL
        for c in cls:
            if total_nbytes >= NOMINAL_TOLERANCE * c.lower_gib * GiB:
                chosen = c
        return chosen


class InsufficientWorkspaceMemoryError(OutOfMemoryError):
    """Too little memory for even the smallest workspace: ``required_nbytes`` is that minimum,
    ``available_nbytes`` what was usable (free after the reserve, times the usable share)."""

    def __init__(self, required_nbytes: int, available_nbytes: int, free_nbytes: int, total_nbytes: int, *,
                 device: str, reserve_nbytes: int = 0, detail: str = "") -> None:
        self.required_nbytes = required_nbytes
        self.available_nbytes = available_nbytes
        self.reserve_nbytes = reserve_nbytes
        super().__init__(required_nbytes, free_nbytes, total_nbytes, device=device, hint=detail)
        # a sizing, not an allocation: nothing was "tried to allocate" (OutOfMemoryError's wording)
        on = f" on {device}" if device else ""
        msg = (f"out of memory{on}: a workspace needs at least {format_bytes(required_nbytes)} "
               f"({required_nbytes} bytes); only {format_bytes(available_nbytes)} ({available_nbytes} bytes) is "
               f"available ({format_bytes(free_nbytes)} free of {format_bytes(total_nbytes)} total, "
               f"{format_bytes(reserve_nbytes)} kept as reserve).")
        if detail:
            msg += " " + detail
        self.args = (msg,)


class WorkspaceDeviceQueryError(GpumemError, RuntimeError):
    """Asking the device what it has (``properties()``/``mem_info()``) failed; ``__cause__`` is the device's
    error. The workspace is not sized from a guess instead."""

    def __init__(self, device: str, cause: BaseException) -> None:
        self.device = device
        self.cause = cause
        super().__init__(f"could not query the memory of {device}: {type(cause).__name__}: {cause}")


@dataclass(frozen=True)
class WorkspaceSize:
    """The result of :func:`calculate_gpu_workspace_size` (all sizes in bytes)."""

    workspace_bytes: int
    """The workspace to allocate."""
    batch_size: int
    """Samples the intermediates have room for (at least 1)."""
    available_bytes: int
    """Usable memory the size was chosen from: ``USABLE_FRACTION * (free - reserve)``."""
    device: str
    """The device's spec."""
    qtype: QType
    in_features: int
    out_features: int
    dequant_bytes: int
    """The dequantized weight matrix: ``in * out * dequant element bytes``."""
    per_sample_bytes: int
    """Intermediates per sample: ``out * 4``."""
    gpu_class: GpuClass
    max_batch_size: int
    """The cap applied: the class's, a caller's, never above :data:`ABSOLUTE_MAX_BATCH_SIZE`."""
    free_bytes: int
    total_bytes: int
    reserve_bytes: int
    """What is kept free: the emergency part of :func:`~gpumem.managers.reserve.compute_reserve`
    (Note [Which part of the reserve])."""
    min_workspace_bytes: int
    max_workspace_bytes: int

    @property
    def desired_bytes(self) -> int:
        """The workspace before the clamp to what is usable: ``dequant + batch * per_sample`` within
        [min, max]."""
        return min(max(self.dequant_bytes + self.batch_size * self.per_sample_bytes, self.min_workspace_bytes),
                   self.max_workspace_bytes)

    @property
    def tiled(self) -> bool:
        """True when the whole dequantized matrix and one sample do not fit: the kernel dequantizes in tiles,
        with a batch of 1 (Note [The batch a workspace holds])."""
        return self.workspace_bytes < self.dequant_bytes + self.per_sample_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (enums as their names)."""
        return {
            "workspace_bytes": self.workspace_bytes, "batch_size": self.batch_size,
            "available_bytes": self.available_bytes, "device": self.device, "qtype": self.qtype.value,
            "in_features": self.in_features, "out_features": self.out_features,
            "dequant_bytes": self.dequant_bytes, "per_sample_bytes": self.per_sample_bytes,
            "gpu_class": self.gpu_class.label, "max_batch_size": self.max_batch_size,
            "free_bytes": self.free_bytes, "total_bytes": self.total_bytes, "reserve_bytes": self.reserve_bytes,
            "min_workspace_bytes": self.min_workspace_bytes, "max_workspace_bytes": self.max_workspace_bytes,
            "tiled": self.tiled,
        }


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(f"{what} must be a positive int, got {value!r:.60}")
    return int(value)


def batch_for_workspace(workspace_nbytes: int, dequant_nbytes: int, per_sample_nbytes: int, cap: int) -> int:
    """The batch a workspace of ``workspace_nbytes`` really holds (Note [The batch a workspace holds]):
    ``(workspace - dequant) // per_sample`` capped by ``cap``; 1 when not even the dequantized matrix and
    one sample fit (tiled). Used by :func:`size_workspace` after its clamps and by
    :class:`~gpumem.workspace.Workspace` when it cuts a size down."""
    rest = workspace_nbytes - dequant_nbytes
    if rest < per_sample_nbytes:
        return 1
    return max(1, min(cap, rest // per_sample_nbytes))


def reserve_nbytes_for(properties: DeviceProperties, mem: MemInfo) -> int:
    """The bytes the reserve rule keeps **free** on a device in state ``mem``: the emergency part of
    :func:`gpumem.managers.reserve.compute_reserve` (Note [Which part of the reserve])."""
    from ..managers.reserve import compute_reserve

    return int(compute_reserve(properties, mem).emergency_nbytes)


def size_workspace(in_features: int, out_features: int, qtype: QType | str, properties: DeviceProperties,
                   mem: MemInfo, *, device: str, reserve_nbytes: int | None = None,
                   max_batch_size: int | None = None, min_workspace_nbytes: int = MIN_WORKSPACE_NBYTES,
                   max_workspace_nbytes: int = MAX_WORKSPACE_NBYTES,
                   usable_fraction: float = USABLE_FRACTION) -> WorkspaceSize:
    """The workspace for a layer on a device whose state is ``properties`` and ``mem`` (no device call).

    ``reserve_nbytes``: what to keep free (default: the reserve rule's emergency part for ``properties`` and
    ``mem``, Note [Which part of the reserve]).
    ``max_batch_size``: a caller's cap below the class's. Raises
    :class:`InsufficientWorkspaceMemoryError` when even the minimum workspace is not usable.
    """
    in_features = _positive_int(in_features, "in_features")
    out_features = _positive_int(out_features, "out_features")
    q = QType.parse(qtype)
    min_ws = _positive_int(min_workspace_nbytes, "min_workspace_nbytes")
    max_ws = _positive_int(max_workspace_nbytes, "max_workspace_nbytes")
    if max_ws < min_ws:
        raise InvalidArgumentError(f"max_workspace_nbytes ({max_ws}) is below min_workspace_nbytes ({min_ws})")
    if isinstance(usable_fraction, bool) or not isinstance(usable_fraction, (int, float)) \
            or not 0 < usable_fraction <= 1:
        raise InvalidArgumentError(f"usable_fraction must be in (0, 1], got {usable_fraction!r:.60}")
    gpu_class = GpuClass.of(properties.total_nbytes)
    cap = min(gpu_class.max_batch_size, ABSOLUTE_MAX_BATCH_SIZE)
    if max_batch_size is not None:
        cap = min(cap, _positive_int(max_batch_size, "max_batch_size"))
    if reserve_nbytes is None:
        reserve_nbytes = reserve_nbytes_for(properties, mem)
    elif isinstance(reserve_nbytes, bool) or not isinstance(reserve_nbytes, int) or reserve_nbytes < 0:
        raise InvalidArgumentError(f"reserve_nbytes must be a non-negative int, got {reserve_nbytes!r:.60}")

    dequant = in_features * out_features * q.dequant_bytes
    per_sample = out_features * q.intermediate_bytes
    free = mem.free_nbytes
    available = int(max(0, free - reserve_nbytes) * usable_fraction)
    remaining = available - dequant
    batch = max(1, min(cap, remaining // per_sample if remaining > 0 else 0))
    required = max(min_ws, per_sample)
    if available < required:
        raise InsufficientWorkspaceMemoryError(
            required, available, free, mem.total_nbytes, device=device, reserve_nbytes=reserve_nbytes,
            detail=f"(layer {in_features}x{out_features} {q.value}: one sample's intermediates are "
                   f"{format_bytes(per_sample)}, the minimum workspace {format_bytes(min_ws)})")
    desired = min(max(dequant + batch * per_sample, required), max(max_ws, required))
    workspace = min(desired, available)
    # the clamps may have cut the workspace below dequant + batch * per_sample: the batch is what it holds
    batch = batch_for_workspace(workspace, dequant, per_sample, cap)
    result = WorkspaceSize(
        workspace_bytes=workspace, batch_size=batch, available_bytes=available, device=device, qtype=q,
        in_features=in_features, out_features=out_features, dequant_bytes=dequant, per_sample_bytes=per_sample,
        gpu_class=gpu_class, max_batch_size=cap, free_bytes=free, total_bytes=mem.total_nbytes,
        reserve_bytes=reserve_nbytes, min_workspace_bytes=required, max_workspace_bytes=max(max_ws, required))
    log.debug("workspace for %dx%d %s on %s: %s, batch %d (%s usable, class %s)", in_features, out_features,
              q.value, device, format_bytes(workspace), batch, format_bytes(available), gpu_class.label)
    return result


SIZING_OPTIONS = ("reserve_nbytes", "max_batch_size", "min_workspace_nbytes", "max_workspace_nbytes",
                  "usable_fraction")
"""The keywords :func:`size_workspace` takes besides the layer and the device's state."""


def check_options(options: dict[str, Any]) -> None:
    """Refuse keywords :func:`size_workspace` does not take (:class:`~gpumem.errors.InvalidArgumentError`)."""
    unknown = sorted(set(options) - set(SIZING_OPTIONS))
    if unknown:
        raise InvalidArgumentError(f"unknown sizing option(s) {', '.join(unknown)}; known: {', '.join(SIZING_OPTIONS)}")


def query_device(device: "Device") -> tuple[DeviceProperties, MemInfo]:
    """``device.properties()`` and ``device.mem_info()``; a failure raises :class:`WorkspaceDeviceQueryError`
    from the device's error."""
    spec = str(getattr(device, "spec", device))
    try:
        return device.properties(), device.mem_info()
    except GpumemError as exc:
        raise WorkspaceDeviceQueryError(spec, exc) from exc


def calculate_gpu_workspace_size(in_features: int, out_features: int, qtype: QType | str,
                                 device: "Device | str | int", **options: Any) -> WorkspaceSize:
    """The workspace for a quantized linear layer of ``in_features`` x ``out_features`` weights of type
    ``qtype`` on ``device`` (a :class:`~gpumem.Device`, or a spec such as ``"sim:t4-16gb"`` or ``"cuda:0"``,
    or a CUDA index ``0`` meaning ``"cuda:0"``, opened and closed here), from its free memory right now.

    ``options`` go to :func:`size_workspace` (``max_batch_size``, ``reserve_nbytes``, ...). Raises
    :class:`InsufficientWorkspaceMemoryError` (an :class:`~gpumem.errors.OutOfMemoryError`) when too little is
    free, :class:`WorkspaceDeviceQueryError` when the device cannot say, and
    :class:`~gpumem.errors.InvalidArgumentError` for bad arguments (checked before the device is opened).

    >>> ws = calculate_gpu_workspace_size(4096, 11008, "i2s", "sim:t4-16gb")
    >>> ws.batch_size, ws.gpu_class.label
    (256, '8-24 GB')
    """
    _positive_int(in_features, "in_features")
    _positive_int(out_features, "out_features")
    QType.parse(qtype)
    check_options(options)
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise InvalidArgumentError(f"a CUDA device index must be >= 0, got {device}")
        device = f"cuda:{device}"
    if isinstance(device, str):
        from ..specs import open_device

        dev = open_device(device)
        try:
            return calculate_gpu_workspace_size(in_features, out_features, qtype, dev, **options)
        finally:
            dev.close()
    from ..device import Device

    if not isinstance(device, Device):
        raise InvalidArgumentError(f"device must be a gpumem.Device, a spec such as 'sim:t4-16gb' or a CUDA index, "
                                   f"got {type(device).__name__}")
    props, mem = query_device(device)
    return size_workspace(in_features, out_features, qtype, props, mem, device=str(device.spec), **options)


SIX_GB_RULE_AVAILABLE_NBYTES = 6 * GiB
"""What the hard-coded rule this module replaces assumed every GPU had free."""

SIX_GB_RULE_MAX_BATCH_SIZE = 128
"""The hard-coded rule's batch cap, on every GPU."""


def six_gb_rule_workspace_size(in_features: int, out_features: int, qtype: QType | str) -> tuple[int, int]:
    """``(workspace_bytes, batch_size)`` by the hard-coded rule this module replaces, for comparison only
    (``sim/workspace_scenario.py``): it assumes 6 GiB are available on every GPU, batch =
    ``min((6 GiB - dequant) / per_sample, 128)``, workspace = ``dequant + batch * per_sample``. It never
    looks at the device, which is the bug."""
    q = QType.parse(qtype)
    in_features = _positive_int(in_features, "in_features")
    out_features = _positive_int(out_features, "out_features")
    dequant = in_features * out_features * q.dequant_bytes
    per_sample = out_features * q.intermediate_bytes
    remaining = max(0, SIX_GB_RULE_AVAILABLE_NBYTES - dequant)
    batch = max(1, min(remaining // per_sample, SIX_GB_RULE_MAX_BATCH_SIZE))
    return dequant + batch * per_sample, batch
