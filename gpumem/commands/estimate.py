"""``gpumem estimate``: peak allocated and peak reserved memory of generate() or training, per dtype."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ._common import EXIT_DEVICE_ERROR, EXIT_DEVICE_LOST, EXIT_OK, EXIT_OOM, EXIT_USAGE, _add_verbose, _exit_codes_text
from ..errors import InvalidArgumentError
from ..estimate.fit import DEFAULT_NEW_TOKENS
from ..progress import progress
from ..units import format_bytes
from ._args import MANY
from ._model_args import (add_lora_args, add_model_args, check_device, context_note, lora_from_args, model_from_args,
                          check_policy_name, needs_vmm, vmm_policy_error,
                          params_text, parse_dtypes)

#: The policies estimate replays under unless --policy says otherwise.
DEFAULT_POLICIES = ("pytorch", "expandable", "gpumem")

DESCRIPTION = """\
Estimate the GPU memory of Hugging Face generate() (greedy, DynamicCache, SDPA) or of full training steps
(AdamW) for a Llama-style decoder, from a config.json or the numbers.

Two figures per dtype:

  PEAK ALLOC  the peak of allocated bytes, what torch.cuda.max_memory_allocated reports. With pytorch as the
              first --policy (the default) it is the blocks of that replay (a block may keep up to 1 MiB
              more than asked); on an H200 it was never below the measurement on the rows not tuned on
              (+0.01 % to +0.50 %, 0.1B-7B models, batch 1-32, prompts up to 4096: docs/estimation.md).
              Otherwise, and with --no-reserved, it is the requests themselves, as gpumem.torch counts
              them, which can be a little below PyTorch's count (-0.12 % on a 7B row of 16 new tokens).
  RES <policy>
              the peak of reserved bytes under each --policy (what nvidia-smi shows, and what decides out
              of memory): the workload's allocations replayed through gpumem's model of that allocator on
              the simulated --device.

examples:
  gpumem estimate --hf-config config.json --batch-size 8 --prompt-len 1024 --new-tokens 128
  gpumem estimate --hidden-size 4096 --intermediate-size 11008 --layers 32 --vocab-size 32000 \\
      --heads 32 --prompt-len 4096 --new-tokens 16 --dtype bf16,fp32 --json
  gpumem estimate --hf-config config.json --training --batch-size 4 --prompt-len 2048
  gpumem estimate --hf-config config.json --training --mixed-precision bf16 --prompt-len 2048
