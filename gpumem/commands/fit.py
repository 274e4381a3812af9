"""``gpumem fit``: the largest batch (or prompt length) that runs on a device without out-of-memory."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from ..errors import InvalidArgumentError
from ._common import EXIT_DEVICE_ERROR, EXIT_DEVICE_LOST, EXIT_OK, EXIT_OOM, EXIT_USAGE, _add_verbose, _exit_codes_text
from ..estimate.fit import DEFAULT_NEW_TOKENS, DEFAULT_PROMPT_LEN
from ._model_args import (add_lora_args, add_model_args, check_device, context_note, lora_from_args, model_from_args,
                          check_policy_name, needs_vmm, vmm_policy_error,
                          params_text, parse_dtypes)

log = logging.getLogger(__name__)

DESCRIPTION = """\
Find the largest batch (or, with --search seq_len, the longest prompt) for which Hugging Face generate()
(or, with --training, a training step) runs on --device without out-of-memory: the workload's allocations
are replayed through gpumem's model of the --policy allocator within the memory a GpuMemoryManager may use on
--device (as gpumem estimate judges FITS), with --margin more of the memory beyond the weights held back
for fragmentation (default: 0.02 for pytorch, 0.01 for expandable and gpumem;
docs/estimation.md says why).

Beside it: what the peak-allocated estimate alone allows, where a halving retry (start at a power of two,
halve on each out-of-memory) settles, and where a binary search on the same replays without margin settles.

examples:
  gpumem fit --hf-config config.json --device sim:a100-80gb --prompt-len 4096 --new-tokens 16
  gpumem fit --hf-config config.json --search seq_len --batch-size 8 --new-tokens 64 --json
  gpumem fit --hf-config config.json --training --lora-rank 16 --weight-format int4 --prompt-len 512
