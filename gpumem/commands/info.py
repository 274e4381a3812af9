"""``gpumem info [--json]``: the backends this machine has (CUDA, simulated, CPU), their devices, and the best
available one (:mod:`gpumem.discovery`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ._common import EXIT_OK, _add_verbose


def cmd_info(args: argparse.Namespace) -> int:
    """``gpumem info``: print the backend summary (or, with ``--json``, one JSON object); returns the exit
    status."""
    from ..discovery import backends_as_json, discover_backends, format_backend_summary
    from .devices import without_misleading_hint

    # Note [The install hint needs a GPU] in gpumem/commands/devices.py
    backends = without_misleading_hint(discover_backends())
    if args.json:
        print(json.dumps(backends_as_json(backends), indent=2))
    else:
        print(format_backend_summary(backends))
    return EXIT_OK


def register(sub: Any, formatter_class: type[argparse.HelpFormatter]) -> None:
    """Add ``gpumem info`` to the ``gpumem`` subcommands."""
    p = sub.add_parser(
        "info", help="which backends (CUDA, simulated, CPU) this machine has, and the best available",
        formatter_class=formatter_class,
        description="List every memory backend and whether it can be used (an unavailable one says why: no\n"
                    "NVIDIA driver, nvidia-ml-py or CuPy missing, CUDA_VISIBLE_DEVICES hiding the GPUs...),\n"
                    "with its devices: total and free memory, compute capability (CC) and unified memory\n"
                    "('?' where it cannot be known without opening the GPU, which discovery avoids: NVML is\n"
                    "read without creating a CUDA context). The best available backend is a real GPU, else\n"
                    "the CPU; the simulator is memory only (no compute), so it is chosen only when asked for\n"
                    "(--device sim:<profile> elsewhere, or preference='sim' from Python).",
        epilog="exit status: 0 done.")
    p.add_argument("--json", action="store_true",
                   help='print one JSON object: {"backends": [{"backend", "available", "reason", "real_compute", '
                        '"devices": [{"spec", "name", "total_bytes", "free_bytes", "compute_capability", '
                        '"unified_memory", "vmm_supported"}]}], "best_available"}')
    _add_verbose(p)
    p.set_defaults(func=cmd_info)
