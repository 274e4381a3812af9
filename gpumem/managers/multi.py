"""Several GPUs behind one manager: placement by free usable memory, device affinity per tensor name.

:class:`MultiGpuMemoryManager` holds one ``GpuMemoryManager`` per device (each with its own reserve and
usable memory, so a 24 GB and an 80 GB card are each used within their own means) and places every
allocation on one of them.

Locks: ``_lock`` (an ``RLock``) guards ``_owned``, ``_allocated_nbytes``, ``_counts`` and
``_affinity``; it is held across the choice and the manager's ``allocate``, so two threads never
both count on the same headroom. Every public operation first enters every simulated device's
``deferred_events()`` (outside ``_lock``), so device memory events (and a pressure monitor's
callbacks) run after ``_lock`` is released.

Note [Placement policy]
-----------------------
``allocate_on_best_device(nbytes, tensor_name)`` tries devices in this order:

1. **Affinity.** A tensor name placed before goes back to its device while it fits there: a model's
   layers, a KV cache's pages stay with their data, and nothing crosses devices because another card
   has a few more free bytes today.
2. **Proportional fill.** Otherwise, the devices in increasing order of the share of usable memory
   each would have in use with the request placed there, ``(allocated + nbytes) / usable``; ties go to
   the lower index. Balancing shares, not free bytes, fills a 24 GB and an 80 GB card in proportion to
   what each may use (most free bytes first left the 24 GB card idle until the 80 GB one was 73 %
   full). The share needs no device call and leaves each reserve alone; counting the request keeps a
   large allocation off a small card. Devices whose headroom is below the request are skipped unasked.
3. **Spill.** A device that refuses (out of memory, fragmentation, an injected fault) is skipped; the
   name's affinity moves to the device that accepted.
4. **A lost or closed device** is refused like a full one before its manager is asked (a caching pool
   could hand out a block of a device that is gone): one ``mem_info`` on the device about to be tried;
   a device found lost stays lost, and ``get_memory_stats()`` reports it (``lost`` says why).

When no device accepts, :class:`MultiGpuOutOfMemoryError` names every device with its headroom, free
bytes and refusal, and nothing changed: no allocation kept, no affinity moved.
"""

from __future__ import annotations

from fractions import Fraction

import contextlib
import logging
import numbers
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from gpumem.device import Device
from gpumem.errors import (DeviceClosedError, DeviceLostError, InvalidArgumentError, InvalidPointerError,
                           OutOfMemoryError)
from gpumem.units import format_bytes

log = logging.getLogger(__name__)


class MultiGpuOutOfMemoryError(OutOfMemoryError):
    """No device accepted an allocation; :attr:`refusals` says, per device, what it had and why it refused."""

    def __init__(self, requested_nbytes: int, refusals: "list[DeviceRefusal]", total_nbytes: int) -> None:
        self.refusals = refusals
        lines = "; ".join(
            f"device {r.index} ({r.spec}): {format_bytes(r.headroom_nbytes)} headroom, "
            f"{format_bytes(r.free_nbytes)} free on the device, {r.reason}" for r in refusals)
        super().__init__(requested_nbytes, max((r.free_nbytes for r in refusals), default=0), total_nbytes,
                         device=f"{len(refusals)} devices", hint=f"Per device: {lines}.")
        # one message for several devices (the base class speaks of one device)
        self.args = (f"out of memory on every device: no device took {format_bytes(requested_nbytes)} "
                     f"({requested_nbytes} bytes); {len(refusals)} devices, {format_bytes(total_nbytes)} in total. "
                     f"Per device: {lines}.",)


@dataclass(frozen=True)
class DeviceRefusal:
    """Why one device did not take an allocation."""

    index: int
    spec: str
    headroom_nbytes: int
    free_nbytes: int
    reason: str


@dataclass(frozen=True)
class DeviceMemoryStats:
    """One device of a :class:`MultiGpuMemoryManager`."""

    index: int
    spec: str
    name: str
    total_nbytes: int
    usable_nbytes: int
    allocated_nbytes: int
    """Bytes this multi-manager has allocated there (the sum of its live allocations' sizes)."""
    headroom_nbytes: int
    """``usable_nbytes - allocated_nbytes`` (what placement ranks by)."""
    free_nbytes: int
    """The device's free bytes right now (``mem_info``; other processes and tenants included)."""
    n_allocations: int
    n_tensor_names: int
    """Tensor names with affinity to this device."""
    detail: Any
    """The device manager's own ``get_detailed_stats()``; None for a lost device."""
    lost: str | None = None
    """Why the device cannot be used (lost, closed), or None for a usable one."""


