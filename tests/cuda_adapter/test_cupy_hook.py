"""The CuPy hook without a GPU: a fake ``cupy`` module over simulated devices (issue 19).

CuPy calls the installed allocator for every device; the hook must choose the allocator by CuPy's current
device at each call, and hand CuPy the block's size (a multiple of 512 B), as CuPy's own pool does.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import threading
import types

import pytest

import gpumem
from gpumem.allocator import CachingAllocator
from gpumem.errors import BackendUnavailableError


class _FakeCuda:
    def __init__(self) -> None:
        self.current = 0
        self.installed = None
        outer = self

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id):
                self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

        class MemoryPointer:
            def __init__(self, mem, offset):
                self.mem, self.ptr, self.device_id = mem, mem.ptr + offset, mem.device_id

        class OutOfMemoryError(Exception):
            pass

        self.memory = types.SimpleNamespace(UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer,
                                            OutOfMemoryError=OutOfMemoryError)
        self.runtime = types.SimpleNamespace(getDevice=lambda: outer.current)
        self.Device = lambda i=None: types.SimpleNamespace(id=outer.current if i is None else i)
        self.get_current_stream = lambda: types.SimpleNamespace(ptr=0)
        self.set_allocator = lambda f: setattr(outer, "installed", f)
        self.get_allocator = lambda: outer.installed


@pytest.fixture()
def fake_cupy(monkeypatch):
    cuda = _FakeCuda()
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    return cuda


def _sim_factory(made: list[int]):
    def factory(device_id: int) -> CachingAllocator:
        made.append(device_id)
        return CachingAllocator(gpumem.open_device("sim:t4-16gb"), "gpumem")
    return factory


def test_each_device_gets_its_own_allocator_chosen_at_call_time(fake_cupy):
    from gpumem.cupy_allocator import CupyMalloc

    made: list[int] = []
    malloc = CupyMalloc(_sim_factory(made))
    p0 = malloc(1000)
    fake_cupy.current = 1          # cupy.cuda.Device(1).use()
    p1 = malloc(1000)
    assert (p0.device_id, p1.device_id) == (0, 1) and made == [0, 1]
    assert malloc.allocator(0) is not malloc.allocator(1)
    assert malloc.allocator(1).allocated_nbytes == p1.mem.size
    assert malloc.allocator(0).allocated_nbytes == p0.mem.size


def test_mem_size_is_the_blocks_size_a_multiple_of_512(fake_cupy):
    """CuPy's test_percentile_memory_access read mem.size == 16 where CuPy's pool gives 512."""
    from gpumem.cupy_allocator import CupyMalloc

    malloc = CupyMalloc(_sim_factory([]))
    for n in (1, 16, 511, 513, 4097, 3 << 20):
        p = malloc(n)
        assert p.mem.size >= n and p.mem.size % 512 == 0
        assert p.mem.size == malloc.allocator().block_size(p.ptr)


def test_an_allocator_for_one_device_refuses_another(fake_cupy):
    from gpumem.cupy_allocator import make_malloc

    alloc = CachingAllocator(gpumem.open_device("sim:t4-16gb"), "gpumem")
    malloc = make_malloc(alloc)
    kept = malloc(4096)
    fake_cupy.current = 1
    with pytest.raises(BackendUnavailableError, match="serves CUDA device 0, and CuPy allocated on device 1"):
        malloc(4096)
    assert alloc.allocated_nbytes == kept.mem.size == 4096  # nothing changed on device 0


def test_threads_make_one_allocator_per_device(fake_cupy):
    from gpumem.cupy_allocator import CupyMalloc

    made: list[int] = []
    malloc = CupyMalloc(_sim_factory(made))
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        malloc.allocator(0)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [0]


# -- the native hook (gpumem._engine.CupyAllocator) without a driver: its checks and its failures --------------

class _Mem:
    def __init__(self, ptr, size, owner, device_id):
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id


class _Ptr:
    def __init__(self, mem, offset):
        self.mem, self.ptr, self.device_id = mem, mem.ptr + offset, mem.device_id


def _native():
    from gpumem.native import engine, native_module

    if engine() != "native":
        pytest.skip("gpumem's native engine is not built")
    return native_module()


def _hook(device=0, stream=0):
    return _native().CupyAllocator(lambda: device, lambda: stream, _Mem, _Ptr, lambda n, d, e: MemoryError(n))


def test_native_hook_size_zero_gets_no_memory_on_the_current_device():
    asked = []
    hook = _native().CupyAllocator(lambda: asked.append(1) or 3, lambda: 0, _Mem, _Ptr, lambda n, d, e: MemoryError(n))
    p = hook(0)
    assert (p.ptr, p.mem.size, p.mem.owner) == (0, 0, None)
    # CuPy's device function is asked only where no CUDA context is current (no driver here); on a GPU
    # the current context's device is CuPy's current device
    assert p.device_id == (3 if asked else 0)


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, "8", True])
def test_native_hook_refuses_a_bad_size(bad):
    from gpumem.errors import InvalidArgumentError

    hook = _hook()
    with pytest.raises(InvalidArgumentError, match="nbytes must be an int"):
        hook(bad)
    assert hook.devices() == []


@pytest.mark.parametrize("device", [-1, 64])
def test_native_hook_refuses_a_device_out_of_range(device):
    from gpumem.errors import InvalidArgumentError

    asked = []
    hook = _native().CupyAllocator(lambda: asked.append(1) or device, lambda: 0, _Mem, _Ptr, lambda *a: None)
    try:
        p = hook(0)
    except InvalidArgumentError as exc:
        assert asked and re.search(r"CuPy's current device is -?\d+, outside \[0, 64\)", str(exc))
        assert hook.devices() == []
    else:   # a GPU with a current context: CuPy's function was not asked
        assert not asked and 0 <= p.device_id < 64


def test_native_hook_refuses_a_negative_stream_and_a_bad_call():
    from gpumem.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="takes 1 positional argument"):
        _hook()(1, 2)
    with pytest.raises(InvalidArgumentError, match="takes 1 positional argument"):
        _hook()(nbytes=1)


def test_native_hook_reads_the_device_and_the_stream_as_an_allocation_does():
    from gpumem.errors import InvalidArgumentError

    asked = []
    hook = _native().CupyAllocator(lambda: asked.append(1) or 3, lambda: 7, _Mem, _Ptr, lambda *a: None)
    device = hook.current_device()
    # CuPy's function where no context is current (no driver here), else the current context's device
    assert device == 3 if asked else 0 <= device < 64
    assert hook.current_stream() == 7
    with pytest.raises(BackendUnavailableError, match="per-thread default stream"):
        _hook(stream=2).current_stream()
    with pytest.raises(InvalidArgumentError, match=r"CuPy's current stream is -1, outside"):
        _hook(stream=-1).current_stream()
    with pytest.raises(InvalidArgumentError, match=r"CuPy's current stream is -1, outside"):
        _hook(stream=-1)(512)
    assert hook.devices() == []


def test_native_hook_refuses_what_is_not_callable_and_a_foreign_capsule():
    import ctypes

    from gpumem.errors import InvalidArgumentError

    mod = _native()
    with pytest.raises(InvalidArgumentError, match="unowned_memory must be callable, got int"):
        mod.CupyAllocator(lambda: 0, lambda: 0, 1, _Ptr, lambda *a: None)
    make_capsule = ctypes.pythonapi.PyCapsule_New
    make_capsule.restype = ctypes.py_object
    make_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    foreign = make_capsule(ctypes.cast(ctypes.pythonapi.Py_IsInitialized, ctypes.c_void_p), b"int (void)", None)
    with pytest.raises(InvalidArgumentError, match=r"must hold a C function 'intptr_t \(void\)' or "
                                                   r"'intptr_t \(int\)', it holds 'int \(void\)'"):
        mod.CupyAllocator(lambda: 0, foreign, _Mem, _Ptr, lambda *a: None)


def _stream_capsule(fn, signature: bytes):
    """A capsule of a C function calling `fn` (ctypes), as CuPy's __pyx_capi__ holds them; keep the pair alive."""
    import ctypes

    proto = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int) if b"int)" in signature else \
        ctypes.CFUNCTYPE(ctypes.c_ssize_t)
    c_fn = proto(fn)
    make_capsule = ctypes.pythonapi.PyCapsule_New
    make_capsule.restype = ctypes.py_object
    make_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return make_capsule(ctypes.cast(c_fn, ctypes.c_void_p), signature, None), c_fn


