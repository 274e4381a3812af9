"""The reserve: memory a manager keeps off-limits, and the usable memory that remains.

A manager never hands out all of a GPU. Two kinds of memory stay out of its reach:

``context_nbytes``
    What the device already showed as *used* when it was measured: the CUDA context, the driver's
    own allocations, on unified-memory boards (Jetson) the operating system, and any other tenant
    present at that moment. This memory is **already gone** from :attr:`MemInfo.free_nbytes`; it is
    counted here so that ``total = context + emergency + usable`` adds up, not taken twice.
``emergency_nbytes``
    Headroom kept *free* on purpose, for what allocates outside the manager later: cuBLAS/cuDNN
    workspaces, kernel images loaded lazily on first use, NCCL buffers, a second library's pool.
    Without it the first such allocation fails even though the manager "had room".

Note [The reserve rule]
-----------------------
With ``T`` the device's total bytes and ``used`` what it showed as used when measured::

    context   = used                        (estimated as clamp(T/64, 64 MiB, 512 MiB) if used == 0)
    emergency = clamp(T/20, lo=min(128 MiB, T/10), hi=2 GiB)
    emergency = max(emergency, min(min_free_bytes, T/8))      when min_free_bytes is given
    reserve   = context + emergency
    usable    = free - emergency     (= T - reserve when nothing else came or went since the measure)

Why not the seeds' rule (600 MB + 10 % of the total, capped at 2 GB)? Its fixed 600 MB stands for
the context, but the context is *measured* (80 MiB on a GTX 1050, 527 MiB on the H200), and on small
cards the fixed part dominates: a 2 GB card loses 40 % of itself. What needs headroom besides the
context is mostly a fixed amount per process (cuBLAS workspaces, lazily loaded kernels: tens of MiB),
growing with the model only through workspaces and buffers, which bigger cards run bigger. Hence 5 %
of the card, at least 128 MiB (a tenth of cards below 1.25 GiB), at most 2 GiB (5 % of a 141 GB card
would be more than any workspace needs). ``min_free_bytes`` raises the emergency part but never past
an eighth of the card: MemoryConfig's 512 MB default would otherwise take a quarter of a 2 GB card.

Properties (tested with Hypothesis over every simulated profile and random totals): the emergency
part is at most 10 % of the total (12.5 % with ``min_free_bytes``); the reserve and the usable
memory never decrease as the total grows; usable memory is positive or the call raises.
``reserve_table()`` gives the figures per simulated profile beside the seeds' rule
(``reports/reserve-rule.md``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gpumem.device import DeviceProperties, MemInfo
from gpumem.errors import InvalidArgumentError, OutOfMemoryError
from gpumem.units import GiB, MiB, format_bytes

log = logging.getLogger(__name__)

#: Share of the total the emergency part aims at (Note [The reserve rule]): 1/20 = 5 %.
EMERGENCY_SHARE_DENOMINATOR = 20
#: The emergency floor, 128 MiB, but never more than a tenth of the card.
EMERGENCY_FLOOR_NBYTES = 128 * MiB
FLOOR_SHARE_DENOMINATOR = 10
#: The emergency ceiling.
EMERGENCY_CAP_NBYTES = 2 * GiB
#: ``min_free_bytes`` is honoured up to an eighth of the card.
MIN_FREE_SHARE_DENOMINATOR = 8
#: Context estimate when the device shows nothing used (measured before the context existed).
CONTEXT_ESTIMATE_MIN_NBYTES = 64 * MiB
CONTEXT_ESTIMATE_MAX_NBYTES = 512 * MiB
CONTEXT_ESTIMATE_SHARE_DENOMINATOR = 64


@dataclass(frozen=True)
class Reserve:
    """Memory kept out of a manager's reach (Note [The reserve rule])."""

    context_nbytes: int
    """Used when measured (context, driver, OS on unified boards, other tenants): already not free."""
    emergency_nbytes: int
    """Headroom kept free on purpose for allocations outside the manager."""

    def __post_init__(self) -> None:
        for what in ("context_nbytes", "emergency_nbytes"):
            value = getattr(self, what)
            if type(value) is not int or value < 0:
                raise InvalidArgumentError(f"Reserve.{what} must be a non-negative int, got {value!r}")

    @property
    def nbytes(self) -> int:
        """The whole reserve: context plus emergency."""
        return self.context_nbytes + self.emergency_nbytes

    def __str__(self) -> str:
        return (f"{format_bytes(self.nbytes)} reserve ({format_bytes(self.context_nbytes)} context, "
                f"{format_bytes(self.emergency_nbytes)} emergency)")