"""

#: ``estimate``'s own words for its exit statuses (the rest of :data:`gpumem.cli.GENERAL_EXIT_CODES` holds).
EXIT_MEANINGS = {
    EXIT_OK: "done, also when a replay runs out of memory on --device: the row then shows\n"
             "      '> X OOM' (X, what was reserved when it failed, is a lower bound of the peak)",
    EXIT_OOM: "",
    EXIT_USAGE: "bad input: a bad option, --device spec, --policy or config.json",
    EXIT_DEVICE_LOST: "",
    EXIT_DEVICE_ERROR: "an internal error of a replay",
}


def register(sub: Any, formatter_class: type) -> None:
    """Add ``estimate`` to the subcommands."""
    p = sub.add_parser("estimate", help="estimate peak allocated and reserved memory of generate() or training",
                       description=DESCRIPTION, epilog=_exit_codes_text(EXIT_MEANINGS), formatter_class=formatter_class)
    add_model_args(p)
    w = p.add_argument_group("workload")
    w.add_argument("--batch-size", type=int, default=1, help="default: %(default)s")
    w.add_argument("--prompt-len", type=int, help="prompt tokens (training: sequence length); "
                                                   "default: --max-seq-len minus --new-tokens")
    w.add_argument("--new-tokens", type=int, default=None,  # None: not given (refused with --training)
                   help=f"tokens generated per sequence (default: {DEFAULT_NEW_TOKENS}, as gpumem fit; "
                        "not with --training)")
    w.add_argument("--max-seq-len", type=int, help="default: prompt + new tokens; without --prompt-len, the --hf-config's "
                                                 "max_position_embeddings")
    w.add_argument("--training", action="store_true", help="full training steps instead of generate()")
    w.add_argument("--gradient-checkpointing", action="store_true",
                   help="training: each block's activations recomputed in the backward pass")
    add_lora_args(w)
    w.add_argument("--optimizer-8bit", action="store_true",
                   help="training: AdamW states in bitsandbytes' block-wise 8-bit layout (modelled, unmeasured)")
    w.add_argument("--mixed-precision", choices=("bf16", "fp16"), metavar="DTYPE",
                   help="training: mixed precision on fp32 master weights: fp32 weights, gradients and AdamW "
                        "states, the forward under torch.autocast in DTYPE (bf16 or fp16; --dtype must be fp32, "
                        "its default then)")
    w.add_argument("--dtype", **MANY, help="bf16, fp16, fp32: one or more, comma-separated or repeatable "
                   "(default: the config's, else bf16)")
    r = p.add_argument_group("peak reserved")
    r.add_argument("--policy", **MANY, help="allocator policies to replay under: one or more, comma-separated or "
                   f"repeatable (default: {','.join(DEFAULT_POLICIES)})")
    r.add_argument("--device", default="sim:h200-141gb", help="simulated device for the replays, and whose usable "
                   "memory (as a GpuMemoryManager sees it) FITS compares with (default: %(default)s)")
    r.add_argument("--no-reserved", action="store_true", help="skip the replays (peak allocated only)")
    r.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="processes to replay on (default: the CPUs this process may use, at most 8; never more "
                        "than those; 1: this one alone). A long decode (new tokens x blocks >= 96,000) on a --device "
                        "without faults or tenants replays its policies side by side, gpumem's here and the others on "
                        "worker processes: the same figures sooner where there are CPUs to spare; training and "
                        "shorter decodes stay in one process. On a busy machine --jobs 1 can be faster")
    p.add_argument("--json", action="store_true", help="one JSON list, an object per dtype")
    _add_verbose(p)
    p.set_defaults(func=run)


def estimate_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The estimate per dtype as JSON-ready dicts."""
    from ..estimate.fit import estimate_peak_reserved
    from ..estimate.formulas import estimate_inference_memory, estimate_training_memory
    from ..estimate.workload import inference_trace, training_trace

    shape, cfg_bytes = model_from_args(args)
    max_seq_len = args.max_seq_len
    if args.prompt_len is None and max_seq_len is None:
        if args.context_len is None:
            raise InvalidArgumentError("give --prompt-len or --max-seq-len (or an --hf-config with "
                                       "max_position_embeddings)")
        max_seq_len = args.context_len  # the config's context
    for opt, value in (("prompt_len", args.prompt_len), ("max_seq_len", args.max_seq_len)):
        if value is not None and value <= 0:
            raise InvalidArgumentError(f"{opt} (--{opt.replace('_', '-')}) must be a positive whole number, got {value}")
    _check_batch_size(args.batch_size)
    if args.prompt_len is None and not args.training and max_seq_len is not None and max_seq_len <= args.new_tokens:
        raise InvalidArgumentError(f"--new-tokens {args.new_tokens} leaves no prompt in a sequence of {max_seq_len}")
    new = args.new_tokens
    max_len = max_seq_len if max_seq_len is not None else args.prompt_len + (0 if args.training else new)
    prompt = args.prompt_len if args.prompt_len is not None else max_len - (0 if args.training else new)
    _check_lengths(args, prompt, new, max_len)
    note = context_note(max(max_len, prompt + (0 if args.training else new)), args.context_len,
                        json_output=bool(getattr(args, "json", False)))
    policies = [x.strip() for x in ",".join(args.policy or DEFAULT_POLICIES).split(",") if x.strip()]
    if not policies:
        raise InvalidArgumentError(f"--policy {' '.join(args.policy)!r} names no allocator policy")
    for pol in policies:  # the size-bucket pool too, as gpumem replay, fit and sweep take it
        check_policy_name(pol)
    shape.check_tokens(prompt + (0 if args.training else new))
    if not check_device(args.device):
        policies = _policies_without_vmm(policies, args.device, given=bool(args.policy))
    for flag in ("gradient_checkpointing", "optimizer_8bit", "lora_rank", "mixed_precision"):
        if getattr(args, flag, None) and not args.training:
            raise InvalidArgumentError(f"--{flag.replace('_', '-')} is for --training")
    args.lora = lora_from_args(args)
    mixed = getattr(args, "mixed_precision", None)
    if mixed is not None:
        _check_mixed_args(args)
    jobs = _jobs(args)
    usable, workspace = _usable(args.device, shape, args.weight_fmt)
    rows = []
    dims = (shape.hidden_size, shape.intermediate_size, shape.n_layers, shape.vocab_size, shape.n_heads,
            shape.n_kv_heads)
    dtypes = ([("fp32", 4)] if mixed is not None and not args.dtype else
              parse_dtypes(",".join(args.dtype) if args.dtype else None, cfg_bytes, args.config_dtype))
    replays = 0 if args.no_reserved else len(policies) * len(dtypes)
    bar = progress(replays * (1 if args.training else max(new, 1)) or None, "estimate: replays", "step",
                   enabled=False if args.json or not replays else None)
    try:
        for name, nbytes in dtypes:
            rows.append(_row(args, shape, dims, name, nbytes, prompt, new, max_len, policies, (usable, workspace),
                             note, bar, jobs))
    finally:
        bar.close()
    return rows


