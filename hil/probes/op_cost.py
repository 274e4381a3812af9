"""Where a PyTorch allocation's time goes: gpumem.torch against PyTorch's allocator, per operation (issue 18).

Live, a 3,000-token ``generate()`` ran 18.7 % slower per token on gpumem.torch than on PyTorch's allocator
(``reports/hil/live-long-decode-h200-2026-11-28.md``) with few device calls, so the cost is per operation.
This probe splits it. Each configuration runs in its own process (an allocator is chosen once per process):

* ``default``: PyTorch's caching allocator; ``default-history``: the same recording its memory history, as
  the workloads probe does;
* ``gpumem``: gpumem.torch with its trace recorder off; ``gpumem-trace``: on, as the workloads probe runs it.

and measures, with no GPU work queued:

* ``pairs``: ``torch.empty`` then its release, over a cycle of sizes from 512 B to 8 MiB, ns per pair;
* ``burst``: 64 tensors of those sizes made, then released oldest first (blocks split and merge), ns per pair;
* ``hook`` (gpumem only): the same pairs through gpumem's C functions called directly (ctypes), less the
  cost of a ctypes call of a trivial C function: the engine's share, without PyTorch's pluggable wrapper;
* ``decode``: the workloads probe's long-decode model (``llama_long_decode``: 8 layers, d 1024, bf16) with a
  512-token prompt, ``--decode-tokens`` new tokens, one request to warm up then one timed: ms per token, wall
  and CPU (a decode of this size is bound by the CPU, so CPU time per token is the allocator's to win).

Run on the GPU: ``python -m hil.probes.op_cost --out DIR [--configs default,gpumem] [--decode-tokens 300]``;
a table is printed and ``DIR/op-cost.json`` written.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

CONFIGS = ("default", "default-history", "gpumem", "gpumem-trace")
#: Sizes the pair and burst loops cycle through (bytes): a decode step's spread, small to a KV cache's.
SIZES_NBYTES = (512, 4096, 65536, 1 << 20, 3 << 20, (8 << 20) + 4096)
BURST = 64


def _pairs(torch: Any, n: int) -> float:
    sizes = [SIZES_NBYTES[i % len(SIZES_NBYTES)] for i in range(n)]
    empty, u8 = torch.empty, torch.uint8
    t0 = time.perf_counter_ns()
    for nb in sizes:
        t = empty(nb, dtype=u8, device="cuda")
        del t
    return (time.perf_counter_ns() - t0) / n


def _burst(torch: Any, rounds: int) -> float:
    sizes = [SIZES_NBYTES[i % len(SIZES_NBYTES)] for i in range(BURST)]
    empty, u8 = torch.empty, torch.uint8
    t0 = time.perf_counter_ns()
    for _ in range(rounds):
        held = [empty(nb, dtype=u8, device="cuda") for nb in sizes]
        for i in range(BURST):
            held[i] = None
    return (time.perf_counter_ns() - t0) / (rounds * BURST)


def _hook_pairs(torch: Any, n: int) -> tuple[float, float]:
    """ns per pair through gpumem_torch_malloc/free called by ctypes, and ns of a trivial ctypes call."""
    import gpumem.torch as gt

    lib = ctypes.CDLL(gt.library_path())
    lib.gpumem_torch_malloc.restype = ctypes.c_void_p
    lib.gpumem_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.gpumem_torch_free.restype = None
    lib.gpumem_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    sizes = [SIZES_NBYTES[i % len(SIZES_NBYTES)] for i in range(n)]
    malloc, free = lib.gpumem_torch_malloc, lib.gpumem_torch_free
    t0 = time.perf_counter_ns()
    for nb in sizes:
        p = malloc(nb, 0, stream)
        free(p, nb, 0, stream)
    pair_ns = (time.perf_counter_ns() - t0) / n
    libc = ctypes.CDLL(None)
    labs = libc.labs
    labs.restype, labs.argtypes = ctypes.c_long, [ctypes.c_long]
    t0 = time.perf_counter_ns()
    for nb in sizes:
        labs(nb)
        labs(nb)
    call_ns = (time.perf_counter_ns() - t0) / n
    return pair_ns, call_ns


def _decode(torch: Any, new_tokens: int) -> dict[str, float]:
    from .workloads import LONG_DECODE_CONFIG, LONG_DECODE_PROMPT, _hf_causal

    torch.manual_seed(0)
    model = _hf_causal(torch, "llama", **LONG_DECODE_CONFIG).to(torch.bfloat16)
    model.eval()
    out: dict[str, float] = {}
    for request in range(2):
        ids = torch.randint(0, 32000, (1, LONG_DECODE_PROMPT), device="cuda")
        torch.cuda.synchronize()
        w0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
        torch.cuda.synchronize()
        wall_s, cpu_s = time.perf_counter() - w0, time.process_time() - c0
        if request == 1:
            out = {"decode_ms_per_token": wall_s / new_tokens * 1e3, "decode_cpu_ms_per_token": cpu_s / new_tokens * 1e3,
                   "decode_checksum": float(gen[:, LONG_DECODE_PROMPT:].sum().item())}
    return out


def _profile_decode(torch: Any, new_tokens: int, top: int = 15) -> dict[str, Any]:
    """A short decode under ``torch.profiler``: the ops of most self CPU and self CUDA time (µs, whole run)."""
    from torch.profiler import ProfilerActivity, profile

    from .workloads import LONG_DECODE_CONFIG, LONG_DECODE_PROMPT, _hf_causal

    torch.manual_seed(0)
    model = _hf_causal(torch, "llama", **LONG_DECODE_CONFIG).to(torch.bfloat16)
    model.eval()
    ids = torch.randint(0, 32000, (1, LONG_DECODE_PROMPT), device="cuda")

    def run() -> None:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
        torch.cuda.synchronize()

    run()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    events = prof.key_averages()
    cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    gpu = sorted(events, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:top]
    return {"profile_tokens": new_tokens,
            "profile_self_cpu_us": [[e.key, e.count, round(e.self_cpu_time_total, 1)] for e in cpu],
            "profile_self_cuda_us": [[e.key, e.count, round(getattr(e, "self_device_time_total", 0), 1)] for e in gpu],
            "profile_total_self_cpu_us": round(sum(e.self_cpu_time_total for e in events), 1),
            "profile_total_self_cuda_us": round(sum(getattr(e, "self_device_time_total", 0) for e in events), 1)}


def run_child(config: str, n_pairs: int, decode_tokens: int, profile_tokens: int = 0) -> dict[str, Any]:
    """Measures one configuration in this process (see the module's docstring)."""
    if config.startswith("gpumem"):
        import gpumem.torch as gt

        gt.install()
        if config == "gpumem-trace":
            gt.start_trace()
    import torch

    if config == "default-history":
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=4_000_000)
    torch.zeros(1, device="cuda")
    _pairs(torch, 2000)   # warm: every size cached once
    record: dict[str, Any] = {"config": config, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    record["pairs_ns"] = min(_pairs(torch, n_pairs) for _ in range(3))
    record["burst_ns"] = min(_burst(torch, max(1, n_pairs // BURST)) for _ in range(3))
    if config.startswith("gpumem"):
        pair_ns, call_ns = min(_hook_pairs(torch, n_pairs) for _ in range(3))
        record.update(hook_pairs_ns=pair_ns, ctypes_two_calls_ns=call_ns, hook_engine_ns=pair_ns - call_ns)
    if decode_tokens:
        record.update(_decode(torch, decode_tokens))
    if profile_tokens:
        record.update(_profile_decode(torch, profile_tokens))
    if config.startswith("gpumem"):
        import gpumem.torch as gt

        st = gt.memory_stats(0)
        record.update({k: st[k] for k in ("num_device_calls", "num_event_calls", "gpumem.n_steals", "gpumem.n_waits")
                       if k in st})
    else:
        st = torch.cuda.memory_stats(0)
        record["num_device_calls"] = int(st.get("num_device_alloc", 0)) + int(st.get("num_device_free", 0))
    return record


def _last_line(text: str) -> str:
    """The last non-empty line of a child's output: the exception of a traceback."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def table(records: Sequence[dict[str, Any]]) -> str:
    """A markdown table of the records, ratios against ``default`` where it ran."""
    base = next((r for r in records if r["config"] == "default"), None)
    rows = ["| config | pairs ns | burst ns | hook ns (engine) | decode ms/token | CPU ms/token | vs default | device calls |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        if "error" in r:
            reason = r["error"].replace("|", "/").replace("\n", " ")[:120]
            rows.append(f"| {r['config']} | failed: {reason} | | | | | | |")
            continue
        ratio = (f"{r['decode_ms_per_token'] / base['decode_ms_per_token'] - 1:+.1%}"
                 if base and "decode_ms_per_token" in r and "decode_ms_per_token" in base else "")
        hook = f"{r['hook_pairs_ns']:.0f} ({r['hook_engine_ns']:.0f})" if "hook_pairs_ns" in r else ""
        rows.append(f"| {r['config']} | {r['pairs_ns']:.0f} | {r['burst_ns']:.0f} | {hook} | "
                    f"{r.get('decode_ms_per_token', float('nan')):.2f} | {r.get('decode_cpu_ms_per_token', float('nan')):.2f} | "
                    f"{ratio} | {r.get('num_device_calls', '')} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hil.probes.op_cost", description=__doc__.split("\n\n")[0] +
                                 " Needs PyTorch with a CUDA GPU (and transformers for the decode).")
    ap.add_argument("--out", type=Path, help="folder for op-cost.json (required)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--pairs", type=int, default=60_000, help="allocations per timed loop (default 60000)")
    ap.add_argument("--decode-tokens", type=int, default=300, help="new tokens of the timed decode; 0: no decode")
    ap.add_argument("--profile-tokens", type=int, default=0,
                    help="also profile a decode of this many new tokens (torch.profiler; top ops in the JSON)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration (default 300)")
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.decode_tokens < 0 or args.profile_tokens < 0:
        ap.error("--pairs must be at least 1, --decode-tokens and --profile-tokens at least 0")
    if args.child:
        print(json.dumps(run_child(args.child, args.pairs, args.decode_tokens, args.profile_tokens)))
        return 0
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        ap.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    if args.out is None:
        ap.error("--out is required")
    try:
        import torch
    except ImportError:
        ap.error("needs PyTorch (and a CUDA GPU): import torch failed")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU: torch.cuda.is_available() is False")
    records = []
    for config in configs:
        cmd = [sys.executable, "-m", "hil.probes.op_cost", "--child", config, "--pairs", str(args.pairs),
               "--decode-tokens", str(args.decode_tokens), "--profile-tokens", str(args.profile_tokens)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
            records.append(json.loads(last) if done.returncode == 0 and last.startswith("{")
                           else {"config": config, "error": _last_line(done.stderr or done.stdout)})
        except subprocess.TimeoutExpired:
            records.append({"config": config, "error": f"timed out after {args.timeout:.0f} s"})
        log.info("%s %s", config, "failed: " + records[-1]["error"] if "error" in records[-1] else "done")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "op-cost.json").write_text(json.dumps(records, indent=1))
    print(table(records))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
