"""Make RMM, and so cuDF, cuML, cuGraph and every RAPIDS library, allocate through gpumem.

One line::

    import gpumem.rmm_resource as grr
    resource = grr.install()          # RMM's resource of the current device is now gpumem's

or, scoped (the previous resource of the device comes back on exit)::

    with grr.using() as resource:
        buf = rmm.DeviceBuffer(size=1 << 20)
        print(resource.check())       # consistent?, bytes allocated and reserved

RAPIDS libraries allocate through RMM's per-device *memory resource*; :func:`make_resource` gives an
``rmm.mr.CallbackMemoryResource`` whose allocations go to gpumem: where gpumem's native engine is built,
to the device's native engine over the CUDA driver (``gpumem._engine.CudaAllocator(device)``, the engine
the CuPy hook and :mod:`gpumem.torch` use on that device: Note [One engine per device, shared with
PyTorch] in ``gpumem/_native/cuda_allocator.cpp``); elsewhere to a
:class:`~gpumem.allocator.CachingAllocator` over gpumem's Python CUDA adapter. RMM itself is imported
only when a resource is made: importing this module needs no RMM.

Note [RMM's stream-ordered contract]: RMM passes a stream to every allocate and deallocate. A block
allocated on stream S may be used on S at once, without synchronising; that is how gpumem's engine
allocates (its free lists are per stream). A deallocate on stream T says that the block's last use is
ordered on T: T may reuse it at once, other streams only after T's work so far has run. gpumem frees a
block to the free list of its allocation stream, so when T is another stream the block is first
recorded as used on T (``record_stream``, as PyTorch's ``Tensor.record_stream``): the engine then
hands it out again only once an event recorded on T at the free has completed. The default streams
are RMM's ``DEFAULT_STREAM`` (handle 0, CUDA's legacy default stream) and CuPy's; the per-thread
default stream (handle 2) names a different stream in each thread, which gpumem's free lists cannot
tell apart: it is refused, as the CuPy hook refuses it.

Note [A deallocate cannot raise through RMM]: RMM 26.10 calls the deallocate callback from C++ (a
``DeviceBuffer`` going away) where an exception cannot propagate: raised from a callback, it
surfaces as a ``SystemError`` of an unrelated later call. A deallocate gpumem refuses (a pointer it
did not hand out, a size larger than the block) is therefore logged, counted, and kept in the
resource's :attr:`~GpumemResource.problems`, which :meth:`GpumemResource.check` reports as
inconsistencies; the allocator's state is left unchanged.

Note [Streams outlive the engine's use of them]: the native engine fences pages lazily: a page a stream
used is only marked, and the event on that stream is recorded when the page is needed by another stream
or given back (``fence_page`` in ``gpumem/_native/engine.cpp``), which keeps frees cheap. So a stream on
which RMM allocated or freed a block must stay alive while gpumem may still cache that block: RMM's
default streams and RAPIDS's stream pools live as long as the process; a program that destroys a stream
of its own calls ``resource.allocator.empty_cache()`` first (the pages go back to the device, fenced while
the stream lives). On the H200, what a destroyed stream did is in the record
(``reports/hil/rmm-resource-h200-2026-11-25.md``, case ``stream_lifetime``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any, Iterator

from .allocator import CachingAllocator
from .allocator.policy import DEFAULT_POLICY, AllocatorPolicy
from .cupy_allocator import PER_THREAD_STREAM, DeviceCheck, cuda_allocator, device_check
from .errors import BackendUnavailableError, CudaError, InternalError, InvalidArgumentError

log = logging.getLogger(__name__)

__all__ = ["make_resource", "install", "using", "installed_resource", "resource_class", "stream_handle"]

#: What to install when RMM is missing.
RMM_MISSING = ("RMM is not installed: pip install rmm-cu13 (CUDA 13) or rmm-cu12 (CUDA 12); "
               "gpumem.rmm_resource is tested with RMM 26.10, whose callbacks receive the stream")

#: Refused deallocations a resource keeps the words of (their count is kept in full).
MAX_PROBLEMS_KEPT = 20


def _rmm() -> Any:
    try:
        import rmm
        import rmm.mr  # noqa: F401 - the resources live here
    except ImportError as exc:
        raise BackendUnavailableError(f"{RMM_MISSING} ({exc})") from exc
    return rmm


def stream_handle(stream: Any) -> int:
    """The ``cudaStream_t`` handle of an RMM ``Stream`` (or anything with ``__cuda_stream__``), as an int.

    Raises:
        BackendUnavailableError: the per-thread default stream (Note [RMM's stream-ordered contract]).
        InvalidArgumentError: ``stream`` is not a CUDA stream.
    """
    try:
        version, handle = stream.__cuda_stream__()
    except (AttributeError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"not a CUDA stream (no __cuda_stream__ protocol): {stream!r}") from exc
    if version != 0:
        raise InvalidArgumentError(f"CUDA stream protocol version {version} is not understood (0 is)")
    handle = int(handle)
    if handle == PER_THREAD_STREAM:
        raise BackendUnavailableError("gpumem's RMM resource does not serve the per-thread default stream "
                                      "(cudaStreamPerThread): one handle names a different stream in each thread; "
                                      "use an explicit rmm.pylibrmm.stream.Stream per thread")
    return handle


def _current_device() -> int:
    from cuda.bindings import runtime

    err, device = runtime.cudaGetDevice()
    if err != runtime.cudaError_t.cudaSuccess:
        raise CudaError("cudaGetDevice", err.name)
    return int(device)


@functools.cache
def resource_class() -> type:
    """The class of gpumem's RMM resources: a subclass of ``rmm.mr.CallbackMemoryResource`` (made once,
    on first use, since RMM is imported only then).

    Raises:
        BackendUnavailableError: RMM is not installed.
    """
    rmm = _rmm()

    class GpumemResource(rmm.mr.CallbackMemoryResource):
        """An RMM memory resource over one gpumem allocator of one device (Note [RMM's stream-ordered
        contract]): ``allocator`` is the device's native engine or a :class:`CachingAllocator`."""

        def __init__(self, device: int, allocator: Any) -> None:
            super().__init__(self._allocate, self._deallocate)
            self.device = int(device)
            self.allocator = allocator
            self._lock = threading.Lock()
            self._problems: list[str] = []     # under _lock: the first MAX_PROBLEMS_KEPT refused deallocations
            self._n_problems = 0

        def __repr__(self) -> str:
            engine = "python" if isinstance(self.allocator, CachingAllocator) else "native"
            return f"<gpumem RMM resource cuda:{self.device} ({engine} engine)>"

        def _allocate(self, nbytes: int, stream: Any) -> int:
            if nbytes == 0:
                return 0        # as cudaMalloc(0): a null pointer, freed as one
            return self.allocator.allocate(nbytes, stream_handle(stream))

        def _deallocate(self, ptr: int, nbytes: int, stream: Any) -> None:
            if ptr == 0:
                return
            allocator = self.allocator
            try:
                handle = stream_handle(stream)
                block_nbytes = allocator.block_size(ptr)
                if nbytes > block_nbytes:
                    raise InvalidArgumentError(f"RMM frees {nbytes} B at {ptr:#x}, a block of {block_nbytes} B")
                allocator.record_stream(ptr, handle)    # nothing when handle is the allocation's stream
                allocator.free(ptr)
            except Exception as exc:  # noqa: BLE001 - Note [A deallocate cannot raise through RMM]
                message = f"deallocate({ptr:#x}, {nbytes}) refused: {type(exc).__name__}: {exc}"
                log.error("gpumem RMM resource cuda:%d: %s", self.device, message)
                with self._lock:
                    self._n_problems += 1
                    if len(self._problems) < MAX_PROBLEMS_KEPT:
                        self._problems.append(message)

        @property
        def problems(self) -> tuple[str, ...]:
            """The deallocations this resource refused (the first :data:`MAX_PROBLEMS_KEPT`, then a count)."""
            with self._lock:
                kept, n = tuple(self._problems), self._n_problems
            return kept + ((f"... and {n - len(kept)} more refused deallocations",) if n > len(kept) else ())

        def check(self, raise_on_problem: bool = False) -> DeviceCheck:
            """The allocator's consistency check, with the deallocations this resource refused.

            Raises:
                InternalError: ``raise_on_problem`` and a problem was found.
            """
            c = device_check(self.device, self.allocator)
            if self.problems:
                c = DeviceCheck(c.device, c.engine, c.problems + self.problems, c.allocated_nbytes,
                                c.reserved_nbytes)
            if raise_on_problem and c.problems:
                raise InternalError(f"cuda:{c.device}: " + "; ".join(c.problems))
            return c

    return GpumemResource


def make_resource(device: int | None = None, policy: str | AllocatorPolicy | None = None, *,
                  allocator: Any = None) -> Any:
    """An RMM memory resource (``rmm.mr.CallbackMemoryResource``) allocating through gpumem on ``device``
    (default: the current CUDA device).

    With no ``allocator``: the device's native engine over the driver where gpumem's engine is built
    (:func:`gpumem.cupy_allocator.cuda_allocator`; a ``policy`` other than the default is given to the engines
    made from now on), else a :class:`~gpumem.allocator.CachingAllocator` over gpumem's Python CUDA adapter
    with ``policy``. Given an ``allocator`` (any gpumem allocator: ``allocate(nbytes, stream)``, ``free``,
    ``record_stream``, ``block_size``), the resource allocates through it.

    Raises:
        BackendUnavailableError: RMM is not installed.
        InvalidArgumentError: a negative device, or ``policy`` together with ``allocator``.
    """
    cls = resource_class()
    if allocator is not None and policy is not None:
        raise InvalidArgumentError("make_resource: give a policy or an allocator (which has its own), not both")
    dev = _current_device() if device is None else int(device)
    if dev < 0:
        raise InvalidArgumentError(f"device must be a CUDA device index >= 0, got {dev}")
    if allocator is None:
        from .native import engine

        if engine() == "native":
            allocator = cuda_allocator(dev, policy)
        else:
            from .specs import open_device

            log.info("RMM allocates through gpumem's Python CUDA adapter: the native engine is not built")
            allocator = CachingAllocator(open_device(f"cuda:{dev}"), DEFAULT_POLICY if policy is None else policy)
    return cls(dev, allocator)


def installed_resource(device: int | None = None) -> Any:
    """gpumem's resource installed as RMM's resource of ``device`` (default: the current device), or None
    when RMM's resource there is not gpumem's."""
    rmm = _rmm()
    dev = _current_device() if device is None else int(device)
    current = rmm.mr.get_per_device_resource(dev)
    return current if isinstance(current, resource_class()) else None


def install(device: int | None = None, policy: str | AllocatorPolicy | None = None) -> Any:
    """Make gpumem RMM's memory resource of ``device`` (default: the current device), one resource per
    device: where gpumem's resource is already RMM's resource there, that one is returned.

    Every RMM allocation on that device from then on (``rmm.DeviceBuffer``, cuDF columns,
    ``rmm.allocators.cupy.rmm_cupy_allocator``...) goes to gpumem. Memory RMM's previous resource handed out
    stays valid: RMM frees it through the resource that allocated it.

    Raises:
        BackendUnavailableError: RMM is not installed.
    """
    rmm = _rmm()
    dev = _current_device() if device is None else int(device)
    current = installed_resource(dev)
    if current is not None:
        return current
    resource = make_resource(dev, policy)
    rmm.mr.set_per_device_resource(dev, resource)
    return resource


@contextlib.contextmanager
def using(device: int | None = None, policy: str | AllocatorPolicy | None = None) -> Iterator[Any]:
    """Like :func:`install` for the duration of a ``with`` block; RMM's previous resource of the device
    comes back after (memory allocated inside stays valid and is freed through gpumem)."""
    rmm = _rmm()
    dev = _current_device() if device is None else int(device)
    previous = rmm.mr.get_per_device_resource(dev)
    resource = install(dev, policy)
    try:
        yield resource
    finally:
        rmm.mr.set_per_device_resource(dev, previous)