def _check_batch_size(batch: Any) -> None:
    """``--batch-size`` must be 1 or more and within the sanity cap: refused here by the option's name (the
    library's own messages name its parameter, ``batch_size``)."""
    from ..estimate.formulas import WORKLOAD_CAPS

    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InvalidArgumentError(f"--batch-size must be a whole number >= 1, got {batch!r:.40}")
    if batch > WORKLOAD_CAPS["batch_size"]:
        raise InvalidArgumentError(f"--batch-size {batch} exceeds the sanity cap of {WORKLOAD_CAPS['batch_size']}")


def _check_lengths(args: argparse.Namespace, prompt: int, new: int, max_len: int) -> None:
    """The sequence lengths within the library's sanity caps, refused by the options that gave them (the
    library names its parameters: ``max_seq_len`` for a sequence the user gave as ``--prompt-len``)."""
    from ..estimate.formulas import WORKLOAD_CAPS

    for flag, value, key in (("--prompt-len", args.prompt_len, "prompt_len"),
                             ("--max-seq-len", args.max_seq_len, "max_seq_len"),
                             ("--new-tokens", None if args.training else new, "new_tokens")):
        if value is not None and value > WORKLOAD_CAPS[key]:
            raise InvalidArgumentError(f"{flag} {value} exceeds the sanity cap of {WORKLOAD_CAPS[key]}")
    cap, total = WORKLOAD_CAPS["max_seq_len"], max(max_len, prompt + (0 if args.training else new))
    if total > cap:
        if args.prompt_len is None and args.max_seq_len is None:
            parts = "the --hf-config's max_position_embeddings"
        else:
            parts = f"--prompt-len {prompt}" + ("" if args.training else f" + --new-tokens {new}")
        raise InvalidArgumentError(f"a sequence of {total} tokens ({parts}) exceeds the sanity cap of {cap}")


def _jobs(args: argparse.Namespace) -> int:
    """``--jobs``: the processes to replay on (None: the default; absent from a Namespace made by hand, a
    harness's: 1, as the API), else InvalidArgumentError naming the option."""
    from ..estimate.probe_pool import default_jobs

    jobs = getattr(args, "jobs", 1)
    if jobs is None:
        return default_jobs()
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise InvalidArgumentError(f"--jobs {jobs!r:.40}: the processes to replay on must be 1 or more")
    return jobs


