"""FallbackBuffer: bytes that live on the GPU, or on the CPU when the GPU cannot hold them.

A buffer is made through a manager (``manager.create_buffer(nbytes, data=...)`` or
``FallbackBuffer(manager, nbytes)``). It tries the GPU first; when the manager refuses
(:class:`~gpumem.errors.OutOfMemoryError`: past the usable memory, or the device is full) and CPU
fallback is enabled (``MemoryConfig.cpu_fallback_enabled`` or ``allow_cpu=True``), it lives in a
NumPy array instead and counts in the manager's ``cpu_fallbacks`` (a fallback is not a failure: it
writes no OOM forensics). It moves back to the GPU by itself when the manager frees memory
(Note [Fallbacks move back by themselves] in :mod:`gpumem.managers.manager`);
:meth:`FallbackBuffer.try_move_to_gpu` (or ``manager.restore_fallbacks()`` for all of them) does it on demand.

Note [Moving preserves the bytes]
---------------------------------
Moves copy through the device's own copy calls, ``Device.write`` (``cudaMemcpy`` host to device)
and ``Device.read`` (device to host); both the simulator (which stores what is written) and a real
GPU implement them, so the bytes after any sequence of moves are the bytes written. A buffer made
on the GPU without ``data`` is uninitialised there, like ``cudaMalloc``'s memory; one made on the
CPU without ``data`` is zeros. A failed move changes nothing: the GPU block is taken before the
copy and given back if the copy fails; the host copy is dropped only after the GPU copy succeeded.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gpumem.errors import InternalError, InvalidArgumentError, InvalidPointerError, OutOfMemoryError
from gpumem.units import format_bytes

from gpumem.device import Device

from .config import MemoryConfig
from .resource import Allocation
from .tracker import AllocationTracker, BufferId, Location

log = logging.getLogger(__name__)


@runtime_checkable
class BufferHost(Protocol):
    """What a :class:`FallbackBuffer` uses of its manager (:class:`~gpumem.managers.GpuMemoryManager` is one;
    the manager builds buffers, so this module names what it needs rather than importing the manager)."""

    config: MemoryConfig
    device: Device
    tracker: AllocationTracker | None

    @property
    def closed(self) -> bool: ...

    def allocate(self, size: int, alignment: int = ..., *, stream: int = 0, tag: str | None = None,
                 n_elements: int | None = None) -> Allocation: ...

    def deallocate(self, allocation: Allocation) -> None: ...

    def _allocate_for_fallback(self, size: int, tag: str | None) -> Allocation: ...

    def _buffer_created(self, buf: "FallbackBuffer") -> None: ...

    def _fallback_placed(self, buf: "FallbackBuffer", *, counted: bool) -> None: ...

    def _fallback_left(self, buf: "FallbackBuffer") -> None: ...


def _as_bytes_view(data: Any) -> memoryview:
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
    try:
        view = memoryview(data)
    except TypeError:
        raise InvalidArgumentError(f"data must be bytes-like or a NumPy array, got {type(data).__name__}") from None
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


class FallbackBuffer:
    """``nbytes`` of memory on the manager's GPU, or in host memory when the GPU cannot hold them.

    ``data`` (bytes-like or a NumPy array, at most ``nbytes``) is written at offset 0. ``allow_cpu``
    defaults to the manager's ``config.cpu_fallback_enabled``; without it a full GPU raises the
    manager's :class:`~gpumem.errors.OutOfMemoryError`. ``_lock`` guards the placement fields.
    """

    def __init__(self, manager: BufferHost, nbytes: int, *, data: Any = None, tag: str | None = None,
                 allow_cpu: bool | None = None) -> None:
        if not isinstance(manager, BufferHost):
            raise InvalidArgumentError(f"manager must be a GpuMemoryManager, got {type(manager).__name__}")
        if type(nbytes) is not int or nbytes <= 0:
            raise InvalidArgumentError(f"nbytes must be an int > 0, got {nbytes!r}")
        if allow_cpu is not None and not isinstance(allow_cpu, bool):
            raise InvalidArgumentError(f"allow_cpu must be None or a bool, got {allow_cpu!r}")
        if tag is not None and not isinstance(tag, str):
            raise InvalidArgumentError(f"tag must be None or a str, got {type(tag).__name__}")
        view = _as_bytes_view(data) if data is not None else None
        if view is not None and len(view) > nbytes:
            raise InvalidArgumentError(f"data has {len(view)} bytes, more than the buffer's {nbytes}")
        self.manager = manager
        self.nbytes = nbytes
        self.tag = tag
        self.allow_cpu = manager.config.cpu_fallback_enabled if allow_cpu is None else allow_cpu
        # re-entrant on purpose: the device calls below run under it (a move must not interleave with a
        # write), and a device call may deliver memory events whose pressure callbacks, in this same
        # thread, use this buffer again (Note [No device call under a layer's lock] in layers.py)
        self._lock = threading.RLock()
        self._alloc: Allocation | None = None
        self._host: np.ndarray | None = None
        self._cpu_id: BufferId | None = None
        self._freed = False
        manager._buffer_created(self)  # close() marks it freed wherever it lives
        try:
            alloc = manager._allocate_for_fallback(nbytes, tag) if self.allow_cpu else manager.allocate(nbytes, tag=tag)
        except OutOfMemoryError as exc:
            if not self.allow_cpu:
                raise
            try:
                host = np.zeros(nbytes, dtype=np.uint8)
            except MemoryError:
                # NumPy's bare MemoryError says neither where nor how much: name the CPU, and the GPU's
                # refusal that sent the buffer there
                from gpumem.hostmem import host_memory
                try:
                    host_total, host_free = host_memory()
                except Exception:  # noqa: BLE001 - the figures only decorate the message
                    host_total = host_free = 0
                raise OutOfMemoryError(nbytes, host_free, host_total, device="cpu (host memory, CPU fallback)",
                                       hint=f"The host could not allocate the fallback's {format_bytes(nbytes)} "
                                            f"either; the GPU ({manager.device.spec}) had refused: "
                                            f"{str(exc).splitlines()[0][:200]}") from exc
            if view is not None:
                host[: len(view)] = np.frombuffer(view, dtype=np.uint8)
            self._to_cpu_state(host, counted=True)
            log.info("%s: %s buffer placed on the CPU: %s", manager.device.spec, format_bytes(nbytes),
                     str(exc).split(".")[0])
            return
        if view is not None and len(view):
            try:
                manager.device.write(alloc.ptr, view)
            except BaseException:
                manager.deallocate(alloc)
                raise
        self._alloc = alloc

    # -- placement ---------------------------------------------------------------------------------------
    def _to_cpu_state(self, host: np.ndarray, *, counted: bool) -> None:
        self._host = host
        if self.manager.tracker is not None:
            self._cpu_id = self.manager.tracker.register(self.nbytes, location=Location.CPU, tag=self.tag,
                                                         device=self.manager.device.spec)
        self.manager._fallback_placed(self, counted=counted)

    def _leave_cpu_state(self) -> None:
        if self._cpu_id is not None and self.manager.tracker is not None:
            self.manager.tracker.unregister(self._cpu_id)
        self._cpu_id = None
        self._host = None
        self.manager._fallback_left(self)

    def _check_live(self) -> None:
        if self._freed:
            # not DeviceClosedError: the device may be open and well; it is this buffer that is gone
            raise InvalidPointerError(f"this {format_bytes(self.nbytes)} FallbackBuffer was freed "
                                      "(free() or its manager's close()); it holds no memory any more")

    @property
    def location(self) -> Location:
        """Where the bytes are now."""
        return Location.GPU if self._alloc is not None else Location.CPU

    @property
    def on_gpu(self) -> bool:
        """Whether the bytes are on the GPU."""
        return self._alloc is not None

    @property
    def ptr(self) -> int | None:
        """The device pointer while on the GPU, else None."""
        return self._alloc.ptr if self._alloc is not None else None

    @property
    def buffer_id(self) -> BufferId | None:
        """The tracker's id of the current placement (a move makes a new one), None without tracking."""
        return self._alloc.buffer_id if self._alloc is not None else self._cpu_id

    def try_move_to_gpu(self) -> bool:
        """Move to the GPU if it has room now (Note [Moving preserves the bytes]); True when on the GPU after."""
        with self._lock:
            self._check_live()
            if self._alloc is not None:
                return True
            try:
                alloc = self.manager._allocate_for_fallback(self.nbytes, self.tag)
            except OutOfMemoryError:
                return False
            try:
                self.manager.device.write(alloc.ptr, memoryview(self._host_bytes()))
            except BaseException:
                self.manager.deallocate(alloc)
                raise
            self._alloc = alloc
            self._leave_cpu_state()
            log.info("%s: %s buffer moved back to the GPU", self.manager.device.spec, format_bytes(self.nbytes))
            return True

    def _move_back_quietly(self) -> bool:
        """For the manager's automatic move back (Note [Fallbacks move back by themselves] in
        :mod:`gpumem.managers.manager`): skip a buffer busy on another thread, never raise."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._freed or self._alloc is not None:
                return False
            return self.try_move_to_gpu()
        except Exception as exc:  # noqa: BLE001 - a free must not fail because a move back did
            log.warning("%s: moving a %s fallback buffer back failed: %s", self.manager.device.spec,
                        format_bytes(self.nbytes), exc)
            return False
        finally:
            self._lock.release()

    def move_to_cpu(self) -> None:
        """Move to host memory now (frees the GPU block; not counted as a fallback)."""
        with self._lock:
            self._check_live()
            if self._alloc is None:
                return
            host = np.frombuffer(bytearray(self.manager.device.read(self._alloc.ptr, self.nbytes)), dtype=np.uint8)
            alloc, self._alloc = self._alloc, None
            try:
                self.manager.deallocate(alloc)
            except BaseException:
                self._alloc = alloc
                raise
            self._to_cpu_state(host, counted=False)

    # -- data ---------------------------------------------------------------------------------------------
    def _check_range(self, offset: int, nbytes: int) -> None:
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0 \
                or offset + nbytes > self.nbytes:
            raise InvalidArgumentError(f"range offset={offset!r} nbytes={nbytes!r} is outside the buffer's "
                                       f"{self.nbytes} bytes")

    def write(self, data: Any, offset: int = 0) -> None:
        """Copy ``data`` (bytes-like or NumPy) into the buffer at ``offset``, wherever it lives."""
        view = _as_bytes_view(data)
        with self._lock:
            self._check_live()
            self._check_range(offset, len(view))
            if not len(view):
                return
            if self._alloc is not None:
                self.manager.device.write(self._alloc.ptr + offset, view)
            else:
                self._host_bytes()[offset: offset + len(view)] = np.frombuffer(view, dtype=np.uint8)

    def _host_bytes(self) -> "np.ndarray":
        """The CPU copy; only called while the buffer is on the CPU (caller holds ``_lock``)."""
        if self._host is None:
            raise InternalError("FallbackBuffer is neither on the GPU nor on the CPU")
        return self._host

    def read(self, offset: int = 0, nbytes: int | None = None) -> bytes:
        """The bytes at ``offset`` (all to the end by default), wherever the buffer lives."""
        with self._lock:
            self._check_live()
            n = self.nbytes - offset if nbytes is None and type(offset) is int else nbytes
            self._check_range(offset, n)  # type: ignore[arg-type]
            if self._alloc is not None:
                return self.manager.device.read(self._alloc.ptr + offset, n) if n else b""
            return self._host_bytes()[offset: offset + n].tobytes()  # type: ignore[operator]

    def to_numpy(self) -> np.ndarray:
        """A host copy of the whole buffer (``uint8``)."""
        return np.frombuffer(bytearray(self.read()), dtype=np.uint8)

    # -- life cycle ---------------------------------------------------------------------------------------
    def free(self) -> None:
        """Give the memory back (GPU block or host array). Idempotent."""
        with self._lock:
            if self._freed:
                return
            if self._alloc is not None:
                if not self.manager.closed:
                    self.manager.deallocate(self._alloc)
                self._alloc = None
            else:
                self._leave_cpu_state()
            self._freed = True

    def _forget(self) -> None:
        """The manager closed: nothing to give back any more."""
        with self._lock:
            self._alloc, self._host, self._freed = None, None, True

    @property
    def freed(self) -> bool:
        """Whether :meth:`free` was called (or the manager closed)."""
        return self._freed

    def __enter__(self) -> "FallbackBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        where = "freed" if self._freed else self.location.value
        return f"<FallbackBuffer {format_bytes(self.nbytes)} on {where} of {self.manager.device.spec}>"


__all__ = ["FallbackBuffer"]
