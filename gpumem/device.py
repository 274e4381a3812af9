"""The abstract device: what every gpumem component knows about a GPU.

The caching allocator, the managers and the workspace logic never talk to CUDA
or to the simulator directly: they call a :class:`Device`. Two implementations
exist: :class:`gpumem.sim.SimDevice` (a SimPy-driven simulated GPU, in the ``sim``
package) and :class:`gpumem.cuda.CudaDevice` (a real GPU through CuPy,
cuda-bindings and NVML). Both pass the same contract suite (``tests/contract``).

The interface mirrors the CUDA calls it stands for:

=======================  ===============================================
``malloc`` / ``free``    ``cudaMalloc`` / ``cudaFree``
``mem_info``             ``cudaMemGetInfo`` (other tenants included)
``address_reserve``      ``cuMemAddressReserve``
``address_free``         ``cuMemAddressFree``
``mem_create``           ``cuMemCreate`` (a physical chunk)
``mem_release``          ``cuMemRelease``
``mem_map``              ``cuMemMap``
``mem_set_access``       ``cuMemSetAccess`` (read-write for this device)
``mem_unmap``            ``cuMemUnmap``
``write`` / ``read``     ``cudaMemcpy`` host-to-device / device-to-host
``synchronize``          ``cudaDeviceSynchronize``
``stream_create``        ``cudaStreamCreateWithFlags`` (non-blocking)
``stream_destroy``       ``cudaStreamDestroy``
``stream_synchronize``   ``cudaStreamSynchronize``
``stream_wait_event``    ``cudaStreamWaitEvent``
``event_record``         ``cudaEventCreateWithFlags`` + ``cudaEventRecord``
``event_query``          ``cudaEventQuery`` (``cudaErrorNotReady`` is ``False``)
``event_synchronize``    ``cudaEventSynchronize``
``event_destroy``        ``cudaEventDestroy``
``engine_work``          none: the allocator's own CPU time, told to the
                         simulator (Note [The engine's own time])
=======================  ===============================================

Note [Public methods check, implementations do]
-----------------------------------------------
As RMM's ``device_memory_resource`` does with ``allocate`` and ``do_allocate``,
the public methods of :class:`Device` are concrete: each validates what every
device validates the same way, takes the device's lock, and calls the
implementation's protected ``_do_<call>`` method. An implementation overrides
only the ``_do_`` methods and never re-checks what the base already did.

Note [Validation before any device call]
----------------------------------------
The public methods validate their arguments with the helpers below, and check
them against the device's :class:`~gpumem.vmm_book.MemoryBook`, *before*
anything touches the device's state or calls CUDA, so that bad input raises a
specific :mod:`gpumem.errors` exception and leaves the accounting unchanged.
The checks live here, once, so both devices reject exactly the same inputs, in
the same order:

1. the argument checks that need no device state (types, signs, the type of an
   event), except for the virtual memory calls, which check nothing first;
2. a closed device (:class:`~gpumem.errors.DeviceClosedError`), then a lost one
   (:class:`~gpumem.errors.DeviceLostError`): after a loss *every* call but
   :meth:`Device.properties`, :meth:`Device.close`, :meth:`Device.subscribe`
   (host-side bookkeeping, so code can still watch a device it is giving up on),
   :meth:`Device.engine_work` (the allocator's time, not the device's: a closed
   or lost device ignores it, before ``_do_engine_work``) and the introspection
   methods (``allocation_ranges``, ``check_invariants``...) raises, the
   simulator's ``advance``, ``launch``, ``add_tenant`` and ``watch_free_level``
   included;
3. the checks against what the device handed out (an unknown pointer, stream or
   mapping, an event destroyed or made by another device), then the call.
"""

from __future__ import annotations

import abc
import collections
import enum
import logging
import threading
from dataclasses import FrozenInstanceError, dataclass
from typing import Any, Callable, TypeVar, Union

from .errors import DeviceClosedError, DeviceLostError, InvalidArgumentError, UnsupportedOperationError
from .events import EventCallback, EventHub, MemoryEvent, Subscription
from .units import format_bytes
from .validate import (  # re-exported: gpumem.device's checks
    STREAM_END, check_int_in_range, check_nbytes, check_pointer, check_stream)
from .vmm_book import Allocation, Mapping, MemoryBook, Physical, Reservation

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Bytes accepted by :meth:`Device.write`.
BytesLike = Union[bytes, bytearray, memoryview]

#: Alignment every ``malloc`` pointer honours (CUDA guarantees at least 256 B).
MIN_POINTER_ALIGNMENT = 256


class DeviceKind(str, enum.Enum):
    """Where a device's memory really is."""

    SIM = "sim"
    CUDA = "cuda"