@dataclass(frozen=True)
class MultiGpuMemoryStats:
    """Memory across every device of a :class:`MultiGpuMemoryManager`; the totals are sums over :attr:`devices`."""

    devices: tuple[DeviceMemoryStats, ...]
    total_nbytes: int
    usable_nbytes: int
    allocated_nbytes: int
    free_nbytes: int
    n_allocations: int
    spills: int
    """Allocations that went elsewhere than their first choice because a device refused."""
    refused: int
    """Allocations no device accepted."""


def _default_factory(enable_pooling: bool, config: Any) -> Callable[..., Any]:
    def make(device: Device | str | int, device_index: int) -> Any:
        from gpumem.managers.manager import GpuMemoryManager  # helper module of the same package

        # its allocations carry the position in this manager's list, the device_index it returns
        return GpuMemoryManager(device, enable_pooling=enable_pooling, config=config, device_index=device_index)

    return make


class MultiGpuMemoryManager:
    """One memory manager per device, and placement across them (Note [Placement policy]).

    ``devices``: a non-empty sequence of :class:`gpumem.Device` objects, specs (``"sim:a100-80gb"``,
    ``"cuda:1"``) or CUDA indices; the position in it is the ``device_index`` this class returns.
    ``enable_pooling`` and ``config`` go to each ``GpuMemoryManager``; ``manager_factory(device)``
    replaces the ``GpuMemoryManager`` constructor (for instance to give each device its own config);
    it must return an object with ``allocate(nbytes, alignment)``, ``deallocate(allocation)``,
    ``usable_memory``, ``total_memory``, ``get_detailed_stats()``, ``empty_cache()`` and ``close()``.
    """

    def __init__(self, devices: Sequence[Device | str | int], *, enable_pooling: bool = True, config: Any = None,
                 manager_factory: Callable[[Any], Any] | None = None) -> None:
        if isinstance(devices, (str, bytes, Device)) or not isinstance(devices, Sequence):
            raise InvalidArgumentError(f"devices must be a sequence of devices, specs or indices, got "
                                       f"{type(devices).__name__}")
        if not devices:
            raise InvalidArgumentError("devices must name at least one device")
        seen: set[int] = set()
        for d in devices:
            if isinstance(d, Device):
                if id(d) in seen:
                    raise InvalidArgumentError(f"device {d.spec} is listed twice")
                seen.add(id(d))
            elif isinstance(d, bool) or not isinstance(d, (str, int)):
                raise InvalidArgumentError(f"a device must be a gpumem.Device, a spec or an index, got "
                                           f"{type(d).__name__}")
        factory = manager_factory if manager_factory is not None else _default_factory(enable_pooling, config)
        managers: list[Any] = []
        try:
            for i, d in enumerate(devices):
                managers.append(factory(d) if manager_factory is not None else factory(d, i))
        except BaseException:
            for m in managers:
                with contextlib.suppress(Exception):
                    m.close()
            raise
        self._managers = managers
        self._devices: list[Device | None] = [getattr(m, "device", d if isinstance(d, Device) else None)
                                              for m, d in zip(managers, devices)]
        self._lock = threading.RLock()
        # guarded by _lock:
        self._owned: dict[int, tuple[int, Any]] = {}
        """id(allocation) -> (device position, allocation): every live allocation this object made."""
        self._allocated_nbytes = [0] * len(managers)
        self._counts = [0] * len(managers)
        self._affinity: dict[str, int] = {}
        self._spills = 0
        self._refused = 0
        self._closed = False
        self._lost: dict[int, str] = {}
        """device position -> why it is unusable (lost or closed; permanent, so asked once)."""

    # -- what is there -----------------------------------------------------------------------------
    @property
    def device_count(self) -> int:
        """How many devices this manager spans."""
        return len(self._managers)

    @property
    def managers(self) -> tuple[Any, ...]:
        """The per-device managers, by device index."""
        return tuple(self._managers)

    def manager(self, device_index: int) -> Any:
        """The manager of device ``device_index``; :class:`InvalidArgumentError` if out of range."""
        if isinstance(device_index, bool) or not isinstance(device_index, int) \
                or not 0 <= device_index < len(self._managers):
            raise InvalidArgumentError(f"device_index must be an int in [0, {len(self._managers)}), "
                                       f"got {device_index!r}")
        return self._managers[device_index]

    def affinity(self, tensor_name: str) -> int | None:
        """The device a tensor name is bound to, or None."""
        with self._lock:
            return self._affinity.get(tensor_name)

    def forget(self, tensor_name: str) -> None:
        """Drop a tensor name's affinity (its allocations stay where they are)."""
        with self._lock:
            self._affinity.pop(tensor_name, None)

    # -- helpers -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _deferred(self) -> Iterator[None]:
        """Every device's ``deferred_events()``, entered outside ``_lock`` (see the module docstring)."""
        with contextlib.ExitStack() as stack:
            for d in self._devices:
                defer = getattr(d, "deferred_events", None)
                if defer is not None:
                    stack.enter_context(defer())
            yield

    def _free_nbytes(self, i: int) -> int:
        d = self._devices[i]
        if d is None:
            return 0
        try:
            return d.mem_info().free_nbytes
        except Exception:  # noqa: BLE001 - only for reports: a lost device has nothing free
            return 0

    def _unusable(self, i: int) -> str | None:
        """Why device ``i`` cannot be used (lost or closed), or None (Note [Placement policy], 4). Called
        with ``_lock`` held, inside ``_deferred()``: the device call delivers no events here."""
        reason = self._lost.get(i)
        if reason is not None:
            return reason
        m, d = self._managers[i], self._devices[i]
        try:
            if getattr(m, "closed", False):
                raise DeviceClosedError(f"the manager of {self._spec(i)} is closed")
            if d is not None:
                d.mem_info()
        except (DeviceLostError, DeviceClosedError) as exc:
            reason = f"{'lost' if isinstance(exc, DeviceLostError) else 'closed'}: {str(exc).splitlines()[0][:160]}"
            self._lost[i] = reason
            log.warning("device %d (%s) is unusable, placement skips it: %s", i, self._spec(i), reason)
            return reason
        return None

    def _spec(self, i: int) -> str:
        d = self._devices[i]
        return d.spec if d is not None else f"device {i}"

    def _headroom(self, i: int) -> int:
        return int(self._managers[i].usable_memory) - self._allocated_nbytes[i]

    def _share_after(self, i: int, nbytes: int) -> Fraction:
        """Share of device ``i``'s usable memory in use with ``nbytes`` more (exact, so equal shares tie
        and go to the lower index: Note [Placement policy])."""
        usable = int(self._managers[i].usable_memory)
        if usable <= 0:
            return Fraction(10**30)
        return Fraction(self._allocated_nbytes[i] + nbytes, usable)

    def _order(self, nbytes: int, name: str | None) -> tuple[list[int], int | None]:
        """Candidate devices in order (Note [Placement policy]), and the affinity device if any."""
        n = len(self._managers)
        ranked = sorted(range(n), key=lambda i: (self._share_after(i, nbytes), i))
        home = self._affinity.get(name) if name is not None else None
        if home is not None:
            ranked.remove(home)
            ranked.insert(0, home)
        return ranked, home

    # -- allocation -----------------------------------------------------------------------------------
    def allocate_on_best_device(self, size: int, tensor_name: str | None = None,
                                alignment: int = 256) -> tuple[int, Any]:
        """Allocate ``size`` bytes on the best device (Note [Placement policy]); return ``(device_index,
        allocation)``.

        ``tensor_name`` (optional) binds the name to the device it lands on. Raises
        :class:`InvalidArgumentError` for a size that is not a positive int or a name that is not a
        non-empty str (nothing changes), and :class:`MultiGpuOutOfMemoryError` when no device accepts.
        """
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size <= 0:
            raise InvalidArgumentError(f"size must be a positive int (bytes), got {type(size).__name__} {size!r}"[:200])
        size = int(size)
        if tensor_name is not None and (not isinstance(tensor_name, str) or not tensor_name):
            raise InvalidArgumentError(f"tensor_name must be a non-empty str or None, got {tensor_name!r}"[:200])
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 \
                or alignment & (alignment - 1):
            raise InvalidArgumentError(f"alignment must be a positive power of two, got {alignment!r}"[:200])
        with self._deferred(), self._lock:
            if self._closed:
                raise InvalidArgumentError("this MultiGpuMemoryManager is closed")
            order, home = self._order(size, tensor_name)
            refusals: list[DeviceRefusal] = []
            for rank, i in enumerate(order):
                headroom = self._headroom(i)
                if headroom < size:
                    refusals.append(DeviceRefusal(i, self._spec(i), headroom, self._free_nbytes(i),
                                                  f"headroom below the request"))
                    continue
                unusable = self._unusable(i)
                if unusable is not None:
                    refusals.append(DeviceRefusal(i, self._spec(i), headroom, 0, unusable))
                    continue
                try:
                    allocation = self._managers[i].allocate(size, alignment)
                except OutOfMemoryError as exc:
                    refusals.append(DeviceRefusal(i, self._spec(i), headroom, self._free_nbytes(i),
                                                  f"refused: {str(exc).splitlines()[0][:160]}"))
                    continue
                except (DeviceLostError, DeviceClosedError) as exc:  # lost between the check and the call
                    kind = "lost" if isinstance(exc, DeviceLostError) else "closed"
                    self._lost[i] = f"{kind}: {str(exc).splitlines()[0][:160]}"
                    refusals.append(DeviceRefusal(i, self._spec(i), headroom, 0, self._lost[i]))
                    continue
                self._owned[id(allocation)] = (i, allocation)
                self._allocated_nbytes[i] += int(getattr(allocation, "nbytes", size))
                self._counts[i] += 1
                if refusals:
                    self._spills += 1
                    log.info("allocation of %s (%s) spilled to device %d after %d refusal(s)", format_bytes(size),
                             tensor_name or "unnamed", i, len(refusals))
                if tensor_name is not None:
                    self._affinity[tensor_name] = i
                return i, allocation
            self._refused += 1
            total = sum(int(m.total_memory) for m in self._managers)
            raise MultiGpuOutOfMemoryError(size, refusals, total)

    def deallocate(self, allocation: Any) -> None:
        """Give back an allocation :meth:`allocate_on_best_device` returned.

        :class:`InvalidPointerError` for anything else, or one already given back (nothing changes).
        """
        with self._deferred(), self._lock:
            entry = self._owned.get(id(allocation))
            if entry is None or entry[1] is not allocation:
                raise InvalidPointerError(f"{allocation!r} is not a live allocation of this MultiGpuMemoryManager"
                                          [:300])
            i, _ = entry
            self._managers[i].deallocate(allocation)
            del self._owned[id(allocation)]
            self._allocated_nbytes[i] -= int(getattr(allocation, "nbytes", 0))
            self._counts[i] -= 1

    def device_of(self, allocation: Any) -> int:
        """The device index a live allocation is on; :class:`InvalidPointerError` if it is not one of ours."""
        with self._lock:
            entry = self._owned.get(id(allocation))
            if entry is None or entry[1] is not allocation:
                raise InvalidPointerError(f"{allocation!r} is not a live allocation of this MultiGpuMemoryManager"
                                          [:300])
            return entry[0]

    def live_allocations(self) -> list[tuple[int, Any]]:
        """``(device_index, allocation)`` of every live allocation, by device then address."""
        with self._lock:
            return sorted(self._owned.values(), key=lambda e: (e[0], int(getattr(e[1], "ptr", 0))))

    # -- stats and cache --------------------------------------------------------------------------------
    def get_memory_stats(self) -> MultiGpuMemoryStats:
        """Per device and in total: total, usable, allocated, headroom, free bytes, counts."""
        with self._deferred(), self._lock:
            per: list[DeviceMemoryStats] = []
            names_per = [0] * len(self._managers)
            for dev_i in self._affinity.values():
                names_per[dev_i] += 1
            for i, m in enumerate(self._managers):
                d = self._devices[i]
                lost = self._unusable(i)
                name = self._spec(i)
                if d is not None:
                    with contextlib.suppress(DeviceLostError, DeviceClosedError):
                        name = d.properties().name
                detail = None
                if lost is None:
                    try:
                        detail = m.get_detailed_stats()
                    except (DeviceLostError, DeviceClosedError) as exc:  # lost between the check and the call
                        lost = self._lost[i] = (f"{'lost' if isinstance(exc, DeviceLostError) else 'closed'}: "
                                                f"{str(exc).splitlines()[0][:160]}")
                per.append(DeviceMemoryStats(
                    index=i, spec=self._spec(i), name=name, total_nbytes=int(m.total_memory),
                    usable_nbytes=int(m.usable_memory), allocated_nbytes=self._allocated_nbytes[i],
                    headroom_nbytes=self._headroom(i), free_nbytes=0 if lost else self._free_nbytes(i),
                    n_allocations=self._counts[i], n_tensor_names=names_per[i], detail=detail, lost=lost))
            return MultiGpuMemoryStats(
                devices=tuple(per), total_nbytes=sum(p.total_nbytes for p in per),
                usable_nbytes=sum(p.usable_nbytes for p in per),
                allocated_nbytes=sum(p.allocated_nbytes for p in per), free_nbytes=sum(p.free_nbytes for p in per),
                n_allocations=sum(p.n_allocations for p in per), spills=self._spills, refused=self._refused)

    def empty_cache(self) -> int:
        """Every device manager's ``empty_cache()``; the bytes given back in total (a pressure releaser)."""
        with self._deferred(), self._lock:
            return sum(int(m.empty_cache() or 0) for m in self._managers)

    def close(self) -> None:
        """Close every device manager (idempotent); live allocations are dropped with them."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._owned.clear()
            managers = list(self._managers)
        for m in managers:
            try:
                m.close()
            except Exception:  # noqa: BLE001 - close the others anyway
                log.exception("closing the manager of %s failed", m)

    def __enter__(self) -> "MultiGpuMemoryManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MultiGpuMemoryManager", "MultiGpuMemoryStats", "DeviceMemoryStats", "DeviceRefusal",
           "MultiGpuOutOfMemoryError"]
