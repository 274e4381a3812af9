"""Train real models under three CUDA allocators and compare memory, losses and speed (H200 evidence).

GPT-2 small (``transformers.GPT2LMHeadModel`` from ``GPT2Config()``) and ResNet-50 (torchvision's
``resnet50``, or ``transformers.ResNetForImageClassification`` with the ResNet-50 layout where
torchvision is missing), random initialisation, synthetic data, fixed seeds and deterministic
algorithms, are each trained ``--steps`` steps under

* ``default``    - PyTorch's CUDA caching allocator as shipped;
* ``expandable`` - the same with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``;
* ``gpumem``     - gpumem's native engine (``gpumem.torch.install()``).

Each run is its own process (PyTorch takes its allocator before CUDA starts), one after the other.
Per run it records every step's loss (the runs must agree bit for bit: the allocator changes
addresses, never results), peak allocated and peak reserved bytes (PyTorch's counters for its
allocator, :func:`gpumem.torch.memory_stats` for gpumem), the device memory in use at the end
(``cudaMemGetInfo``, allocator-independent) and the mean step time after warm-up (the GPU
synchronised only at the ends of the timed window). Writes ``train-<gpu>-<date>.json`` and a
Markdown record with the issue's targets (peak reserved at most 1 % above peak allocated; step time
within 2 % of the default allocator) into ``--out``.

Run: ``python -m hil.probes.train [--steps 300] [--out reports/hil]``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODELS = ("gpt2", "resnet50")
ALLOCATORS = ("default", "expandable", "gpumem")

#: Note [Deterministic cuBLAS]: cuBLAS picks reduction orders that vary between runs unless its
#: workspace is configured; PyTorch's deterministic mode requires this setting.
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


# -- one run (child process) ----------------------------------------------------------------------------
def _build(model_name: str, torch: Any, batch: int, seq_len: int) -> tuple[Any, Any, str]:
    """The model (on the GPU) and a function making step ``i``'s synthetic batch and loss."""
    if model_name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config()
        config.n_positions = max(config.n_positions, seq_len)
        # Note [Eager attention]: the fused attention kernels' backward passes are not deterministic
        # (PyTorch only warns under warn_only=True); the eager path is matmuls and a softmax.
        config._attn_implementation = "eager"
        model = GPT2LMHeadModel(config).cuda()
        vocab = config.vocab_size

        def step_loss(gen: Any) -> Any:
            ids = torch.randint(0, vocab, (batch, seq_len), device="cuda", generator=gen)
            return model(input_ids=ids, labels=ids).loss

        return model, step_loss, f"GPT-2 small (GPT2Config(), {sum(p.numel() for p in model.parameters()):,} parameters)"
    if model_name == "resnet50":
        try:
            import torchvision

            model = torchvision.models.resnet50(weights=None).cuda()
            source = "torchvision resnet50(weights=None)"

            def forward(x: Any) -> Any:
                return model(x)
        except ImportError:
            from transformers import ResNetConfig, ResNetForImageClassification

            cfg = ResNetConfig(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3],
                               layer_type="bottleneck", num_labels=1000)
            model = ResNetForImageClassification(cfg).cuda()
            source = "transformers ResNetForImageClassification (ResNet-50 layout)"

            def forward(x: Any) -> Any:
                return model(pixel_values=x).logits
        loss_fn = torch.nn.CrossEntropyLoss()

        def step_loss(gen: Any) -> Any:
            x = torch.randn((batch, 3, 224, 224), device="cuda", generator=gen)
            y = torch.randint(0, 1000, (batch,), device="cuda", generator=gen)
            return loss_fn(forward(x), y)

        return model, step_loss, f"ResNet-50 ({source}, {sum(p.numel() for p in model.parameters()):,} parameters)"
    raise SystemExit(f"unknown model {model_name!r}; choose from {', '.join(MODELS)}")


