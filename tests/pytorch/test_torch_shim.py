"""gpumem.torch_shim: gpumem as PyTorch's allocator through PyTorch's C++ interface.

Without a GPU (and without PyTorch): the build's errors and the fallback to the two C hooks, with
a fake ``torch`` module; the native pool/engine functions the shim calls (through ctypes). On a
real device (``--gpumem-device cuda:0``): the HIL record's scenarios (hil/probes/torch_shim.py),
each in a fresh process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest

import gpumem
import gpumem.torch as gt
import gpumem.torch_shim as ts
from gpumem.errors import BackendUnavailableError, GpumemError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
HAVE_TORCH = importlib.util.find_spec("torch") is not None
native_only = pytest.mark.skipif(gpumem.engine() != "native", reason="gpumem's native engine is not built")


@pytest.fixture(autouse=True)
def fresh_caches():
    ts.build.cache_clear()
    ts._installed.cache_clear()
    ts._plain_allocator.cache_clear()
    yield
    ts.build.cache_clear()
    ts._installed.cache_clear()
    ts._plain_allocator.cache_clear()


class FakeCppExtension(types.ModuleType):
    def __init__(self, ninja: bool = True, cuda_home: "str | None" = "/cuda", error: "Exception | None" = None):
        super().__init__("torch.utils.cpp_extension")
        self.ninja, self.CUDA_HOME, self.error, self.loads = ninja, cuda_home, error, []

    def is_ninja_available(self) -> bool:
        return self.ninja

    def load(self, **kw):
        self.loads.append(kw)
        if self.error is not None:
            raise self.error
        return types.SimpleNamespace(install=lambda path: self.loads.append(("install", path)),
                                     pool_table=lambda: [(0, 1, 0, 1, 2)])


@pytest.fixture
def fake_torch(monkeypatch):
    """A ``torch`` module with what torch_shim touches, CUDA not initialised."""
    def make(**kw):
        ext = FakeCppExtension(**kw)
        torch = types.ModuleType("torch")
        torch.__version__ = "2.11.0+fake"
        torch.cuda = types.SimpleNamespace(is_initialized=lambda: False, MemPool=lambda *a: ("MemPool", a))
        utils = types.ModuleType("torch.utils")
        utils.cpp_extension = ext
        torch.utils = utils
        monkeypatch.setitem(sys.modules, "torch", torch)
        monkeypatch.setitem(sys.modules, "torch.utils", utils)
        monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", ext)
        return torch, ext
    yield make
    # what an install through the stand-in left: later tests (gpumem.torch's "before install") see none
    ts._installed.cache_clear()          # noqa: SLF001
    gt._installed_through_shim.cache_clear()  # noqa: SLF001


@pytest.mark.skipif(HAVE_TORCH, reason="PyTorch is installed")
def test_without_torch_says_so():
    with pytest.raises(BackendUnavailableError, match="PyTorch is not installed"):
        ts.build()
    with pytest.raises(BackendUnavailableError, match="PyTorch is not installed"):
        ts.install()
    assert ts.installed() is None


@pytest.mark.parametrize("kw, match", [({"ninja": False}, "needs ninja"),
                                       ({"cuda_home": None}, "CUDA toolkit's headers"),
                                       ({"error": RuntimeError("g++: fatal error: no input")},
                                        "could not be built against torch 2.11.0.*g\\+\\+: fatal error")])
def test_build_errors_are_specific_and_cache_nothing(fake_torch, kw, match):
    _, ext = fake_torch(**kw)
    with pytest.raises(ts.ShimBuildError, match=match):
        ts.build()
    assert ts.build.cache_info().currsize == 0  # a later call tries again
    ext.ninja, ext.CUDA_HOME, ext.error = True, "/cuda", None
    before = len(ext.loads)
    assert ts.build() is ts.build()  # now it builds, once
    assert len(ext.loads) == before + 1


def test_build_compiles_the_shim_source_with_the_engine_headers(fake_torch):
    _, ext = fake_torch()
    ts.build()
    kw = ext.loads[0]
    assert kw["name"] == ts.MODULE_NAME and kw["with_cuda"] is True
    assert Path(kw["sources"][0]) == ts.SOURCE and ts.SOURCE.is_file()
    assert (Path(kw["extra_include_paths"][0]) / "engine.h").is_file()


@native_only
def test_install_uses_the_shim(fake_torch):
    _, ext = fake_torch()
    assert ts.install() is ts.InstallPath.SHIM
    assert ext.loads[-1] == ("install", gpumem.native.library_path())
    assert ts.installed() is ts.InstallPath.SHIM and ts.install() is ts.InstallPath.SHIM
    assert gt.installed()  # gpumem.torch's stats accessors accept the shim
    assert ts.pool_table() == [(0, 1, 0, 1, 2)]


def test_install_falls_back_to_the_c_hooks_with_one_warning(fake_torch, monkeypatch, caplog):
    fake_torch(ninja=False)
    calls = []
    monkeypatch.setattr(gt, "install", lambda *a: calls.append(a))
    with caplog.at_level(logging.WARNING, logger="gpumem.torch_shim"):
        assert ts.install() is ts.InstallPath.CTYPES
        assert ts.install() is ts.InstallPath.CTYPES
    assert calls == [()]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "needs ninja" in warnings[0].getMessage()
    assert "two C hooks" in warnings[0].getMessage()
    with pytest.raises(GpumemError, match="two C hooks"):
        ts.mem_pool()
    with pytest.raises(GpumemError, match="not installed"):
        ts.pool_table()


def _c_hooks_torch(torch):
    """The parts of torch gpumem.torch's install touches, on the fake: what PyTorch takes is listed."""
    taken = []
    torch.cuda.is_available = lambda: True
    torch.cuda.memory = types.SimpleNamespace(CUDAPluggableAllocator=lambda *a: ("pluggable", a),
                                              change_current_allocator=taken.append)
    return taken


