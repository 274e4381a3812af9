"""gpumem.torch: PyTorch on gpumem's native engine.

Without a GPU: the import guards, the errors, and the C functions PyTorch loads (called through
ctypes, no CUDA needed for the paths tested). On a real device (``--gpumem-device cuda:0``): real
PyTorch programs, each in a fresh process (PyTorch takes its allocator once, before CUDA starts):
see ``torch_child.py``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpumem
import gpumem.torch as gt
from gpumem.errors import BackendUnavailableError, GpumemError, InvalidArgumentError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
HAVE_TORCH = importlib.util.find_spec("torch") is not None

native_only = pytest.mark.skipif(gpumem.engine() != "native", reason="gpumem's native engine is not built")


@pytest.mark.skipif(HAVE_TORCH, reason="PyTorch is installed")
def test_install_without_torch_says_so():
    with pytest.raises(BackendUnavailableError, match="PyTorch is not installed"):
        gt.install()
    assert not gt.installed()


def test_stats_before_install_are_an_error():
    assert not gt.installed()
    for call in (gt.memory_stats, gt.memory_summary, gt.empty_cache):
        with pytest.raises(GpumemError, match=r"call gpumem.torch.install\(\) first"):
            call(0)


@pytest.mark.parametrize("spec, index", [(0, 0), (3, 3), ("cuda:2", 2)])
def test_device_index(spec, index):
    assert gt._device_index(spec) == index


@pytest.mark.parametrize("bad", [-1, True, "cpu", "cuda:x", "cuda:-1", "mps:0", 1.5])
def test_bad_device_is_rejected(bad):
    with pytest.raises(InvalidArgumentError):
        gt._device_index(bad)


# -- the C functions PyTorch loads ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def lib():
    if gpumem.engine() != "native":
        pytest.skip("gpumem's native engine is not built")
    return gt._lib()


@native_only
def test_the_hooks_are_exported(lib):
    for name in (gt.ALLOC_FN, gt.FREE_FN, "gpumem_torch_stats", "gpumem_torch_empty_cache",
                 "gpumem_torch_record_stream", "gpumem_torch_start", "gpumem_torch_trace_wait_stream",
                 "gpumem_torch_releasable"):
        assert hasattr(lib, name), name


@native_only
def test_the_hooks_without_an_engine(lib):
    # no engine has started in this process: nothing to report, release or record; a null free is a no-op
    if lib.gpumem_torch_engine_state(0) != 0:
        # a suite run before this one in the same process (tests/cuda_adapter on a GPU) made device 0's engine
        pytest.skip("an engine already runs on CUDA device 0 in this process")
    names = lib.gpumem_torch_stat_names().decode().split(",")
    assert len(names) == len(set(names)) and "peak_reserved_nbytes" in names
    out = (ctypes.c_uint64 * len(names))()
    assert lib.gpumem_torch_stats(0, out, len(names)) == 0
    released = ctypes.c_uint64(7)
    assert lib.gpumem_torch_empty_cache(0, ctypes.byref(released)) == 0 and released.value == 0
    releasable = ctypes.c_uint64(7)
    assert lib.gpumem_torch_releasable(0, 1, ctypes.byref(releasable)) == 0 and releasable.value == 0
    assert lib.gpumem_torch_record_stream(ctypes.c_void_p(0x1000), None) == -1
    assert b"no gpumem engine has started" in lib.gpumem_torch_last_error()
    assert lib.gpumem_torch_engine_state(-1) == -1 and lib.gpumem_torch_engine_state(5) == 0
    free = lib.gpumem_torch_free
    free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free(None, 0, 0, None)
    malloc = lib.gpumem_torch_malloc
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    assert malloc(0, 0, None) is None  # zero-size tensors get no memory


@native_only
def test_trace_and_configure_hooks_without_an_engine(lib):
    # tracing toggles without an engine; reading a device that has none is a clear error
    assert hasattr(lib, "gpumem_torch_trace") and hasattr(lib, "gpumem_torch_trace_read")
    lib.gpumem_torch_trace(1)
    lib.gpumem_torch_trace(0)
    # a wait is traced for any device in range, engine or not (nothing is recorded while tracing is off)
    assert lib.gpumem_torch_trace_wait_stream(0, ctypes.c_void_p(0x10), ctypes.c_void_p(0x20)) == 0
    assert lib.gpumem_torch_trace_wait_stream(-1, None, None) == -1
    assert b"device -1 out of range" in lib.gpumem_torch_last_error()
    assert lib.gpumem_torch_trace_read(7, None, 0) == -1
    assert b"no engine on CUDA device 7" in lib.gpumem_torch_last_error()
    with pytest.raises(GpumemError, match=r"call gpumem.torch.install\(\) first"):
        gt.recorded_trace(0)
    # the engine refuses values out of range (nothing changes); a valid policy is taken
    for bad in [(2, 0.0, 0.5, 0.0, 1, 0.05, 1), (1, 1.5, 0.5, 0.0, 1, 0.05, 1), (1, 0.0, -0.1, 0.0, 1, 0.05, 1),
                (1, 0.0, 0.5, -0.1, 1, 0.05, 1), (1, 0.0, 0.5, 1.5, 1, 0.05, 1), (1, float("nan"), 0.5, 0.0, 1, 0.05, 1),
                (1, 0.0, 0.5, 0.0, 1, -1.0, 1), (1, 0.0, 0.5, 0.0, 1, float("nan"), 1), (1, 0.0, 0.5, 0.0, 1, 0.05, 2),
                (1, 0.0, 0.5, 0.0, 2, 0.05, 1), (1, 0.0, 0.5, 0.0, -1, 0.05, 1)]:   # steal_empty_pages 0 or 1 too
        assert lib.gpumem_torch_configure(*bad, 0, 1, 0, 0, 1, 1, 0) == -1, bad
        assert b"growth must be 0 or 1" in lib.gpumem_torch_last_error()
    # plan_warmup, wait_own_stream, warmup_give_back, steal_after_warmup, steal_before_warmup, wait_on_gpu
    for bad_bools in [(2, 0, 0, 1, 1, 0), (0, 2, 0, 1, 1, 0), (0, -1, 0, 1, 1, 0), (0, 0, 2, 1, 1, 0),
                      (1, 1, -1, 1, 1, 0), (1, 1, 1, 2, 1, 0), (0, 0, 0, -1, 1, 0), (0, 0, 0, 1, 2, 0),
                      (1, 1, 1, 1, -1, 0), (0, 0, 0, 1, 1, 2), (0, 0, 0, 1, 1, -1)]:
        assert lib.gpumem_torch_configure(1, 0.0, 0.5, 0.0, 1, 0.05, 1, 0, *bad_bools) == -1, bad_bools
        assert (b"plan_warmup, wait_own_stream, warmup_give_back, steal_after_warmup, steal_before_warmup and "
                b"wait_on_gpu 0 or 1" in lib.gpumem_torch_last_error())
    # AllocatorPolicy's ranges are the engine's: the ends are taken (attacker 9, F3)
    assert lib.gpumem_torch_configure(1, 1.0, 0.0, 1.0, 1, 0.05, 1, 0, 0, 1, 1, 0, 0, 1) == 0
    assert lib.gpumem_torch_plan_warmup(1) == 0 and lib.gpumem_torch_plan_warmup(0) == 0   # no engine: nothing to do
    for bad in (2, -1, 7):   # 0 or 1, as configure's plan_warmup (review attacker 14, F4)
        assert lib.gpumem_torch_plan_warmup(bad) == -1, bad
        assert b"on must be 0 or 1" in lib.gpumem_torch_last_error()
    gt.configure("gpumem")
    with pytest.raises(InvalidArgumentError, match="unknown allocator policy"):
        gt.configure("nope")


@native_only
def test_starting_without_a_driver_is_a_clear_error(lib):
    if ctypes.util.find_library("cuda"):
        pytest.skip("this machine has libcuda")
    assert lib.gpumem_torch_start(0) == -1
    assert b"libcuda.so.1" in lib.gpumem_torch_last_error()
    assert lib.gpumem_torch_engine_state(0) == -1  # the failure is remembered


# -- real PyTorch programs (H200) -----------------------------------------------------------------------
def _child(scenario: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(HERE / "torch_child.py"), scenario], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0 and f"PASS {scenario}" in done.stdout, done.stdout + done.stderr
    return done.stdout


@pytest.mark.cuda
@pytest.mark.parametrize("scenario", ["work_matches_cpu", "oom_is_torch_oom", "too_late", "streams", "trace",
                                      "trace_gpu_clock", "trace_out_env", "step_marks_env", "step_marks_off_env",
                                      "graph_capture_refused", "shim_after_c_hooks", "c_hooks_after_shim"])
def test_pytorch_on_gpumem(scenario, device_spec):
    if not device_spec.startswith("cuda:"):
        pytest.skip("needs a real CUDA device")
    if not HAVE_TORCH:
        pytest.skip("PyTorch is not installed")
    if gpumem.engine() != "native":
        pytest.fail("gpumem's native engine is not built: PyTorch cannot run on gpumem")
    _child(scenario)


@pytest.mark.parametrize("policy, field", [("bestfit", "vmm"), ("pytorch", "segment_rule"),
                                           ("expandable", "large_page_nbytes"), ("round", "round_nbytes")])
def test_configure_refuses_a_policy_the_engine_cannot_run(policy, field):
    """configure() once took any policy and passed on only the growth knobs: the engine then ran
    something else than asked, silently. Now a field other than those knobs must be the default's."""
    import dataclasses

    from gpumem.allocator.policy import get_policy

    pol = dataclasses.replace(get_policy("gpumem"), round_nbytes=1 << 20) if policy == "round" else policy
    with pytest.raises(InvalidArgumentError, match=f"default policy's .*{field}"):
        gt.configure(pol)


