"""Device calls per decode step of a long ``generate()``, per window of steps, under each allocator policy.

Issue 18, point 3 (per-operation cost in steady state). The estimate's emitter
(:func:`gpumem.estimate.workload.stream_inference`: loading the weights, the prefill, then every decode step
with the DynamicCache grown by ``torch.cat``) drives one allocator per policy on ``sim:h200-141gb`` priced as
measured (``LatencyModel.as_measured()``), with the GPU idle (every fence complete at once: the estimate's replay
before it ran the GPU's lag, Note [The GPU's lag in the decode replay] in ``gpumem/estimate/fit.py``; with
``--decode-slack`` every policy's ops get the 24 MiB block that stood in for that lag; a recorded command from
before 2026-11-30 without a flag gave it to ``gpumem`` only, which no flag reproduces); after each decode step the allocator's device calls (memory calls)
and event calls, the simulated cost of every device call (µs), and the memory held are read. Per window of
``--window`` steps it prints the calls per step, the modelled µs per step, and the most memory held, for each
policy side by side; a policy is ``NAME`` or ``NAME:key=value,...`` (``gpumem:page_slack=0.02``).

    python -m sim.decode_calls --model 7b --prompt 2048 --new-tokens 3500
    python -m sim.decode_calls --model small --prompt 512 --new-tokens 3000 --policies gpumem,pytorch
    python -m sim.decode_calls --corpus tuning --policies "gpumem;gpumem:page_slack=0.01"

With ``--ring BLOCKS`` it runs instead the storm's smallest form (:func:`ring_run`): ``BLOCKS`` tensors grown by
``torch.cat`` every step (a new block one token larger, then the old one freed, a small activation around it)
beside ``--weights-mib`` of weights, ``--ring-token-nbytes`` per token, from ``--prompt`` tokens.

With ``--corpus PART`` it replays instead every trace of that corpus part (:mod:`gpumem.trace.corpus`) under
each policy, with the GPU idle and behind (``gpu_timing="trace"``): overhead (peak reserved over peak
allocated), and memory and event calls of the whole trace and of its second half (the steady state).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumem.allocator import make_allocator
from gpumem.errors import GpumemError, OutOfMemoryError
from gpumem.estimate.shape import ModelShape
from gpumem.estimate.workload import stream_inference
from gpumem.sim import get_profile
from gpumem.sim.latency import LatencyModel
from gpumem.specs import open_device
from hil.probes.workloads import WorkloadInputError, parse_policy
from sim.cli_checks import json_target_problem

PROFILE = "h200-141gb"
#: The models: the 7B Llama-style shape of the estimate's benchmarks, and the small Llama of the live probe
#: ``llama_long_decode`` (:data:`hil.probes.workloads.LONG_DECODE_CONFIG`), bf16.
MODELS = {
    "7b": ModelShape(4096, 11008, 32, 32000, 32, 32),
    "small": ModelShape(1024, 2816, 8, 32000, 16, 16),
}


@dataclass
class Window:
    """Steps ``first`` .. ``last`` of one policy's decode: totals over the window."""

    first: int
    last: int
    device_calls: int = 0
    event_calls: int = 0
    cost_us: float = 0.0
    """Simulated µs of every device call made in the window (the program's kernel launches excluded)."""
    max_reserved_nbytes: int = 0
    max_allocated_nbytes: int = 0

    @property
    def steps(self) -> int:
        return self.last - self.first + 1


@dataclass
class PolicyRun:
    """One policy's decode, window by window."""

    policy: str
    windows: list[Window] = field(default_factory=list)
    peak_reserved_nbytes: int = 0
    peak_allocated_nbytes: int = 0
    oom_step: int = -1