@pytest.fixture
def no_install_env(monkeypatch):
    for name in (gt.TRACE_OUT_ENV, gt.STEP_MARKS_ENV):
        monkeypatch.delenv(name, raising=False)


@native_only
def test_the_shim_after_the_c_hooks_says_so_and_stays_on_them(fake_torch, caplog, no_install_env):
    """Attacker 39: gpumem.torch.install() first, then gpumem.torch_shim.install(): PyTorch refused the second
    allocator and the shim said "called too late", when gpumem was PyTorch's allocator all along. Now the shim
    says what happened and reports the C hooks (InstallPath.CTYPES), building nothing, even once CUDA started."""
    torch, ext = fake_torch()
    taken = _c_hooks_torch(torch)
    gt._installed_allocator.cache_clear()
    try:
        gt._installed_allocator()            # what gpumem.torch.install() makes
        torch.cuda.is_initialized = lambda: True   # the program allocated since
        with caplog.at_level(logging.WARNING, logger="gpumem.torch_shim"):
            assert ts.install() is ts.InstallPath.CTYPES
            assert ts.install() is ts.InstallPath.CTYPES
    finally:
        gt._installed_allocator.cache_clear()
    assert len(taken) == 1 and ext.loads == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "gpumem.torch.install() came first" in warnings[0]


@native_only
def test_the_shim_loses_a_race_to_the_c_hooks_without_too_late(fake_torch, caplog, no_install_env):
    """Install-order review: another thread's gpumem.torch.install() while the shim was being built (minutes, the
    first time) made PyTorch refuse the shim, and the shim said "called too late". It says what happened."""
    torch, ext = fake_torch()
    taken = _c_hooks_torch(torch)

    def build_while_the_other_thread_installs(verbose=False):
        gt._installed_allocator()   # the other thread, during the build
        return types.SimpleNamespace(install=lambda path: (_ for _ in ()).throw(
            RuntimeError("Can't swap an already initialized allocator")))

    gt._installed_allocator.cache_clear()
    try:
        for race_at_build in (True, False):
            ts._installed.cache_clear()
            gt._installed_allocator.cache_clear()
            if race_at_build:   # the other thread done before the shim looks again
                build = build_while_the_other_thread_installs
            else:               # ... or between the shim's look and its swap: PyTorch refuses
                def build(verbose=False):
                    module = build_while_the_other_thread_installs()
                    real = gt._installed_allocator
                    gt._installed_allocator.cache_clear()   # not seen at the look, seen after the refusal
                    module.install = lambda path: (real(), (_ for _ in ()).throw(
                        RuntimeError("Can't swap an already initialized allocator")))
                    return module
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(ts, "build", build)
                with caplog.at_level(logging.WARNING, logger="gpumem.torch_shim"):
                    assert ts.install() is ts.InstallPath.CTYPES
    finally:
        gt._installed_allocator.cache_clear()
    assert taken and all(t[0] == "pluggable" for t in taken)
    assert all("gpumem.torch.install() came first" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)


