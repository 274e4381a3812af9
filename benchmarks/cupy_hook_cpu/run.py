"""gpumem's CuPy hook without a GPU or CuPy: the hook's own cost per allocate+free, in µs and instructions.

The GPU benchmark (``benchmarks/cupy_hook_bench.py``) needs CuPy and a GPU. This one runs the native hook
(``gpumem.cupy_allocator.native_hook()``, the engine over the CUDA driver) in a child process whose
``libcuda.so.1`` is a stand-in (``fake_libcuda.c``: one device, calls of a few instructions) and whose
``cupy`` and ``cupy_backends`` are stand-ins (``fake_cupy.c``): ``UnownedMemory`` and ``MemoryPointer`` as
C types with CuPy 14.2's signatures, made and converted as Cython makes CuPy's, and the C functions CuPy
exports for the current stream (the same thread-local reads as CuPy's). What it measures is the hook's
work around the engine: the device and stream lookups, the owner, the integers and the two objects. A
real driver's calls cost more than these (the hook's device lookup, two driver calls then, measured
0.045 µs with its Python call on the H200).

Usage::

    python -m benchmarks.cupy_hook_cpu.run [--calls 200000 | --trace FILE [--passes 3]] [--callgrind]
                                           [--no-backends-capsule] [--check]

``--callgrind`` adds the instructions per hook call (``valgrind --tool=callgrind``, two runs of different
lengths, the difference divided by the calls between them). Exit status: 0 done; 1 no C compiler, or the
child failed (no native engine, for one).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import types
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent


def build(out: Path) -> None:
    """Compiles the stand-in driver and CuPy pieces into ``out``."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler (cc) to build the stand-in libcuda")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out / "libcuda.so.1"), str(HERE / "fake_libcuda.c")],
                   check=True)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", "-o",
                    str(out / "fake_cupy.so"), str(HERE / "fake_cupy.c")], check=True)


def _capsule(fn: Any, signature: bytes) -> Any:
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.cast(fn, ctypes.c_void_p), signature, None)


def fake_cupy(lib_dir: Path) -> tuple[Any, Any]:
    """Stand-in ``cupy`` and ``cupy_backends`` modules (what gpumem.cupy_allocator.native_hook reads)."""
    lib = ctypes.PyDLL(str(lib_dir / "fake_cupy.so"))
    local_cupy, local_backends = threading.local(), threading.local()
    local_cupy.tls = object()
    local_backends.tls = [0]           # device 0's current stream: the null stream
    lib.fake_set.argtypes = [ctypes.py_object, ctypes.py_object]
    if lib.fake_set(local_cupy, local_backends) != 0:
        raise SystemExit("fake_set failed")

    lib.fake_make_types.restype = ctypes.py_object
    UnownedMemory, MemoryPointer = lib.fake_make_types()   # C types, as Cython makes CuPy's

    class OutOfMemoryError(MemoryError):
        pass

    memory = types.SimpleNamespace(UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer,
                                   OutOfMemoryError=OutOfMemoryError)
    stream = types.SimpleNamespace(__pyx_capi__={
        "get_current_stream_ptr": _capsule(lib.fake_cupy_get_current_stream_ptr, b"intptr_t (void)")})
    backends_stream = types.SimpleNamespace(__pyx_capi__={
        "get_current_stream_ptr": _capsule(lib.fake_backends_get_current_stream_ptr, b"intptr_t (void)"),
        "get_stream_ptr": _capsule(lib.fake_backends_get_stream_ptr, b"intptr_t (int)")})
    cuda = types.SimpleNamespace(memory=memory, stream=stream, runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                 get_current_stream=lambda: types.SimpleNamespace(ptr=0))
    cupy = types.SimpleNamespace(cuda=cuda)
    backends = types.SimpleNamespace(cuda=types.SimpleNamespace(stream=backends_stream))
    return cupy, backends


def install_fakes(lib_dir: Path, backends_capsule: bool) -> Any:
    cupy, backends = fake_cupy(lib_dir)
    sys.modules["cupy"] = cupy   # type: ignore[assignment]
    if not backends_capsule:   # as CuPy 13: no get_stream_ptr
        del backends.cuda.stream.__pyx_capi__["get_stream_ptr"]
    sys.modules["cupy_backends"] = backends   # type: ignore[assignment]
    sys.modules["cupy_backends.cuda"] = backends.cuda   # type: ignore[assignment]
    sys.modules["cupy_backends.cuda.stream"] = backends.cuda.stream   # type: ignore[assignment]
    return cupy


def best_us(fn: Callable[[], Any], n: int) -> float:
    """µs per call: the best of 5 timings (``benchmarks/cupy_hook_bench.py``'s timer)."""
    from benchmarks.cupy_hook_bench import best_us as timed

    return timed(fn, n, repeats=5)