def test_native_hook_reads_the_stream_of_the_device_it_found_through_cupy_backends_function():
    """Note [CuPy's stream in C]: given cupy_backends' get_stream_ptr(device) the hook passes the device it
    found (here CuPy's, no context being current; on a GPU the current context's) and refuses the per-thread
    default stream as before."""
    asked: list[int] = []
    streams = {3: 7, 4: 2}
    # on a GPU a context is current (another test made it): the hook finds its device, which may be any
    capsule, keep = _stream_capsule(lambda d: asked.append(d) or streams.get(d, 11), b"intptr_t (int)")
    device = [3]
    hook = _native().CupyAllocator(lambda: device[0], capsule, _Mem, _Ptr, lambda *a: None)
    assert hook.reads_stream_in_c() and hook.reads_stream_by_device()
    found = hook.current_device()
    assert hook.current_stream() == streams.get(found, 11) and asked == [found]
    if found == 3:   # no CUDA context here: CuPy's device, whose stream is 2 once it is device 4
        device[0] = 4
        with pytest.raises(BackendUnavailableError, match="per-thread default stream"):
            hook.current_stream()
        with pytest.raises(BackendUnavailableError, match="per-thread default stream"):
            hook(4096)
        assert asked == [3, 4, 4] and hook.devices() == []
    del keep


