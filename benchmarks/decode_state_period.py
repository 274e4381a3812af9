"""How often the allocator's state repeats across the decode steps of ``generate()`` (issue 22 point 5: the study
behind an exact jump over decode steps)::

    python -m benchmarks.decode_state_period [--batch 1] [--new-tokens 800] [--policy pytorch]

Replays every op of a 7B Llama-style model's ``generate()`` (the fast path's step template, no op skipped) under a
segment policy and, at the end of each decode step from the fifth, reads each pool's state: its segments and, in
address order, their blocks (allocated or not; for an allocated block the op that made it, as steps back and
place in its step) with their addresses, sizes and requested bytes. A pool is *affine with period p* at step ``t``
when its states at ``t - 2p``, ``t - p`` and ``t`` have the same structure (segments, blocks, owners) and every
number moved by the same amount over both periods: the condition under which a jump of whole periods could be
proved (Note [Decode step template] in ``gpumem/estimate/fastreplay.py``; ``reports/estimate-speed.md``). Per pool
it prints the segments made during the decode, the periods found and the share of steps that have one.
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from gpumem.allocator.backing import SegmentBacking
from gpumem.allocator.factory import make_allocator
from gpumem.estimate import ModelShape
from gpumem.estimate.fastreplay import PlainSink, SinkGroup, StepJumper
from gpumem.estimate.workload import stream_inference
from gpumem.specs import open_device

LLAMA_7B = ModelShape(4096, 11008, 32, 32000, 32, 32)


def pool_state(engine, sink: PlainSink, tpl, step: int, small: bool) -> tuple[tuple, np.ndarray]:
    """(structure, numbers) of one pool at the end of ``step``: owners relative to the step where the template
    names them (made in decode step 1 or later), absolute op ids otherwise."""
    owner_of = {addr: op for op, addr in sink.ptrs.items() if addr}
    structure, numbers = [], []
    for seg in sorted((s for s in engine.backing.segments_list() if s.small == small), key=lambda s: s.base):
        blocks, b = [], seg.last
        while b is not None:
            blocks.append(b)
            b = b.prev
        row = []
        for b in reversed(blocks):
            owner = None
            if b.allocated:
                op = owner_of[b.addr]
                if tpl is not None and op >= tpl.alloc_id(1, 0):
                    owner = (step - (tpl.s0 + (op - tpl.first_id) // tpl.n_allocs), (op - tpl.first_id) % tpl.n_allocs)
                else:
                    owner = ("op", op)
            row.append((b.allocated, owner))
            numbers += (b.addr, b.size, b.requested if b.allocated else 0)
        structure.append((seg.base, seg.nbytes, seg.live, tuple(row)))
    return tuple(structure), np.array(numbers, dtype=np.int64)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_state_period",
                                 description=" ".join(__doc__.split("\n\n")[0].split()).rstrip(":.") + ".")
    ap.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    ap.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--new-tokens", type=int, default=800, help="new tokens (default 800)")
    ap.add_argument("--policy", default="pytorch", help="a policy over malloc'd segments (default pytorch)")
    ap.add_argument("--max-period", type=int, default=200, help="longest period looked for, in steps (default 200)")
    ap.add_argument("--check-periods", default="", help="comma-separated periods whose share of steps is printed "
                    "on their own (e.g. 32,33,65: the period that makes every request affine, the large pool's ring)")
    ap.add_argument("--device", default="sim:h200-141gb", help="simulated device (default sim:h200-141gb)")
    args = ap.parse_args()
    dev = open_device(args.device)
    alloc = make_allocator(dev, args.policy)
    engine = alloc._engine
    if not isinstance(getattr(engine, "backing", None), SegmentBacking):
        raise SystemExit(f"policy {args.policy!r} does not run over malloc'd segments on the Python engine")
    sink = PlainSink(alloc)
    seen: dict[bool, dict[int, tuple[tuple, np.ndarray]]] = {True: {}, False: {}}
    periods: dict[bool, collections.Counter] = {True: collections.Counter(), False: collections.Counter()}
    made: dict[bool, list[int]] = {True: [], False: []}
    count = {True: 0, False: 0}
    checks = [int(x) for x in args.check_periods.split(",") if x]
    checked: dict[bool, collections.Counter] = {True: collections.Counter(), False: collections.Counter()}
    n_segments = {True: 0, False: 0}

    def affine(states: dict[int, tuple[tuple, np.ndarray]], step: int, p: int) -> bool:
        a, b, cur = states.get(step - 2 * p), states.get(step - p), states[step]
        return (a is not None and b is not None and a[0] == b[0] == cur[0]
                and np.array_equal(cur[1] - b[1], b[1] - a[1]))

    def on_step(step: int) -> None:
        for small in (True, False):
            n = sum(1 for s in engine.backing.segments_list() if s.small == small)
            if step >= 1 and n != n_segments[small]:
                made[small].append(step)
            n_segments[small] = n
        if step < 5 or jumper.template is None:
            return
        for small in (True, False):
            states = seen[small]
            cur = pool_state(engine, sink, jumper.template, step, small)
            states[step] = cur
            count[small] += 1
            for p in range(1, args.max_period + 1):
                if affine(states, step, p):
                    periods[small][p] += 1
                    break
            for p in checks:
                checked[small][p] += affine(states, step, p)
            states.pop(step - 2 * max(args.max_period, *checks, 0), None)

    jumper = StepJumper(SinkGroup([sink]), on_step, args.new_tokens - 1)
    t0 = time.perf_counter()
    stream_inference(LLAMA_7B, 2, (jumper,), on_step=jumper.end_step, jump=jumper.jump, batch_size=args.batch,
                     prompt_len=args.prompt_len, new_tokens=args.new_tokens)  # the ops the estimate replays
    alloc.close()
    dev.close()
    print(f"7B, batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, {args.policy}; "
          f"{time.perf_counter() - t0:.1f} s")
    print(f"{'pool':<6} {'segments made at steps':<40} {'steps read':>10} {'with a period':>13}  periods (steps: count)")
    for small in (True, False):
        steps = made[small]
        shown = ", ".join(map(str, steps[:8])) + (" ..." if len(steps) > 8 else "") or "-"
        found = sum(periods[small].values())
        top = ", ".join(f"{p}: {c}" for p, c in periods[small].most_common(5)) or "-"
        print(f"{'small' if small else 'large':<6} {shown:<40} {count[small]:>10} {found:>13}  {top}")
    for p in checks:
        print(f"period {p}: small pool affine at {checked[True][p]} of {count[True]} steps, large pool at "
              f"{checked[False][p]} of {count[False]}")


if __name__ == "__main__":
    main()