class _Sink:
    """Sends the emitter's ops to an allocator and reads its counters after each step."""

    def __init__(self, allocator: Any, device: Any, window: int, run: PolicyRun) -> None:
        self.a, self.dev, self.window, self.run = allocator, device, window, run
        self.ptrs: dict[int, int] = {}
        self.stopped = False
        self._last = (0, 0, 0.0)
        self.step = 0

    def alloc(self, op_id: int, nbytes: int) -> None:
        if self.stopped:
            return
        try:
            self.ptrs[op_id] = self.a.allocate(nbytes, 0) if nbytes else 0
        except OutOfMemoryError:
            self.stopped = True
            self.run.oom_step = self.step
            return
        self.run.peak_reserved_nbytes = max(self.run.peak_reserved_nbytes, self.a.reserved_nbytes)
        self.run.peak_allocated_nbytes = max(self.run.peak_allocated_nbytes, self.a.allocated_nbytes)

    def free(self, op_id: int) -> None:
        p = self.ptrs.pop(op_id, 0)
        if p and not self.stopped:
            self.a.free(p)

    def _counters(self) -> tuple[int, int, float]:
        st = self.a.snapshot_stats()
        cost = sum(c for k, c in self.dev.stats.cost_us.items() if k != "launch")
        return st.device_calls, st.event_calls, cost

    def end_step(self, step: int) -> None:
        now = self._counters()
        self.step = step + 1
        if step == 0:  # the prefill: the decode's windows start after it
            self._last = now
            return
        ws = self.run.windows
        if not ws or ws[-1].last - ws[-1].first + 1 >= self.window:
            ws.append(Window(step, step))
        w = ws[-1]
        w.last = step
        w.device_calls += now[0] - self._last[0]
        w.event_calls += now[1] - self._last[1]
        w.cost_us += now[2] - self._last[2]
        w.max_reserved_nbytes = max(w.max_reserved_nbytes, self.a.reserved_nbytes)
        w.max_allocated_nbytes = max(w.max_allocated_nbytes, self.a.allocated_nbytes)
        self._last = now


def decode_run(shape: ModelShape, policy: str, *, prompt: int, new_tokens: int, window: int = 100,
               dtype_bytes: int = 2, latency: LatencyModel | None = None, decode_slack: bool = False) -> PolicyRun:
    """``generate()`` of ``new_tokens`` after a ``prompt`` under ``policy`` (a name or ``NAME:key=value,...``),
    one request of batch 1, on ``sim:h200-141gb`` (priced as measured unless ``latency`` is given).
    ``decode_slack``: with the decode slack the estimate gave ``gpumem`` before it ran the GPU's lag (Note [The GPU's
    lag in the decode replay] in ``gpumem/estimate/fit.py``); the ops are the estimate's without it. The GPU here is
    idle (every fence complete at once), as the estimate's replay was before."""
    profile = dataclasses.replace(get_profile(PROFILE), latency=latency or LatencyModel.as_measured())
    dev = open_device(f"sim:{PROFILE}", profile=profile)
    run = PolicyRun(policy)
    try:
        pol = parse_policy(policy)
        alloc = make_allocator(dev, pol)
        sink = _Sink(alloc, dev, window, run)
        stream_inference(shape, dtype_bytes, (sink,), prompt_len=prompt, new_tokens=new_tokens,
                         on_step=sink.end_step, decode_slack=decode_slack)
        alloc.close()
    finally:
        dev.close()
    return run