def test_native_hook_reads_cupys_current_stream_function_without_a_device():
    capsule, keep = _stream_capsule(lambda: 9, b"intptr_t (void)")
    hook = _native().CupyAllocator(lambda: 0, capsule, _Mem, _Ptr, lambda *a: None)
    assert hook.reads_stream_in_c() and not hook.reads_stream_by_device()
    assert hook.current_stream() == 9
    del keep


def test_native_hook_prefers_cupy_backends_get_stream_ptr(fake_cupy, monkeypatch):
    """gpumem.cupy_allocator.native_hook gives cupy_backends' get_stream_ptr where CuPy exports it (CuPy 14),
    else cupy.cuda.stream's get_current_stream_ptr (CuPy 13), else CuPy's Python function."""
    import gpumem.cupy_allocator as gca

    _native()
    by_device, keep_a = _stream_capsule(lambda d: 5, b"intptr_t (int)")
    current, keep_b = _stream_capsule(lambda: 6, b"intptr_t (void)")
    backends_stream = types.SimpleNamespace(__pyx_capi__={"get_stream_ptr": by_device})
    backends = types.SimpleNamespace(cuda=types.SimpleNamespace(stream=backends_stream))
    fake_cupy.stream = types.SimpleNamespace(__pyx_capi__={"get_current_stream_ptr": current})
    fake_cupy.get_current_stream = lambda: types.SimpleNamespace(ptr=8)
    for name, mod in (("cupy_backends", backends), ("cupy_backends.cuda", backends.cuda),
                      ("cupy_backends.cuda.stream", backends_stream)):
        monkeypatch.setitem(sys.modules, name, mod)
    hook = gca.native_hook()
    assert hook.reads_stream_by_device() and hook.current_stream() == 5
    backends_stream.__pyx_capi__ = {}   # CuPy 13
    hook = gca.native_hook()
    assert hook.reads_stream_in_c() and not hook.reads_stream_by_device() and hook.current_stream() == 6
    fake_cupy.stream = types.SimpleNamespace()   # no C API at all
    hook = gca.native_hook()
    assert not hook.reads_stream_in_c() and hook.current_stream() == 8
    foreign, keep_c = _stream_capsule(lambda: 4, b"int (void)")
    backends_stream.__pyx_capi__ = {"get_stream_ptr": foreign}   # another CuPy build's signature: the next way
    fake_cupy.stream = types.SimpleNamespace(__pyx_capi__={"get_current_stream_ptr": current})
    hook = gca.native_hook()
    assert hook.reads_stream_in_c() and not hook.reads_stream_by_device() and hook.current_stream() == 6
    del keep_a, keep_b, keep_c