"""

#: ``fit``'s own words for its exit statuses (the rest of :data:`gpumem.cli.GENERAL_EXIT_CODES` holds).
EXIT_MEANINGS = {
    EXIT_OK: "done: at least batch 1 (or a 1-token prompt) fits --device",
    EXIT_OOM: "nothing fits --device, not even batch 1 (or a 1-token prompt); the output says why",
    EXIT_USAGE: "bad input: a bad option, --device spec, --policy or config.json",
    EXIT_DEVICE_LOST: "",
    EXIT_DEVICE_ERROR: "an internal error of a replay, or a fault the --device spec injects (?fail_rate=...)\n"
                       "      failed one: no size can be judged on such a device",
}


def register(sub: Any, formatter_class: type) -> None:
    """Add ``fit`` to the subcommands."""
    p = sub.add_parser("fit", help="the largest batch or prompt that fits a device",
                       description=DESCRIPTION, epilog=_exit_codes_text(EXIT_MEANINGS), formatter_class=formatter_class)
    add_model_args(p)
    p.add_argument("--device", default="sim:h200-141gb", help="device spec (default: %(default)s)")
    p.add_argument("--policy", default="pytorch", help="allocator policy (default: %(default)s)")
    p.add_argument("--margin", type=float, help="extra share of the memory beyond the weights held back (0.25: "
                                                "the rest must fit in usable/1.25)")
    p.add_argument("--search", choices=("batch", "seq_len"), default="batch",
                   help="what to find: batch, the largest --batch-size at --prompt-len (the default), or seq_len, "
                        "the longest --prompt-len at --batch-size")
    p.add_argument("--batch-size", type=int, default=1, help="the batch when searching the sequence length "
                                                               "(default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN, help="prompt (training: sequence) length when "
                                                               "searching the batch (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=None,  # None: not given (refused with --training)
                   help=f"tokens generated per sequence (default: {DEFAULT_NEW_TOKENS}, as gpumem estimate; "
                        "not with --training)")
    p.add_argument("--training", action="store_true", help="training steps instead of generate()")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="training: each block's activations recomputed in the backward pass (as estimate)")
    p.add_argument("--optimizer-8bit", action="store_true",
                   help="training: 8-bit AdamW states (modelled, unmeasured; as estimate)")
    add_lora_args(p)
    p.add_argument("--mixed-precision", choices=("bf16", "fp16"), metavar="DTYPE",
                   help="training: fp32 master weights, gradients and AdamW states, the forward under "
                        "torch.autocast in DTYPE (--dtype must be fp32, its default then; as estimate)")
    p.add_argument("--dtype", help="bf16, fp16 or fp32, one (default: the config's, else bf16)")
    p.add_argument("--max", type=int, default=4096, dest="max_value",
                   help="upper bound of the search (default: %(default)s); an answer equal to it is shown as '>= N' "
                        "with a warning (JSON: at_max): larger values were not tried")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="worker processes for the generate() replays (default: the CPUs this process may use, at "
                        "most 8; 1: none). They start with the first replay of a long decode (new tokens x blocks >= "
                        "64,000) or after a replay of a second, and also replay sizes the search may ask next, "
                        "so more CPU is used in all; the answer is the same as with --jobs 1. Training, and a "
                        "--device with faults or tenants, stay in one process. On a busy machine --jobs 1 can be "
                        "faster")
    p.add_argument("--json", action="store_true", help="one JSON object (its fields include the workload: "
                                                       "prompt_len, new_tokens, batch_size, training)")
    _add_verbose(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the answer (or JSON); exit 0, or 1 when not even the smallest size fits."""
    from ..estimate.fit import InjectedFaultError, find_max_batch
    from ..estimate.probe_pool import default_jobs

    shape, cfg_bytes = model_from_args(args)
    if args.mixed_precision is not None and args.dtype is None:
        name, nbytes = "fp32", 4  # the master weights
    else:
        dtypes = parse_dtypes(args.dtype, cfg_bytes, args.config_dtype)
        if len(dtypes) > 1:  # one search per run: the others were dropped without a word
            raise InvalidArgumentError(f"--dtype {args.dtype}: gpumem fit searches one dtype per run; run it once "
                                       f"per dtype (gpumem estimate takes a list)")
        name, nbytes = dtypes[0]
    for flag in ("gradient_checkpointing", "optimizer_8bit", "mixed_precision"):
        if getattr(args, flag) and not args.training:
            raise InvalidArgumentError(f"--{flag.replace('_', '-')} is for --training")
    lora = lora_from_args(args)
    if args.mixed_precision is not None and args.weight_fmt is not None:
        raise InvalidArgumentError("--mixed-precision with a weight format is not modelled: its master weights "
                                   "are fp32")
    check_policy_name(args.policy)
    if not check_device(args.device) and needs_vmm(args.policy):
        raise vmm_policy_error(args.policy, args.device)
    # find_max_batch would name its parameters (batch_size, prompt_len), not the options
    for flag, value in (("--batch-size", args.batch_size), ("--prompt-len", args.prompt_len)):
        if value < 1:
            raise InvalidArgumentError(f"{flag} must be a whole number >= 1, got {value}")
    if args.max_value < 1:  # find_max_batch would name its parameter (max_value), not the option
        raise InvalidArgumentError(f"--max {args.max_value}: the search's upper bound must be 1 or more")
    if args.jobs is not None and args.jobs < 1:
        raise InvalidArgumentError(f"--jobs {args.jobs}: the processes to replay on must be 1 or more")
    jobs = default_jobs() if args.jobs is None else args.jobs
    note = (context_note(args.prompt_len + (0 if args.training else args.new_tokens), args.context_len,
                         json_output=args.json)
            if args.search == "batch" else "")
    try:
        r = find_max_batch(shape, nbytes, device=args.device, prompt_len=args.prompt_len,
                           new_tokens=args.new_tokens, batch_size=args.batch_size, search=args.search,
                           training=args.training, policy=args.policy, margin=args.margin,
                           max_value=args.max_value, progress=False if args.json else None,
                           weight_format=None if lora is not None else args.weight_fmt,
                           gradient_checkpointing=args.gradient_checkpointing, optimizer_8bit=args.optimizer_8bit,
                           mixed_precision=args.mixed_precision, lora=lora, jobs=jobs)
    except InjectedFaultError as exc:  # Note: the injected fault is named, never read as a shortage
        print(f"gpumem fit: {exc}", file=sys.stderr)
        return EXIT_DEVICE_ERROR
    if args.json:
        out = r.as_dict()
        if args.search == "seq_len":   # the prompt length is the answer, not --prompt-len (unused then)
            out["prompt_len"] = r.simulated
        out.update(dtype=name, weight_format=None if args.weight_fmt is None else args.weight_fmt.name,
                   n_params=shape.n_params, context_len=args.context_len,
                   warnings=[w for w in (note, r.bound, r.at_max_note()) if w])
        print(json.dumps(out, indent=2))
    else:
        what = "batch" if args.search == "batch" else "prompt length"
        if args.training:   # a training step's length is its prompt: said once
            work = f"training steps of {args.prompt_len} tokens" if args.search == "batch" else "training steps"
            if lora is not None:
                work = f"LoRA (rank {lora.rank}) {work}"
        else:
            work = f"generate(), {args.new_tokens} new tokens"
        at = (f"batch {args.batch_size}" if args.search != "batch" else
              None if args.training else f"prompt {args.prompt_len}")
        if args.weight_fmt is not None:
            name = f"{name}, {'frozen base' if lora is not None else 'projections'} in {args.weight_fmt.name}"
        print(f"{params_text(shape.n_params)} parameters, {name}, {work}{'' if at is None else ', ' + at}; on {r.device} "
              f"({r.usable_bytes / 2**30:.2f} GiB usable by a GpuMemoryManager), policy {r.policy}, "
              f"margin {r.margin:.0%} beyond the weights")
        lines = [(f"largest {what} (simulated, with margin):", r.simulated),
                 ("  estimate alone (peak allocated <= usable):", r.estimate),
                 (f"  halving retry from {r.start}:", r.halving),
                 ("  binary search, no margin:", r.binary_search)]
        width = max(len(label) for label, _ in lines)
        for label, value in lines:
            # a value at the search's upper bound is a lower bound: larger ones were not tried
            shown = f">= {value}" if value == r.max_value and not r.bound else str(value)
            print(f"{label:<{width}} {shown:>6}")
        if r.reason:
            print(f"does not fit: {r.reason}")
        if note:
            print(f"warning: {note}")
        if r.bound:
            print(f"warning: {r.bound}")
        if r.at_max:
            print(f"warning: {r.at_max_note()}")
    if r.reason and args.json:  # the text says it on standard output
        log.warning("does not fit: %s", r.reason)
    return 0 if r.simulated >= 1 else EXIT_OOM
