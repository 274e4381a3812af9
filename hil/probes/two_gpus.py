"""CuPy and PyTorch on gpumem across two GPUs (issue 19): each array gets its own device's memory, and
copies between the devices work.

    python -m hil.probes.two_gpus --out-json R.json --out-md R.md [--iterations 2000]

CuPy calls the installed allocator for whatever device is current. An allocator that reads the device
once, at install, hands device 0's memory to an array of device 1. For each of gpumem's two CuPy paths
(the native hook over the driver, and the Python ``CachingAllocator`` over gpumem's CUDA adapter), this
probe, on a machine with two or more GPUs:

* makes an array under ``cupy.cuda.Device(d)`` for each device and checks that the driver says its
  pointer lives on ``d`` (``pointerGetAttributes``), that arithmetic on it is right, and that a copy to
  the other device reads the same values;
* runs one thread per device at once, each allocating, filling, checking and freeing arrays of
  mixed sizes on its own device (``--iterations`` each);
* runs gpumem's consistency check of every device the hook allocated on (``check_installed``);

and, in a child process (PyTorch takes gpumem's allocator before it touches the GPU), under
``gpumem.torch_shim.install()``: a tensor made on ``cuda:0`` copied ``.to("cuda:1")`` and back, values
compared. gpumem's memory is mapped with ``cuMemMap``, which another GPU can read only where
``cuMemSetAccess`` named it (Note [Peers read mapped memory] in ``gpumem/_native/cuda_backend.cpp``).

Exit status: 0 every check passed; 1 a check failed; 2 fewer than two GPUs or CuPy missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable


@dataclasses.dataclass
class Check:
    path: str
    name: str
    ok: bool
    detail: str


def _placement(cupy: Any, path: str, n_devices: int) -> list[Check]:
    out = []
    for d in range(n_devices):
        with cupy.cuda.Device(d):
            a = cupy.arange(1 << 20, dtype=cupy.float32)
            where = cupy.cuda.runtime.pointerGetAttributes(a.data.ptr).device
            total = float((a * 2).sum())
        other = (d + 1) % n_devices
        with cupy.cuda.Device(other):
            b = cupy.asarray(a)              # a copy between devices
            b_where = cupy.cuda.runtime.pointerGetAttributes(b.data.ptr).device
            same = bool(cupy.array_equal(b, cupy.arange(1 << 20, dtype=cupy.float32)))
        expected = float((1 << 20) * ((1 << 20) - 1))
        out.append(Check(path, f"array made under Device({d}) lives on device {d}", where == d,
                         f"driver says device {where}"))
        out.append(Check(path, f"arithmetic on device {d}", total == expected, f"sum {total} (expected {expected})"))
        out.append(Check(path, f"copy from device {d} to device {other}", b_where == other and same,
                         f"copy on device {b_where}, values equal: {same}"))
    return out


def _threads(cupy: Any, path: str, n_devices: int, iterations: int) -> list[Check]:
    errors: dict[int, list[str]] = {d: [] for d in range(n_devices)}

    def work(d: int) -> None:
        try:
            with cupy.cuda.Device(d):
                for i in range(iterations):
                    n = 1 + (i * 7919) % (1 << 18)
                    x = cupy.full(n, i % 251, dtype=cupy.int32)
                    if cupy.cuda.runtime.pointerGetAttributes(x.data.ptr).device != d:
                        errors[d].append(f"iteration {i}: memory of another device")
                        return
                    if int(x.sum()) != n * (i % 251):
                        errors[d].append(f"iteration {i}: wrong sum")
                        return
                    del x
        except Exception as exc:  # noqa: BLE001 - reported as a failed check
            errors[d].append(f"{type(exc).__name__}: {exc}")

    for d in range(n_devices):   # compile and load CuPy's kernels on each device before timing
        with cupy.cuda.Device(d):
            int(cupy.full(3, 1, dtype=cupy.int32).sum())
    threads = [threading.Thread(target=work, args=(d,)) for d in range(n_devices)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall_s = time.perf_counter() - t0
    return [Check(path, f"thread on device {d}: {iterations} alloc/fill/check/free", not errors[d],
                  "; ".join(errors[d]) or f"{wall_s:.2f} s for all threads "
                  f"({wall_s / iterations * 1e6:.0f} µs per iteration)") for d in range(n_devices)]


def _checks(gca: Any, path: str, n_devices: int) -> list[Check]:
    checks = gca.check_installed()
    seen = {c.device for c in checks}
    out = [Check(path, f"consistency check, device {c.device} ({c.engine} engine)", c.ok,
                 "; ".join(c.problems) or f"allocated {c.allocated_nbytes} B, reserved {c.reserved_nbytes} B")
           for c in checks]
    out.append(Check(path, "the hook allocated on every device", seen >= set(range(n_devices)),
                     f"devices seen: {sorted(seen)}"))
    return out


def torch_child() -> int:
    """In a fresh process: PyTorch on gpumem's shim, copies between cuda:0 and cuda:1; prints JSON checks."""
    import gpumem.torch_shim as ts

    how = ts.install().value
    import torch

    out = []
    for src, dst in ((0, 1), (1, 0)):
        x = torch.arange(1 << 22, dtype=torch.float32, device=f"cuda:{src}")
        try:
            y = x.to(f"cuda:{dst}")
            z = (y * 2).to(f"cuda:{src}")
            torch.cuda.synchronize(src)
            torch.cuda.synchronize(dst)
            ok = y.device.index == dst and bool(torch.equal(z, x * 2))
            detail = f"installed through {how}; values equal: {ok}"
        except Exception as exc:  # noqa: BLE001 - reported as a failed check
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        out.append(dataclasses.asdict(Check("torch", f"tensor cuda:{src} -> cuda:{dst} -> cuda:{src}", ok, detail)))
    print(json.dumps(out))
    return 0