class MemInfo:
    """Free and total bytes of a device right now, other tenants included.

    An immutable value (equality, hash, ``repr`` and :class:`dataclasses.FrozenInstanceError` on assignment,
    as the frozen dataclass it was), written out by hand: Note [Value objects on the hot path].
    """

    __slots__ = ("free_nbytes", "total_nbytes")

    free_nbytes: int
    total_nbytes: int

    def __init__(self, free_nbytes: int, total_nbytes: int) -> None:
        _set_free_nbytes(self, free_nbytes)
        _set_total_nbytes(self, total_nbytes)

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self.free_nbytes, self.total_nbytes) == (other.free_nbytes, other.total_nbytes)  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.free_nbytes, self.total_nbytes))

    def __repr__(self) -> str:
        return f"MemInfo(free_nbytes={self.free_nbytes!r}, total_nbytes={self.total_nbytes!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (MemInfo, (self.free_nbytes, self.total_nbytes))

    @property
    def used_nbytes(self) -> int:
        """Bytes in use by anyone: this process, its CUDA context and other tenants."""
        return self.total_nbytes - self.free_nbytes

    def __str__(self) -> str:
        return f"{format_bytes(self.free_nbytes)} free of {format_bytes(self.total_nbytes)}"


_set_free_nbytes = MemInfo.free_nbytes.__set__  # type: ignore[attr-defined]
_set_total_nbytes = MemInfo.total_nbytes.__set__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class DeviceProperties:
    """What a device is: the fields allocators and estimators size themselves from."""

    name: str
    total_nbytes: int
    compute_capability: tuple[int, int]
    multiprocessor_count: int
    memory_bandwidth_gbps: float
    unified_memory: bool
    vmm_supported: bool
    granularity_nbytes: int


# Note [Value objects on the hot path]
# ------------------------------------
# ``mem_create`` returns a new handle and ``mem_info`` a new MemInfo on every call. As frozen
# dataclasses they cost three times what a plain slotted object does (each field is set through
# ``object.__setattr__``), which was a visible part of a simulated call. They are written out by hand:
# slots set through the slot descriptors, and the same value semantics (equality with their own type
# only, hash, repr, assignment refused with FrozenInstanceError, pickling).
class PhysicalHandle:
    """A physical memory chunk from :meth:`Device.mem_create` (CUDA's ``CUmemGenericAllocationHandle``).

    An immutable value: Note [Value objects on the hot path]."""

    __slots__ = ("handle", "nbytes")

    handle: int
    nbytes: int

    def __init__(self, handle: int, nbytes: int) -> None:
        _set_handle(self, handle)
        _set_nbytes(self, nbytes)

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self.handle, self.nbytes) == (other.handle, other.nbytes)  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.handle, self.nbytes))

    def __repr__(self) -> str:
        return f"PhysicalHandle(handle={self.handle!r}, nbytes={self.nbytes!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (PhysicalHandle, (self.handle, self.nbytes))


_set_handle = PhysicalHandle.handle.__set__  # type: ignore[attr-defined]
_set_nbytes = PhysicalHandle.nbytes.__set__  # type: ignore[attr-defined]


def check_granular(nbytes: object, granularity: int, *, what: str = "nbytes") -> int:
    """A positive size (any integer type, :func:`gpumem.validate.check_nbytes`) that is a multiple of the
    device's allocation granularity, as an int."""
    n = check_nbytes(nbytes, what=what)
    if n % granularity:
        raise InvalidArgumentError(
            f"{what}={n} is not a multiple of the allocation granularity {granularity} "
            f"({format_bytes(granularity)})"
        )
    return n


def check_data(data: object) -> memoryview:
    """Bytes-like data for :meth:`Device.write` as a flat byte memoryview."""
    # Any object with the buffer protocol (bytes, numpy arrays, array.array, mmap...): Python 3.12
    # adds __buffer__ to all of them, 3.10/3.11 do not, so just try.
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except (TypeError, ValueError, BufferError):  # ValueError: e.g. a numpy array of Python objects
        raise InvalidArgumentError(f"data must be bytes-like, got {type(data).__name__}") from None
    if not view.c_contiguous:
        raise InvalidArgumentError("data must be C-contiguous")
    if view.nbytes == 0:
        return memoryview(b"")  # cast() refuses views with a zero in their shape, e.g. np.zeros((0, 3))
    return view.cast("B")


class Event:
    """A point in a stream's work, from :meth:`Device.event_record` (CUDA's ``cudaEvent_t``).

    Opaque: devices subclass it and keep their handle inside. An event belongs to the
    device that recorded it; give it back with :meth:`Device.event_destroy`.
    """

    __slots__ = ("stream", "_device", "_destroyed")

    def __init__(self, device: "Device", stream: int) -> None:
        self.stream = stream
        """The stream the event was recorded on."""
        self._device = device
        self._destroyed = False

    def __repr__(self) -> str:
        state = " destroyed" if self._destroyed else ""
        return f"<{type(self).__name__} stream={self.stream}{state}>"


class _CallState(threading.local):
    """Per thread: how deep in ``deferred_events`` blocks (a device call is known by its lock), whether its
    queue is being delivered, and the events queued meanwhile."""

    depth = 0
    delivering = False

    def __init__(self) -> None:
        self.queue: collections.deque[MemoryEvent] = collections.deque()