def _check_mixed_args(args: argparse.Namespace) -> None:
    """Refuse --mixed-precision with what it does not model (Note [Mixed precision] in gpumem.estimate.workload)."""
    from ..estimate.workload import check_mixed_precision

    if args.weight_fmt is not None:
        raise InvalidArgumentError("--mixed-precision with a weight format is not modelled: its master weights "
                                   "are fp32")
    others = [d for d in ",".join(args.dtype or ()).split(",") if d.strip() and d.strip() != "fp32"]
    if others:
        raise InvalidArgumentError(f"--mixed-precision {args.mixed_precision} keeps fp32 master weights: --dtype "
                                   f"must be fp32 (or left out), got {','.join(args.dtype)}")
    check_mixed_precision(args.mixed_precision, 4, lora=args.lora is not None, optimizer_8bit=args.optimizer_8bit)


def _policies_without_vmm(policies: list[str], device: str, given: bool) -> list[str]:
    """``policies`` on a device without virtual memory management: one that needs it (``expandable``) is bad
    input when ``--policy`` named it, and left out of the default ones with a line on stderr saying so."""
    needing = [p for p in policies if needs_vmm(p)]
    if needing and given:
        raise vmm_policy_error(needing[0], device)
    for p in needing:
        print(f"gpumem estimate: policy {p!r} left out: it needs virtual memory management, which {device} "
              "does not support", file=sys.stderr)
    return [p for p in policies if p not in needing]


def _usable(spec: str, shape: Any, fmt: Any) -> tuple[int, int]:
    """The usable memory of ``spec`` and the dequantization workspace of ``fmt`` there."""
    from ..estimate.fit import usable_memory
    from ..estimate.formulas import dequant_workspace_nbytes
    from ..specs import open_device

    dev = open_device(spec)
    try:
        return usable_memory(dev), dequant_workspace_nbytes(shape, fmt, dev)
    finally:
        dev.close()