def test_native_hook_without_a_driver_raises_and_keeps_no_engine():
    hook = _hook()
    try:
        p = hook(512)
    except BackendUnavailableError as exc:
        assert "CUDA device 0" in str(exc)
        assert hook.devices() == []
    else:  # a machine with a driver: the allocation is real
        assert p.mem.size == 512 and hook.devices() == [0]


def test_install_without_the_native_engine_warns_once_and_uses_the_python_adapter(fake_cupy, monkeypatch):
    import warnings

    import gpumem.native as native
    import gpumem.specs
    from gpumem.cupy_allocator import CupyMalloc, install

    monkeypatch.setattr(native, "_load", lambda: (None, "not built in this test"))
    native._warn_once.cache_clear()
    monkeypatch.setattr(gpumem.specs, "open_device", lambda spec: gpumem.open_device("sim:t4-16gb"))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            install()
            alloc = install()
        assert [type(w.message) for w in caught] == [native.NativeEngineWarning]
        assert "not built in this test" in str(caught[0].message)
        assert isinstance(fake_cupy.installed, CupyMalloc) and isinstance(alloc, CachingAllocator)
        p = fake_cupy.installed(1000)
        assert p.mem.size == 1024 == alloc.allocated_nbytes
    finally:
        native._warn_once.cache_clear()


def test_check_installed_reports_each_device_and_refuses_a_foreign_allocator(fake_cupy):
    from gpumem.cupy_allocator import CupyMalloc, check_installed

    malloc = CupyMalloc(_sim_factory([]))
    fake_cupy.set_allocator(malloc)
    kept = [malloc(4096)]
    fake_cupy.current = 1
    kept.append(malloc(100))
    checks = check_installed(raise_on_problem=True)
    assert [(c.device, c.engine, c.ok, c.allocated_nbytes) for c in checks] == [(0, "python", True, 4096),
                                                                                (1, "python", True, 512)]
    fake_cupy.set_allocator(lambda n: None)
    with pytest.raises(BackendUnavailableError, match="not gpumem's"):
        check_installed()


def test_the_per_thread_default_stream_is_refused_by_both_hooks(fake_cupy):
    """Under CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1 the stream handle 2 is a different stream in each thread: a
    block freed by one thread could go at once to another thread's stream. Both hooks refuse it, allocating
    nothing."""
    from gpumem.cupy_allocator import PER_THREAD_MESSAGE, CupyMalloc

    malloc = CupyMalloc(_sim_factory([]))
    fake_cupy.get_current_stream = lambda: types.SimpleNamespace(ptr=2)
    with pytest.raises(BackendUnavailableError, match="per-thread default stream"):
        malloc(4096)
    assert malloc.allocator(0).allocated_nbytes == 0
    hook = _hook(stream=2)
    with pytest.raises(BackendUnavailableError, match="per-thread default stream") as exc:
        hook(4096)
    assert str(exc.value) == PER_THREAD_MESSAGE and hook.devices() == []


