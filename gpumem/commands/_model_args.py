"""Options shared by ``gpumem estimate`` and ``gpumem fit``: the model, from numbers or a ``config.json``."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import logging

from ..errors import InvalidArgumentError
from ..estimate.shape import DTYPE_BYTES, ModelShape, config_weight_format, from_hf_config, read_config_text

log = logging.getLogger("gpumem.commands")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Add ``--hf-config`` and the shape options to ``p``."""
    g = p.add_argument_group("model (a Hugging Face config.json, or the numbers)")
    g.add_argument("--hf-config", metavar="CONFIG.json", help="a Hugging Face config.json of a decoder LLM")
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--intermediate-size", type=int)
    g.add_argument("--layers", type=int, help="number of decoder blocks")
    g.add_argument("--vocab-size", type=int)
    g.add_argument("--heads", type=int, help="attention heads")
    g.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    g.add_argument("--head-dim", type=int, default=None, help="default: hidden size / heads")
    g.add_argument("--tie-word-embeddings", action="store_true")
    f = g.add_mutually_exclusive_group()
    f.add_argument("--weight-format", metavar="FORMAT",
                   help="the projections' weights: int8, int4 (group 128), fp8, i2s, tl1, tl2 (ternary, with "
                        "their dequantization workspace); default: the config's quantization_config, else --dtype")
    f.add_argument("--weight-bits", type=float, metavar="BITS",
                   help="bits per projection weight (4, 1.58...), scales not counted")


def model_from_args(args: argparse.Namespace) -> tuple[ModelShape, int]:
    """The shape and the config's dtype bytes (2 without a config); raises ``InvalidArgumentError``.
    Sets ``args.config_dtype`` to the config's dtype name (``bf16`` without one) and ``args.context_len`` to
    its ``max_position_embeddings`` (``None`` without one)."""
    args.config_dtype = "bf16"
    _resolve_new_tokens(args)
    check_workload_args(args)
    from ..estimate.formats import custom_bits, weight_format

    args.weight_fmt = None
    if getattr(args, "weight_format", None) is not None:
        args.weight_fmt = weight_format(args.weight_format)
    elif getattr(args, "weight_bits", None) is not None:
        args.weight_fmt = custom_bits(args.weight_bits)
    args.context_len = None
    numbers = (args.hidden_size, args.intermediate_size, args.layers, args.vocab_size, args.heads)
    if args.hf_config:
        # Note [Shape options beside --hf-config]: every shape option changes memory (--kv-heads the KV cache,
        # --head-dim the projections, --tie-word-embeddings the output matrix); beside a config none is read,
        # so each is refused rather than dropped without a word
        given = [n for n, v in zip(_SHAPE_OPTIONS, (*numbers, args.kv_heads, args.head_dim)) if v is not None]
        if args.tie_word_embeddings:
            given.append("--tie-word-embeddings")
        if given:
            raise InvalidArgumentError(f"give either --hf-config or the shape options, not both (got "
                                       f"{', '.join(given)} beside --hf-config; the config decides them: "
                                       "edit a copy of it to change them)")
        # a --weight-format given stands for the config's quantization_config (which may be one not read)
        shape, nbytes = from_hf_config(args.hf_config, read_quantization_config=args.weight_fmt is None)
        cfg = json.loads(read_config_text(args.hf_config))
        cfg = {**cfg.get("text_config", {}), **cfg} if isinstance(cfg.get("text_config"), dict) else cfg
        if args.weight_fmt is None:
            args.weight_fmt = config_weight_format(cfg, args.hf_config)
        name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
        args.config_dtype = _SHORT.get(name, name)
        ctx = cfg.get("max_position_embeddings")
        if ctx is not None:  # a value not understood is refused, never dropped (it decides the default length)
            if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx <= 0:
                raise InvalidArgumentError(f"{args.hf_config}: max_position_embeddings must be a positive JSON "
                                           f"integer (the model's context), got {ctx!r:.40}")
            args.context_len = ctx
        return shape, nbytes
    missing = [n for n, v in zip(_SHAPE_OPTIONS, numbers) if v is None]
    if missing:
        raise InvalidArgumentError(f"missing {', '.join(missing)} (or give --hf-config)")
    if args.head_dim is not None and args.head_dim <= 0:  # 0 is ModelShape's "default": never from the user
        raise InvalidArgumentError(f"--head-dim must be positive, got {args.head_dim}")
    try:
        shape = ModelShape(args.hidden_size, args.intermediate_size, args.layers, args.vocab_size, args.heads,
                           args.heads if args.kv_heads is None else args.kv_heads, args.head_dim or 0,
                           args.tie_word_embeddings)
    except InvalidArgumentError as exc:  # ModelShape names its parameters; the user gave the options
        raise InvalidArgumentError(_option_names(str(exc))) from None
    return shape, 2