def _spin(seconds: float) -> None:
    """Keep the CPU busy for ``seconds`` (a sleep would let the launch queue drain the same way, but a
    busy CPU is what an allocator's driver calls are)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run_child(model_name: str, allocator: str, steps: int, warmup: int, batch: int, seq_len: int,
              cpu_spin_ms: float = 0.0) -> dict[str, Any]:
    """Trains one model under one allocator in this process; returns the record. ``cpu_spin_ms``: CPU time
    added to every step (busy), to measure how much CPU time a step absorbs before it slows down."""
    if allocator == "gpumem":
        import gpumem.torch as gt

        gt.install()  # before anything touches CUDA
    import warnings

    import torch

    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    model, step_loss, description = _build(model_name, torch, batch, seq_len)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device="cuda")
    losses = torch.empty(steps, dtype=torch.float32, device="cuda")
    t_start = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            if i == warmup:
                torch.cuda.synchronize()
                t_start = time.perf_counter()
            gen.manual_seed(1000 + i)
            loss = step_loss(gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses[i] = loss.detach()
            if cpu_spin_ms:
                _spin(cpu_spin_ms / 1e3)
        torch.cuda.synchronize()
    elapsed_s = time.perf_counter() - t_start
    free_b, total_b = torch.cuda.mem_get_info()
    record: dict[str, Any] = {
        "model": model_name, "description": description, "allocator": allocator, "steps": steps, "warmup": warmup,
        "cpu_spin_ms": cpu_spin_ms,
        "batch": batch, "seq_len": seq_len if model_name == "gpt2" else None,
        "losses": [float(x) for x in losses.cpu().tolist()],
        "mean_step_ms": elapsed_s / (steps - warmup) * 1e3,
        "device_used_bytes_at_end": int(total_b - free_b),
        "nondeterministic_warnings": sorted({str(w.message).split(".")[0] for w in caught
                                             if "deterministic" in str(w.message)}),
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
    }
    if allocator == "gpumem":
        import gpumem.torch as gt

        st = gt.memory_stats(0)
        record.update(peak_allocated_bytes=st["allocated_bytes.all.peak"],
                      peak_reserved_bytes=st["reserved_bytes.all.peak"],
                      peak_requested_bytes=st["requested_bytes.all.peak"], num_allocs=st["num_allocs"],
                      num_device_calls=st["num_device_calls"], num_event_calls=st["num_event_calls"],
                      num_ooms=st["num_ooms"], summary=gt.memory_summary(0))
    else:
        st = torch.cuda.memory_stats(0)
        record.update(peak_allocated_bytes=int(st["allocated_bytes.all.peak"]),
                      peak_reserved_bytes=int(st["reserved_bytes.all.peak"]),
                      peak_requested_bytes=int(st.get("requested_bytes.all.peak", 0)),
                      num_allocs=int(st["allocation.all.allocated"]),
                      num_device_calls=int(st.get("num_device_alloc", 0)) + int(st.get("num_device_free", 0)),
                      num_ooms=int(st["num_ooms"]))
    return record


# -- the comparison (parent process) -------------------------------------------------------------------
def _child_env(allocator: str) -> dict[str, str]:
    env = dict(os.environ)
    env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3f}"


def render_markdown(result: dict[str, Any]) -> str:
    lines = [f"# PyTorch training under three allocators: {result['gpu']} ({result['date']})", "",
             f"`python -m hil.probes.train --steps {result['steps']} --warmup {result['warmup']}`; "
             f"PyTorch {result['torch']}; each run its own process, one after the other; fp32, AdamW, "
             "synthetic data, fixed seeds, `torch.use_deterministic_algorithms(True, warn_only=True)`, "
             f"`CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE_CONFIG}`. Peaks: PyTorch's counters for its allocator, "
             "`gpumem.torch.memory_stats()` for gpumem. Overhead = peak reserved / peak allocated - 1. "
             "Step time: mean over the steps after warm-up (GPU synchronised at the ends of the window).", ""]
    for model in result["models"]:
        runs = {r["allocator"]: r for r in result["runs"] if r["model"] == model and "error" not in r}
        failed = [r for r in result["runs"] if r["model"] == model and "error" in r]
        if not runs and not failed:
            continue
        first = next(iter(runs.values()), None)
        lines += [f"## {first['description'] if first else model}", ""]
        if first:
            extra = f", sequence {first['seq_len']}" if first.get("seq_len") else ""
            lines += [f"batch {first['batch']}{extra}, {first['steps']} steps ({first['warmup']} warm-up)", ""]
        lines += ["| allocator | peak allocated GiB | peak reserved GiB | overhead | device used at end GiB "
                  "| step ms | vs default | final loss | losses equal to default |",
                  "|---|---|---|---|---|---|---|---|---|"]
        base = runs.get("default")
        for name in ALLOCATORS:
            r = runs.get(name)
            if r is None:
                continue
            over = r["peak_reserved_bytes"] / r["peak_allocated_bytes"] - 1 if r["peak_allocated_bytes"] else float("nan")
            vs = f"{(r['mean_step_ms'] / base['mean_step_ms'] - 1) * 100:+.2f} %" if base else "n/a"
            equal = ("(reference)" if name == "default" else
                     ("yes" if base and r["losses"] == base["losses"] else
                      f"no (max abs diff {max(abs(a - b) for a, b in zip(r['losses'], base['losses'])):.3g})"
                      if base else "n/a"))
            lines.append(f"| {name} | {_gib(r['peak_allocated_bytes'])} | {_gib(r['peak_reserved_bytes'])} | "
                         f"{over * 100:.2f} % | {_gib(r['device_used_bytes_at_end'])} | {r['mean_step_ms']:.2f} | {vs} | "
                         f"{r['losses'][-1]:.6f} | {equal} |")
        for r in failed:
            lines.append(f"| {r['allocator']} | failed: {r['error'][:200]} | | | | | | | |")
        warned = sorted({w for r in runs.values() for w in r.get("nondeterministic_warnings", [])})
        if warned:
            lines += ["", "Operations without a deterministic implementation (PyTorch warned): " + "; ".join(warned)]
        if "gpumem" in runs:
            g = runs["gpumem"]
            lines += ["", f"gpumem: {g['num_allocs']:,} allocations, {g['num_device_calls']:,} driver memory calls, "
                          f"{g.get('num_event_calls', 0):,} event calls.", "", "```", g.get("summary", ""), "```"]
        lines.append("")
    lines += ["## Targets (issue 7)", ""]
    for model in result["models"]:
        runs = {r["allocator"]: r for r in result["runs"] if r["model"] == model and "error" not in r}
        g, base = runs.get("gpumem"), runs.get("default")
        if not g:
            lines.append(f"- {model}: no gpumem run")
            continue
        over = g["peak_reserved_bytes"] / g["peak_allocated_bytes"] - 1
        lines.append(f"- {model}: peak reserved {over * 100:.2f} % above peak allocated (target <= 1 %): "
                     f"{'met' if over <= 0.01 else 'NOT met'}")
        if base:
            slow = g["mean_step_ms"] / base["mean_step_ms"] - 1
            lines.append(f"- {model}: step time {slow * 100:+.2f} % vs PyTorch's default (target within 2 %): "
                         f"{'met' if slow <= 0.02 else 'NOT met'}")
            lines.append(f"- {model}: losses equal to the default allocator's at every step: "
                         f"{'yes' if g['losses'] == base['losses'] else 'NO'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hil.probes.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--allocators", default=",".join(ALLOCATORS))
    parser.add_argument("--gpt2-batch", type=int, default=8)
    parser.add_argument("--gpt2-seq-len", type=int, default=512)
    parser.add_argument("--resnet-batch", type=int, default=64)
    parser.add_argument("--out", default=".")
    parser.add_argument("--cpu-spin-ms", type=float, default=0.0,
                        help="busy CPU time added to every step (ms): how much a step absorbs before it slows")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "ALLOCATOR"), help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.warmup < args.steps:
        parser.error("need 0 < --warmup < --steps")
    if not 0.0 <= args.cpu_spin_ms < 10_000.0:
        parser.error("--cpu-spin-ms must be in [0, 10000)")

    def sizes(model: str) -> tuple[int, int]:
        return (args.gpt2_batch, args.gpt2_seq_len) if model == "gpt2" else (args.resnet_batch, 0)

    if args.child:
        model, allocator = args.child
        record = run_child(model, allocator, args.steps, args.warmup, *sizes(model), cpu_spin_ms=args.cpu_spin_ms)
        Path(args.child_out).write_text(json.dumps(record))
        return 0

    models = [m for m in args.models.split(",") if m]
    allocators = [a for a in args.allocators.split(",") if a]
    for name in models + allocators:
        if name not in MODELS + ALLOCATORS:
            parser.error(f"unknown model or allocator {name!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"date": _dt.date.today().isoformat(), "steps": args.steps, "warmup": args.warmup,
                              "models": models, "runs": [], "gpu": "?", "torch": "?"}
    json_path = md_path = None
    for model in models:
        for allocator in allocators:
            child_out = out / f".train-{model}-{allocator}.json"
            cmd = [sys.executable, "-m", "hil.probes.train", "--child", model, allocator, "--steps",
                   str(args.steps), "--warmup", str(args.warmup), "--gpt2-batch", str(args.gpt2_batch),
                   "--gpt2-seq-len", str(args.gpt2_seq_len), "--resnet-batch", str(args.resnet_batch),
                   "--cpu-spin-ms", str(args.cpu_spin_ms), "--child-out", str(child_out)]
            t0 = time.perf_counter()
            done = subprocess.run(cmd, env=_child_env(allocator), capture_output=True, text=True)
            wall_s = time.perf_counter() - t0
            if done.returncode == 0 and child_out.is_file():
                record = json.loads(child_out.read_text())
                child_out.unlink()
                result["gpu"], result["torch"] = record["gpu"], record["torch"]
            else:
                record = {"model": model, "allocator": allocator, "error": (done.stderr or done.stdout)[-2000:]}
            record["wall_s"] = wall_s
            result["runs"].append(record)
            print(f"{model:<9} {allocator:<11} "
                  + (f"step {record['mean_step_ms']:.2f} ms, peak alloc {_gib(record['peak_allocated_bytes'])} GiB, "
                     f"peak reserved {_gib(record['peak_reserved_bytes'])} GiB, final loss {record['losses'][-1]:.6f}"
                     if "error" not in record else "FAILED: " + record["error"][-500:]) + f" ({wall_s:.0f} s)",
                  flush=True)
            # written after every run, so that a run cut short still leaves what was measured
            gpu = result["gpu"].replace("NVIDIA ", "").replace(" ", "-").lower() if result["gpu"] != "?" else "gpu"
            json_path = out / f"train-{gpu}-{result['date']}.json"
            md_path = json_path.with_suffix(".md")
            json_path.write_text(json.dumps(result, indent=1))
            md_path.write_text(render_markdown(result))
    if md_path is not None:
        print(md_path.read_text())
    return 0 if all("error" not in r for r in result["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