# -- CUDA graph capture under the two C functions (Note [No graph capture through two C functions]) -------------
def _stand_in_torch(with_graphs_module: bool = True):
    """A stand-in for the parts of ``torch`` the refusal touches: a CUDAGraph whose capture_begin, a graph context
    manager whose __enter__ (which switches the current stream first, as PyTorch's does) and a
    make_graphed_callables (which runs warm-up passes first) record what they did."""
    import types

    calls = []

    class _CBase:   # PyTorch's C base class: capture_begin inherited from it
        def capture_begin(self, pool=None, capture_error_mode="global"):
            calls.append("capture_begin")

    class CUDAGraph(_CBase):
        pass

    class graph:
        def __init__(self, cuda_graph):
            self.cuda_graph = cuda_graph

        def __enter__(self):
            calls.append("stream switched")
            self.cuda_graph.capture_begin()

        def __exit__(self, *exc):
            calls.append("capture_end")

    def make_graphed_callables(callables, sample_args):
        calls.append("warm-up passes")
        with graph(CUDAGraph()):
            pass

    names = dict(CUDAGraph=CUDAGraph, graph=graph, make_graphed_callables=make_graphed_callables)
    cuda = types.SimpleNamespace(**names)
    if with_graphs_module:
        cuda.graphs = types.SimpleNamespace(**names)
    return types.SimpleNamespace(cuda=cuda), calls