def replay_trace(hook: Any, trace: Path, passes: int, quiet: bool) -> None:
    """A growth pass of ``trace`` through ``hook``, then ``passes`` passes, as cupy_hook_bench replays it."""
    import importlib.util

    from gpumem.trace import load_trace

    spec = importlib.util.spec_from_file_location("cupy_hook_bench", HERE.parent / "cupy_hook_bench.py")
    if spec is None or spec.loader is None:
        raise SystemExit("cannot load benchmarks/cupy_hook_bench.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench   # its dataclasses look their module up
    spec.loader.exec_module(bench)
    kinds, ids, sizes, _ = load_trace(trace).as_lists()
    bench.replay(kinds, ids, sizes, hook)
    times = [bench.replay(kinds, ids, sizes, hook) for _ in range(passes)]
    if not quiet:
        print(f"{trace.name.split('.')[0]}: {len(kinds)} ops, µs per op of {passes} passes: "
              + " / ".join(f"{t:.3f}" for t in times))


def child(lib_dir: Path, calls: int, loop_only: bool, backends_capsule: bool, trace: Path | None,
          passes: int) -> None:
    cupy = install_fakes(lib_dir, backends_capsule)
    import gpumem.cupy_allocator as gca

    hook = gca.native_hook()
    if trace is not None:
        replay_trace(hook, trace, passes, loop_only)
        return
    mem = cupy.cuda.memory
    if loop_only:   # for callgrind: `calls` hook calls and nothing else
        hook(512)
        for _ in range(calls):
            hook(512)
        return
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("hook(512), dropped", lambda: hook(512)),
        ("  hook.current_device()", hook.current_device),
        ("  hook.current_stream()", hook.current_stream),
        ("  UnownedMemory + MemoryPointer (no owner)",
         lambda: mem.MemoryPointer(mem.UnownedMemory(1 << 40, 512, None, 0), 0)),
        ("python: empty lambda", lambda: None),
    ]
    by_device = getattr(hook, "reads_stream_by_device", lambda: False)()
    print(f"stream read in C: {hook.reads_stream_in_c()}, by device (cupy_backends' get_stream_ptr): {by_device}")
    print("| one allocate + free, 512 B | µs |\n|---|---|")
    for label, fn in cases:
        print(f"| {label} | {best_us(fn, calls):.3f} |")


def check(lib_dir: Path) -> None:
    """Behaviour through the stand-in driver: real blocks, CuPy's contract (raises AssertionError)."""
    cupy = install_fakes(lib_dir, True)
    import gpumem.cupy_allocator as gca

    hook = gca.native_hook()
    engine = gca._engine_module().CudaAllocator(0)
    base = engine.allocated_nbytes()
    assert hook.reads_stream_by_device()
    # sizes whose ints share a cache slot ((size >> 9) % 64), repeated, and sizes off the 512 B grid
    sizes = [512, 512 * 65, 512, 1, 513, 4096, 3 << 20, 512 * 65, 1000, 512 * 129, 4096]
    live = [hook(n) for n in sizes]
    for n, p in zip(sizes, live):
        assert p.mem.size == engine.block_size(p.ptr) and p.mem.size >= n and p.mem.size % 512 == 0, (n, p.mem.size)
        assert p.ptr == p.mem.ptr and p.device_id == p.mem.device_id == 0
    assert len({p.ptr for p in live}) == len(live)
    assert engine.allocated_nbytes() - base == sum(p.mem.size for p in live)
    del live, p
    assert engine.allocated_nbytes() == base

    mem = cupy.cuda.memory
    make = gca._engine_module().CupyAllocator
    capsule = sys.modules["cupy_backends.cuda.stream"].__pyx_capi__["get_stream_ptr"]

    class Refused:   # a MemoryPointer that fails: the block goes back
        def __init__(self, m: Any, offset: int) -> None:
            raise ValueError("refused")

    bad = make(lambda: 0, capsule, mem.UnownedMemory, Refused, lambda *a: MemoryError())
    for _ in range(3):
        try:
            bad(4096)
        except ValueError:
            pass
        else:
            raise AssertionError("the failing MemoryPointer's error was not raised")
    assert engine.allocated_nbytes() == base

    class Ptr:
        def __init__(self, m: Any, offset: int) -> None:
            self.mem, self.ptr, self.device_id = m, m.ptr + offset, m.device_id

    class KeepsArgs(Exception):   # BaseException keeps the argument tuple it is made with
        def __init__(self, ptr: int, size: int, owner: Any, device_id: int) -> None:
            self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

    keep = make(lambda: 0, capsule, KeepsArgs, Ptr, lambda *a: MemoryError())
    a, b = keep(512), keep(1024)
    assert a.mem.args[:2] == (a.ptr, 512) and a.mem.args[2] is a.mem.owner and b.mem.args[1] == 1024
    del a, b

    class PtrKeepsArgs(Exception):   # a MemoryPointer that keeps its tuple: a cycle through it is collected
        def __init__(self, m: Any, offset: int) -> None:
            self.ptr = m.ptr + offset

    class Mem:   # a Python UnownedMemory, which a cycle can go through
        def __init__(self, ptr: int, size: int, owner: Any, device_id: int) -> None:
            self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

    cyc = make(lambda: 0, capsule, Mem, PtrKeepsArgs, lambda *a: MemoryError())
    p = cyc(1 << 20)
    assert gc.is_tracked(p.args), "a kept argument tuple must be tracked by the garbage collector again"
    p.args[0].back = p               # p -> p.args -> its UnownedMemory -> p
    del p
    gc.collect()
    assert engine.allocated_nbytes() == base, "the block of a collected cycle must be freed"

    depth: list[Any] = []

    class Reenters:   # an UnownedMemory whose making allocates through the hook again
        def __init__(self, ptr: int, size: int, owner: Any, device_id: int) -> None:
            self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id
            if not depth:
                depth.append(None)
                depth[0] = reenter(2048)

    reenter = make(lambda: 0, capsule, Reenters, Ptr, lambda *a: MemoryError())
    outer = reenter(512)
    inner = depth.pop()
    assert (outer.mem.size, inner.mem.size) == (512, 2048) and outer.ptr != inner.ptr
    assert engine.allocated_nbytes() - base == 2560
    del outer, inner
    assert engine.allocated_nbytes() == base
    print("checks passed")


