"""``gpumem workspace``: the GPU workspace of a quantized linear layer on a device, from its free memory now."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..units import format_bytes

_DESCRIPTION = """\
Size the GPU workspace of a quantized linear layer (in x out weights) from what the device has free now:
  dequant      in x out dequantized weights (fp16 for i2s and tl1, fp32 for tl2);
  per sample   out fp32 intermediates;
  usable       95% of the free memory left after the reserve (gpumem.managers.reserve);
  batch        what the usable memory holds after the dequantized weights, capped by the GPU's class
               (< 4 GB: 64, 4-8 GB: 128, 8-24 GB: 256, >= 24 GB: 512), at least 1;
  workspace    dequant + batch x per sample, clamped to [1 MiB, 64 GiB] and never above usable;
               the batch is then what the clamped workspace holds (below dequant + one sample, the
               kernel dequantizes in tiles, with a batch of 1).
Too little memory exits 1 with what was required and available; nothing falls back to a constant."""

_EXIT_MEANINGS = {
    0: "done",
    1: "not even the minimum workspace fits what is usable on the device (with --json: an error\n"
       "      object on stdout; the message on stderr)",
    2: "bad input: a bad option or device spec",
    3: "the device was lost while it was asked what it has free (with --json: an error object)",
    4: "another device error: the device could not be asked what it has free (with --json: an\n"
       "      error object)",
}
"""Exit status -> meaning for ``gpumem workspace --help`` (130 and 141 as for every command)."""


MAX_FEATURES = 2**31
"""The most ``--in-features``/``--out-features`` accepted: larger layers do not exist, and their sizes
(terabytes of dequantized weights) would only be printed as nonsense."""


def _features(text: str) -> int:
    value = _positive(text)
    if value > MAX_FEATURES:
        raise argparse.ArgumentTypeError(f"must be at most 2**31 ({MAX_FEATURES}), got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text!r}")
    return value


def register(sub: Any, formatter_class: Any) -> None:
    """Add the ``workspace`` subcommand to ``sub``."""
    from ._common import _DEFAULT_DEVICE, _add_verbose, _exit_codes_text

    p = sub.add_parser("workspace", help="size a quantized linear layer's GPU workspace from the device's free memory",
                       formatter_class=formatter_class, description=_DESCRIPTION,
                       epilog=_exit_codes_text(_EXIT_MEANINGS))
    p.add_argument("--in-features", type=_features, required=True, metavar="N",
                   help="the layer's input features (at most 2**31)")
    p.add_argument("--out-features", type=_features, required=True, metavar="M",
                   help="the layer's output features (at most 2**31)")
    p.add_argument("--qtype", choices=("i2s", "tl1", "tl2"), required=True, type=str.lower,
                   help="quantization type: i2s and tl1 dequantize to fp16, tl2 to fp32")
    p.add_argument("--device", default=_DEFAULT_DEVICE, help="device spec (default: %(default)s)")
    p.add_argument("--max-batch-size", type=_positive, default=None, metavar="B",
                   help="cap the batch below the GPU class's cap")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (workspace_bytes, batch_size, available_bytes, device, ...)")
    _add_verbose(p)
    p.set_defaults(func=cmd_workspace)


def cmd_workspace(args: argparse.Namespace) -> int:
    """Run ``gpumem workspace``; returns the exit status."""
    import sys

    from ._common import EXIT_DEVICE_ERROR, EXIT_DEVICE_LOST, EXIT_OK, EXIT_OOM, _UsageError
    from ..errors import DeviceLostError, GpumemError
    from ..specs import open_device
    from ..workspace import InsufficientWorkspaceMemoryError, WorkspaceDeviceQueryError, calculate_gpu_workspace_size

    options = {} if args.max_batch_size is None else {"max_batch_size": args.max_batch_size}
    try:
        device = open_device(args.device)
    except GpumemError as exc:
        raise _UsageError(f"--device {args.device}: {exc}") from None
    try:
        ws = calculate_gpu_workspace_size(args.in_features, args.out_features, args.qtype, device, **options)
    except InsufficientWorkspaceMemoryError as exc:
        if args.json:
            print(json.dumps({"error": "insufficient_memory", "required_bytes": exc.required_nbytes,
                              "available_bytes": exc.available_nbytes, "free_bytes": exc.free_nbytes,
                              "device": exc.device, "message": str(exc)}, indent=2))
        print(f"gpumem workspace: {exc}", file=sys.stderr)
        return EXIT_OOM
    except WorkspaceDeviceQueryError as exc:
        # the device's own error decides the status: lost (3) or any other device error (4), as documented
        lost = isinstance(exc.cause, DeviceLostError)
        if args.json:
            print(json.dumps({"error": "device_lost" if lost else "device_error", "device": exc.device,
                              "cause": type(exc.cause).__name__, "message": str(exc)}, indent=2))
        print(f"gpumem workspace: {'the device was lost' if lost else 'device error'}: {exc}", file=sys.stderr)
        return EXIT_DEVICE_LOST if lost else EXIT_DEVICE_ERROR
    finally:
        device.close()
    if args.json:
        print(json.dumps(ws.to_dict(), indent=2))
        return EXIT_OK
    rows = [
        ("device", f"{ws.device} ({ws.gpu_class.label} class, batch cap {ws.max_batch_size})"),
        ("layer", f"{ws.in_features} x {ws.out_features} {ws.qtype.value}"),
        ("free", f"{format_bytes(ws.free_bytes)} of {format_bytes(ws.total_bytes)}"),
        ("reserve", format_bytes(ws.reserve_bytes)),
        ("available", f"{format_bytes(ws.available_bytes)} ({ws.available_bytes} bytes)"),
        ("dequant", format_bytes(ws.dequant_bytes)),
        ("per sample", format_bytes(ws.per_sample_bytes)),
        ("batch", str(ws.batch_size)),
        ("workspace", f"{format_bytes(ws.workspace_bytes)} ({ws.workspace_bytes} bytes)"
                      + (" - tiled: the whole dequantized matrix does not fit" if ws.tiled else "")),
    ]
    for label, value in rows:
        print(f"{label:<12}{value}")
    return EXIT_OK
