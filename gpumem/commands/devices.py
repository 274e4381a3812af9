"""``gpumem devices``: real CUDA devices (through NVML, without a CUDA context) and every simulated
profile, with total and free bytes, and which allocator engine gpumem runs on."""

from __future__ import annotations

import argparse
import json
from typing import Any

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


def _no_cuda_reason() -> str:
    """Why no CUDA device is listed, as backend discovery found it: the extra missing, no driver, no GPU..."""
    from ..discovery import BackendKind, discover_backends

    cuda = next((b for b in discover_backends() if b.kind is BackendKind.CUDA), None)
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