def callgrind_instructions(lib_dir: Path, env: dict[str, str], calls: int, extra: list[str],
                           trace: Path | None = None) -> float:
    """Instructions per hook call, or per operation of ``trace`` (3 passes less 1, over 2 passes of its ops)."""
    def total(n: int) -> int:
        what = ["--calls", str(n)] if trace is None else ["--trace", str(trace), "--passes", str(n)]
        with tempfile.TemporaryDirectory() as tmp:
            r = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out", sys.executable,
                                "-m", "benchmarks.cupy_hook_cpu.run", "--child", str(lib_dir), "--loop-only",
                                *what, *extra], env=env, capture_output=True, text=True, check=True)
        m = re.search(r"Collected : (\d+)", r.stderr)
        if not m:
            raise SystemExit("callgrind gave no total:\n" + r.stderr[-2000:])
        return int(m.group(1))

    if trace is None:
        return (total(2 * calls) - total(calls)) / calls
    from gpumem.trace import load_trace

    ops = len(load_trace(trace).as_lists()[0])
    return (total(3) - total(1)) / (2 * ops)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cupy_hook_cpu.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200_000, help="calls per timing (default 200000)")
    ap.add_argument("--callgrind", action="store_true", help="also count instructions per hook call (valgrind)")
    ap.add_argument("--no-backends-capsule", action="store_true",
                    help="hide cupy_backends' get_stream_ptr (as CuPy 13): the hook reads cupy.cuda.stream's function")
    ap.add_argument("--trace", type=Path, help="replay this trace through the hook instead of hook(512) "
                    "(a growth pass, then --passes passes; its allocations and frees, as cupy_hook_bench replays it)")
    ap.add_argument("--passes", type=int, default=3, help="timed passes of --trace (default 3)")
    ap.add_argument("--check", action="store_true",
                    help="instead of timing, check the hook's behaviour through the stand-ins (real blocks)")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--loop-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.calls <= 0 or args.passes <= 0:
        ap.error("--calls and --passes must be positive")
    if args.trace is not None and not args.trace.is_file():
        ap.error(f"--trace {args.trace}: no such file")
    if args.trace is not None:
        args.trace = args.trace.resolve()
    if args.child is not None:
        if args.check:
            check(args.child)
        else:
            child(args.child, args.calls, args.loop_only, not args.no_backends_capsule, args.trace, args.passes)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        lib_dir = Path(tmp)
        build(lib_dir)
        env = dict(os.environ, LD_LIBRARY_PATH=f"{lib_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}")
        if args.check:
            subprocess.run([sys.executable, "-m", "benchmarks.cupy_hook_cpu.run", "--child", str(lib_dir), "--check"],
                           env=env, check=True)
            return 0
        extra = ["--no-backends-capsule"] if args.no_backends_capsule else []
        what = ["--calls", str(args.calls)] if args.trace is None else ["--trace", str(args.trace), "--passes",
                                                                         str(args.passes)]
        cmd = [sys.executable, "-m", "benchmarks.cupy_hook_cpu.run", "--child", str(lib_dir), *what, *extra]
        subprocess.run(cmd, env=env, check=True)
        if args.callgrind:
            if shutil.which("valgrind") is None:
                print("no valgrind: no instruction count")
                return 0
            ir = callgrind_instructions(lib_dir, env, min(args.calls, 20_000), extra, args.trace)
            what_ir = "hook(512) call (allocate + free)" if args.trace is None else "operation of the trace"
            print(f"\ninstructions per {what_ir}, callgrind: {ir:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
