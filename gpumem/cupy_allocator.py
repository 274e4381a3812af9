"""Make CuPy allocate through gpumem: its native engine over the CUDA driver, or a
:class:`~gpumem.allocator.CachingAllocator`.

One line::

    import gpumem.cupy_allocator as gca
    allocator = gca.install()          # every CuPy array now lives in gpumem's allocator

or, scoped (the previous CuPy allocator comes back on exit)::

    with gca.using() as allocator:
        x = cupy.arange(10**8)
        print(gca.check_installed())   # per device: consistent?, bytes allocated and reserved

CuPy calls the installed function with a byte count and expects a
``cupy.cuda.MemoryPointer``; gpumem hands it an ``UnownedMemory`` whose *owner*
returns the block to the allocator when CuPy drops the last reference, so the
block is freed exactly when CuPy would have freed its own. Blocks are allocated on
CuPy's current stream (its handle is the stream id), so gpumem never hands a
block freed on one stream to another (Note [Streams] in
:mod:`gpumem.allocator.caching`).

Where gpumem's native engine is built, :func:`install` puts the native engine over the CUDA driver
in CuPy, one engine per device (the engine ``gpumem._engine.CudaAllocator(device)`` and
:mod:`gpumem.torch` use), called from C (Note [CuPy's allocator in C] in
``gpumem/_native/cuda_allocator.cpp``); it returns the current device's ``CudaAllocator``. Given a
:class:`~gpumem.allocator.CachingAllocator` or allocator options, or where the engine is not built
(one :class:`~gpumem.native.NativeEngineWarning`), CuPy allocates through a ``CachingAllocator`` over
gpumem's Python CUDA adapter (:class:`CupyMalloc`) instead. :func:`check_installed` runs the
consistency check of every device the installed hook allocated on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import Any, Callable, Iterator, Union

from .allocator import CachingAllocator
from .allocator.policy import DEFAULT_POLICY, AllocatorPolicy, get_policy
from .errors import BackendUnavailableError, InternalError, OutOfMemoryError

log = logging.getLogger(__name__)


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(
            "CuPy is not installed: pip install 'gpumem[cuda12]' (CUDA 12) or 'gpumem[cuda13]' (CUDA 13)"
        ) from exc
    return cupy


#: cudaStreamPerThread, CuPy's current stream in every thread under CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1: one
#: handle for a different stream in each thread, which gpumem's free lists cannot tell apart (Note [CuPy's
#: per-thread default stream] in gpumem/_native/cuda_allocator.cpp).
PER_THREAD_STREAM = 2
PER_THREAD_MESSAGE = ("gpumem's CuPy hook does not serve CuPy's per-thread default stream "
                      "(CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1): one handle names a different stream in each thread; "
                      "use an explicit cupy.cuda.Stream per thread")


#: The page slack of the engines CuPy's hook makes (Note [CuPy's page slack]).
CUPY_PAGE_SLACK = 0.2

# Note [CuPy's page slack]: past ``page_slack`` of the most pages live data touched, the engine moves
# memory (steals an idle chunk: an unmap, a map and an access call, 65 us together on the H200) instead of
# creating it. A training step that repeats touches, over the step, more pages than are live at its peak,
# so at the default slack (0.5 %) the same chunks moved back and forth in every step: CuPy's hook made 298
# device calls per pass of gpt2_train and 800 of llama_varlen, 1.5x and 2.5-3x the time per operation of
# CuPy's pool. A slack is a bound, not a reservation: memory is created only where a block needs it, so
# the engine holds the pages the repeating step touches, and no more (0.1 to 13.7 % more than at 0.5 % on
# the corpus). A rule that created only where a steal had taken memory before (hysteresis) held as much
# as a static slack for as many calls or more (reports/hil/cupy-hook-bench-h200-2026-11-25-run3.md).
# CuPy's own pool never gives memory back and held more than gpumem at 0.2 on 13 of the 15 traces on the
# H200, so CuPy's hook takes 0.2; gpumem.torch keeps the default, whose memory issue 18 holds to 1 % above
# the live peak. The engines are shared per device with gpumem.torch (Note [One engine per device, shared
# with PyTorch]): :func:`install` sets the policy of the engines made from then on, as
# :func:`gpumem.torch.configure` does.


def cupy_policy() -> AllocatorPolicy:
    """The policy of the engines :func:`install` makes by default: the default policy with
    :data:`CUPY_PAGE_SLACK` (Note [CuPy's page slack])."""
    return dataclasses.replace(get_policy(DEFAULT_POLICY), name=f"{DEFAULT_POLICY}-cupy",
                               description="the default policy with CuPy's page slack (Note [CuPy's page slack] "
                                           "in gpumem.cupy_allocator)", page_slack=CUPY_PAGE_SLACK)


class _BlockOwner:
    """Keeps a gpumem block alive while CuPy references it; frees it when CuPy lets go."""

    __slots__ = ("allocator", "ptr")

    def __init__(self, allocator: CachingAllocator, ptr: int) -> None:
        self.allocator = allocator
        self.ptr = ptr

    def __del__(self) -> None:
        try:
            self.allocator.free(self.ptr)
        except Exception as exc:  # noqa: BLE001 - never raise from a finaliser
            log.debug("could not free %#x: %s", self.ptr, exc)


class CupyMalloc:
    """The function given to ``cupy.cuda.set_allocator``: one gpumem allocator per device, chosen at each
    call by CuPy's current device (as CuPy's own ``MemoryPool`` keeps one pool per device).

    Note [One allocator per device, chosen at call time]: CuPy calls the installed function for every
    device; a function bound to the device that was current at install time handed device 0's memory to
    an array made after ``cupy.cuda.Device(1).use()``. The allocator of a device is made on its first
    allocation there (by ``factory(device_id)``), under ``_lock``; the hot path after that is a dict read.

    The ``MemoryPointer`` CuPy gets has the block's size (``mem.size``: the request rounded as the
    allocator rounds it, a multiple of 512 B as CuPy's pool gives), since CuPy code reads it as the
    allocation's size (CuPy's ``test_percentile_memory_access`` does).
    """

    def __init__(self, factory: Callable[[int], CachingAllocator],
                 allocators: "dict[int, CachingAllocator] | None" = None) -> None:
        self._cupy = _cupy()
        self._factory = factory
        self._lock = threading.Lock()
        self._allocators: dict[int, CachingAllocator] = dict(allocators or {})  # written under _lock

    def allocator(self, device_id: int | None = None) -> CachingAllocator:
        """The allocator of ``device_id`` (default: CuPy's current device), made on first use."""
        dev = self._cupy.cuda.runtime.getDevice() if device_id is None else int(device_id)
        alloc = self._allocators.get(dev)
        if alloc is None:
            with self._lock:
                alloc = self._allocators.get(dev)
                if alloc is None:
                    alloc = self._allocators[dev] = self._factory(dev)
        return alloc

    @property
    def allocators(self) -> "dict[int, CachingAllocator]":
        """The allocators made so far, by device id (a copy)."""
        with self._lock:
            return dict(self._allocators)

    def __call__(self, nbytes: int) -> Any:
        cupy = self._cupy
        memory = cupy.cuda.memory
        device_id = cupy.cuda.runtime.getDevice()
        if nbytes == 0:
            return memory.MemoryPointer(memory.UnownedMemory(0, 0, None, device_id), 0)
        allocator = self.allocator(device_id)
        stream = cupy.cuda.get_current_stream().ptr
        if stream == PER_THREAD_STREAM:
            raise BackendUnavailableError(PER_THREAD_MESSAGE)
        try:
            ptr = allocator.allocate(nbytes, stream)
        except OutOfMemoryError as exc:
            # CuPy's own OutOfMemoryError lets CuPy code that catches it keep working
            raise memory.OutOfMemoryError(nbytes, allocator.allocated_nbytes) from exc
        mem = memory.UnownedMemory(ptr, allocator.block_size(ptr), _BlockOwner(allocator, ptr), device_id)
        return memory.MemoryPointer(mem, 0)


def make_malloc(allocator: CachingAllocator) -> Callable[[int], Any]:
    """The function to give ``cupy.cuda.set_allocator`` for ``allocator``'s device alone: an allocation on
    any other device is refused (:class:`CupyMalloc` serves every device)."""
    cupy = _cupy()
    own = cupy.cuda.Device().id

    def refuse(device_id: int) -> CachingAllocator:
        raise BackendUnavailableError(f"this gpumem allocator serves CUDA device {own}, and CuPy allocated on "
                                      f"device {device_id}: use gpumem.cupy_allocator.install(), which keeps "
                                      "one allocator per device")

    return CupyMalloc(refuse, {own: allocator})


#: What :func:`install` returns: the current device's allocator, native or Python.
InstalledAllocator = Union[CachingAllocator, Any]   # Any: gpumem._engine.CudaAllocator


def _on_out_of_memory(cupy: Any) -> Callable[[int, int, BaseException], BaseException]:
    def on_oom(nbytes: int, device_id: int, error: BaseException) -> BaseException:
        # CuPy's own OutOfMemoryError lets CuPy code that catches it keep working; gpumem's says why
        allocated_nbytes = _engine_module().CudaAllocator(device_id).allocated_nbytes()
        cupy_error = cupy.cuda.memory.OutOfMemoryError(nbytes, allocated_nbytes)
        cupy_error.__cause__ = error
        return cupy_error
    return on_oom


def _engine_module() -> Any:
    from .native import native_module

    return native_module()


def cuda_allocator(device: int, policy: Any = None) -> Any:
    """The native engine of CUDA device ``device`` over the driver, ``gpumem._engine.CudaAllocator(device)``:
    one per device and process, shared by :mod:`gpumem.torch`, the CuPy hook
    (this module) and the RMM resource (:mod:`gpumem.rmm_resource`).

    A ``policy`` (name or :class:`~gpumem.allocator.policy.AllocatorPolicy`) other than the default is given
    to the engines made from now on (:func:`gpumem.torch.configure`): an engine already made keeps its policy.

    Raises:
        BackendUnavailableError: the native engine is not built.
        InvalidArgumentError: a policy the engine refuses, or a bad device.
    """
    module = _engine_module()
    if policy is not None and dataclasses.replace(get_policy(policy), name="", description="") != \
            dataclasses.replace(get_policy(DEFAULT_POLICY), name="", description=""):
        from .torch import configure

        configure(policy)
    return module.CudaAllocator(int(device))


def native_hook() -> Any:
    """The native hook (``gpumem._engine.CupyAllocator``) for ``cupy.cuda.set_allocator``: every device on
    its engine over the CUDA driver, chosen by CuPy's current device at each call; the owner CuPy keeps
    frees the block from C (Note [CuPy's allocator in C]).

    Raises:
        BackendUnavailableError: CuPy is not installed, or gpumem's native engine is not built.
    """
    cupy = _cupy()
    engine = _engine_module()
    memory = cupy.cuda.memory
    make = engine.CupyAllocator
    get_device = cupy.cuda.runtime.getDevice
    on_oom = _on_out_of_memory(cupy)
    # Note [CuPy's stream in C] (gpumem/_native/cuda_allocator.cpp): cupy_backends' get_stream_ptr(device)
    # (CuPy 14), else cupy.cuda.stream's get_current_stream_ptr(), else CuPy's Python function
    for module, name in ((_backends_stream(), "get_stream_ptr"), (cupy.cuda.stream, "get_current_stream_ptr")):
        capsule = getattr(module, "__pyx_capi__", {}).get(name)
        if capsule is None:
            continue
        try:
            return make(get_device, capsule, memory.UnownedMemory, memory.MemoryPointer, on_oom)
        except Exception as exc:  # noqa: BLE001 - another CuPy build: the next way below
            log.debug("CuPy's %s capsule is not usable (%s)", name, exc)
    log.debug("reading CuPy's current stream from Python")
    return make(get_device, lambda: cupy.cuda.get_current_stream().ptr, memory.UnownedMemory, memory.MemoryPointer,
                on_oom)


def _backends_stream() -> Any:
    """``cupy_backends.cuda.stream`` (imported by CuPy), or None where it cannot be imported."""
    try:
        import cupy_backends.cuda.stream as backends_stream
    except ImportError:
        return None
    return backends_stream


def install(allocator: CachingAllocator | None = None, *, policy: str | AllocatorPolicy | None = None,
            **allocator_options: Any) -> InstalledAllocator:
    """Route CuPy's allocations through gpumem, one allocator per device (Note [One allocator per device,
    chosen at call time]); return the current device's allocator. ``policy`` None: :func:`cupy_policy`
    (Note [CuPy's page slack]).

    With neither ``allocator`` nor ``allocator_options``, and gpumem's native engine built, CuPy gets the
    native hook (:func:`native_hook`) and this returns ``gpumem._engine.CudaAllocator(device)``; a
    ``policy`` other than the default (CuPy's, unless named) is given to the engines made from now on (as
    :func:`gpumem.torch.configure`: an engine already made keeps its policy). Otherwise each device gets a
    :class:`~gpumem.allocator.CachingAllocator` over gpumem's Python CUDA adapter (``allocator`` serves the
    current device; the others get new ones with ``policy`` and ``allocator_options``); where that is
    because the native engine is not built, :func:`gpumem.engine` warns once.
    """
    cupy = _cupy()
    current = cupy.cuda.Device().id
    policy = cupy_policy() if policy is None else get_policy(policy)
    if allocator is None and not allocator_options:
        from .native import engine

        if engine() == "native":
            hook = native_hook()
            current_allocator = cuda_allocator(current, policy)
            cupy.cuda.set_allocator(hook)
            return current_allocator
        log.info("CuPy allocates through gpumem's Python CUDA adapter: the native engine is not built")
    from .specs import open_device

    def factory(device_id: int) -> CachingAllocator:
        return CachingAllocator(open_device(f"cuda:{device_id}"), policy, **allocator_options)

    malloc = CupyMalloc(factory, {current: allocator} if allocator is not None else None)
    cupy.cuda.set_allocator(malloc)
    return malloc.allocator(current)


def _is_native_hook(hook: Any) -> bool:
    from .native import engine

    return engine() == "native" and isinstance(hook, _engine_module().CupyAllocator)


@dataclasses.dataclass(frozen=True)
class DeviceCheck:
    """The consistency check of one device's allocator under the installed hook."""

    device: int
    engine: str                  # "native" (the engine over the driver) or "python" (CachingAllocator)
    problems: tuple[str, ...]    # empty: consistent
    allocated_nbytes: int
    reserved_nbytes: int

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems


def device_check(device: int, allocator: InstalledAllocator) -> DeviceCheck:
    """The consistency check of ``allocator``, device ``device``'s allocator: a
    :class:`~gpumem.allocator.CachingAllocator`, or the native engine over the driver
    (``gpumem._engine.CudaAllocator``)."""
    if isinstance(allocator, CachingAllocator):
        try:
            allocator.check_consistency()
            problems: tuple[str, ...] = ()
        except InternalError as exc:
            problems = (str(exc),)
        return DeviceCheck(device, "python", problems, allocator.allocated_nbytes, allocator.reserved_nbytes)
    return DeviceCheck(device, "native", tuple(allocator.consistency_problems()), allocator.allocated_nbytes(),
                       allocator.reserved_nbytes())


def check_installed(raise_on_problem: bool = False) -> list[DeviceCheck]:
    """Run the consistency check of every device the gpumem hook installed in CuPy allocated on.

    Raises:
        BackendUnavailableError: CuPy's current allocator is not one of gpumem's.
        InternalError: ``raise_on_problem`` and some device's bookkeeping is inconsistent.
    """
    cupy = _cupy()
    hook = cupy.cuda.get_allocator()
    if isinstance(hook, CupyMalloc):
        checks = [device_check(dev, alloc) for dev, alloc in sorted(hook.allocators.items())]
    elif _is_native_hook(hook):
        checks = [device_check(dev, _engine_module().CudaAllocator(dev)) for dev in hook.devices()]
    else:
        raise BackendUnavailableError(f"CuPy's allocator is {hook!r}, not gpumem's: call gpumem.cupy_allocator.install()")
    bad = [c for c in checks if c.problems]
    if raise_on_problem and bad:
        raise InternalError("; ".join(f"cuda:{c.device}: " + "; ".join(c.problems) for c in bad))
    return checks


@contextlib.contextmanager
def using(allocator: CachingAllocator | None = None, *, policy: str | AllocatorPolicy | None = None,
          **allocator_options: Any) -> Iterator[InstalledAllocator]:
    """Like :func:`install` for the duration of a ``with`` block; the previous allocator comes back after."""
    cupy = _cupy()
    previous = cupy.cuda.get_allocator()
    alloc = install(allocator, policy=policy, **allocator_options)
    try:
        yield alloc
    finally:
        cupy.cuda.set_allocator(previous)