def test_install_gives_the_engines_cupys_page_slack_unless_a_policy_is_named(fake_cupy, monkeypatch):
    """Note [CuPy's page slack]: install() gives the native engines made from then on the default policy with
    CUPY_PAGE_SLACK; a policy named (the default's name too) is given as it is."""
    import gpumem.cupy_allocator as gca
    import gpumem.torch
    from gpumem.allocator.policy import DEFAULT_POLICY, get_policy
    from gpumem.native import engine

    if engine() != "native":
        pytest.skip("needs gpumem's native engine")
    real = gca._engine_module()
    fake_cupy.stream = types.SimpleNamespace()   # no C API: the hook reads the stream through Python
    monkeypatch.setattr(gca, "_engine_module", lambda: types.SimpleNamespace(
        CupyAllocator=real.CupyAllocator, CudaAllocator=lambda device: ("engine of", device)))
    configured: list = []
    monkeypatch.setattr(gpumem.torch, "configure", configured.append)
    assert gca.install() == ("engine of", 0)
    assert type(fake_cupy.installed) is real.CupyAllocator
    assert [p.page_slack for p in configured] == [gca.CUPY_PAGE_SLACK] == [0.2]
    cupy_pol = configured[0]
    default = get_policy(DEFAULT_POLICY)
    assert cupy_pol == dataclasses.replace(default, name=cupy_pol.name, description=cupy_pol.description,
                                           page_slack=gca.CUPY_PAGE_SLACK)
    configured.clear()
    gca.install(policy=DEFAULT_POLICY)   # the default by name: the engines keep gpumem.torch's default
    assert configured == []
    gca.install(policy=dataclasses.replace(default, name="mine", page_slack=0.01))
    assert [p.page_slack for p in configured] == [0.01]


def test_install_python_adapter_uses_cupys_page_slack(fake_cupy, monkeypatch):
    import gpumem.native as native
    import gpumem.specs
    from gpumem.cupy_allocator import CUPY_PAGE_SLACK, install

    monkeypatch.setattr(native, "_load", lambda: (None, "not built in this test"))
    native._warn_once.cache_clear()
    monkeypatch.setattr(gpumem.specs, "open_device", lambda spec: gpumem.open_device("sim:t4-16gb"))
    try:
        with pytest.warns(native.NativeEngineWarning):
            alloc = install()
        assert alloc.policy.page_slack == CUPY_PAGE_SLACK
        assert install(policy="gpumem").policy.page_slack == 0.005
    finally:
        native._warn_once.cache_clear()


def test_cuda_allocator_configures_a_custom_policy_that_keeps_the_default_name():
    """A policy made with dataclasses.replace(get_policy("gpumem"), page_slack=0.3) keeps the name
    "gpumem": cuda_allocator once compared names and dropped its knobs without a word."""
    import dataclasses
    from unittest import mock

    import gpumem.cupy_allocator as gca
    import gpumem.torch as gt
    from gpumem.allocator.policy import get_policy

    calls: list = []
    engine = mock.Mock()
    engine.CudaAllocator = lambda d: f"engine {d}"
    with mock.patch.object(gca, "_engine_module", lambda: engine), mock.patch.object(gt, "configure", calls.append):
        custom = dataclasses.replace(get_policy("gpumem"), page_slack=0.3)
        assert gca.cuda_allocator(0, custom) == "engine 0"
        gca.cuda_allocator(0, "gpumem")            # the default itself: nothing to configure
    assert calls == [custom]


def test_native_hook_through_a_stand_in_driver_keeps_cupys_contract():
    """benchmarks/cupy_hook_cpu --check: the hook allocates real blocks through a stand-in libcuda and
    stand-in CuPy types (Note [CuPy's objects, made for less]): mem.size is the block's size for sizes whose
    ints share a cache slot, every block goes back when CuPy lets go, a MemoryPointer that fails frees its
    block, an UnownedMemory that keeps its argument tuple keeps it intact, and a re-entrant allocation gets
    its own tuple."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    _native()
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler for the stand-in libcuda")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["PYTHONPATH"] = str(root)
    r = subprocess.run([sys.executable, "-m", "benchmarks.cupy_hook_cpu.run", "--check"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checks passed" in r.stdout
