"""Options shared by ``gpumem estimate`` and ``gpumem fit``: the model, from numbers or a ``config.json``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import logging

from ..errors import InvalidArgumentError
from ..estimate.shape import DTYPE_BYTES, ModelShape, from_hf_config

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
    g.add_argument("--head-dim", type=int, default=0, help="default: hidden size / heads")
    g.add_argument("--tie-word-embeddings", action="store_true")


def model_from_args(args: argparse.Namespace) -> tuple[ModelShape, int]:
    """The shape and the config's dtype bytes (2 without a config); raises ``InvalidArgumentError``.
    Sets ``args.config_dtype`` to the config's dtype name (``bf16`` without one) and ``args.context_len`` to
    its ``max_position_embeddings`` (``None`` without one)."""
    args.config_dtype = "bf16"
    args.context_len = None
    numbers = (args.hidden_size, args.intermediate_size, args.layers, args.vocab_size, args.heads)
    if args.hf_config:
        if any(v is not None for v in numbers):
            raise InvalidArgumentError("give either --hf-config or the shape options, not both")
        shape, nbytes = from_hf_config(args.hf_config)
        cfg = json.loads(Path(args.hf_config).read_text())
        cfg = {**cfg.get("text_config", {}), **cfg} if isinstance(cfg.get("text_config"), dict) else cfg
        name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
        args.config_dtype = _SHORT.get(name, name)
        ctx = cfg.get("max_position_embeddings")
        if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx > 0:
            args.context_len = ctx
        return shape, nbytes
    names = ("--hidden-size", "--intermediate-size", "--layers", "--vocab-size", "--heads")
    missing = [n for n, v in zip(names, numbers) if v is None]
    if missing:
        raise InvalidArgumentError(f"missing {', '.join(missing)} (or give --hf-config)")
    shape = ModelShape(args.hidden_size, args.intermediate_size, args.layers, args.vocab_size, args.heads,
                       args.kv_heads or args.heads, args.head_dim, args.tie_word_embeddings)
    return shape, 2


def context_note(tokens: int, context_len: int | None) -> str:
    """A warning (logged, and returned for the output) when ``tokens`` exceed the config's context; else ``""``."""
    if context_len is None or tokens <= context_len:
        return ""
    note = (f"{tokens} tokens exceed the model's context of {context_len} (max_position_embeddings in the config); "
            f"the estimate is for the shape as if it could")
    log.warning("%s", note)
    return note


def check_device(spec: str) -> None:
    """Open and close ``spec`` once, so that a bad device spec is bad input (exit 2) found before any work;
    raises ``InvalidArgumentError`` naming ``--device``."""
    from ..errors import GpumemError
    from ..specs import open_device

    try:
        open_device(spec).close()
    except GpumemError as exc:
        raise InvalidArgumentError(f"--device {spec}: {exc}") from None


_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16"}


def parse_dtypes(text: str | None, default_bytes: int, default_name: str = "") -> list[tuple[str, int]]:
    """``bf16,fp32`` -> ``[("bf16", 2), ("fp32", 4)]``; ``None`` -> the config's dtype."""
    if not text:
        name = default_name or {4: "fp32", 2: "bf16", 1: "int8"}[default_bytes]
        return [(name, default_bytes)]
    out = []
    for name in text.split(","):
        name = name.strip()
        if name not in DTYPE_BYTES:
            raise InvalidArgumentError(f"unknown dtype {name!r}; choose from {', '.join(DTYPE_BYTES)}")
        out.append((name, DTYPE_BYTES[name]))
    return out