def _row(args: argparse.Namespace, shape: Any, dims: tuple[int, ...], name: str, nbytes: int, prompt: int,
         new: int, max_len: int, policies: list[str], room: tuple[int, int], note: str, bar: Any,
         jobs: int = 1) -> dict[str, Any]:
    """One dtype's estimate as a JSON-ready dict; ``room`` is (usable bytes, dequantization workspace bytes)."""
    usable, workspace = room
    fmt = args.weight_fmt
    from ..estimate.fit import (allocated_as_pytorch_counts, estimate_peak_reserved, replay_inference,
                                 training_reserved_nbytes)
    from ..estimate.formulas import estimate_inference_memory, estimate_training_memory
    from ..estimate.workload import training_trace

    moe = {k: getattr(shape, k) for k in ("n_experts", "experts_per_token", "expert_intermediate_size",
                                          "shared_expert_intermediate_size", "router_weights_cast", "sub_norms",
                                          "activation", "sliding_window", "always_masked")}
    if args.training:
        est = estimate_training_memory(*dims, prompt, nbytes, batch_size=args.batch_size, head_dim=shape.head_dim,
                                       tie_word_embeddings=shape.tie_word_embeddings,
                                       attention_bias=shape.attention_bias,
                                       gradient_checkpointing=args.gradient_checkpointing,
                                       optimizer_8bit=args.optimizer_8bit, lora=args.lora,
                                       mixed_precision=getattr(args, "mixed_precision", None), **moe)
    else:
        est = estimate_inference_memory(*dims, max_len, nbytes, batch_size=args.batch_size, prompt_len=prompt,
                                        new_tokens=new, head_dim=shape.head_dim,
                                        tie_word_embeddings=shape.tie_word_embeddings,
                                        attention_bias=shape.attention_bias, weight_format=fmt,
                                        workspace_nbytes=workspace, **moe)
    row: dict[str, Any] = {
        "dtype": name, "dtype_bytes": nbytes, "workload": "training" if args.training else "generate",
        "batch_size": args.batch_size, "prompt_len": prompt, "new_tokens": 0 if args.training else new,
        "n_params": shape.n_params, "peak_allocated_bytes": est.total_bytes, "model_bytes": est.model_bytes,
        "kv_cache_bytes": est.kv_cache_bytes, "activation_bytes": est.activation_bytes,
        "overhead_bytes": est.overhead_bytes, "peak_phase": est.phase,
        "context_len": args.context_len, "warnings": [note] if note else [],
        "device": args.device, "usable_bytes": usable,
        "weight_format": None if fmt is None else fmt.name,
        "weight_bits": None if fmt is None else fmt.bits_per_weight, "dequant_workspace_bytes": workspace,
    }
    if fmt is not None and fmt.scales == "none":
        row["warnings"].append(f"--weight-bits {fmt.bits_per_weight:g}: the weights' scales (if any) are not counted")
    if args.training:
        row["gradient_bytes"] = est.gradient_bytes  # type: ignore[attr-defined]
        row["optimizer_bytes"] = est.optimizer_bytes  # type: ignore[attr-defined]
        row["gradient_checkpointing"] = args.gradient_checkpointing
        row["optimizer_8bit"] = args.optimizer_8bit
        row["lora_rank"] = args.lora_rank
        row["mixed_precision"] = getattr(args, "mixed_precision", None)
    judged = est.total_bytes
    if not args.no_reserved and policies:
        if args.training:
            w = training_trace(shape, nbytes, batch_size=args.batch_size, seq_len=prompt,
                               gradient_checkpointing=args.gradient_checkpointing, optimizer_8bit=args.optimizer_8bit,
                               lora=args.lora, mixed_precision=getattr(args, "mixed_precision", None))
            res = estimate_peak_reserved(w, policies, device=args.device, limit=usable)
            bar.update(len(policies))
        else:
            res = replay_inference(shape, nbytes, policies, args.device, batch_size=args.batch_size,
                                   prompt_len=prompt, new_tokens=new, limit=usable, peak_nbytes=est.total_bytes,
                                   bar=bar, weight_format=fmt, workspace_nbytes=workspace,
                                   jobs=jobs)
        by_policy = {e.policy: e.peak_reserved_bytes for e in res}
        first = res[0]
        # Note [Allocated as PyTorch counts it] in gpumem.estimate.fit: with pytorch first, the replay's blocks,
        # not the requests (training and generate() alike)
        counted = allocated_as_pytorch_counts(est.total_bytes, first)
        if counted is not None:
            row["trace_peak_allocated_bytes"] = est.total_bytes
            row["peak_allocated_bytes"] = counted
        if args.training:  # Note [Training reserved margin] in gpumem.estimate.fit
            row["replayed_reserved_by_policy"] = dict(by_policy)
            by_policy.update({e.policy: training_reserved_nbytes(e.peak_reserved_bytes) for e in res
                              if e.policy == "pytorch" and e.fits})
        row["peak_reserved_bytes"] = by_policy[res[0].policy]
        row["reserved_policy"] = res[0].policy
        row["peak_reserved_by_policy"] = by_policy
        row["fits_by_policy"] = {e.policy: e.fits for e in res}
        # a replay that ran out of memory stopped there: what it had reserved is a lower bound of the peak
        row["peak_reserved_is_lower_bound"] = not res[0].fits
        row["peak_reserved_is_lower_bound_by_policy"] = {e.policy: not e.fits for e in res}
        injected = [e.policy for e in res if e.injected_fault]
        if injected:
            row["warnings"].append(f"an injected fault (the device spec's fault options) stopped the replay under "
                                   f"{', '.join(injected)}: nothing was out of memory; that figure is a lower bound")
        judged = by_policy[res[0].policy] if res[0].fits else None
    # Note [Fits]: the replays run within the usable memory of --device as a GpuMemoryManager sees it (what
    # gpumem fit sizes against: an allocator near its limit frees its cache and retries, as PyTorch's does);
    # the first policy's replay fits or not (peak allocated with --no-reserved), headroom = usable - its peak.
    row["fits"] = judged is not None and judged <= usable
    row["headroom_bytes"] = None if judged is None else usable - judged
    return row


def _fits_text(r: dict[str, Any]) -> str:
    if r["headroom_bytes"] is None:
        return "no (OOM)"
    return f"{'yes' if r['fits'] else 'no'} {'+' if r['headroom_bytes'] >= 0 else ''}{r['headroom_bytes'] / 2**30:.2f}"


