"""A workspace that follows memory pressure, and one workspace per device.

:class:`Workspace` holds the scratch memory of a quantized linear layer (sized by
:func:`~gpumem.workspace.sizing.size_workspace`) through a gpumem
:class:`~gpumem.allocator.CachingAllocator`. :meth:`Workspace.poll` asks the device what is free and
resizes when it must: it **shrinks** as soon as other processes have taken so much that what is left
free is below the reserve, and it **grows** back once more room has stayed available for a while.
:class:`WorkspaceSet` keeps one :class:`Workspace` per device.

>>> import gpumem
>>> from gpumem.workspace import Workspace
>>> dev = gpumem.open_device("sim:t4-16gb")
>>> ws = Workspace(dev, 4096, 11008, "i2s")
>>> ws.batch_size, ws.nbytes > 0
(256, True)
>>> ws.poll()        # call between steps: resizes only when pressure says so
False
>>> ws.close(); dev.close()

Note [Hysteresis]
-----------------
Two thresholds, so that a noisy neighbour does not make the workspace flap:

* **shrink** when the device's free memory has dropped below the reserve (``free < reserve``, the
  memory the reserve rule keeps free: Note [Which part of the reserve] in :mod:`.sizing`): holding on
  would leave what allocates outside the workspace less than the reserve. The new size is what the
  rule allows now, :data:`~gpumem.workspace.sizing.USABLE_FRACTION` of what is free after the reserve:
  after a shrink 5 % of that stays free again, so the next small take does not shrink it once more.
* **grow** only when the rule allows at least ``grow_ratio`` (default 1.05, 5 % more) of what is held,
  or the rule's full size when the cap (the class's batch cap or the maximum workspace), not memory,
  limits it and that is above what is held, on ``grow_after_polls``
  (default 3) polls in a row. A tenant whose use goes up and down between two polls therefore does
  not make it grow, and a shrink has to be forced by a real shortage.

In the band between the two, the workspace holds between 1 / 1.05 = 95.2 % and 100 % of what the
rule would choose afresh; when memory is what limits it, the rule chooses 95 % of what is free after the
reserve, so the workspace holds between 0.95 / 1.05 = 90.5 % and 95 % of that (the feasible maximum of
:mod:`gpumem.workspace.scenario`) between polls that change nothing.

Note [Shrinking never runs out of memory]
-----------------------------------------
A resize frees the old block first, gives the allocator's cached memory back to the device
(:meth:`CachingAllocator.empty_cache`, so that what a shrink gives up really reaches the other
processes, on a segment backing too), and then allocates the new size: it never needs the old and the
new block at once, so a shrink asks the device for less than it just gave back and does not fail for
lack of memory. Should the allocation fail anyway (another process took the memory in between;
on the simulator, device calls let simulated time pass), smaller sizes are tried, halving down to
the minimum workspace. If even that fails, the workspace holds nothing (``nbytes == 0``, ``ptr is None``,
``batch_size == 0``), the allocator's cache is given back, and :class:`InsufficientWorkspaceMemoryError`
is raised; the next :meth:`Workspace.poll` or :meth:`Workspace.ensure` tries again. (With an allocator
shared with other code, the ``empty_cache`` of a resize also gives back that code's cached memory.)

Note [Recovering from a failed resize]
--------------------------------------
A device call that fails in a resize (``mem_unmap``, ``mem_map``... a :class:`~gpumem.errors.CudaError`)
leaves the workspace holding nothing and is raised as :class:`WorkspaceResizeError`, so that
:meth:`Workspace.poll` has one contract (it raises that, :class:`InsufficientWorkspaceMemoryError` or
:class:`WorkspaceDeviceQueryError`) and every failure is counted in ``failed_resizes``. A failed unmap can
leave the old block's segment cached in the allocator; the device counts it as used, so sizing first
would see no room and fail forever without reaching the ``empty_cache`` of the resize. The re-allocation
(:meth:`Workspace._refill`) therefore gives the cache back *before* it asks the device what is free.

Note [Closing gives everything back]
------------------------------------
Releasing memory can fail transiently (a failed unmap or release keeps the segment cached), so
:meth:`Workspace.close` retries ``empty_cache`` up to :data:`CLOSE_RELEASE_ATTEMPTS` times; what still
stays held is not leaked silently but reported by :class:`WorkspaceReleaseError` (``held_nbytes``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from ..errors import GpumemError, InternalError, InvalidArgumentError, OutOfMemoryError
from ..units import format_bytes
from .sizing import (InsufficientWorkspaceMemoryError, QType, WorkspaceDeviceQueryError, WorkspaceSize,
                     batch_for_workspace, check_options, query_device, reserve_nbytes_for, size_workspace)

if TYPE_CHECKING:  # pragma: no cover
    from ..allocator import CachingAllocator
    from ..device import Device

log = logging.getLogger(__name__)


class WorkspaceResizeError(GpumemError, RuntimeError):
    """A device call failed in the middle of a resize (``__cause__`` is the device's error, e.g. a
    :class:`~gpumem.errors.CudaError`). The workspace then holds nothing (``ptr is None``); the failure is
    counted in :attr:`WorkspaceStats.failed_resizes` and the next :meth:`Workspace.poll` or
    :meth:`Workspace.ensure` tries again."""

    def __init__(self, device: str, cause: BaseException, *, holds_nothing: bool = True) -> None:
        self.device = device
        self.cause = cause
        now = "it holds nothing now" if holds_nothing else "it still holds its old block"
        super().__init__(f"resizing the workspace on {device} failed, {now}: "
                         f"{type(cause).__name__}: {cause}")


class WorkspaceReleaseError(GpumemError, RuntimeError):
    """:meth:`Workspace.close` could not give all of the workspace's memory back to the device, even after
    retrying (Note [Closing gives everything back]); ``held_nbytes`` is what stays held."""

    def __init__(self, device: str, held_nbytes: int, cause: BaseException | None = None) -> None:
        self.device = device
        self.held_nbytes = held_nbytes
        why = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        super().__init__(f"closing the workspace on {device} left {format_bytes(held_nbytes)} ({held_nbytes} "
                         f"bytes) held on the device after {CLOSE_RELEASE_ATTEMPTS} attempts to release it{why}")


CLOSE_RELEASE_ATTEMPTS = 5
"""How often :meth:`Workspace.close` tries to give the cache back before it reports what stays held."""


@dataclass(frozen=True)
class Hysteresis:
    """When a :class:`Workspace` grows back (Note [Hysteresis]); shrinking is forced by a shortage."""

    grow_ratio: float = 1.05
    """Grow when the rule allows at least this multiple of what is held (or its full, capped size)."""
    grow_after_polls: int = 3
    """... on this many polls in a row."""

    def __post_init__(self) -> None:
        if isinstance(self.grow_ratio, bool) or not isinstance(self.grow_ratio, (int, float)) \
                or not self.grow_ratio >= 1.0:
            raise InvalidArgumentError(f"grow_ratio must be a number >= 1, got {self.grow_ratio!r:.60}")
        if isinstance(self.grow_after_polls, bool) or not isinstance(self.grow_after_polls, int) \
                or self.grow_after_polls < 1:
            raise InvalidArgumentError(f"grow_after_polls must be an int >= 1, got {self.grow_after_polls!r:.60}")


@dataclass(frozen=True)
class WorkspaceStats:
    """Counters of one :class:`Workspace`."""

    nbytes: int
    batch_size: int
    polls: int
    shrinks: int
    grows: int
    failed_resizes: int
    """Resizes (and re-allocations of an empty workspace) that failed: with
    :class:`InsufficientWorkspaceMemoryError` or :class:`WorkspaceResizeError`."""
    peak_nbytes: int
    recoveries: int = 0
    """Polls (or :meth:`Workspace.ensure` calls) that allocated a workspace again after a failure had left
    it holding nothing."""

    @property
    def resizes(self) -> int:
        """Shrinks and grows."""
        return self.shrinks + self.grows


class Workspace:
    """The scratch memory of one quantized linear layer on one device, following memory pressure.

    Allocated at construction (from :func:`~gpumem.workspace.sizing.size_workspace` on the device's free
    memory now); :meth:`poll` resizes it under pressure (Note [Hysteresis]). ``allocator``: the
    :class:`~gpumem.allocator.CachingAllocator` to hold it through (default: one of its own with the
    default policy, closed by :meth:`close`). ``sizing``: keywords for
    :func:`~gpumem.workspace.sizing.size_workspace` (``max_batch_size``, ``min_workspace_nbytes``...).

    Thread-safe: ``_lock`` guards ``_ptr``, ``_size``, ``_pending_grows`` and the counters; one resize runs
    at a time and readers see a workspace either before or after it.
    """

    def __init__(self, device: "Device", in_features: int, out_features: int, qtype: QType | str, *,
                 allocator: "CachingAllocator | None" = None, hysteresis: Hysteresis | None = None,
                 stream: int = 0, **sizing: Any) -> None:
        from ..allocator import CachingAllocator

        self.device = device
        self.qtype = QType.parse(qtype)
        self.in_features = in_features
        self.out_features = out_features
        self.hysteresis = hysteresis if hysteresis is not None else Hysteresis()
        if not isinstance(self.hysteresis, Hysteresis):
            raise InvalidArgumentError(f"hysteresis must be a Hysteresis, got {type(hysteresis).__name__}")
        self.stream = stream
        check_options(sizing)
        self._sizing = dict(sizing)
        # checks every argument (raises InvalidArgumentError) before anything is allocated
        first = self._rule(*query_device(device), held_nbytes=0)
        self._owns_allocator = allocator is None
        self.allocator = allocator if allocator is not None else CachingAllocator(device)
        self._lock = threading.RLock()
        self._ptr: int | None = None  # guarded by _lock
        self._size: WorkspaceSize | None = None  # guarded by _lock: the sizing of the block held
        self._pending_grows = 0  # guarded by _lock: polls in a row that allowed growth
        self._polls = self._shrinks = self._grows = self._failed = self._peak = 0  # guarded by _lock
        self._recoveries = 0  # guarded by _lock
        self._closed = False  # guarded by _lock
        try:
            self._resize(first, ladder_from=None)
        except BaseException:
            if self._owns_allocator:
                self.allocator.close()
            raise

    # -- sizing ------------------------------------------------------------------------------------------
    def _rule(self, props: Any, mem: Any, *, held_nbytes: int) -> WorkspaceSize:
        """The size the rule chooses with what this workspace holds counted as free (it could have it)."""
        from ..device import MemInfo

        spec = str(getattr(self.device, "spec", self.device))
        avail = MemInfo(mem.free_nbytes + held_nbytes, mem.total_nbytes)
        return size_workspace(self.in_features, self.out_features, self.qtype, props, avail, device=spec,
                              **self._sizing)

    def _reserve(self, props: Any, mem: Any) -> int:
        explicit = self._sizing.get("reserve_nbytes")
        return int(explicit) if explicit is not None else reserve_nbytes_for(props, mem)

    # -- what it holds -----------------------------------------------------------------------------------
    @property
    def ptr(self) -> int | None:
        """The device pointer of the workspace (None while it holds nothing after a failed resize)."""
        with self._lock:
            return self._ptr

    @property
    def nbytes(self) -> int:
        """Bytes held now (0 after a failed resize)."""
        with self._lock:
            return self._size.workspace_bytes if self._ptr is not None and self._size is not None else 0

    @property
    def batch_size(self) -> int:
        """The batch the workspace holds intermediates for now (0 while it holds nothing)."""
        with self._lock:
            return self._size.batch_size if self._ptr is not None and self._size is not None else 0

    @property
    def size(self) -> WorkspaceSize | None:
        """The sizing of the block held (None while it holds nothing)."""
        with self._lock:
            return self._size if self._ptr is not None else None

    def stats(self) -> WorkspaceStats:
        """The counters now."""
        with self._lock:
            return WorkspaceStats(nbytes=self.nbytes, batch_size=self.batch_size, polls=self._polls,
                                  shrinks=self._shrinks, grows=self._grows, failed_resizes=self._failed,
                                  peak_nbytes=self._peak, recoveries=self._recoveries)

    # -- following pressure -----------------------------------------------------------------------------
    def poll(self) -> bool:
        """Look at the device's free memory and resize if the rule says so (Note [Hysteresis]); return
        whether the workspace was resized. Raises :class:`InsufficientWorkspaceMemoryError` when it had to
        shrink (or holds nothing) and not even the minimum fits (Note [Shrinking never runs out of memory]),
        :class:`WorkspaceResizeError` when a device call failed during the resize (the workspace then holds
        nothing and the next poll tries again), :class:`WorkspaceDeviceQueryError` when the device cannot be
        asked. Every failed resize is counted in ``failed_resizes``, every re-allocation after one in
        ``recoveries``."""
        with self._lock:
            self._check_open()
            self._polls += 1
            if self._ptr is None:  # a failed resize left nothing: try again now
                self._pending_grows = 0
                self._refill()
                return True
            props, mem = query_device(self.device)
            held = self.nbytes
            reserve = self._reserve(props, mem)
            if mem.free_nbytes < reserve:  # a real shortage: shrink now
                self._pending_grows = 0
                try:
                    target = self._rule(props, mem, held_nbytes=held)
                except InsufficientWorkspaceMemoryError:
                    self._release_all()
                    self._failed += 1
                    raise
                if target.workspace_bytes < held:
                    self._resize(target, ladder_from=None)
                    self._shrinks += 1
                    return True
                return False
            target = self._rule(props, mem, held_nbytes=held)
            h = self.hysteresis
            # "the rule's full size" only when the cap (not memory) limits the target: when memory limits
            # it, desired_bytes is computed from the clamped batch and equals workspace_bytes, which would
            # make any increase count as full and skip the margin (Note [Hysteresis])
            capped = target.batch_size >= target.max_batch_size or target.workspace_bytes >= target.max_workspace_bytes
            full = capped and target.workspace_bytes >= target.desired_bytes
            wants_more = target.workspace_bytes > held and (target.workspace_bytes >= h.grow_ratio * held or full)
            if not wants_more:
                self._pending_grows = 0
                return False
            self._pending_grows += 1
            if self._pending_grows < h.grow_after_polls:
                return False
            self._pending_grows = 0
            self._resize(target, ladder_from=self._size)
            self._grows += 1
            return True

    def ensure(self) -> int:
        """The pointer of the workspace, allocating it again first if a failed resize left nothing."""
        with self._lock:
            self._check_open()
            if self._ptr is None:
                self._refill()
            if self._ptr is None:  # _refill raises when it cannot allocate: this is a bug
                raise InternalError("the workspace holds no memory after a refill that did not fail")
            return self._ptr

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError(f"the workspace on {self.device.spec} is closed")

    def _refill(self) -> None:
        """Allocate a workspace again after a failure left nothing (caller holds ``_lock``).

        The allocator's cache is given back *before* the device is asked what is free: a failed
        ``empty_cache`` in the failed resize may have left the old block's segment cached, and the rule
        would count it as used by someone else and never find room (Note [Recovering from a failed
        resize])."""
        try:
            self.allocator.empty_cache()
        except OutOfMemoryError:
            raise
        except GpumemError as exc:
            self._failed += 1
            raise WorkspaceResizeError(str(self.device.spec), exc) from exc
        props, mem = query_device(self.device)
        try:
            target = self._rule(props, mem, held_nbytes=0)
        except InsufficientWorkspaceMemoryError:
            self._failed += 1
            raise
        self._resize(target, ladder_from=None)
        self._recoveries += 1

    def _release_all(self) -> None:
        """Free the block and give the cache back (caller holds ``_lock``)."""
        if self._ptr is not None:
            self.allocator.free(self._ptr)
            self._ptr = None
        self.allocator.empty_cache()

    def _resize(self, target: WorkspaceSize, *, ladder_from: WorkspaceSize | None) -> None:
        """Free what is held, then allocate ``target`` (or smaller: Note [Shrinking never runs out of
        memory]); caller holds ``_lock``. ``ladder_from``: on a grow, the old size, tried second."""
        old = self.nbytes
        try:
            self._free_and_allocate(target, ladder_from, old)
        except (InsufficientWorkspaceMemoryError, WorkspaceResizeError):
            raise
        except GpumemError as exc:  # a device call failed (CudaError, ...): nothing half-done is kept
            if self._ptr is None:
                self._size = None
            self._failed += 1
            raise WorkspaceResizeError(str(self.device.spec), exc, holds_nothing=self._ptr is None) from exc

    def _free_and_allocate(self, target: WorkspaceSize, ladder_from: WorkspaceSize | None, old: int) -> None:
        if self._ptr is not None:
            self.allocator.free(self._ptr)
            self._ptr = None
        # the old block's memory goes back to the device before the new size is asked for: a segment
        # backing would otherwise keep the old segment (split, not released) beside the new block
        self.allocator.empty_cache()
        candidates: list[WorkspaceSize] = [target]
        if ladder_from is not None and ladder_from.workspace_bytes < target.workspace_bytes:
            candidates.append(ladder_from)
        size = min(c.workspace_bytes for c in candidates) // 2
        while size > target.min_workspace_bytes:
            candidates.append(self._shrunk(target, size))
            size //= 2
        if candidates[-1].workspace_bytes > target.min_workspace_bytes:
            candidates.append(self._shrunk(target, target.min_workspace_bytes))
        last: OutOfMemoryError | None = None
        for c in candidates:
            try:
                ptr = self.allocator.allocate(c.workspace_bytes, self.stream)
            except OutOfMemoryError as exc:
                last = exc
                continue
            self._ptr, self._size = ptr, c
            self._peak = max(self._peak, c.workspace_bytes)
            log.info("workspace on %s: %s -> %s (batch %d)", target.device, format_bytes(old),
                     format_bytes(c.workspace_bytes), c.batch_size)
            return
        self._size = None
        try:
            self.allocator.empty_cache()
        except GpumemError as exc:  # the next poll's _refill gives the cache back first
            log.warning("workspace on %s: giving the cache back failed: %s", target.device, exc)
        self._failed += 1
        mem = self.device.mem_info()
        raise InsufficientWorkspaceMemoryError(
            target.min_workspace_bytes, max(0, mem.free_nbytes - target.reserve_bytes), mem.free_nbytes,
            mem.total_nbytes, device=target.device, reserve_nbytes=target.reserve_bytes,
            detail=f"The allocation failed: {last}") from last

    @staticmethod
    def _shrunk(target: WorkspaceSize, nbytes: int) -> WorkspaceSize:
        """``target`` cut to ``nbytes``, its batch recomputed for that size."""
        from dataclasses import replace

        batch = batch_for_workspace(nbytes, target.dequant_bytes, target.per_sample_bytes, target.max_batch_size)
        return replace(target, workspace_bytes=nbytes, batch_size=batch)

    # -- life cycle --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the workspace (and close the allocator if it is this workspace's own). Idempotent.

        Raises :class:`WorkspaceReleaseError` (saying how much) when memory stays held on the device after
        :data:`CLOSE_RELEASE_ATTEMPTS` attempts to give it back (Note [Closing gives everything back]); the
        workspace is closed all the same."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._ptr is not None:
                    self.allocator.free(self._ptr)
                    self._ptr = None
            finally:
                self._size = None
                last: BaseException | None = None
                for _ in range(CLOSE_RELEASE_ATTEMPTS):
                    try:
                        self.allocator.empty_cache()
                    except GpumemError as exc:
                        last = exc
                        continue
                    last = None
                    if self._cached_nbytes() == 0:
                        break
                held = self._cached_nbytes()
                if self._owns_allocator:
                    self.allocator.close()
                    held = int(getattr(self.allocator, "leaked_nbytes", 0) or 0)
            if held:
                raise WorkspaceReleaseError(str(self.device.spec), held, last) from last

    def _cached_nbytes(self) -> int:
        """What the allocator holds on the device and no live block uses."""
        ms = self.allocator.memory_stats()
        return max(0, int(ms["reserved_nbytes"]) - int(ms["allocated_nbytes"]))

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Workspace({self.device.spec}, {self.in_features}x{self.out_features} {self.qtype.value}, "
                f"{format_bytes(self.nbytes)}, batch {self.batch_size})")


class WorkspaceSet:
    """One :class:`Workspace` per device, for a layer run on several GPUs.

    >>> import gpumem
    >>> devs = [gpumem.open_device("sim:a100-80gb"), gpumem.open_device("sim:t4-16gb")]
    >>> wss = WorkspaceSet(devs, 4096, 11008, "i2s")
    >>> [wss[d.spec].batch_size for d in devs]
    [512, 256]
    >>> wss.close()

    ``workspace_options`` go to every :class:`Workspace`. Thread-safe: ``_lock`` guards ``_by_spec``; each
    workspace has its own lock. Creating it is all or nothing: if one device's workspace fails, the ones
    already made are closed and the error propagates.
    """

    def __init__(self, devices: "list[Device]", in_features: int, out_features: int, qtype: QType | str,
                 **workspace_options: Any) -> None:
        self._lock = threading.Lock()
        self._by_spec: dict[str, Workspace] = {}  # guarded by _lock
        made: list[Workspace] = []
        try:
            for dev in devices:
                spec = str(dev.spec)
                if spec in self._by_spec:
                    raise InvalidArgumentError(f"device {spec} is given twice")
                ws = Workspace(dev, in_features, out_features, qtype, **workspace_options)
                made.append(ws)
                self._by_spec[spec] = ws
        except BaseException:
            for ws in made:
                ws.close()
            self._by_spec.clear()
            raise

    def __getitem__(self, spec: str) -> Workspace:
        with self._lock:
            try:
                return self._by_spec[spec]
            except KeyError:
                raise InvalidArgumentError(f"no workspace on {spec}; have {', '.join(self._by_spec)}") from None

    def __iter__(self) -> Iterator[Workspace]:
        with self._lock:
            return iter(list(self._by_spec.values()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_spec)

    def poll(self) -> dict[str, bool]:
        """Poll every workspace; return which were resized. A device whose workspace cannot be kept raises
        after the others were polled (the first such error)."""
        resized: dict[str, bool] = {}
        first: GpumemError | None = None
        for ws in self:
            try:
                resized[ws.device.spec] = ws.poll()
            except (InsufficientWorkspaceMemoryError, WorkspaceResizeError, WorkspaceDeviceQueryError) as exc:
                resized[ws.device.spec] = True
                first = first or exc
        if first is not None:
            raise first
        return resized

    def total_nbytes(self) -> int:
        """Bytes held on all devices together."""
        return sum(ws.nbytes for ws in self)

    def close(self) -> None:
        """Close every workspace."""
        with self._lock:
            items = list(self._by_spec.values())
            self._by_spec.clear()
        for ws in items:
            ws.close()