#: ModelShape's parameter names -> the shape options that give them (:func:`_option_names`).
_SHAPE_PARAMS = {"hidden_size": "--hidden-size", "intermediate_size": "--intermediate-size", "n_layers": "--layers",
                 "vocab_size": "--vocab-size", "n_heads": "--heads", "n_kv_heads": "--kv-heads",
                 "head_dim": "--head-dim", "tie_word_embeddings": "--tie-word-embeddings"}


def _option_names(message: str) -> str:
    """A :class:`ModelShape` message with its parameter names as the command's options: "hidden_size 4096 is
    not a multiple of n_heads 30; give head_dim" -> "--hidden-size 4096 is not a multiple of --heads 30; give
    --head-dim"."""
    return re.sub(r"\b(" + "|".join(_SHAPE_PARAMS) + r")\b", lambda m: _SHAPE_PARAMS[m.group(1)], message)


#: The shape options, in the order of :func:`model_from_args`'s numbers (the five required ones first).
_SHAPE_OPTIONS = ("--hidden-size", "--intermediate-size", "--layers", "--vocab-size", "--heads", "--kv-heads",
                  "--head-dim")


def _resolve_new_tokens(args: argparse.Namespace) -> None:
    """``--new-tokens`` left out (None) -> its default; given with ``--training`` (other than 0) -> refused:
    a training step generates nothing, and the option would be dropped without a word (as ``--lora-rank`` without
    ``--training`` is refused the other way round)."""
    if not hasattr(args, "new_tokens"):
        return
    if args.new_tokens not in (None, 0) and getattr(args, "training", False):  # 0 agrees with training
        raise InvalidArgumentError(f"--new-tokens {args.new_tokens} is for generate(): a --training step generates "
                                   "no tokens (its length is --prompt-len)")
    if args.new_tokens is not None and args.new_tokens <= 0 and not getattr(args, "training", False):
        raise InvalidArgumentError(f"--new-tokens {args.new_tokens}: generate() makes at least one token "
                                   "(transformers refuses max_new_tokens=0); give --new-tokens 1 or more, or "
                                   "--training for a step")
    if args.new_tokens is None:
        from ..estimate.fit import DEFAULT_NEW_TOKENS

        args.new_tokens = DEFAULT_NEW_TOKENS


def add_lora_args(p: "argparse._ActionsContainer") -> None:
    """Add ``--lora-rank`` and ``--lora-targets`` (``gpumem estimate`` and ``gpumem fit`` alike)."""
    p.add_argument("--lora-rank", type=int, metavar="R",
                   help="training: LoRA adapters of rank R on a frozen base (with --weight-format: QLoRA); "
                        "modelled, unmeasured")
    p.add_argument("--lora-targets", default=None,
                   help="training: the projections LoRA adapts, comma-separated (default: all seven)")