def _torch_checks() -> list[Check]:
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "hil.probes.two_gpus", "--torch-child"], capture_output=True,
                          text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return [Check("torch", "PyTorch child process", False, f"rc {proc.returncode}: {proc.stderr[-500:]}")]
    return [Check(**c) for c in json.loads(lines[-1])]


def run(iterations: int) -> tuple[list[Check], dict[str, Any]]:
    import cupy

    import gpumem.cupy_allocator as gca
    from gpumem.allocator import CachingAllocator
    from gpumem.native import engine
    from gpumem.specs import open_device

    n_devices = cupy.cuda.runtime.getDeviceCount()
    paths: dict[str, Callable[[], Any]] = {
        "python": lambda: gca.using(CachingAllocator(open_device("cuda:0"), gca.cupy_policy())),
    }
    if engine() == "native":
        paths = {"native": lambda: gca.using(), **paths}
    out: list[Check] = []
    for path, scope in paths.items():
        with cupy.cuda.Device(0), scope():
            out += _placement(cupy, path, n_devices)
            out += _threads(cupy, path, n_devices, iterations)
            for d in range(n_devices):
                cupy.cuda.Device(d).synchronize()
            out += _checks(gca, path, n_devices)
    try:
        import torch  # noqa: F401
        out += _torch_checks()
    except ImportError:
        pass
    meta = {"devices": n_devices, "cupy": cupy.__version__, "engine": engine(), "iterations": iterations,
            "device_names": [cupy.cuda.runtime.getDeviceProperties(d)["name"].decode() for d in range(n_devices)]}
    return out, meta


def render(checks: list[Check], meta: dict[str, Any]) -> str:
    lines = [f"# CuPy and PyTorch on gpumem across {meta['devices']} GPUs ({', '.join(sorted(set(meta['device_names'])))}, "
             f"CuPy {meta['cupy']}, engine {meta['engine']})", "",
             "| path | check | result | detail |", "|---|---|---|---|"]
    lines += [f"| {c.path} | {c.name} | {'PASS' if c.ok else 'FAIL'} | {c.detail} |" for c in checks]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hil.probes.two_gpus", description=__doc__.split("\n\n")[0])
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--torch-child"]:   # the PyTorch part, in a fresh process (see the module docstring)
        return torch_child()
    ap.add_argument("--out-json", type=Path, required=True, help="the checks and the machine, as JSON")
    ap.add_argument("--out-md", type=Path, required=True, help="the table of checks, as Markdown")
    ap.add_argument("--iterations", type=int, default=2000, help="allocations per thread and device")
    args = ap.parse_args(argv)
    if args.iterations < 1:
        print("--iterations must be at least 1", file=sys.stderr)
        return 2
    try:
        import cupy
    except ImportError:
        print("CuPy is not installed", file=sys.stderr)
        return 2
    if cupy.cuda.runtime.getDeviceCount() < 2:
        print(f"this probe needs two GPUs; this machine has {cupy.cuda.runtime.getDeviceCount()}", file=sys.stderr)
        return 2
    checks, meta = run(args.iterations)
    args.out_json.write_text(json.dumps({"meta": meta, "checks": [dataclasses.asdict(c) for c in checks]}, indent=1))
    text = render(checks, meta)
    args.out_md.write_text(text)
    print(text)
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
