"""The shape of a decoder-only (Llama-style) language model, from numbers or a Hugging Face ``config.json``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..errors import InvalidArgumentError

__all__ = ["ModelShape", "from_hf_config", "DTYPE_BYTES"]

#: Bytes per element of the dtype names ``gpumem estimate --dtype`` and ``from_hf_config`` understand.
DTYPE_BYTES: Mapping[str, int] = {
    "float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
    "int8": 1, "fp8": 1, "float8": 1,
}


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be a positive whole number, got {value!r}")
    if value <= 0:
        raise InvalidArgumentError(f"{name} must be positive, got {value}")
    return value


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder: embeddings, ``n_layers`` blocks (RMSNorm, attention with ``n_kv_heads``
    key/value heads, RMSNorm, gated MLP), a final RMSNorm and an output projection.

    ``head_dim`` defaults to ``hidden_size // n_heads``; ``tie_word_embeddings`` shares the output
    projection with the embeddings (one matrix fewer).
    """

    hidden_size: int
    intermediate_size: int
    n_layers: int
    vocab_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int = 0
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "n_layers", "vocab_size", "n_heads", "n_kv_heads"):
            _positive_int(name, getattr(self, name))
        if self.head_dim == 0:
            if self.hidden_size % self.n_heads:
                raise InvalidArgumentError(
                    f"hidden_size {self.hidden_size} is not a multiple of n_heads {self.n_heads}; give head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)
        _positive_int("head_dim", self.head_dim)
        if self.n_heads % self.n_kv_heads:
            raise InvalidArgumentError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    @property
    def q_dim(self) -> int:
        """Width of the query projection (``n_heads * head_dim``)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection (``n_kv_heads * head_dim``)."""
        return self.n_kv_heads * self.head_dim

    def layer_param_shapes(self) -> list[tuple[str, int]]:
        """Parameters of one block, in the order PyTorch creates them: (name, elements)."""
        h, i = self.hidden_size, self.intermediate_size
        return [("q_proj", h * self.q_dim), ("k_proj", h * self.kv_dim), ("v_proj", h * self.kv_dim),
                ("o_proj", self.q_dim * h), ("gate_proj", h * i), ("up_proj", h * i), ("down_proj", i * h),
                ("input_layernorm", h), ("post_attention_layernorm", h)]

    def param_shapes(self) -> list[tuple[str, int]]:
        """Every parameter tensor of the model, in creation order: (name, elements)."""
        out = [("embed_tokens", self.vocab_size * self.hidden_size)]
        for layer in range(self.n_layers):
            out += [(f"layers.{layer}.{name}", n) for name, n in self.layer_param_shapes()]
        out.append(("norm", self.hidden_size))
        if not self.tie_word_embeddings:
            out.append(("lm_head", self.vocab_size * self.hidden_size))
        return out

    @property
    def n_params(self) -> int:
        """Number of parameters."""
        return sum(n for _, n in self.param_shapes())


def _first(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if name in cfg and cfg[name] is not None:
            return cfg[name]
    return default


def from_hf_config(path_or_dict: "str | os.PathLike[str] | Mapping[str, Any]") -> tuple[ModelShape, int]:
    """Read a Hugging Face ``config.json`` (a path, or the parsed dict) of a Llama-style decoder.

    Returns ``(shape, dtype_bytes)``; ``dtype_bytes`` comes from ``torch_dtype`` / ``dtype`` (2 when
    absent). Multimodal configs with a ``text_config`` use it. Raises ``InvalidArgumentError`` when the
    file cannot be read, is not JSON, or lacks a field the estimate needs.
    """
    if isinstance(path_or_dict, Mapping):
        cfg: Mapping[str, Any] = path_or_dict
        origin = "config"
    else:
        origin = str(path_or_dict)
        try:
            cfg = json.loads(Path(path_or_dict).read_text())
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read {origin}: {exc.strerror or exc}") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgumentError(f"{origin} is not a JSON file: {exc}") from None
        if not isinstance(cfg, dict):
            raise InvalidArgumentError(f"{origin}: expected a JSON object, got {type(cfg).__name__}")
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k in ("torch_dtype", "dtype")}}
    fields = {
        "hidden_size": _first(cfg, "hidden_size", "n_embd", "d_model"),
        "intermediate_size": _first(cfg, "intermediate_size", "n_inner", "ffn_dim"),
        "n_layers": _first(cfg, "num_hidden_layers", "n_layer", "num_layers"),
        "vocab_size": _first(cfg, "vocab_size"),
        "n_heads": _first(cfg, "num_attention_heads", "n_head"),
    }
    hf_keys = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
               "n_layers": "num_hidden_layers", "vocab_size": "vocab_size", "n_heads": "num_attention_heads"}
    missing = [hf_keys[k] for k, v in fields.items() if v is None]  # the config's own key names
    if missing:
        raise InvalidArgumentError(f"{origin}: missing {', '.join(missing)} (not a decoder LLM config?)")
    n_kv = _first(cfg, "num_key_value_heads", default=fields["n_heads"])
    head_dim = _first(cfg, "head_dim", default=0)
    dtype_name = str(_first(cfg, "torch_dtype", "dtype", default="bfloat16")).replace("torch.", "")
    if dtype_name not in DTYPE_BYTES:
        raise InvalidArgumentError(f"{origin}: unknown dtype {dtype_name!r}; known: {', '.join(DTYPE_BYTES)}")
    shape = ModelShape(fields["hidden_size"], fields["intermediate_size"], fields["n_layers"], fields["vocab_size"],
                       fields["n_heads"], n_kv, head_dim, bool(cfg.get("tie_word_embeddings", False)))
    return shape, DTYPE_BYTES[dtype_name]