def run(args: argparse.Namespace) -> int:
    """Print the table (or JSON); exit 0."""
    rows = estimate_rows(args)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    first = rows[0]
    kind = (f"training, batch {first['batch_size']} x {first['prompt_len']} tokens" if args.training else
            f"generate(), batch {first['batch_size']}, prompt {first['prompt_len']}, {first['new_tokens']} new tokens")
    fmt = "" if first["weight_format"] is None else f"; projections in {first['weight_format']}"
    if first["dequant_workspace_bytes"]:
        fmt += f" (dequantization workspace {format_bytes(first['dequant_workspace_bytes'])} in OVERHEAD)"
    print(f"{params_text(first['n_params'])} parameters{fmt}; {kind}; sizes in GiB (2^30 bytes)")
    pols = list(first.get("peak_reserved_by_policy", {}))
    middle = ("GRADIENTS", "OPTIMIZER") if args.training else ("KV @PEAK",)
    keys = ("gradient_bytes", "optimizer_bytes") if args.training else ("kv_cache_bytes",)
    head = f"{'DTYPE':<6} {'MODEL':>11}" + "".join(f" {m:>11}" for m in middle)
    head += f" {'ACTIV.':>11} {'OVERHEAD':>11} {'PEAK ALLOC':>11}"
    head += "".join(f" {('RES ' + p)[:16]:>16}" for p in pols)
    head += f" {'FITS, HEADROOM':>15}"
    print(head)
    oom = False
    for r in rows:
        line = f"{r['dtype']:<6} {format_bytes(r['model_bytes']):>11}" + "".join(
            f" {format_bytes(r[k]):>11}" for k in keys)
        line += (f" {format_bytes(r['activation_bytes']):>11} {format_bytes(r['overhead_bytes']):>11} "
                 f"{format_bytes(r['peak_allocated_bytes']):>11}")
        for p in pols:
            text = format_bytes(r["peak_reserved_by_policy"][p])
            if not r["fits_by_policy"][p]:
                text, oom = f"> {text} OOM", True
            line += f" {text:>16}"
        line += f" {_fits_text(r):>15}"
        print(line)
    device = first["device"]
    judged = f"RES {pols[0]}" if pols else "PEAK ALLOC"
    footer = [f"peak in: {first['peak_phase']} (where the requests peak; MODEL ... OVERHEAD split that peak); "
              "ACTIV. = activations and temporaries at the peak"]
    if not args.training:
        footer.append("KV @PEAK = the key/value cache at the peak (not after the last token)")
    else:
        footer.append("GRADIENTS, OPTIMIZER = what is live at the peak" +
                      (" (0 B: the peak falls after the gradients were zeroed)" if not first.get("gradient_bytes") else ""))
    blocks = ["trace_peak_allocated_bytes" in r for r in rows]
    if all(blocks):
        footer.append("PEAK ALLOC = allocated blocks as PyTorch counts them (the pytorch replay; a block keeps a "
                      "remainder of up to 1 MiB), at or above MODEL + ... + OVERHEAD, the requests, which is what "
                      "gpumem.torch counts (--json: trace_peak_allocated_bytes)")
    elif any(blocks):
        footer.append("PEAK ALLOC = allocated blocks as PyTorch counts them where the pytorch replay fit (at or "
                      "above the requests, MODEL + ... + OVERHEAD, what gpumem.torch counts), the requests where it "
                      "ran out of memory")
    else:
        footer.append("PEAK ALLOC = the requests at the peak (MODEL + ... + OVERHEAD)")
    if pols:
        footer.append(f"RES = peak reserved by replay on {device} within the usable memory")
    footer.append(f"FITS, HEADROOM = whether {judged} fits the {format_bytes(first['usable_bytes'])} a "
                  f"GpuMemoryManager may use on {device}, and what is left (GiB)")
    print("; ".join(footer))
    if first["warnings"]:
        print("warning: " + "; ".join(first["warnings"]))
    if oom:
        print(f"> X OOM: the replay ran out of the usable memory of {device} with X reserved; the peak is more "
              "than X")
    return 0