class _DeferredEvents:
    """The context manager :meth:`Device.deferred_events` returns: a class, not ``contextlib.contextmanager``,
    because the native engine enters one around every operation that leaves its fast path (a long decode's
    replay under the ``gpumem`` policy: a quarter of a million, where the generator's machinery cost about a
    tenth of the replay's time). Like the generator's, each object is entered once, and must be exited on the
    thread that entered it (``with``, ``ExitStack``): a second entry raises (it would lose the depth saved by the
    first, and events on that thread would queue for good: attacker 28); it is not a decorator."""

    __slots__ = ("_device", "_tls", "_depth")

    def __init__(self, device: "Device") -> None:
        self._device = device
        self._tls: "_CallState | None" = None

    def __enter__(self) -> None:
        if self._tls is not None:
            raise RuntimeError("deferred_events(): this block was entered already; call deferred_events() for "
                               "each with-block")
        tls = self._tls = self._device._tls
        depth = self._depth = tls.depth
        tls.depth = depth + 1

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        tls, depth = self._tls, self._depth
        tls.depth = depth
        device = self._device
        if not depth and tls.queue and not device._lock._is_owned():  # type: ignore[attr-defined]
            device._flush_events()


class Device(abc.ABC):
    """A GPU, simulated or real. See the module docstring for the CUDA call each method stands for.

    Devices are context managers: ``with open_device("sim:h200-141gb") as dev: ...``
    closes them (freeing what they still hold) on exit.
    """

    #: The spec this device was opened with, e.g. ``"sim:a100-80gb"`` or ``"cuda:0"``.
    spec: str
    kind: DeviceKind
    #: The event type this device's :meth:`event_record` returns.
    event_type: type[Event] = Event

    def __init__(self) -> None:
        # Note [One lock per device]: every public call runs under this lock, so a device object
        # may be shared by threads; an RLock, because a SimPy tenant acting during a call calls
        # back into the device on the same thread.
        self._lock = threading.RLock()
        self._tls = _CallState()
        self._queued_events = 0
        self._vmm_gran = 0
        """The granularity once a VMM call found VMM supported (0 before: the check runs in full)."""
        """Events queued on any thread, not yet delivered (Note [The hot path of a device call])."""
        self.events = EventHub(dispatch=self._dispatch_event)
        """Memory events this device published (:attr:`EventHub.history`) and their subscribers."""
        self._user_streams: set[int] = set()
        self._closed = False
        self._lost: Any = False
        """Truthy once the device is lost (the simulator: True; CUDA: the sticky error)."""
        self._pending_error: Exception | None = None
        """An error found while no call ran (the simulator's physical alias, seen as the GPU ran work): the next
        call raises it, once, before it changes anything (:meth:`_check_usable`); the fast paths test it with
        closed and lost."""
        self._book = MemoryBook(self)
        """What this device handed out (:class:`~gpumem.vmm_book.MemoryBook`)."""
        self._reservations_made = 0
        """Address reservations made so far (guarded by ``_lock``): the next one's serial, less one."""

    # Note [Event delivery after the call]
    # ------------------------------------
    # A device publishes memory events (another tenant took memory, free memory fell below a
    # level...) while a call runs, often from deep inside it (a SimPy tenant acts while a call's
    # simulated time passes). Delivering them there would let a subscriber re-enter the device,
    # or the allocator above it, in the middle of an operation. So each thread has a deferral
    # depth: inside ``deferred_events()`` (every public call runs inside one) published events
    # queue up, and they reach the subscribers when the outermost block on that thread exits,
    # after the device's lock was released. Callbacks run one at a time in publication order;
    # events their own device calls publish are queued behind and delivered by the same loop.
    # A callback's exception never reaches the caller of the device call (it is logged: Note [A
    # subscriber cannot break a call] in :mod:`gpumem.events`); a KeyboardInterrupt does, and the
    # events still queued on that thread are dropped.
    #
    # Note [The hot path of a device call]
    # ------------------------------------
    # A simulated call is mostly this bookkeeping, and the native engine calls these public methods
    # once per page it maps, so the common case is kept to a handful of bytecodes: "inside a device
    # call on this thread" is "this thread holds the device's (re-entrant) lock", which a call takes
    # anyway, so a call does not touch the per-thread state (a ``threading.local`` costs more than
    # the lock) unless an event was queued: ``_queued_events`` counts the events queued on all
    # threads (changed only under the lock) and a call looks at its thread's queue only when it is
    # non-zero. The public methods of the hot calls take the lock themselves rather than through
    # :meth:`_run`, and check plain ``int`` arguments with one comparison each before falling back
    # to the full checks (which raise the same errors in the same order as before).
    def _inside_call(self) -> bool:
        """Whether this thread is inside a device call or a ``deferred_events()`` block (events queue)."""
        return bool(self._tls.depth) or self._lock._is_owned()  # type: ignore[attr-defined]

    def _dispatch_event(self, event: MemoryEvent) -> None:
        if self._inside_call():
            with self._lock:
                self._tls.queue.append(event)
                self._queued_events += 1
        else:
            self.events.deliver(event)

    def _after_call(self) -> None:
        """After a call released the lock, with events queued somewhere: deliver this thread's, if the call
        was the outermost (Note [Event delivery after the call])."""
        if self._tls.queue and not self._inside_call():
            self._flush_events()

    def _flush_events(self) -> None:
        """Deliver what this thread queued (outermost block only); see the Note above.

        Never raises an ``Exception``: a subscriber's exception is logged and delivery goes on
        (Note [A subscriber cannot break a call] in :mod:`gpumem.events`), so a call that took
        effect always returns its result. A ``BaseException`` from a subscriber
        (``KeyboardInterrupt``, ``SystemExit``) propagates, after the call's state is complete;
        the events still queued behind it are dropped (logged), never delivered later inside an
        unrelated call.
        """
        tls = self._tls
        queue = tls.queue
        if not queue or tls.delivering:
            return
        tls.delivering = True
        try:
            while queue:
                event = queue.popleft()
                with self._lock:
                    self._queued_events -= 1
                self.events.deliver(event)
        except BaseException:
            if queue:
                log.warning("%s: %d memory event(s) dropped, not delivered: a subscriber raised a "
                            "BaseException", self.spec, len(queue))
                with self._lock:
                    self._queued_events -= len(queue)
                queue.clear()
            raise
        finally:
            tls.delivering = False

    def deferred_events(self) -> "_DeferredEvents":
        """Queue memory events published on this thread meanwhile; deliver them when the outermost
        such block on this thread exits (Note [Event delivery after the call]).

        The allocator wraps each public operation in one, outside its own lock, so a subscriber
        may call the allocator back (``empty_cache()``, ``allocate()``) safely.
        """
        return _DeferredEvents(self)

    def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one device call under the lock, then deliver the events it queued if it was the outermost
        (Note [The hot path of a device call])."""
        lock = self._lock
        lock.acquire()
        try:
            return fn(*args)
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    def subscribe(self, callback: EventCallback) -> Subscription:
        """Call ``callback(event)`` for every :class:`~gpumem.events.MemoryEvent` from now on, always
        after the device call that published it returned. ``Subscription.cancel()`` stops it.

        Allowed on a closed or lost device (it is host-side bookkeeping: code may still watch a
        device it is giving up on); see Note [Validation before any device call]."""
        if not callable(callback):
            raise InvalidArgumentError(f"callback must be callable, got {type(callback).__name__}")
        with self._lock:
            return self.events.subscribe(callback)

    # -- checks shared by every device ---------------------------------------------------
    def _check_event_type(self, event: object, call: str) -> None:
        """The argument check that needs no device state: is ``event`` an event of this device's type?"""
        if not isinstance(event, self.event_type):
            raise InvalidArgumentError(f"{call}: expected an Event from event_record, got {type(event).__name__}")

    def _check_event(self, event: Event, call: str) -> Event:
        """Look ``event`` up (after :meth:`_check_usable`): made by this device and not destroyed."""
        if event._device is not self:
            raise InvalidArgumentError(f"{call}: {event!r} belongs to another device than {self.spec}")
        if event._destroyed:
            raise InvalidArgumentError(f"{call}: {event!r} was destroyed")
        return event

    # -- what the device is and has -------------------------------------------------
    @abc.abstractmethod
    def properties(self) -> DeviceProperties:
        """Static properties (cached: a real ``cudaGetDeviceProperties`` costs about 1 ms)."""

    def mem_info(self) -> MemInfo:
        """Free and total bytes right now, other processes and tenants included."""
        # the lock inline, not through _run: Note [The hot path of a device call]
        lock = self._lock
        lock.acquire()
        try:
            if self._closed or self._lost or self._pending_error:
                self._check_usable()
            return self._do_mem_info()
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    # -- state every device keeps (Note [Public methods check, implementations do]) -----------
    def _check_usable(self) -> None:
        """Refuse a call on a closed or lost device, before looking anything up (a closed device has
        forgotten its allocations, so a lookup would misreport DeviceClosedError as a bad pointer)."""
        if self._closed:
            raise DeviceClosedError(f"{self.spec} is closed")
        if self._lost:
            raise DeviceLostError(self._lost_message())
        error = self._pending_error
        if error is not None:
            self._pending_error = None
            raise error

    def _lost_message(self) -> str:
        return f"{self.spec} is lost"

    def _require_vmm(self, call: str) -> None:
        """Refuse on a closed or lost device, then on one without virtual memory management; both
        before any argument is checked."""
        self._check_usable()
        self._check_vmm(call)

    def _check_vmm(self, call: str) -> None:
        """Raise :class:`~gpumem.errors.UnsupportedOperationError` unless VMM calls work here."""
        props = self.properties()
        if not props.vmm_supported:
            raise UnsupportedOperationError(
                f"{call}: {self.spec} ({props.name}) does not support virtual memory management")

    # -- plain allocation ------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` (> 0) of device memory; return a pointer aligned to at least 256 B.

        Raises :class:`~gpumem.errors.OutOfMemoryError` when the device cannot.
        """
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = check_nbytes(nbytes)
        # the lock inline, not through _run: Note [The hot path of a device call]
        lock = self._lock
        lock.acquire()
        try:
            if self._closed or self._lost or self._pending_error:
                self._check_usable()
            alloc = self._do_malloc(nbytes)
            self._book.add_allocation(alloc)
            return alloc.start
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    def free(self, ptr: int) -> None:
        """Free a pointer from :meth:`malloc`. Unknown or already-freed pointers raise.

        Like ``cudaFree``, the memory must not be in use by queued work: the
        simulator's sanitizer raises :class:`~gpumem.errors.MemoryHazardError` if it is.
        """
        if type(ptr) is not int or ptr <= 0:
            ptr = check_pointer(ptr)
        # the lock inline, not through _run: Note [The hot path of a device call]
        lock = self._lock
        lock.acquire()
        try:
            if self._closed or self._lost or self._pending_error:
                self._check_usable()
            alloc = self._book.allocation_to_free(ptr)
            self._do_free(alloc)
            self._book.forget_allocation(alloc)
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    # -- virtual memory management ----------------------------------------------------
    def _check_alignment(self, alignment: object) -> int:
        alignment = check_nbytes(alignment, what="alignment", allow_zero=True)
        gran = self.granularity_nbytes
        if alignment and (alignment & (alignment - 1) or alignment % gran):  # type: ignore[operator]
            raise InvalidArgumentError(f"alignment {alignment} must be 0 or a power-of-two multiple of the granularity")
        return alignment  # type: ignore[return-value]

    def _vmm_ready(self, call: str) -> int:
        """The slow path of the virtual-memory calls' first check: refuse a closed or lost device or one
        without VMM (:meth:`_require_vmm`), else remember that VMM works and return the granularity."""
        self._require_vmm(call)
        gran = self._vmm_gran = self.granularity_nbytes
        return gran

    def address_reserve(self, nbytes: int, alignment: int = 0) -> int:
        """Reserve ``nbytes`` (a granularity multiple) of virtual address space; return its base."""
        # the lock inline, not through _run: Note [The hot path of a device call]
        lock = self._lock
        lock.acquire()
        try:
            gran = self._vmm_gran
            if not gran or self._closed or self._lost or self._pending_error:
                gran = self._vmm_ready("address_reserve")
            if type(nbytes) is not int or nbytes <= 0 or nbytes % gran or type(alignment) is not int or alignment:
                nbytes = check_granular(nbytes, gran)
                alignment = self._check_alignment(alignment)
            va = self._do_address_reserve(nbytes, alignment)
            self._reservations_made += 1
            self._book.reservations.add(va, va + nbytes, Reservation(va, nbytes, self._reservations_made))
            return va
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    def address_free(self, va: int, nbytes: int) -> None:
        """Give back a whole reservation; it must have no mappings left."""
        # the lock inline, not through _run: Note [The hot path of a device call]
        lock = self._lock
        lock.acquire()
        try:
            gran = self._vmm_gran
            if not gran or self._closed or self._lost or self._pending_error:
                gran = self._vmm_ready("address_free")
            if type(va) is not int or type(nbytes) is not int or va <= 0 or nbytes <= 0 or nbytes % gran:
                va = check_pointer(va, what="va")
                nbytes = check_granular(nbytes, gran)
            self._book.reservation_to_free(va, nbytes)
            self._do_address_free(va, nbytes)
            self._book.reservations.remove(va)
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    def mem_create(self, nbytes: int) -> PhysicalHandle:
        """Create a physical chunk of ``nbytes`` (a granularity multiple); takes device memory."""
        # the lock inline, not through _run: Note [The hot path of a device call]
        lock = self._lock
        lock.acquire()
        try:
            gran = self._vmm_gran
            if not gran or self._closed or self._lost or self._pending_error:
                gran = self._vmm_ready("mem_create")
            if type(nbytes) is not int or nbytes <= 0 or nbytes % gran:
                nbytes = check_granular(nbytes, gran)
            native = self._do_mem_create(nbytes)
            return self._book.add_physical(PhysicalHandle, nbytes, native).handle
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    def mem_release(self, handle: PhysicalHandle) -> None:
        """Release a physical chunk. Its memory returns once it is also unmapped everywhere."""
        # the lock inline, not through _run: Note [The hot path of a device call]
        lock = self._lock
        lock.acquire()
        try:
            if not self._vmm_gran or self._closed or self._lost or self._pending_error:
                self._vmm_ready("mem_release")
            phys = self._book.physical(handle, PhysicalHandle, "mem_release")
            self._do_mem_release(phys)
            phys.released = True
            if phys.map_count == 0:
                self._drop_physical(phys)
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    def _drop_physical(self, phys: Physical) -> None:
        del self._book.physicals[phys.handle.handle]
        self._physical_gone(phys)

    def _physical_gone(self, phys: Physical) -> None:
        """Hook: ``phys`` was released and has no mapping left, so its memory went back to the device."""

    def mem_map(self, va: int, nbytes: int, handle: PhysicalHandle, offset: int = 0) -> None:
        """Map ``nbytes`` of ``handle`` starting at ``offset`` at ``va`` inside a reservation."""
        # the lock inline, not through _run: Note [The hot path of a device call]
        lock = self._lock
        lock.acquire()
        try:
            gran = self._vmm_gran
            if not gran or self._closed or self._lost or self._pending_error:
                gran = self._vmm_ready("mem_map")
            if (type(va) is not int or type(nbytes) is not int or type(offset) is not int or va <= 0 or nbytes <= 0
                    or offset < 0 or va % gran or nbytes % gran or offset % gran):
                va, nbytes, offset = self._check_map_args(va, nbytes, offset, gran)
            book = self._book
            phys = book.physical(handle, PhysicalHandle, "mem_map")
            if offset + nbytes > phys.handle.nbytes:
                raise InvalidArgumentError(f"mem_map: offset {offset} + nbytes {nbytes} exceeds the chunk's "
                                           f"{phys.handle.nbytes} bytes")
            r = book.reservation(va, nbytes, "mem_map")
            r.check_unmapped(va, nbytes, "mem_map")
            self._do_mem_map(va, nbytes, phys, offset)
            r.add(va, nbytes, phys, offset)
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    @staticmethod
    def _check_map_args(va: object, nbytes: object, offset: object, gran: int) -> tuple[int, int, int]:
        """The argument checks of :meth:`mem_map`, in their order (the slow path: one of them fails, or an
        argument is an integer of another type); the arguments as ints."""
        va = check_pointer(va, what="va")
        nbytes = check_granular(nbytes, gran)
        offset = check_nbytes(offset, what="offset", allow_zero=True)
        if va % gran or offset % gran:
            raise InvalidArgumentError(f"mem_map: va and offset must be multiples of the granularity {gran}")
        return va, nbytes, offset

    def mem_set_access(self, va: int, nbytes: int) -> None:
        """Make a mapped range readable and writable by this device.

        The range must be fully mapped (possibly by several mappings); every mapping it
        touches is recorded as accessible.
        """
        # the lock inline, not through _run: Note [The hot path of a device call]
        lock = self._lock
        lock.acquire()
        try:
            gran = self._vmm_gran
            if not gran or self._closed or self._lost or self._pending_error:
                gran = self._vmm_ready("mem_set_access")
            if type(va) is not int or type(nbytes) is not int or va <= 0 or nbytes <= 0 or nbytes % gran:
                va = check_pointer(va, what="va")
                nbytes = check_granular(nbytes, gran)
            r = self._book.reservation(va, nbytes, "mem_set_access")
            m = r.mappings.get(va)  # the common case, one whole mapping: what covering() finds, without the walk
            maps = [m] if m is not None and m.nbytes == nbytes else r.covering(va, nbytes, "mem_set_access")
            self._do_mem_set_access(va, nbytes, maps)
            for m in maps:
                m.accessible = True
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    def mem_unmap(self, va: int, nbytes: int) -> None:
        """Unmap a range that was mapped with exactly this base and size.

        ``cuMemUnmap`` does not wait for the GPU: unmapping memory that queued or
        running work touches kills the context later (``CUDA_ERROR_ILLEGAL_ADDRESS``).
        Wait for that work first (:meth:`event_synchronize`); the simulator's sanitizer
        raises :class:`~gpumem.errors.MemoryHazardError` otherwise.
        """
        # the lock inline, not through _run: Note [The hot path of a device call]
        lock = self._lock
        lock.acquire()
        try:
            gran = self._vmm_gran
            if not gran or self._closed or self._lost or self._pending_error:
                gran = self._vmm_ready("mem_unmap")
            if type(va) is not int or type(nbytes) is not int or va <= 0 or nbytes <= 0 or nbytes % gran:
                va = check_pointer(va, what="va")
                nbytes = check_granular(nbytes, gran)
            r = self._book.reservation(va, nbytes, "mem_unmap")
            m = r.mappings.get(va)  # one whole mapping: what whole_mappings() finds, without the walk
            maps = [m] if m is not None and m.nbytes == nbytes else r.whole_mappings(va, nbytes, "mem_unmap")
            self._do_mem_unmap(r, maps)
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    def _unmapped(self, r: Reservation, m: Mapping) -> None:
        """Record that ``m`` was unmapped: implementations of ``_do_mem_unmap`` call it for each mapping
        right after the device unmapped it (Note [The book follows the device] in :mod:`gpumem.vmm_book`)."""
        r.remove(m)
        if m.physical.released and m.physical.map_count == 0:
            self._drop_physical(m.physical)

    # -- data and ordering --------------------------------------------------------------
    def write(self, ptr: int, data: BytesLike) -> None:
        """Copy host bytes to device memory at ``ptr`` (inside one allocation or accessible mapping)."""
        ptr = check_pointer(ptr)
        view = check_data(data)
        return self._run(self._write, ptr, view)

    def _write(self, ptr: int, view: memoryview) -> None:
        self._check_usable()
        if len(view) == 0:
            return
        pieces = self._book.locate(ptr, len(view), "write")
        self._do_write(ptr, view, pieces)

    def read(self, ptr: int, nbytes: int) -> bytes:
        """Copy ``nbytes`` of device memory at ``ptr`` back to the host."""
        ptr = check_pointer(ptr)
        nbytes = check_nbytes(nbytes, allow_zero=True)
        return self._run(self._read, ptr, nbytes)

    def _read(self, ptr: int, nbytes: int) -> bytes:
        self._check_usable()
        if nbytes == 0:
            return b""
        pieces = self._book.locate(ptr, nbytes, "read")
        return self._do_read(ptr, nbytes, pieces)

    def synchronize(self) -> None:
        """Wait until all work on the device, on every stream, has finished."""
        return self._run(self._synchronize)

    def _synchronize(self) -> None:
        self._check_usable()
        self._do_synchronize()

    def engine_work(self, pages_indexed: int) -> None:
        """Told by an allocator's engine that it did CPU work of its own: it indexed ``pages_indexed`` pages
        before it looked for a page to steal (Note [The engine's own time] in ``gpumem/sim/latency.py``). A real
        device does nothing: the time passed by itself. A simulated one lets it pass. Not a device call: a
        closed or lost device ignores it (``_do_engine_work`` is not called), and it counts no call.

        Raises:
            InvalidArgumentError: ``pages_indexed`` is not an integer in ``[0, 2**63)``.
        """
        if pages_indexed.__class__ is not int or not 0 <= pages_indexed < 1 << 63:  # the hot case: a plain int
            pages_indexed = check_int_in_range(pages_indexed, "engine_work: pages_indexed", 0, (1 << 63) - 1)
        if pages_indexed:
            self._run(self._engine_work, pages_indexed)

    def _engine_work(self, pages_indexed: int) -> None:
        if not (self._closed or self._lost):
            self._do_engine_work(pages_indexed)

    def _do_engine_work(self, pages_indexed: int) -> None:
        """The engine's CPU time passes (:meth:`engine_work`; never on a closed or lost device); a real device's
        time passes by itself."""

    # -- streams and events ---------------------------------------------------------------
    def stream_create(self) -> int:
        """Create a stream; return its id (> 0). Stream 0 is the default stream and always exists."""
        return self._run(self._stream_create)

    def _stream_create(self) -> int:
        self._check_usable()
        stream = self._do_stream_create()
        self._user_streams.add(stream)
        return stream

    def stream_destroy(self, stream: int) -> None:
        """Destroy a stream from :meth:`stream_create`; work already queued on it still completes.

        Stream 0 and streams this device did not create raise :class:`~gpumem.errors.InvalidArgumentError`.
        """
        stream = check_stream(stream)
        return self._run(self._stream_destroy, stream)

    def _stream_destroy(self, stream: int) -> None:
        self._check_usable()
        if stream not in self._user_streams:
            why = "the default stream cannot be destroyed" if stream == 0 else "it was not made by stream_create"
            raise InvalidArgumentError(f"stream_destroy: stream {stream} on {self.spec}: {why}")
        self._do_stream_destroy(stream)
        self._user_streams.discard(stream)

    def event_record(self, stream: int = 0) -> Event:
        """Record an event on ``stream``: it completes when all work queued there before it has completed."""
        if type(stream) is not int or not 0 <= stream < STREAM_END:
            stream = check_stream(stream)
        # the lock inline, not through _run: Note [The hot path of a device call]
        lock = self._lock
        lock.acquire()
        try:
            if self._closed or self._lost or self._pending_error:
                self._check_usable()
            return self._do_event_record(stream)
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    def event_query(self, event: Event) -> bool:
        """Whether ``event`` has completed (never waits)."""
        if not isinstance(event, self.event_type):
            self._check_event_type(event, "event_query")
        # the lock inline, not through _run: Note [The hot path of a device call]
        lock = self._lock
        lock.acquire()
        try:
            if self._closed or self._lost or self._pending_error:
                self._check_usable()
            if event._device is not self or event._destroyed:
                self._check_event(event, "event_query")
            return self._do_event_query(event)
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    def event_synchronize(self, event: Event) -> None:
        """Wait until ``event`` has completed."""
        if not isinstance(event, self.event_type):
            self._check_event_type(event, "event_synchronize")
        # the lock inline, not through _run: Note [The hot path of a device call]
        lock = self._lock
        lock.acquire()
        try:
            if self._closed or self._lost or self._pending_error:
                self._check_usable()
            if event._device is not self or event._destroyed:
                self._check_event(event, "event_synchronize")
            return self._do_event_synchronize(event)
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    def event_destroy(self, event: Event) -> None:
        """Give ``event`` back; using it afterwards raises :class:`~gpumem.errors.InvalidArgumentError`."""
        if not isinstance(event, self.event_type):
            self._check_event_type(event, "event_destroy")
        # the lock inline, not through _run: Note [The hot path of a device call]
        lock = self._lock
        lock.acquire()
        try:
            if self._closed or self._lost or self._pending_error:
                self._check_usable()
            if event._device is not self or event._destroyed:
                self._check_event(event, "event_destroy")
            self._do_event_destroy(event)
            event._destroyed = True
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    def stream_synchronize(self, stream: int) -> None:
        """Wait until all work queued on ``stream`` has completed."""
        if type(stream) is not int or not 0 <= stream < STREAM_END:
            stream = check_stream(stream)
        # the lock inline, not through _run: Note [The hot path of a device call]
        lock = self._lock
        lock.acquire()
        try:
            if self._closed or self._lost or self._pending_error:
                self._check_usable()
            self._do_stream_synchronize(stream)
        finally:
            lock.release()
            if self._queued_events:
                self._after_call()

    def stream_wait_event(self, stream: int, event: Event) -> None:
        """Make work queued on ``stream`` from now on wait until ``event`` has completed (no host wait)."""
        stream = check_stream(stream)
        self._check_event_type(event, "stream_wait_event")
        return self._run(self._stream_wait_event, stream, event)

    def _stream_wait_event(self, stream: int, event: Event) -> None:
        self._check_usable()
        self._check_event(event, "stream_wait_event")
        self._do_stream_wait_event(stream, event)

    # -- life cycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Wait for all queued work, then free everything this device object still holds. Idempotent.

        Like ``cudaDeviceSynchronize`` before teardown: work still queued or running on any stream
        runs to its end first (the simulator runs simulated time until every stream is idle), so
        nothing is freed or unmapped under it. A lost device has no work left to wait for.
        """
        return self._run(self._close)

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._do_close()
        finally:
            self._book.clear()
            self._user_streams.clear()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    # -- introspection for tests and reports ------------------------------------------------
    @property
    def n_allocations(self) -> int:
        """Live ``malloc`` allocations."""
        return len(self._book.allocations)

    def allocation_ranges(self) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` of every live ``malloc`` allocation, by address."""
        with self._lock:
            return [(s, e - s) for s, e, _ in self._book.allocations.items()]

    def mapping_ranges(self) -> list[tuple[int, int, int]]:
        """``(va, nbytes, handle)`` of every live mapping, by address."""
        with self._lock:
            return [(m.va, m.nbytes, m.physical.handle.handle)
                    for r in self._book.reservations.values() for m in r.mappings.values()]

    def reservation_ranges(self) -> list[tuple[int, int]]:
        """``(va, nbytes)`` of every live address reservation, by address."""
        with self._lock:
            return [(s, e - s) for s, e, _ in self._book.reservations.items()]

    def reservation_at(self, ptr: int) -> tuple[int, int, int] | None:
        """``(va, nbytes, serial)`` of the live address reservation holding ``ptr``, or None when none does (a
        closed device holds none). ``serial`` numbers this device's reservations in the order they were made (1, 2,
        ...), so a reservation made again at the address of one given back is told apart from it.

        Raises:
            InvalidArgumentError: ``ptr`` is not a positive int (as :meth:`free` refuses it)."""
        if type(ptr) is not int or ptr <= 0:
            ptr = check_pointer(ptr, what="ptr")
        with self._lock:
            hit = self._book.reservations.find(ptr)
        return None if hit is None else (hit[0], hit[1] - hit[0], hit[2].serial)

    def check_invariants(self) -> None:
        """Raise :class:`~gpumem.errors.InternalError` if the device's bookkeeping is inconsistent
        (used by property tests and by ``CachingAllocator.check_consistency``)."""
        with self._lock:
            self._book.check()
            self._check_device_invariants()

    def _check_device_invariants(self) -> None:
        """Hook: an implementation's own consistency checks (raise InternalError)."""

    # -- what an implementation provides (Note [Public methods check, implementations do]) --
    # Each is called under the device's lock, after the base class validated the arguments and
    # found the records involved, and before it records the outcome: raising changes nothing.
    @abc.abstractmethod
    def _do_mem_info(self) -> MemInfo: ...

    @abc.abstractmethod
    def _do_malloc(self, nbytes: int) -> Allocation:
        """Allocate; return the :class:`~gpumem.vmm_book.Allocation` (its ``native`` is the device's)."""

    @abc.abstractmethod
    def _do_free(self, alloc: Allocation) -> None: ...

    @abc.abstractmethod
    def _do_address_reserve(self, nbytes: int, alignment: int) -> int: ...

    @abc.abstractmethod
    def _do_address_free(self, va: int, nbytes: int) -> None: ...

    @abc.abstractmethod
    def _do_mem_create(self, nbytes: int) -> Any:
        """Create a chunk; return the device's own object for it (kept as ``Physical.native``)."""

    @abc.abstractmethod
    def _do_mem_release(self, phys: Physical) -> None: ...

    @abc.abstractmethod
    def _do_mem_map(self, va: int, nbytes: int, phys: Physical, offset: int) -> None: ...

    @abc.abstractmethod
    def _do_mem_set_access(self, va: int, nbytes: int, maps: list[Mapping]) -> None: ...

    @abc.abstractmethod
    def _do_mem_unmap(self, r: Reservation, maps: list[Mapping]) -> None:
        """Unmap ``maps`` (whole mappings of ``r``), calling :meth:`_unmapped` for each one unmapped."""

    @abc.abstractmethod
    def _do_write(self, ptr: int, view: memoryview, pieces: list[tuple[Any, int, int]]) -> None:
        """Copy ``view`` to ``ptr``; ``pieces`` is where it lands (:meth:`MemoryBook.locate`)."""

    @abc.abstractmethod
    def _do_read(self, ptr: int, nbytes: int, pieces: list[tuple[Any, int, int]]) -> bytes: ...

    @abc.abstractmethod
    def _do_synchronize(self) -> None: ...

    @abc.abstractmethod
    def _do_stream_create(self) -> int: ...

    @abc.abstractmethod
    def _do_stream_destroy(self, stream: int) -> None: ...

    @abc.abstractmethod
    def _do_event_record(self, stream: int) -> Event: ...

    @abc.abstractmethod
    def _do_event_query(self, event: Any) -> bool: ...

    @abc.abstractmethod
    def _do_event_synchronize(self, event: Any) -> None: ...

    @abc.abstractmethod
    def _do_event_destroy(self, event: Any) -> None: ...

    @abc.abstractmethod
    def _do_stream_synchronize(self, stream: int) -> None: ...

    @abc.abstractmethod
    def _do_stream_wait_event(self, stream: int, event: Any) -> None: ...

    @abc.abstractmethod
    def _do_close(self) -> None:
        """Free what the device still holds (the book still lists it; the base clears it afterwards)."""

    @property
    def vmm_supported(self) -> bool:
        """Whether :meth:`address_reserve` and friends work on this device."""
        return self.properties().vmm_supported

    @property
    def granularity_nbytes(self) -> int:
        """The physical allocation granularity (2 MiB on CUDA GPUs)."""
        return self.properties().granularity_nbytes

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec}>"