def lora_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~gpumem.estimate.workload.LoraConfig` that ``--lora-rank`` / ``--lora-targets`` ask for
    (``None`` without ``--lora-rank``), on the base format ``args.weight_fmt`` (QLoRA); raises
    ``InvalidArgumentError`` for LoRA without ``--training``, targets without a rank, and a weight format
    with full training (it updates 16-bit weights)."""
    if args.lora_rank is not None and not args.training:
        raise InvalidArgumentError("--lora-rank is for --training")
    if args.lora_rank is None and args.lora_targets is not None:
        raise InvalidArgumentError("--lora-targets needs --lora-rank (without it the training is full, not LoRA)")
    if args.lora_rank is None:
        if args.weight_fmt is not None and args.training and args.weight_fmt.qtype:
            # a ternary base (BitNet's i2s) takes no LoRA either (LoraConfig): do not send the user there
            raise InvalidArgumentError(f"--training with {args.weight_fmt.name} weights is not modelled: the ternary "
                                       "formats' kernels are for inference (generate() only), and full training "
                                       "updates 16-bit weights")
        if args.weight_fmt is not None and args.training:
            raise InvalidArgumentError("--training with a weight format is modelled only with --lora-rank (QLoRA): "
                                       "full training updates 16-bit weights")
        return None
    from ..estimate.workload import LoraConfig

    targets = {} if args.lora_targets is None else {
        "targets": tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())}
    return LoraConfig(args.lora_rank, **targets, base_format=args.weight_fmt)


def params_text(n_params: int) -> str:
    """``n_params`` for a header: ``7.24B``, ``2.09M``, ``950`` (a small model read ``0.00B``)."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n_params >= scale:
            return f"{n_params / scale:.2f}{suffix}"
    return str(n_params)


def context_note(tokens: int, context_len: int | None, json_output: bool = False) -> str:
    """A warning when ``tokens`` exceed the config's context, else ``""``: returned for the output, which
    shows it once (the text on standard output as a ``warning:`` line); logged as well only for
    ``json_output``, whose ``warnings`` field a reader of the terminal does not see. Logged beside the text
    line it was printed twice (stdout and stderr)."""
    if context_len is None or tokens <= context_len:
        return ""
    note = (f"{tokens} tokens exceed the model's context of {context_len} (max_position_embeddings in the config); "
            f"the estimate is for the shape as if it could")
    if json_output:
        log.warning("%s", note)
    return note


def check_device(spec: str) -> bool:
    """Open and close ``spec`` once, so that a bad device spec is bad input (exit 2) found before any work;
    raises ``InvalidArgumentError`` naming ``--device``. Returns whether the device has virtual memory
    management (:func:`needs_vmm` policies run only there)."""
    from ..errors import GpumemError
    from ..specs import open_device

    try:
        dev = open_device(spec)
    except GpumemError as exc:
        raise InvalidArgumentError(f"--device {spec}: {exc}") from None
    try:
        return bool(dev.vmm_supported)
    finally:
        dev.close()


def vmm_policy_error(policy: str, device: str) -> InvalidArgumentError:
    """The bad-input error of ``--policy`` naming a :func:`needs_vmm` policy on a device without virtual memory."""
    return InvalidArgumentError(f"--policy {policy}: it needs virtual memory management, which {device} does not "
                                "support; choose another policy")


def check_policy_name(policy: str) -> None:
    """Refuse an unknown ``--policy`` name, listing every name the command takes: the caching policies and the
    size-bucket pool (``get_policy``'s own message leaves ``bucket`` out: it builds caching policies only)."""
    from ..allocator.bucket import BUCKET_POLICY_NAME, is_bucket_policy
    from ..allocator.policy import POLICIES

    if not is_bucket_policy(policy) and policy not in POLICIES:
        raise InvalidArgumentError(f"unknown allocator policy {policy!r}; choose one of "
                                   f"{', '.join([*POLICIES, BUCKET_POLICY_NAME])}")


def needs_vmm(policy: str) -> bool:
    """Whether ``policy`` (a checked name) backs memory with virtual memory management or fails (``expandable``)."""
    from ..allocator.bucket import is_bucket_policy
    from ..allocator.policy import VmmMode, get_policy

    return not is_bucket_policy(policy) and get_policy(policy).vmm is VmmMode.ALWAYS


_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16"}


_COMPUTE_DTYPES = tuple(n for n, b in DTYPE_BYTES.items() if b > 1)


def _refuse_one_byte(name: str, nbytes: int, where: str) -> None:
    """A 1-byte dtype would hold the embeddings and the output projection in one byte, without scales: no
    int8/fp8 runtime does (Note [Weight formats] in gpumem.estimate.formats); the projections' format is
    --weight-format's."""
    if nbytes == 1:
        raise InvalidArgumentError(f"{where} {name}: 1-byte weights are a weight format: give --weight-format "
                                   f"{'fp8' if 'fp8' in name or 'float8' in name else 'int8'} (the projections in "
                                   "it with their scales, the rest in --dtype bf16, fp16 or fp32)")


def parse_dtypes(text: str | None, default_bytes: int, default_name: str = "") -> list[tuple[str, int]]:
    """``bf16,fp32`` -> ``[("bf16", 2), ("fp32", 4)]``; ``None`` -> the config's dtype."""
    if text is None:  # an empty --dtype is refused below, not taken for "the default"
        name = default_name or {4: "fp32", 2: "bf16", 1: "int8"}[default_bytes]
        _refuse_one_byte(name, default_bytes, "the config's torch_dtype")
        return [(name, default_bytes)]
    out: list[tuple[str, int]] = []
    for name in text.split(","):
        name = name.strip()
        if name not in DTYPE_BYTES:
            raise InvalidArgumentError(f"unknown dtype {name!r}; choose from {', '.join(_COMPUTE_DTYPES)}")
        _refuse_one_byte(name, DTYPE_BYTES[name], "--dtype")
        if name in (n for n, _ in out):
            raise InvalidArgumentError(f"--dtype gives {name} twice")
        out.append((name, DTYPE_BYTES[name]))
    return out


def check_workload_args(args: argparse.Namespace) -> None:
    """Refuse conflicting or empty workload options (those the command has): an empty ``--policy`` list,
    ``--training`` with both ``--max-seq-len`` and ``--prompt-len``, ``--new-tokens`` that leave no room
    for a prompt within ``--max-seq-len``."""
    policy = getattr(args, "policy", None)
    if isinstance(policy, str) and not [x for x in policy.split(",") if x.strip()]:
        raise InvalidArgumentError(f"--policy {policy!r} names no allocator policy")
    max_len = getattr(args, "max_seq_len", None)
    prompt = getattr(args, "prompt_len", None)
    new = getattr(args, "new_tokens", None) or 0
    if getattr(args, "training", False) and max_len is not None and prompt is not None and max_len != prompt:
        raise InvalidArgumentError(f"--training takes one sequence length: give --prompt-len {prompt} or "
                                   f"--max-seq-len {max_len}, not both")
    if (max_len is not None and prompt is None and not getattr(args, "training", False)
            and isinstance(max_len, int) and max_len > 0 and new >= max_len):
        raise InvalidArgumentError(f"--new-tokens {new} leaves no room for a prompt within --max-seq-len {max_len}")