def ring_run(policy: str, *, blocks: int, steps: int, prompt: int, token_nbytes: int, weights_nbytes: int,
              activation_nbytes: int = 4096, window: int = 100) -> PolicyRun:
    """The KV cache's pattern alone: ``blocks`` tensors of ``(prompt + t) * token_nbytes`` at step ``t``, each
    allocated before the old one is freed, an activation of ``activation_nbytes`` allocated before and freed
    after each; weights of ``weights_nbytes`` held throughout. No estimate emitter; calls priced idle (the default latency model)."""
    dev = open_device(f"sim:{PROFILE}")
    run = PolicyRun(policy)
    try:
        a = make_allocator(dev, parse_policy(policy))
        a.allocate(weights_nbytes, 0)
        cache = [a.allocate(prompt * token_nbytes, 0) for _ in range(blocks)]
        sink = _Sink(a, dev, window, run)
        sink.end_step(0)
        for t in range(1, steps + 1):
            for i in range(blocks):
                x = a.allocate(activation_nbytes, 0)
                new = a.allocate((prompt + t) * token_nbytes, 0)
                a.free(cache[i])
                cache[i] = new
                a.free(x)
                run.peak_reserved_nbytes = max(run.peak_reserved_nbytes, a.reserved_nbytes)
                run.peak_allocated_nbytes = max(run.peak_allocated_nbytes, a.allocated_nbytes)
            sink.end_step(t)
        a.close()
    finally:
        dev.close()
    return run


