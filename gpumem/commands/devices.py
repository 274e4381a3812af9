"""``gpumem devices``: real CUDA devices (through NVML, without a CUDA context) and every simulated
profile, with total and free bytes, and which allocator engine gpumem runs on."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import glob
import json
import os
import shutil
import sys
from typing import Any, Callable

from ..units import format_bytes
from ._common import EXIT_OK, _add_verbose, log


def _device_rows() -> list[dict[str, Any]]:
    from gpumem import sim

    rows: list[dict[str, Any]] = []
    try:
        from ..cuda.nvml import list_cuda_devices
    except ImportError as exc:  # the adapter itself always imports; this guards partial installs
        log.debug("no CUDA listing: %s", exc)
    else:
        for d in list_cuda_devices():
            # NVML lists without a CUDA context; whether the device has VMM needs one: unknown (None)
            rows.append({"spec": f"cuda:{d.index}", "kind": "cuda", "name": d.name, "total_bytes": d.total_bytes,
                         "free_bytes": d.free_bytes, "vmm_supported": None})
    for profile in sim.BUILTIN_PROFILES:
        dev = sim.SimDevice(profile)
        info = dev.mem_info()
        props = dev.properties()
        dev.close()
        rows.append({
            "spec": profile.spec, "kind": "sim", "name": props.name, "total_bytes": info.total_nbytes,
            "free_bytes": info.free_nbytes, "compute_capability": list(props.compute_capability),
            "unified_memory": props.unified_memory, "vmm_supported": props.vmm_supported,
        })
    return rows


#: What `gpumem devices` and `gpumem info` say where the CUDA backend is unavailable and nothing on the machine
#: shows an NVIDIA GPU (Note [The install hint needs a GPU]).
NO_GPU_REASON = "no NVIDIA GPU found on this machine (no /dev/nvidia* device, no nvidia-smi, no NVIDIA driver library)"

_NVML_LIBRARIES = ("nvml.dll",) if sys.platform == "win32" else ("libnvidia-ml.so.1", "libnvidia-ml.so")


def nvidia_gpu_present(*, dev_dir: str = "/dev", which: Callable[[str], str | None] = shutil.which,
                       load: Callable[[str], Any] = ctypes.CDLL) -> bool:
    """Whether this machine shows a sign of an NVIDIA GPU: a device node ``/dev/nvidia<N>``, ``nvidia-smi`` on
    the ``PATH``, or the driver's NVML library loading (which also covers WSL, where the GPU is no
    ``/dev/nvidia<N>``). Nothing is initialised (no NVML session, no CUDA context). ``dev_dir``, ``which`` and ``load``
    replace the device folder, ``shutil.which`` and ``ctypes.CDLL`` (tests)."""
    if glob.glob(os.path.join(dev_dir, "nvidia[0-9]*")):
        return True
    if which("nvidia-smi"):
        return True
    for name in _NVML_LIBRARIES:
        try:
            load(name)
        except OSError:
            continue
        return True
    return False


def without_misleading_hint(backends: list[Any], *, gpu_present: Callable[[], bool] | None = None) -> list[Any]:
    """``backends`` (a :func:`gpumem.discovery.discover_backends` result) with the CUDA backend's reason
    replaced by :data:`NO_GPU_REASON` where it tells to install a CUDA extra but the machine has no sign of
    an NVIDIA GPU (Note [The install hint needs a GPU])."""
    from ..cuda.backend import INSTALL_HINT
    from ..discovery import BackendKind

    out = []
    for b in backends:
        if (b.kind is BackendKind.CUDA and not b.available and not b.devices and INSTALL_HINT in b.reason
                and not (gpu_present or nvidia_gpu_present)()):
            b = dataclasses.replace(b, reason=NO_GPU_REASON)
        out.append(b)
    return out


def _no_cuda_reason() -> str:
    """Why no CUDA device is listed, as backend discovery found it: the extra missing, no driver, no GPU...

    Note [The install hint needs a GPU]: where nvidia-ml-py is missing, discovery's reason ends in
    'pip install "gpumem[cuda12]"'; on a machine without an NVIDIA GPU that advice leads nowhere (the extra
    installs, and still no GPU is listed). So the hint is given only where the machine shows a GPU
    (:func:`nvidia_gpu_present`); elsewhere the reason says that no NVIDIA GPU was found."""
    from ..discovery import BackendKind, discover_backends

    cuda = next((b for b in without_misleading_hint(discover_backends()) if b.kind is BackendKind.CUDA), None)
    if cuda is None or not cuda.reason:
        return "CUDA backend discovery found none"
    return cuda.reason


def cmd_devices(args: argparse.Namespace) -> int:
    """``gpumem devices``: print the device table (or JSON list); returns the exit status."""
    from ..native import engine

    rows = _device_rows()
    which = engine()  # "native" or "python" (the allocator engine gpumem runs on in this install)
    if args.json:
        # Note [The engine in the JSON list]: the list stays a list of devices (what scripts parse);
        # each row says which engine gpumem's default policy would allocate on it with: the native
        # engine is the default in virtual-memory mode only, so devices without VMM run on the Python engine. A CUDA row
        # (vmm_supported None: unknown until a context exists) names the engine the allocator will try.
        print(json.dumps([{**r, "engine": "python" if r.get("vmm_supported") is False else which} for r in rows],
                         indent=2))
        return EXIT_OK
    print(f"{'SPEC':<24} {'KIND':<5} {'NAME':<36} {'TOTAL':>11} {'FREE':>11}")
    for r in rows:
        print(f"{r['spec']:<24} {r['kind']:<5} {r['name'][:36]:<36} {format_bytes(r['total_bytes']):>11} "
              f"{format_bytes(r['free_bytes']):>11}")
    if not any(r["kind"] == "cuda" for r in rows):
        print(f"(no CUDA device listed: {_no_cuda_reason()})")
    print(f"engine: {which}" + (" (devices without virtual memory management run on the python engine)"
                                if which == "native" and any(r.get("vmm_supported") is False for r in rows) else ""))
    return EXIT_OK


def register(sub: Any, formatter_class: Any) -> None:
    """Add ``gpumem devices`` to the subcommands."""
    raw = formatter_class
    p = sub.add_parser("devices", help="list real CUDA devices and simulated profiles", formatter_class=raw,
                       description="List real CUDA devices (via NVML, no CUDA context) and every simulated "
                                   "profile, with total and free bytes, and which allocator engine gpumem runs on "
                                   "(native: the C++ engine; python: the pure-Python one).",
                       epilog="exit status: 0 done.")
    p.add_argument("--json", action="store_true", help="print a JSON list of {spec, kind, name, total_bytes, "
                                                       "free_bytes, engine, ...}")
    _add_verbose(p)
    p.set_defaults(func=cmd_devices)
