"""Time ``gpumem estimate`` and ``gpumem fit`` for a 7B Llama-style model, before and after the short decode
trace (Note [Decode steps simulated] in ``gpumem.estimate.workload``)::

    python benchmarks/estimate_speed.py [--new-tokens 1000,100] [--policies pytorch,expandable,gpumem]

"before": the full generate() trace built in memory (``full_decode=True``, one decode forward per new token)
and replayed under each policy, as ``estimate`` did. "after": the peak allocated from the short trace, and the
reserved figures replayed step by step without keeping the trace (the command's path now). It also checks
that both give the same figures, and times ``find_max_batch`` (``gpumem fit``'s search) as it is now.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

from gpumem.estimate import ModelShape, find_max_batch, inference_trace
from gpumem.estimate.fit import _replay, replay_inference

LLAMA_7B = ModelShape(4096, 11008, 32, 32000, 32, 32)


def _timed(fn, memory: bool = False):
    """``(fn(), seconds, peak Python heap bytes)``; the heap is traced (which slows the run) only with
    ``memory``, timed apart."""
    t0 = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    peak = 0
    if memory:
        tracemalloc.start()
        fn()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return out, wall, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--new-tokens", default="16,100,1000")
    ap.add_argument("--policies", default="pytorch,expandable,gpumem")
    ap.add_argument("--device", default="sim:h200-141gb")
    ap.add_argument("--skip-before-above", type=int, default=1000, help="no 'before' run above this many tokens")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    print(f"7B (6.74B, bf16), batch 1, prompt {args.prompt_len}, policies {','.join(policies)}, {args.device}")
    print("MiB: the Python heap's peak while the trace is built (the replays add the allocator's own state)")
    print(f"{'new tok':>7} {'what':<26} {'before s':>9} {'after s':>8} {'before MiB':>10} {'after MiB':>9} {'same':>5}")
    for n in (int(x) for x in args.new_tokens.split(",")):
        def peak_before():
            return inference_trace(LLAMA_7B, 2, prompt_len=args.prompt_len, new_tokens=n, full_decode=True)

        def peak_after():
            return inference_trace(LLAMA_7B, 2, prompt_len=args.prompt_len, new_tokens=n)

        fast, t_a, m_a = _timed(peak_after, True)
        if n <= args.skip_before_above:
            full, t_b, m_b = _timed(peak_before, True)
            same = full.peak_nbytes == fast.peak_nbytes and full.at_peak == fast.at_peak
            print(f"{n:>7} {'peak allocated':<26} {t_b:>9.2f} {t_a:>8.2f} {m_b / 2**20:>10.1f} {m_a / 2**20:>9.1f} "
                  f"{'yes' if same else 'NO':>5}")

            def reserved_before():
                return [_replay(full, args.device, p).peak_reserved_bytes for p in policies]
            res_b, r_b, rm_b = _timed(reserved_before)
        else:
            print(f"{n:>7} {'peak allocated':<26} {'-':>9} {t_a:>8.2f} {'-':>10} {m_a / 2**20:>9.1f} {'-':>5}")
        res_a, r_a, rm_a = _timed(lambda: [r.peak_reserved_bytes for r in replay_inference(
            LLAMA_7B, 2, policies, args.device, prompt_len=args.prompt_len, new_tokens=n,
            peak_nbytes=fast.peak_nbytes)])
        if n <= args.skip_before_above:
            print(f"{n:>7} {'peak reserved (replays)':<26} {t_b + r_b:>9.2f} {t_a + r_a:>8.2f} "
                  f"{m_b / 2**20:>10.1f} {m_a / 2**20:>9.1f} {'yes' if res_a == res_b else 'NO':>5}")
        else:
            print(f"{n:>7} {'peak reserved (replays)':<26} {'-':>9} {t_a + r_a:>8.2f} {'-':>10} "
                  f"{m_a / 2**20:>9.1f} {'-':>5}")
        t0 = time.perf_counter()
        r = find_max_batch(LLAMA_7B, 2, device=args.device, prompt_len=args.prompt_len, new_tokens=n)
        print(f"{n:>7} {'fit (batch ' + str(r.simulated) + ')':<26} {'-':>9} {time.perf_counter() - t0:>8.2f}")


if __name__ == "__main__":
    main()
