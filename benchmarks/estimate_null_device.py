"""How much of the ``gpumem`` policy's estimate replay is the simulated device's Python methods: the replay of a 7B
``generate()`` timed with the device as it is, and with its page-move and event methods replaced by C builtins that
do nothing (what is left is the native engine and its binding), side by side in one process::

    python -m benchmarks.estimate_null_device [--prompt-len 2048] [--new-tokens 6000] [--rounds 3]

The devices are passed in (``replay_inference(..., device=dev)``), so the idle device twin (Note [An idle device's
bookkeeping calls made here] in ``gpumem/_native/pybackend.cpp``) stays off and the device's methods are the ones
called. CPU seconds of the process (``time.process_time``); both replays must give the same peak reserved.
"""

from __future__ import annotations

import argparse
import time

from gpumem.estimate.fit import replay_inference
from gpumem.specs import open_device

from benchmarks.estimate_speed import LLAMA_7B


def _null(dev) -> None:
    """The device's mem_map, mem_unmap, mem_set_access and event calls made C builtins that do nothing (events all
    one object that is always complete)."""
    event = object()
    nothing = "".format
    dev.mem_map = dev.mem_unmap = dev.mem_set_access = dev.event_destroy = nothing
    dev.event_record = {0: event}.__getitem__   # the estimate records on stream 0 only
    dev.event_query = bool


def _replay(prompt: int, tokens: int, null: bool) -> tuple[float, int]:
    dev = open_device("sim:h200-141gb")
    try:
        if null:
            _null(dev)
        t0 = time.process_time()
        r = replay_inference(LLAMA_7B, 2, ("gpumem",), dev, prompt_len=prompt, new_tokens=tokens)[0]
        return time.process_time() - t0, r.peak_reserved_bytes
    finally:
        dev.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.estimate_null_device",
                                 description=" ".join(__doc__.split("\n\n")[0].split()).rstrip(":.") + ".")
    ap.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--new-tokens", type=int, default=6000, help="new tokens (default 6000)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    args = ap.parse_args(argv)
    if args.prompt_len < 1 or args.new_tokens < 1 or args.rounds < 1:
        ap.error("--prompt-len, --new-tokens and --rounds must be at least 1")
    print(f"gpumem replay of a 7B generate(), prompt {args.prompt_len}, {args.new_tokens} new tokens; CPU seconds")
    print(f"{'round':>5} {'device s':>9} {'null s':>8} {'device share':>12}")
    for k in range(1, args.rounds + 1):
        real_s, real_peak = _replay(args.prompt_len, args.new_tokens, null=False)
        null_s, null_peak = _replay(args.prompt_len, args.new_tokens, null=True)
        if real_peak != null_peak:
            raise SystemExit(f"the null device changed the peak reserved: {real_peak} != {null_peak}")
        print(f"{k:>5} {real_s:>9.2f} {null_s:>8.2f} {1 - null_s / real_s:>11.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