def _check_inputs(properties: DeviceProperties, mem: MemInfo, min_free_bytes: object) -> None:
    if not isinstance(properties, DeviceProperties):
        raise InvalidArgumentError(f"properties must be a DeviceProperties, got {type(properties).__name__}")
    if not isinstance(mem, MemInfo):
        raise InvalidArgumentError(f"mem must be a MemInfo, got {type(mem).__name__}")
    if mem.total_nbytes <= 0 or not 0 <= mem.free_nbytes <= mem.total_nbytes:
        raise InvalidArgumentError(f"mem must have 0 <= free <= total and total > 0, got {mem!r}")
    if min_free_bytes is not None and (type(min_free_bytes) is not int or min_free_bytes < 0):
        raise InvalidArgumentError(f"min_free_bytes must be None or an int >= 0, got {min_free_bytes!r}")


def estimate_context_nbytes(total_nbytes: int) -> int:
    """A context estimate for a device measured before its context existed: ``clamp(T/64, 64 MiB, 512 MiB)``."""
    return max(CONTEXT_ESTIMATE_MIN_NBYTES,
               min(total_nbytes // CONTEXT_ESTIMATE_SHARE_DENOMINATOR, CONTEXT_ESTIMATE_MAX_NBYTES))


def emergency_nbytes(total_nbytes: int, *, min_free_bytes: int | None = None) -> int:
    """The emergency part for a device of ``total_nbytes`` (Note [The reserve rule])."""
    floor = min(EMERGENCY_FLOOR_NBYTES, total_nbytes // FLOOR_SHARE_DENOMINATOR)
    e = min(max(total_nbytes // EMERGENCY_SHARE_DENOMINATOR, floor), EMERGENCY_CAP_NBYTES)
    if min_free_bytes is not None:
        honoured = min(min_free_bytes, total_nbytes // MIN_FREE_SHARE_DENOMINATOR)
        if honoured < min_free_bytes:
            log.info("min_free_bytes %s capped at %s, an eighth of the device's %s (Note [The reserve rule])",
                     format_bytes(min_free_bytes), format_bytes(honoured), format_bytes(total_nbytes))
        e = max(e, honoured)
    return e


def compute_reserve(properties: DeviceProperties, mem: MemInfo, *, min_free_bytes: int | None = None) -> Reserve:
    """The reserve for a device with ``properties``, measured as ``mem`` (Note [The reserve rule]).

    ``mem`` should be read when the manager starts: what is used then counts as context. The total
    is ``mem.total_nbytes`` (``properties.total_nbytes`` says the same on every gpumem device).
    Raises :class:`~gpumem.errors.InvalidArgumentError` on inconsistent input.
    """
    _check_inputs(properties, mem, min_free_bytes)
    return reserve_for_mem(mem, min_free_bytes=min_free_bytes)


def reserve_for_mem(mem: MemInfo, *, min_free_bytes: int | None = None) -> Reserve:
    """:func:`compute_reserve` from the memory figures alone (backend discovery has no
    :class:`DeviceProperties` without opening the device)."""
    total = mem.total_nbytes
    used = mem.used_nbytes
    context = used if used > 0 else min(estimate_context_nbytes(total), total // 2)
    return Reserve(context_nbytes=context, emergency_nbytes=emergency_nbytes(total, min_free_bytes=min_free_bytes))


def manager_usable_nbytes(mem: MemInfo, reserve: Reserve, gpu_memory_fraction: float) -> int:
    """What a ``GpuMemoryManager`` started on a device measured as ``mem`` may hand out: the reserve
    rule's usable memory (:func:`usable_nbytes`) capped by ``gpu_memory_fraction`` of the total minus
    what was in use at start (Note [Usable memory and the fraction] in :mod:`gpumem.managers.manager`).
    May be ``<= 0`` (nothing usable). The manager and
    :func:`gpumem.discovery.select_backend_for_model` both call this, so a device that discovery
    selects for ``n`` bytes is one whose manager accepts ``n`` bytes.
    """
    rule = min(mem.total_nbytes - reserve.nbytes, mem.free_nbytes - reserve.emergency_nbytes)
    cap = int(mem.total_nbytes * gpu_memory_fraction) - reserve.context_nbytes
    return min(rule, cap)


def default_usable_nbytes(mem: MemInfo) -> int:
    """The ONE usable memory of a device measured as ``mem``: what a ``GpuMemoryManager`` with the default
    :class:`~gpumem.managers.MemoryConfig` may hand out (:func:`manager_usable_nbytes` of the reserve
    rule and the default ``gpu_memory_fraction``). ``gpumem estimate`` and ``gpumem fit`` size against
    it, so a batch they approve is one the manager accepts on the same device. May be ``<= 0``."""
    from .config import MemoryConfig

    return manager_usable_nbytes(mem, reserve_for_mem(mem), MemoryConfig().gpu_memory_fraction)


def usable_nbytes(properties: DeviceProperties, mem: MemInfo, *, min_free_bytes: int | None = None,
                  reserve: Reserve | None = None) -> int:
    """Bytes a manager may hand out: ``total - reserve``, and never more than is free now minus the
    emergency part (they agree when measured at start).

    Raises :class:`~gpumem.errors.OutOfMemoryError` when nothing would be usable (the device is
    already nearly full), :class:`~gpumem.errors.InvalidArgumentError` on inconsistent input.
    """
    if reserve is None:
        reserve = compute_reserve(properties, mem, min_free_bytes=min_free_bytes)
    else:
        _check_inputs(properties, mem, min_free_bytes)
        if not isinstance(reserve, Reserve):
            raise InvalidArgumentError(f"reserve must be a Reserve, got {type(reserve).__name__}")
    usable = min(mem.total_nbytes - reserve.nbytes, mem.free_nbytes - reserve.emergency_nbytes)
    if usable <= 0:
        raise OutOfMemoryError(reserve.nbytes, mem.free_nbytes, mem.total_nbytes, device=properties.name,
                               hint=f"Nothing is usable: the device keeps a {reserve} and only "
                                    f"{format_bytes(mem.free_nbytes)} is free.")
    return usable


def reserve_table() -> str:
    """The per-profile table of Note [The reserve rule], computed from the simulated profiles (MiB)."""
    from gpumem.sim.profiles import BUILTIN_PROFILES

    rows = [f"{'profile':<18} {'total':>7} {'context':>8} {'emergency':>9} {'reserve':>7} {'usable':>7} "
            f"{'usable %':>8} {'seeds rsrv':>10} {'seeds usable':>12}"]
    for p in BUILTIN_PROFILES:
        props = p.properties()
        mem = MemInfo(p.total_nbytes - p.context_nbytes - p.host_reserved_nbytes, p.total_nbytes)
        r = compute_reserve(props, mem)
        u = usable_nbytes(props, mem, reserve=r)
        seeds = min(600 * 1000**2 + p.total_nbytes // 10, 2 * 1000**3)
        rows.append(f"{p.name:<18} {p.total_nbytes // MiB:>7} {r.context_nbytes // MiB:>8} "
                    f"{r.emergency_nbytes // MiB:>9} {r.nbytes // MiB:>7} {u // MiB:>7} {u / p.total_nbytes:>8.1%} "
                    f"{seeds // MiB:>10} {(p.total_nbytes - seeds) // MiB:>12}")
    return "\n".join(rows)


__all__ = ["Reserve", "compute_reserve", "usable_nbytes", "default_usable_nbytes", "manager_usable_nbytes", "emergency_nbytes", "estimate_context_nbytes",
           "reserve_table"]