@pytest.mark.parametrize("with_graphs_module", [True, False])
def test_graph_capture_is_refused_before_anything_happens(with_graphs_module):
    """Live on the H200 a capture under gpumem.torch failed only at capture_end, with CUDA's "operation failed due
    to a previous error during capture", and one that allocated nothing on the engine's slow path would have
    handed the graph's memory to other tensors. Now every door raises gpumem's error first, with nothing done
    (make_graphed_callables included: its warm-up passes would update BatchNorm statistics; attacker 39)."""
    from gpumem.errors import UnsupportedOperationError

    torch, calls = _stand_in_torch(with_graphs_module)
    gt._refuse_graph_capture(torch)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(UnsupportedOperationError, match=r"gpumem\.torch_shim\.install\(\)"):
        g.capture_begin(pool=None, capture_error_mode="global")
    with pytest.raises(UnsupportedOperationError, match="private graph pool"):
        with torch.cuda.graph(g):
            calls.append("captured work")
    modules = [torch.cuda] + ([torch.cuda.graphs] if with_graphs_module else [])
    for module in modules:
        with pytest.raises(UnsupportedOperationError):
            module.make_graphed_callables((), ())
        with pytest.raises(UnsupportedOperationError):
            module.graph(g).__enter__()
    assert calls == []   # no stream switched, nothing captured, no warm-up pass, no capture_end
    assert torch.cuda.CUDAGraph.capture_begin.__name__ == "capture_begin"   # wrapped, not renamed


def test_graph_capture_refusal_skips_what_this_torch_lacks():
    """A PyTorch without CUDA graphs (or a stand-in without them) is left as it is, with no error at install."""
    import types

    torch = types.SimpleNamespace(cuda=types.SimpleNamespace())
    gt._refuse_graph_capture(torch)
    assert vars(torch.cuda) == {}