@native_only
def test_the_c_hooks_after_the_shim_make_no_second_allocator(fake_torch, monkeypatch, no_install_env):
    """gpumem.torch.install() after the shim (a library calling one, the program the other) made a second
    pluggable allocator, which PyTorch refused as "called too late". gpumem is PyTorch's allocator already:
    install() goes on with what it adds (step marks, the trace at exit) and makes none."""
    fake_torch()
    assert ts.install() is ts.InstallPath.SHIM
    import functools

    made = []
    monkeypatch.setattr(gt, "_installed_allocator", functools.cache(lambda: made.append(1)))
    gt.install()
    assert made == [] and gt.installed()


def test_install_after_cuda_started_is_too_late_and_changes_nothing(fake_torch):
    torch, ext = fake_torch()
    torch.cuda.is_initialized = lambda: True
    with pytest.raises(gt.TooLateError, match="before the first CUDA tensor"):
        ts.install()
    assert ts.installed() is None and ext.loads == []


def test_mem_pool_needs_a_pytorch_with_mempool(fake_torch):
    torch, _ = fake_torch()
    del torch.cuda.MemPool
    with pytest.raises(BackendUnavailableError, match="no torch.cuda.MemPool"):
        ts.mem_pool()


def test_pool_table_before_install_is_an_error():
    with pytest.raises(GpumemError, match=r"gpumem.torch_shim.install\(\)"):
        ts.pool_table()


# -- the native functions the shim calls ------------------------------------------------------------
@pytest.fixture(scope="module")
def lib():
    if gpumem.engine() != "native":
        pytest.skip("gpumem's native engine is not built")
    lib = ctypes.CDLL(gpumem.native.library_path())
    lib.gpumem_torch_pool_new.restype = ctypes.c_void_p
    lib.gpumem_torch_pool_new.argtypes = [ctypes.c_int]
    lib.gpumem_torch_pool_last_error.restype = ctypes.c_char_p
    lib.gpumem_torch_device_engine.restype = ctypes.c_void_p
    lib.gpumem_torch_device_engine.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.gpumem_torch_pool_delete.argtypes = [ctypes.c_void_p]
    lib.gpumem_torch_engine_stats_size.restype = ctypes.c_uint64
    return lib


@native_only
def test_the_shim_functions_are_exported(lib):
    source = ts.SOURCE.read_text()
    for name in ("device_engine", "pool_new", "pool_engine", "pool_delete", "engine_malloc", "engine_free",
                 "engine_record_stream", "engine_stats", "engine_empty_cache", "engine_set_limit",
                 "engine_reset_peak", "engine_stats_size", "pool_last_error"):
        assert hasattr(lib, f"gpumem_torch_{name}"), name
        assert f'"gpumem_torch_{name}"' in source, name  # and the shim loads each one
    # EngineStats: 30 counters of 8 bytes (the shim refuses a library built with another layout)
    assert lib.gpumem_torch_engine_stats_size() == 30 * 8


@native_only
def test_the_shim_functions_without_a_driver(lib):
    if ctypes.util.find_library("cuda"):
        pytest.skip("this machine has libcuda")
    assert lib.gpumem_torch_pool_new(0) is None
    assert b"could not make a memory pool on CUDA device 0" in lib.gpumem_torch_pool_last_error()
    assert lib.gpumem_torch_device_engine(0, 1) is None  # no driver: no device engine either
    assert lib.gpumem_torch_pool_last_error()
    assert lib.gpumem_torch_pool_delete(None) == 0


# -- real PyTorch programs ---------------------------------------------------------------------------
@pytest.mark.cuda
def test_shim_hil_record(device_spec, tmp_path):
    if not device_spec.startswith("cuda:"):
        pytest.skip("needs a real CUDA device")
    if not HAVE_TORCH:
        pytest.skip("PyTorch is not installed")
    done = subprocess.run([sys.executable, str(ROOT / "hil" / "probes" / "torch_shim.py"), "--out-json",
                           str(tmp_path / "r.json"), "--out-md", str(tmp_path / "r.md")],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
