"""The ``gpumem`` command.

``gpumem devices [--json]``
    Real CUDA devices (through NVML, without creating a CUDA context) and every
    simulated profile, with total and free bytes.

``gpumem replay TRACE [--device SPEC] [--policy NAME] [--json]``
    Replay an allocation trace (PyTorch snapshot, RMM log or gpumem trace)
    through gpumem's caching allocator and report peak live and reserved bytes,
    overhead, out-of-memory errors and time per operation.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Sequence

from . import __version__
from .errors import GpumemError, TraceFormatError
from .units import format_bytes

log = logging.getLogger("gpumem")

EXIT_OK = 0
EXIT_OOM = 1
EXIT_USAGE = 2


def _device_rows() -> list[dict[str, Any]]:
    from gpumem import sim

    rows: list[dict[str, Any]] = []
    try:
        from .cuda.nvml import list_cuda_devices
    except ImportError as exc:  # the adapter itself always imports; this guards partial installs
        log.debug("no CUDA listing: %s", exc)
    else:
        for d in list_cuda_devices():
            rows.append({"spec": f"cuda:{d.index}", "kind": "cuda", "name": d.name, "total_bytes": d.total_bytes,
                         "free_bytes": d.free_bytes})
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


def cmd_devices(args: argparse.Namespace) -> int:
    rows = _device_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    print(f"{'SPEC':<24} {'KIND':<5} {'NAME':<36} {'TOTAL':>11} {'FREE':>11}")
    for r in rows:
        print(f"{r['spec']:<24} {r['kind']:<5} {r['name'][:36]:<36} {format_bytes(r['total_bytes']):>11} "
              f"{format_bytes(r['free_bytes']):>11}")
    if not any(r["kind"] == "cuda" for r in rows):
        print("(no CUDA device found: install gpumem[cuda12] or gpumem[cuda13] on a GPU machine to list them)")
    return EXIT_OK


def cmd_replay(args: argparse.Namespace) -> int:
    from .allocator import CachingAllocator
    from .replay import replay
    from .specs import open_device
    from .trace import load_trace, save_pytorch_snapshot

    try:
        trace = load_trace(args.trace)
    except FileNotFoundError:
        print(f"gpumem replay: no such trace file: {args.trace}", file=sys.stderr)
        return EXIT_USAGE
    except TraceFormatError as exc:
        print(f"gpumem replay: cannot read the trace: {exc}", file=sys.stderr)
        return EXIT_USAGE
    device = open_device(args.device)
    try:
        allocator = CachingAllocator(device, args.policy, limit=args.limit, record_history=bool(args.export_snapshot))
        result = replay(trace, allocator, stop_on_oom=True, progress=None if not args.json else False)
        summary = allocator.memory_summary()
        if args.export_snapshot:
            save_pytorch_snapshot(allocator.history(), args.export_snapshot)
        allocator.close()
    finally:
        device.close()
    if args.json:
        print(json.dumps(result.as_json(), indent=2))
    else:
        print(f"trace       {result.trace} ({result.n_ops:,} ops, {result.n_allocs:,} allocations)")
        print(f"device      {result.device}")
        print(f"policy      {result.policy}")
        print(f"peak live   {format_bytes(result.peak_live_bytes)}")
        print(f"peak reserv {format_bytes(result.peak_reserved_bytes)}")
        print(f"overhead    {result.overhead:.2%}")
        print(f"ooms        {result.ooms}")
        print(f"time        {result.wall_s:.2f} s wall, {result.ns_per_op:,.0f} ns per op")
        if args.summary:
            print(summary)
    if result.oom_message:
        print(f"gpumem replay: the trace does not fit {result.device}: stopped after {result.completed_ops:,} of "
              f"{result.n_ops:,} ops.\n{result.oom_message}", file=sys.stderr)
        return EXIT_OOM
    return EXIT_OK


def _limit(text: str) -> int | float:
    value = float(text)
    return value if 0 < value <= 1 and ("." in text or "e" in text.lower()) else int(value)


def build_parser() -> argparse.ArgumentParser:
    from .allocator.policy import DEFAULT_POLICY, POLICIES

    parser = argparse.ArgumentParser(
        prog="gpumem",
        description="GPU memory management, simulation first: list devices, replay allocation traces.",
        epilog="Device specs: 'sim:<profile>' (see `gpumem devices`), with options such as "
               "'sim:h200-141gb?pressure=spikes&seed=3', or 'cuda:<index>' for a real GPU.",
    )
    parser.add_argument("--version", action="version", version=f"gpumem {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("devices", help="list real CUDA devices and simulated profiles",
                       description="List real CUDA devices (via NVML, no CUDA context) and every simulated "
                                   "profile, with total and free bytes.")
    p.add_argument("--json", action="store_true", help="print a JSON list of {spec, kind, name, total_bytes, "
                                                       "free_bytes, ...}")
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("replay", help="replay an allocation trace through the caching allocator",
                       description="Replay an allocation trace (PyTorch snapshot .pickle[.gz], RMM log "
                                   ".csv[.gz], or gpumem .gmt[.gz]) through gpumem's caching allocator and "
                                   "report peak live bytes, peak reserved bytes, overhead "
                                   "(peak reserved / peak live - 1), OOMs and time per operation.")
    p.add_argument("trace", help="the trace file")
    p.add_argument("--device", default="sim:h200-141gb", help="device spec (default: %(default)s)")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                   help="allocator policy (default: %(default)s): " + "; ".join(
                       f"{name}: {pol.description}" for name, pol in POLICIES.items()))
    p.add_argument("--limit", type=_limit, default=None,
                   help="cap on reserved memory: bytes, or a fraction of the device such as 0.5")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--summary", action="store_true", help="also print the allocator's memory summary table")
    p.add_argument("--export-snapshot", metavar="PATH",
                   help="write what gpumem did as a PyTorch memory snapshot (open it in PyTorch's memory_viz)")
    p.set_defaults(func=cmd_replay)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except GpumemError as exc:
        print(f"gpumem {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