def test_graph_capture_refusal_never_fails_the_install(caplog):
    """The refusal is put in after PyTorch took gpumem's allocator: a door that cannot be found or wrapped is
    logged, never raised (a raise there left gpumem installed but install() failed, and a retry said TooLateError;
    attacker 39)."""
    import types

    class Frozen(type):
        def __setattr__(cls, name, value):
            raise TypeError("frozen class")

    class CUDAGraph(metaclass=Frozen):
        def capture_begin(self):
            return "captured"

    class Exploding:
        def __getattr__(self, name):
            raise RuntimeError("no such thing here")

    with caplog.at_level("WARNING", logger="gpumem.torch"):
        gt._refuse_graph_capture(types.SimpleNamespace(cuda=types.SimpleNamespace(CUDAGraph=CUDAGraph)))
        gt._refuse_graph_capture(types.SimpleNamespace(cuda=Exploding()))
    assert CUDAGraph().capture_begin() == "captured"   # left as it was, and said so
    said = [r.getMessage() for r in caplog.records]
    assert any("could not refuse CUDA graph capture at CUDAGraph.capture_begin (frozen class)" in m for m in said)
    assert any("could not look at graphs" in m and "no such thing here" in m for m in said)


def test_one_unreadable_door_leaves_the_others_guarded(caplog):
    """Re-check 39: a lookup that raised something else than AttributeError (a lazy attribute) made the whole
    search fail, so no door was guarded. Now only that door is skipped (and said). A door that is a static or a
    class method stays one, so a call let through (the shim's guard) binds as before."""
    import types

    from gpumem.errors import UnsupportedOperationError

    torch, calls = _stand_in_torch(with_graphs_module=False)

    class Lazy(types.SimpleNamespace):
        def __getattribute__(self, name):
            if name == "make_graphed_callables":
                raise ImportError("a lazy import that fails")
            return super().__getattribute__(name)

    class StaticGraph:
        @staticmethod
        def capture_begin(pool=None):
            calls.append(("static", pool))

    torch.cuda = Lazy(**vars(torch.cuda))
    torch.cuda.graphs = types.SimpleNamespace(CUDAGraph=StaticGraph)
    with caplog.at_level("WARNING", logger="gpumem.torch"):
        gt._refuse_graph_capture(torch)
    assert any("make_graphed_callables" in r.getMessage() for r in caplog.records)
    for g in (torch.cuda.CUDAGraph(), StaticGraph()):
        with pytest.raises(UnsupportedOperationError):
            g.capture_begin(pool=1)
    assert isinstance(vars(StaticGraph)["capture_begin"], staticmethod)
    gt._installed_through_shim()
    try:
        StaticGraph().capture_begin(pool=1)   # let through: bound as the static method it was
    finally:
        gt._installed_through_shim.cache_clear()
    assert calls == [("static", 1)]


def test_graph_capture_goes_through_where_the_shim_is_the_allocator():
    """A guard: PyTorch lets no allocator take over from the two C functions, but were gpumem's C++ shim
    PyTorch's allocator, its graphs have pools of their own, and the wrapped doors pass through."""
    torch, calls = _stand_in_torch()
    gt._refuse_graph_capture(torch)
    gt._installed_through_shim()
    try:
        torch.cuda.CUDAGraph().capture_begin()
    finally:
        gt._installed_through_shim.cache_clear()
    assert calls == ["capture_begin"]


@native_only
def test_install_refuses_graph_capture(monkeypatch):
    """install() itself puts the refusal in, once PyTorch took the two C functions."""
    import types

    from gpumem.errors import UnsupportedOperationError

    torch, calls = _stand_in_torch()
    taken = []
    torch.cuda.is_available = lambda: True
    torch.cuda.is_initialized = lambda: False
    torch.cuda.memory = types.SimpleNamespace(CUDAPluggableAllocator=lambda *a: ("pluggable", a),
                                              change_current_allocator=taken.append)
    monkeypatch.setattr(gt, "_torch", lambda who="gpumem.torch": torch)
    gt._installed_allocator.cache_clear()
    try:
        gt._installed_allocator()
        assert taken and taken[0][0] == "pluggable"
        with pytest.raises(UnsupportedOperationError):
            torch.cuda.CUDAGraph().capture_begin()
    finally:
        gt._installed_allocator.cache_clear()
    assert calls == []
