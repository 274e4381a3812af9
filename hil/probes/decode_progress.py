"""A long ``generate()`` with what the allocator did every ``--window`` tokens, printed as it goes.

``hil.probes.workloads live`` reports a request only once it has finished, and a 7B decode of thousands of tokens
can outlive the device tool's time for one call; then nothing of it comes back. This probe prints one line per
window of tokens while the request runs, so a run cut short still says where it was and what the allocator did:

* the time per token over the window (the first window's includes the prefill of the prompt);
* under gpumem.torch, made in the window: ``dev`` driver memory calls (create, map, set access, unmap,
  release), ``ev`` event calls, ``steals`` pages moved from an idle place to a needed one, ``nallocs``
  allocations (:func:`gpumem.torch.memory_stats`);
* at the window's end: ``res`` bytes held, ``alloc`` bytes allocated, ``peak_res``/``peak_alloc`` their peaks
  (under PyTorch's allocator: ``torch.cuda.memory_reserved()`` and the like; ``nallocs`` there is PyTorch's
  count since the start).

After each request one ``request`` line gives its seconds and the counters since the process started.

Needs a CUDA GPU with torch and transformers (about 17 GB of GPU memory; about 5 minutes for 4,500 SDPA tokens on
an H200).

The model is ``llama7b_long_decode``'s (``hil/probes/workloads.py``: Llama-7B's shape, random bf16 weights made on
the GPU, greedy ``generate()`` with the ``DynamicCache`` grown by ``torch.cat``), with eager or SDPA attention.
PyTorch's default dtype is bf16 for the whole run, as the records' runs were made (``hil.probes.workloads`` sets it
only while building the model). Two requests run: a 32-token one (warm-up), then one of ``--new-tokens``. Lines go
to stdout; ``--json`` also writes them as a list of objects, rewritten after every window (a run cut short keeps
what it printed). ``--record FILE`` (gpumem only) also records gpumem's trace of the whole process and saves it at
the end: a short decode recorded so is what ``python -m sim.extend_decode`` extends to thousands of tokens for a
replay::

    python -m hil.probes.decode_progress --allocator gpumem --attention sdpa --new-tokens 4500
    python -m hil.probes.decode_progress --allocator gpumem --attention sdpa --new-tokens 96 --record short.gmt.gz
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

WARMUP_TOKENS = 32
MAX_POSITIONS = 8192
"""``LONG7B_CONFIG``'s ``max_position_embeddings``: prompt and new tokens together at most this."""
STEAL_KEY = "gpumem.n_steals"
COUNTED = ("dev", "ev", "steals", "nallocs")
"""Keys of a window's line that are counts made in the window (the others are levels at its end)."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hil.probes.decode_progress", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--allocator", choices=("gpumem", "default"), required=True,
                   help="'gpumem' (gpumem.torch.install(), nothing set) or 'default' (PyTorch's own allocator)")
    p.add_argument("--attention", choices=("eager", "sdpa"), default="sdpa",
                   help="the model's attention implementation (default sdpa, transformers' default)")
    p.add_argument("--new-tokens", type=_positive, default=4500, help="new tokens of the second request (4500)")
    p.add_argument("--prompt", type=_positive, default=2048, help="prompt tokens of both requests (2048)")
    p.add_argument("--batch", type=_positive, default=1, help="sequences per request, both requests (1)")
    p.add_argument("--window", type=_positive, default=250, help="tokens per printed line (250)")
    p.add_argument("--json", type=Path, help="also write every line, as JSON, to this file (rewritten after every "
                                             "window)")
    p.add_argument("--record", type=Path,
                   help="under gpumem, record every allocation from before the model is built and save the trace "
                        "here at the end (e.g. short.gmt.gz; a few dozen tokens are enough for "
                        "python -m sim.extend_decode, and a 4,500-token trace takes minutes to write)")
    p.add_argument("--gpu-clock", action="store_true",
                   help="with --record, also record when the GPU ran each op's queued work (start_trace(gpu_clock="
                        "True)): the trace then carries its GPU clock, and gpumem replay runs the program's GPU "
                        "work on it")
    return p


def _arguments_problem(args: argparse.Namespace) -> str:
    """Why the arguments cannot work, or ``""``: checked before minutes on the GPU."""
    from sim.cli_checks import json_target_problem

    if args.prompt + args.new_tokens > MAX_POSITIONS:
        return (f"--prompt {args.prompt:,} + --new-tokens {args.new_tokens:,} is more than the model's "
                f"{MAX_POSITIONS:,} positions (max_position_embeddings)")
    if args.gpu_clock and args.record is None:
        return "--gpu-clock needs --record (the clock is saved in the trace)"
    if args.record is not None:
        if args.allocator != "gpumem":
            return ("--record needs --allocator gpumem (PyTorch's allocator: hil.probes.workloads records its memory "
                    "history)")
        if not (args.record.name.endswith(".gmt") or args.record.name.endswith(".gmt.gz")):
            return f"--record {args.record}: gpumem's trace format: name it .gmt or .gmt.gz"
    for target in (args.json, args.record):
        if target is not None and (why := json_target_problem(target)):
            return why
    if args.json is not None and args.record is not None and args.json.resolve() == args.record.resolve():
        return "--json and --record name the same file"
    return ""


def _write_json(args: argparse.Namespace, lines: list[dict]) -> None:
    """Write the lines so far: to a temporary file beside ``--json``, then renamed over it (a run killed while
    writing leaves the previous whole file)."""
    if args.json is None:
        return
    tmp = args.json.with_name(f".{args.json.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"allocator": args.allocator, "attention": args.attention, "batch": args.batch,
                               "prompt": args.prompt, "new_tokens": args.new_tokens, "window": args.window,
                               "lines": lines}, indent=1) + "\n")
    os.replace(tmp, args.json)


def window_line(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """A window's figures: counts made in it (:data:`COUNTED`), levels (bytes held, allocated...) at its end."""
    return {k: after[k] - before.get(k, 0) if k in COUNTED else after[k] for k in after}


