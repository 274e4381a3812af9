"""Time what ``gpumem estimate`` and ``gpumem fit`` compute for a 7B Llama-style model, the full replay against
the fast one (``gpumem.estimate.fastreplay``), side by side in one run::

    python -m benchmarks.estimate_speed [--new-tokens 16,100,1000,4000] [--full-fit-up-to 100]

"estimate": the peak allocated (the short trace, Note [Decode steps simulated]) and the peak reserved under
``--policies`` (``replay_inference``; full: ``full_replay=True``, one stream per policy with every op sent).
"fit": ``find_max_batch`` under ``pytorch`` (full: ``full_replay=True``, no probe shared). Each row also
checks that both give the same figures (estimate: every ``ReservedEstimate``; fit: the whole ``FitResult``).
The full fit takes minutes past a few hundred tokens: ``--full-fit-up-to`` bounds the lengths it runs at.

``--fast-only`` times the fast path alone in CPU seconds of the process (``time.process_time``, which other jobs
on a shared machine disturb far less than wall time): the estimate, each policy alone, and ``gpumem fit``. To
compare two checkouts, run this file once with each on ``PYTHONPATH``, alternating::

    PYTHONPATH=<checkout> python benchmarks/estimate_speed.py --fast-only --new-tokens 1000

``--search`` times ``gpumem fit``'s search instead, both on the fast replay: the plain search that replays every
size it asks (``skip_gallop=False``, the search before Note [Gallop skipped]) against the default, one after the
other at each length, and checks that both give the same answers (the whole ``FitResult`` but its tries)::

    python -m benchmarks.estimate_speed --search --new-tokens 16,100,1000

``--jobs 1,2`` times ``gpumem fit`` (``find_max_batch`` under ``pytorch``) on each number of worker processes
(Note [Probes replayed ahead] in ``gpumem/estimate/probe_pool.py``), the counts alternated over ``--rounds``, in
wall seconds (the workers' time is not this process's), and checks every run against the first (the whole
``FitResult``, its tries included)::

    python -m benchmarks.estimate_speed --jobs 1,2 --new-tokens 1000,4000 --rounds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time
from typing import Any

from gpumem.estimate import ModelShape, find_max_batch, inference_trace
from gpumem.estimate.fit import replay_inference

LLAMA_7B = ModelShape(4096, 11008, 32, 32000, 32, 32)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _cpu_timed(fn):
    """``fn()`` and the CPU seconds of this process it took (``time.process_time``: other jobs on a shared
    machine disturb it far less than wall time)."""
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.estimate_speed",
                                 description=" ".join(__doc__.split("\n\n")[0].split()).rstrip(":.") + ".")
    ap.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--new-tokens", default="16,100,1000,4000", help="comma-separated new-token counts to time")
    ap.add_argument("--policies", default="pytorch,expandable,gpumem", help="comma-separated policies of the estimate")
    ap.add_argument("--device", default="sim:h200-141gb", help="simulated device (default sim:h200-141gb)")
    ap.add_argument("--full-fit-up-to", type=int, default=100, help="no full fit above this many new tokens")
    ap.add_argument("--no-fit", action="store_true", help="time the estimate only, not gpumem fit")
    ap.add_argument("--fast-only", action="store_true",
                    help="time the fast path only, in CPU seconds (time.process_time), per policy too: to compare "
                         "two checkouts, run this file with each on PYTHONPATH")
    ap.add_argument("--search", action="store_true",
                    help="time gpumem fit's search instead: every size replayed (skip_gallop=False) against the "
                         "default (Note [Gallop skipped]), both on the fast replay")
    ap.add_argument("--jobs", help="comma-separated worker counts: time gpumem fit on each (Note [Probes replayed "
                                   "ahead])")
    ap.add_argument("--estimate-jobs", help="comma-separated process counts: time the estimate's replays (every "
                                            "--policies) on each (Note [Policies replayed apart])")
    ap.add_argument("--rounds", type=int, default=1, help="--jobs, --estimate-jobs: runs of each count, alternated "
                                                          "(default 1)")
    args = ap.parse_args()
    if args.jobs:
        _jobs_table(args)
        return
    if args.estimate_jobs:
        _estimate_jobs_table(args)
        return
    if args.search:
        _search_table(args)
        return
    if args.fast_only:
        _fast_table(args)
        return
    policies = tuple(p for p in args.policies.split(",") if p)
    print(f"7B (6.74B, bf16), batch 1{'' if args.no_fit else ' (fit: searched)'}, prompt {args.prompt_len}, {args.device}; "
          f"{platform.python_implementation()} {platform.python_version()}")
    print(f"estimate: peak allocated + peak reserved under {','.join(policies)}; fit: find_max_batch, pytorch")
    print(f"{'new tok':>7} {'what':<28} {'full s':>8} {'fast s':>8} {'full/fast':>9} {'same':>5}")
    for n in (int(x) for x in args.new_tokens.split(",")):
        kw = dict(prompt_len=args.prompt_len, new_tokens=n)

        def estimate(full: bool):
            peak = inference_trace(LLAMA_7B, 2, **kw)
            return replay_inference(LLAMA_7B, 2, policies, args.device, peak_nbytes=peak.peak_nbytes,
                                    full_replay=full, **kw)
        fast, t_fast = _timed(lambda: estimate(False))
        full, t_full = _timed(lambda: estimate(True))
        print(f"{n:>7} {'estimate':<28} {t_full:>8.2f} {t_fast:>8.2f} {t_full / t_fast:>8.1f}x "
              f"{'yes' if fast == full else 'NO':>5}", flush=True)
        if args.no_fit:
            continue
        fit_fast, f_fast = _timed(lambda: find_max_batch(LLAMA_7B, 2, device=args.device, **kw))
        what = f"fit (batch {fit_fast.simulated})"
        if n <= args.full_fit_up_to:
            fit_full, f_full = _timed(lambda: find_max_batch(LLAMA_7B, 2, device=args.device, full_replay=True,
                                                             **kw))
            print(f"{n:>7} {what:<28} {f_full:>8.2f} {f_fast:>8.2f} {f_full / f_fast:>8.1f}x "
                  f"{'yes' if fit_full == fit_fast else 'NO':>5}", flush=True)
        else:
            print(f"{n:>7} {what:<28} {'-':>8} {f_fast:>8.2f} {'-':>9} {'-':>5}", flush=True)


def _fast_table(args: argparse.Namespace) -> None:
    """The fast path alone in CPU seconds: the estimate (all ``--policies``), each policy alone, and ``gpumem fit``
    (unless ``--no-fit``); with the load average, since the machine may be shared."""
    policies = tuple(p for p in args.policies.split(",") if p)
    print(f"7B (6.74B, bf16), batch 1{'' if args.no_fit else ' (fit: searched)'}, prompt {args.prompt_len}, {args.device}; "
          f"{platform.python_implementation()} {platform.python_version()}; load average at start "
          f"{os.getloadavg()[0]:.1f}; CPU seconds")
    print(f"{'new tok':>7} {'what':<28} {'cpu s':>8} {'wall s':>8} {'load':>5}")
    for n in (int(x) for x in args.new_tokens.split(",")):
        kw = dict(prompt_len=args.prompt_len, new_tokens=n)
        peak = inference_trace(LLAMA_7B, 2, **kw)
        rows = [("estimate", policies)] + ([(f"  {p} alone", (p,)) for p in policies] if len(policies) > 1 else [])
        for what, pols in rows:
            def estimate(pols=pols):
                if what == "estimate":
                    inference_trace(LLAMA_7B, 2, **kw)  # the estimate's short trace, as the full row counts it
                return replay_inference(LLAMA_7B, 2, pols, args.device, peak_nbytes=peak.peak_nbytes, **kw)
            t0 = time.perf_counter()
            _, cpu = _cpu_timed(estimate)
            print(f"{n:>7} {what:<28} {cpu:>8.2f} {time.perf_counter() - t0:>8.2f} {os.getloadavg()[0]:>5.1f}",
                  flush=True)
        if not args.no_fit:
            t0 = time.perf_counter()
            fit, cpu = _cpu_timed(lambda: find_max_batch(LLAMA_7B, 2, device=args.device, **kw))
            what = f"fit (batch {fit.simulated}/{fit.binary_search}/{fit.halving})"
            print(f"{n:>7} {what:<28} {cpu:>8.2f} {time.perf_counter() - t0:>8.2f} {os.getloadavg()[0]:>5.1f}",
                  flush=True)


def _search_table(args: argparse.Namespace) -> None:
    """``find_max_batch`` under ``pytorch`` with the plain search and with the gallop skipped, side by side, with the
    replays each made (counted at ``replay_inference``)."""
    from gpumem.estimate import fit as fit_module

    calls = [0]
    real = fit_module.replay_inference

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    def run(skip: bool, kw: dict):
        calls[0] = 0
        r, t = _timed(lambda: find_max_batch(LLAMA_7B, 2, skip_gallop=skip, **kw))
        return r, t, calls[0]

    print(f"7B (6.74B, bf16), prompt {args.prompt_len}, {args.device}, fit under pytorch; "
          f"{platform.python_implementation()} {platform.python_version()}; load average at start "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'new tok':>7} {'answer':>12} {'old s':>8} {'new s':>8} {'old/new':>8} {'replays':>9} {'same':>5}")
    fit_module.replay_inference = counted
    try:
        for n in (int(x) for x in args.new_tokens.split(",")):
            kw = dict(device=args.device, prompt_len=args.prompt_len, new_tokens=n)
            old, t_old, n_old = run(False, kw)
            new, t_new, n_new = run(True, kw)
            same = dataclasses.replace(old, tries=[]) == dataclasses.replace(new, tries=[])
            answer = f"{new.simulated}/{new.binary_search}/{new.halving}"
            print(f"{n:>7} {answer:>12} {t_old:>8.2f} {t_new:>8.2f} {t_old / t_new:>7.2f}x "
                  f"{f'{n_old}/{n_new}':>9} {'yes' if same else 'NO':>5}", flush=True)
    finally:
        fit_module.replay_inference = real


def _alternated(counts: "list[int]", rounds: int, run: Any, label: Any, n: int) -> None:
    """``run(j)`` for each process count ``j``, the order alternated round by round; one line per round: ``label``
    of the first result, the wall seconds, the ratios to the first count, and whether every result is the same."""
    for rnd in range(rounds):
        order = counts if rnd % 2 == 0 else counts[::-1]
        runs = {j: _timed(lambda j=j: run(j)) for j in order}
        first = runs[counts[0]][0]
        same = all(r == first for r, _ in runs.values())
        base = runs[counts[0]][1]
        print(f"{n:>7} {rnd + 1:>5} {label(first)}" + " ".join(f"{runs[j][1]:>9.2f}" for j in counts) + " "
              + " ".join(f"{base / runs[j][1]:>5.2f}x" for j in counts[1:]) + f" {'yes' if same else 'NO':>5}",
              flush=True)


def _jobs_header(args: argparse.Namespace, what: str, counts: "list[int]", answer: bool) -> None:
    print(f"7B (6.74B, bf16), prompt {args.prompt_len}, {args.device}, {what}; "
          f"{platform.python_implementation()} {platform.python_version()}; {os.cpu_count()} CPUs; load average at "
          f"start {os.getloadavg()[0]:.1f}; wall seconds")
    print(f"{'new tok':>7} {'round':>5} " + (f"{'answer':>10} " if answer else "")
          + " ".join(f"{f'jobs {j} s':>9}" for j in counts)
          + " " + " ".join(f"{f'1/{j}':>6}" for j in counts[1:]) + f" {'same':>5}")


def _jobs_table(args: argparse.Namespace) -> None:
    """``find_max_batch`` under ``pytorch`` on each ``--jobs`` count, alternated, in wall seconds."""
    counts = [int(x) for x in args.jobs.split(",")]
    _jobs_header(args, "fit under pytorch", counts, answer=True)
    for n in (int(x) for x in args.new_tokens.split(",")):
        kw = dict(device=args.device, prompt_len=args.prompt_len, new_tokens=n)
        _alternated(counts, args.rounds, lambda j: find_max_batch(LLAMA_7B, 2, jobs=j, **kw),
                    lambda r: f"{f'{r.simulated}/{r.binary_search}/{r.halving}':>10} ", n)


def _estimate_jobs_table(args: argparse.Namespace) -> None:
    """The estimate (its short trace and ``replay_inference`` of every ``--policies``) on each ``--estimate-jobs``
    count, alternated, in wall seconds, with the figures compared."""
    counts = [int(x) for x in args.estimate_jobs.split(",")]
    policies = tuple(p for p in args.policies.split(",") if p)
    _jobs_header(args, f"batch 1, estimate under {','.join(policies)}", counts, answer=False)
    for n in (int(x) for x in args.new_tokens.split(",")):
        kw = dict(prompt_len=args.prompt_len, new_tokens=n)

        def estimate(j: int, kw: dict = kw) -> list:
            peak = inference_trace(LLAMA_7B, 2, **kw)
            return replay_inference(LLAMA_7B, 2, policies, args.device, peak_nbytes=peak.peak_nbytes, jobs=j, **kw)
        _alternated(counts, args.rounds, estimate, lambda r: "", n)

if __name__ == "__main__":
    main()
