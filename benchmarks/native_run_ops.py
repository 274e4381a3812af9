"""The estimate's fast replay of ``generate()`` over the native engine: each decode step made from the template sent
op by op from Python (:class:`~gpumem.estimate.fastreplay.PlainSink`'s loop) against in one call
(``Allocator.run_ops``, Note [A step's ops in one call] in ``gpumem/_native/op_table.h``), side by side in one run::

    python -m benchmarks.native_run_ops [--new-tokens 100,1000,4000] [--batch-size 1] [--policies gpumem]

Each row streams a 7B Llama-style model's ``generate()`` (the emitter's steps and the jumped ones, Note [Decode step
template]) into one allocator per way, in CPU seconds of the process (``time.process_time``), and checks that both
end with the same stats, live blocks, pointers and error. Policies whose allocator runs on the Python engine have
no batch path (the row says so).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from gpumem.allocator import make_allocator
from gpumem.estimate import ModelShape
from gpumem.estimate.fastreplay import AllStopped, PlainSink, SinkGroup, StepJumper, native_run_ops
from gpumem.estimate.workload import stream_inference
from gpumem.specs import open_device

LLAMA_7B = ModelShape(4096, 11008, 32, 32000, 32, 32)


def _stream(policy: str, device: str, batched: bool, limit: int | None, **kw) -> tuple[float, tuple]:
    """CPU seconds of one streamed ``generate()`` into one sink, and what it ended with."""
    dev = open_device(device)
    try:
        alloc = make_allocator(dev, policy, limit=limit)
        sink = PlainSink(alloc)
        if not batched:
            sink._run_ops_native, sink.ptrs = None, {}  # the Python loop
        jumper = StepJumper(SinkGroup([sink]), lambda step: None, kw["new_tokens"] - 1)
        t0 = time.process_time()
        try:
            stream_inference(LLAMA_7B, 2, (jumper,), on_step=jumper.end_step, jump=jumper.jump, **kw)
        except AllStopped:
            pass
        cpu = time.process_time() - t0
        end = (alloc.snapshot_stats(), sorted(alloc.live_blocks()), sorted(sink.ptrs.items()),
               type(sink.error).__name__, str(sink.error), sink.error_step)
        return cpu, end
    finally:
        dev.close()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.native_run_ops",
                                 description=" ".join(__doc__.split("\n\n")[0].split()).rstrip(":.") + ".")
    ap.add_argument("--new-tokens", default="100,1000,4000", help="comma-separated new-token counts")
    ap.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--batch-size", type=int, default=1, help="sequences (default 1)")
    ap.add_argument("--policies", default="gpumem", help="comma-separated policies (default gpumem)")
    ap.add_argument("--device", default="sim:h200-141gb", help="simulated device (default sim:h200-141gb)")
    ap.add_argument("--limit-gib", type=float, default=None, help="the allocators' limit in GiB (default none)")
    args = ap.parse_args()
    limit = None if args.limit_gib is None else int(args.limit_gib * 2**30)
    print(f"7B (6.74B, bf16), batch {args.batch_size}, prompt {args.prompt_len}, {args.device}, limit "
          f"{args.limit_gib or 'none'}; {platform.python_implementation()} {platform.python_version()}; load average "
          f"at start {os.getloadavg()[0]:.1f}; CPU seconds of the whole stream (emitter included)")
    print(f"{'new tok':>7} {'policy':<12} {'loop s':>8} {'batch s':>8} {'loop/batch':>10} {'same':>5}")
    for n in (int(x) for x in args.new_tokens.split(",")):
        kw = dict(batch_size=args.batch_size, prompt_len=args.prompt_len, new_tokens=n)
        for policy in (p for p in args.policies.split(",") if p):
            dev = open_device(args.device)
            try:
                native = native_run_ops(make_allocator(dev, policy)) is not None
            finally:
                dev.close()
            t_loop, end_loop = _stream(policy, args.device, False, limit, **kw)
            if not native:
                print(f"{n:>7} {policy:<12} {t_loop:>8.2f} {'-':>8} {'(python engine)':>16}", flush=True)
                continue
            t_batch, end_batch = _stream(policy, args.device, True, limit, **kw)
            print(f"{n:>7} {policy:<12} {t_loop:>8.2f} {t_batch:>8.2f} {t_loop / t_batch:>9.1f}x "
                  f"{'yes' if end_loop == end_batch else 'NO':>5}", flush=True)


if __name__ == "__main__":
    main()