def _stats_reader(torch: Any, allocator: str) -> Callable[[], dict[str, int]]:
    if allocator == "gpumem":
        import gpumem.torch as gt

        def gpumem_stats() -> dict[str, int]:
            s = gt.memory_stats()
            return dict(dev=s["num_device_calls"], ev=s["num_event_calls"], steals=s.get(STEAL_KEY, -1),
                        res=s["reserved_bytes.all.current"], alloc=s["allocated_bytes.all.current"],
                        nallocs=s["num_allocs"], peak_res=s["reserved_bytes.all.peak"],
                        peak_alloc=s["allocated_bytes.all.peak"])
        return gpumem_stats

    def torch_stats() -> dict[str, int]:
        return dict(res=torch.cuda.memory_reserved(), alloc=torch.cuda.memory_allocated(),
                    peak_res=torch.cuda.max_memory_reserved(), peak_alloc=torch.cuda.max_memory_allocated(),
                    nallocs=torch.cuda.memory_stats().get("allocation.all.allocated", 0))
    return torch_stats


class _WindowClock:
    """A ``generate()`` streamer: every ``window`` tokens, one line of time per token and allocator figures."""

    def __init__(self, label: str, window: int, stats: Callable[[], dict[str, int]], lines: list[dict],
                 written: Callable[[], None]) -> None:
        self.label, self.window, self.stats, self.lines, self.written = label, window, stats, lines, written
        self.n = -1  # the first put is the prompt
        self.t_s = time.perf_counter()
        self.last = stats()

    def put(self, value: Any) -> None:
        self.n += 1
        if self.n and self.n % self.window == 0:
            now_s, now = time.perf_counter(), self.stats()
            line = window_line(self.last, now)
            ms = (now_s - self.t_s) / self.window * 1e3
            print(f"[{self.label}] tok {self.n} {ms:.2f} ms/tok {json.dumps(line)}", flush=True)
            self.lines.append({"token": self.n, "ms_per_token": round(ms, 3), **line})
            self.written()
            self.t_s, self.last = now_s, now

    def end(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = _arguments_problem(args)
    if problem:
        print(f"decode_progress: {problem}", file=sys.stderr)
        return 2
    try:
        import torch
        import transformers  # noqa: F401 - checked here, used below
    except ImportError as exc:
        print(f"decode_progress: needs torch and transformers: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("decode_progress: no CUDA device", file=sys.stderr)
        return 2
    if args.allocator == "gpumem":
        import gpumem.torch as gt
        gt.install()
        if args.record is not None:
            gt.start_trace(gpu_clock=args.gpu_clock)
    from transformers import LlamaConfig, LlamaForCausalLM

    from hil.probes.workloads import LONG7B_CONFIG

    config = LlamaConfig(**LONG7B_CONFIG)
    config._attn_implementation = args.attention
    label = f"{args.allocator}/{args.attention}"
    torch.set_default_dtype(torch.bfloat16)  # for the whole run, as the records' runs were made
    t0_s = time.perf_counter()
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    model.eval()
    torch.cuda.synchronize()
    print(f"[{label}] model built {time.perf_counter() - t0_s:.1f}s", flush=True)
    stats = _stats_reader(torch, args.allocator)
    lines: list[dict] = []
    for n in (WARMUP_TOKENS, args.new_tokens):
        ids = torch.randint(0, config.vocab_size, (args.batch, args.prompt), device="cuda")
        clock = _WindowClock(label, args.window, stats, lines, lambda: _write_json(args, lines))
        t_s = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, use_cache=True, pad_token_id=0, streamer=clock)
        torch.cuda.synchronize()
        request_s = time.perf_counter() - t_s
        end = stats()
        print(f"[{label}] request {n} tokens {request_s:.1f}s {json.dumps(end)}", flush=True)
        lines.append({"request_tokens": n, "request_s": round(request_s, 3), **end})
    if args.record is not None:
        from gpumem.trace import save_trace

        gt.stop_trace()
        name = (f"7B {args.attention} decode of {args.new_tokens} tokens, batch {args.batch}, prompt {args.prompt}, "
                "on gpumem.torch")
        save_trace(gt.recorded_trace(0, name=name), args.record)
        print(f"[{label}] trace saved to {args.record}" + (" (with its GPU clock)" if args.gpu_clock else ""),
              flush=True)
    _write_json(args, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