def corpus_rows(part: str, policies: list[str]) -> list[dict]:
    """Every trace of corpus ``part`` under each policy, GPU idle and behind: overhead and calls."""
    from gpumem.replay import replay_trace
    from gpumem.trace import load_trace
    from gpumem.trace.corpus import corpus_traces

    rows = []
    for path in corpus_traces(part):
        trace = load_trace(path)
        half = trace.head(trace.n_ops // 2)
        for timing in ("idle", "trace"):
            for pol in policies:
                r = replay_trace(trace, f"sim:{PROFILE}", parse_policy(pol), progress=False, gpu_timing=timing)
                h = replay_trace(half, f"sim:{PROFILE}", parse_policy(pol), progress=False, gpu_timing=timing)
                rows.append({"trace": path.name.removesuffix(".gz"), "timing": timing, "policy": pol,
                             "overhead": r.overhead, "ooms": r.ooms, "calls": r.stats.device_calls,
                             "event_calls": r.stats.event_calls,
                             "calls_second_half": r.stats.device_calls - h.stats.device_calls,
                             "event_calls_second_half": r.stats.event_calls - h.stats.event_calls})
    return rows


def corpus_table(rows: list[dict]) -> str:
    lines = ["| trace | timing | policy | overhead | memory calls (second half) | event calls (second half) |",
             "|---|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['trace']} | {r['timing']} | {r['policy']} | {r['overhead']:.3%} | "
                     f"{r['calls']:,} ({r['calls_second_half']:,}) | "
                     f"{r['event_calls']:,} ({r['event_calls_second_half']:,}) |")
    return "\n".join(lines)


def table(runs: list[PolicyRun]) -> str:
    """Per window: calls / step (memory + event), modelled µs / step, most held (GB), per policy."""
    head = "| steps | " + " | ".join(f"{r.policy}: calls / step (mem + event), µs / step, held GB" for r in runs) + " |"
    lines = [head, "|---|" + "---|" * len(runs)]
    for i, w0 in enumerate(runs[0].windows):
        cells = []
        for r in runs:
            if i >= len(r.windows):
                cells.append("-")
                continue
            w = r.windows[i]
            cells.append(f"{w.device_calls / w.steps:.1f} + {w.event_calls / w.steps:.1f}, "
                         f"{w.cost_us / w.steps:.0f}, {w.max_reserved_nbytes / 1e9:.3f}")
        lines.append(f"| {w0.first}-{w0.last} | " + " | ".join(cells) + " |")
    lines.append("| peak held / peak allocated | " + " | ".join(
        f"{r.peak_reserved_nbytes / 1e9:.3f} / {r.peak_allocated_nbytes / 1e9:.3f} GB "
        f"({r.peak_reserved_nbytes / max(r.peak_allocated_nbytes, 1) - 1:+.2%})"
        + (f", OOM at step {r.oom_step}" if r.oom_step >= 0 else "") for r in runs) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.decode_calls", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="7b", help="the model shape (default 7b)")
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens (default 2048)")
    p.add_argument("--new-tokens", type=int, default=3500, help="tokens generated (default 3500)")
    p.add_argument("--window", type=int, default=100, help="decode steps per row (default 100)")
    p.add_argument("--policies", default="gpumem,pytorch,expandable",
                   help="comma-separated policies; ';' separates when a policy has options (default "
                        "gpumem,pytorch,expandable)")
    p.add_argument("--ring", type=int, metavar="BLOCKS", help="the ring of growing blocks instead (ring_run)")
    p.add_argument("--weights-mib", type=int, default=1024, help="--ring: weights held (MiB, default 1024)")
    p.add_argument("--ring-token-nbytes", type=int, default=4096, help="--ring: bytes per token (default 4096)")
    p.add_argument("--corpus", choices=("tuning", "check"), help="replay this corpus part's traces instead")
    p.add_argument("--json", type=Path, help="write the windows (or the corpus rows) here")
    slack = p.add_mutually_exclusive_group()
    slack.add_argument("--decode-slack", action="store_true",
                       help="add the decode slack to every policy's ops (the block the estimate gave the gpumem "
                            "replay before it ran the GPU's lag: Note [The GPU's lag in the decode replay] in "
                            "gpumem/estimate/fit.py); the peak allocated printed then counts it")
    slack.add_argument("--no-decode-slack", action="store_true",
                       help="the program's requests only: the default since 2026-11-30 (kept for recorded commands)")
    args = p.parse_args(argv)
    if (args.no_decode_slack or args.decode_slack) and (args.ring is not None or args.corpus):
        p.error("--decode-slack and --no-decode-slack are for the model's decode, not --ring or --corpus")
    if args.prompt < 1 or args.new_tokens < 2 or args.window < 1:
        p.error("--prompt and --window must be >= 1, --new-tokens >= 2")
    if args.json is not None and (why := json_target_problem(args.json)):
        p.error(f"--json: {why}")
    sep = ";" if ";" in args.policies else ","
    policies = [s for s in args.policies.split(sep) if s]
    if not policies:
        p.error("--policies: no policy given")
    for pol in policies:   # every policy checked before the first run
        try:
            parse_policy(pol)
        except WorkloadInputError as exc:
            p.error(f"--policies: {exc}")
    if args.ring is not None and (args.ring < 1 or args.weights_mib < 1 or args.ring_token_nbytes < 1):
        p.error("--ring, --weights-mib and --ring-token-nbytes must be >= 1")
    try:
        return _study(args, policies)
    except GpumemError as exc:   # out of memory on the simulated device (weights larger than it), ...
        p.error(f"{type(exc).__name__}: {exc}")


def _study(args: argparse.Namespace, policies: list[str]) -> int:
    """The rows :func:`main` asked for, printed (and written to ``--json``)."""
    if args.ring is not None:
        runs = [ring_run(pol, blocks=args.ring, steps=args.new_tokens - 1, prompt=args.prompt,
                         token_nbytes=args.ring_token_nbytes, weights_nbytes=args.weights_mib << 20,
                         window=args.window) for pol in policies]
        print(f"ring of {args.ring} growing blocks, {args.ring_token_nbytes} bytes per token from {args.prompt}, "
              f"{args.weights_mib} MiB of weights, sim:{PROFILE}")
        print(table(runs))
        return 0
    if args.corpus:
        rows = corpus_rows(args.corpus, policies)
        print(f"corpus part {args.corpus}, sim:{PROFILE}")
        print(corpus_table(rows))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    runs = [decode_run(MODELS[args.model], pol, prompt=args.prompt, new_tokens=args.new_tokens,
                       window=args.window, decode_slack=args.decode_slack) for pol in policies]
    print(f"model {args.model}, prompt {args.prompt}, {args.new_tokens} new tokens, batch 1, bf16, sim:{PROFILE} "
          f"priced as measured, GPU idle, {'with the decode slack' if args.decode_slack else 'no decode slack'}")
    print(table(runs))
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in runs], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
