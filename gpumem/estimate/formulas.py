"""Peak-allocated estimates of inference and training memory for Llama-style decoders."""

from __future__ import annotations

import logging
import warnings
from dataclasses import asdict, dataclass
from typing import Any

from ..device import Device
from ..errors import InvalidArgumentError
from ..workspace.sizing import size_workspace
from .formats import WeightFormat
from .shape import ModelShape
from .workload import Category, LoraConfig, WorkloadTrace, check_weight_format, inference_trace, training_trace

__all__ = ["MemoryEstimate", "TrainingEstimate", "estimate_model_memory", "estimate_kv_cache_memory",
           "estimate_inference_memory", "estimate_training_memory", "dequant_workspace_nbytes"]

log = logging.getLogger(__name__)

_GIB = float(2**30)
_MIB = float(2**20)


def _deprecated_alias(field: str, divisor: float, new: str) -> property:
    """The old ``*_gb``/``*_mb`` helper: warns, names ``new``, and returns what it always did, ``field`` in
    decimal units (Note [GiB everywhere])."""

    def get(self: Any) -> float:
        warnings.warn(f"MemoryEstimate.{new.replace('_gib', '_gb').replace('_mib', '_mb')} (decimal GB/MB) is "
                      f"deprecated: use {new} (GiB/MiB, 2**30/2**20 bytes, as the command line prints)",
                      DeprecationWarning, stacklevel=2)
        return getattr(self, field) / divisor

    return property(get, doc=f"Deprecated: ``{field}`` in decimal units; use ``{new}`` (it warns).")

def _in_units(field: str, unit_nbytes: float, unit: str) -> property:
    """A read-only figure: ``field`` in ``unit``."""
    return property(lambda self: getattr(self, field) / unit_nbytes, doc=f"``{field}`` in {unit}.")


#: Sanity caps on the workload (far beyond any real run; see also ``shape.SHAPE_CAPS``): larger values
#: raise ``InvalidArgumentError`` naming the field and the cap.
WORKLOAD_CAPS = {"batch_size": 2**20, "seq_len": 2**24, "max_seq_len": 2**24, "prompt_len": 2**24,
                 "new_tokens": 2**24}


def _cap(name: str, value: Any) -> None:
    cap = WORKLOAD_CAPS[name]
    if isinstance(value, int) and not isinstance(value, bool) and value > cap:
        raise InvalidArgumentError(f"{name} {value} exceeds the sanity cap of {cap}")


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimated peak of GPU memory a workload allocates, and its parts at that moment.

    ``total_bytes`` is the peak of allocated bytes (what ``torch.cuda.max_memory_allocated`` reports):
    ``model_bytes + kv_cache_bytes + activation_bytes + overhead_bytes``. ``phase`` names where the peak
    falls (``prefill``, ``decode``, ``forward 2``, ``optimizer 1``, ...).
    """

    model_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    overhead_bytes: int
    total_bytes: int
    phase: str = ""

    total_gib = _in_units("total_bytes", _GIB, "GiB (2**30 bytes, the unit of the command line)")
    total_mib = _in_units("total_bytes", _MIB, "MiB (2**20 bytes)")
    model_gib = _in_units("model_bytes", _GIB, "GiB")
    kv_cache_gib = _in_units("kv_cache_bytes", _GIB, "GiB")
    activation_gib = _in_units("activation_bytes", _GIB, "GiB")

    # Note [GiB everywhere]: the command line prints GiB (2**30); the ``*_gb``/``*_mb`` helpers returned GB
    # (10**9), so one figure read differently in Python and in a terminal. The helpers are ``*_gib``/``*_mib``
    # now; the old names stay as deprecated aliases that warn and still return the decimal figure (code
    # that used them keeps its numbers until it moves).
    total_gb = _deprecated_alias("total_bytes", 1e9, "total_gib")
    total_mb = _deprecated_alias("total_bytes", 1e6, "total_mib")
    model_gb = _deprecated_alias("model_bytes", 1e9, "model_gib")
    kv_cache_gb = _deprecated_alias("kv_cache_bytes", 1e9, "kv_cache_gib")
    activation_gb = _deprecated_alias("activation_bytes", 1e9, "activation_gib")

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class TrainingEstimate(MemoryEstimate):
    """A :class:`MemoryEstimate` of training steps; ``kv_cache_bytes`` is 0, and the peak's gradients and
    optimizer states are given apart."""

    gradient_bytes: int = 0
    optimizer_bytes: int = 0


def _check_dtype(dtype_bytes: Any) -> int:
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes not in (1, 2, 4):
        raise InvalidArgumentError(f"dtype_bytes must be 1, 2 or 4, got {dtype_bytes!r}")
    return int(dtype_bytes)


def estimate_model_memory(hidden_size: int, intermediate_size: int, n_layers: int, vocab_size: int,
                          dtype_bytes: int, *, n_heads: int | None = None, n_kv_heads: int | None = None,
                          tie_word_embeddings: bool = False) -> int:
    """Bytes of the weights of a Llama-style decoder (embeddings, blocks, final norm, output projection).

    ``n_heads``/``n_kv_heads`` matter for grouped-query attention (smaller k/v projections); without them
    the attention is taken as multi-head (``n_kv_heads == n_heads``).
    """
    dtype_bytes = _check_dtype(dtype_bytes)
    heads = n_heads or 1
    shape = ModelShape(hidden_size, intermediate_size, n_layers, vocab_size, heads, n_kv_heads or heads,
                       0 if hidden_size % heads == 0 else 1, tie_word_embeddings)
    return shape.n_params * dtype_bytes


def estimate_kv_cache_memory(n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int, dtype_bytes: int, *,
                             batch_size: int = 1) -> int:
    """Bytes of a full key/value cache: ``2 * n_layers * batch * seq_len * n_kv_heads * head_dim * dtype``."""
    dtype_bytes = _check_dtype(dtype_bytes)
    for name, v in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                    ("seq_len", seq_len), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise InvalidArgumentError(f"{name} must be a positive whole number, got {v!r}")
    _cap("seq_len", seq_len)
    _cap("batch_size", batch_size)
    ModelShape(1, 1, n_layers, 1, n_kv_heads, n_kv_heads, head_dim)  # the shape caps
    return 2 * n_layers * batch_size * seq_len * n_kv_heads * head_dim * max(dtype_bytes, 2)


def _from_trace(model_bytes: int, w: WorkloadTrace, cls: type = MemoryEstimate, **extra: int) -> Any:
    at = w.at_peak
    kv = at.get(Category.KV_CACHE, 0)
    over = at.get(Category.OVERHEAD, 0)
    weights = at.get(Category.WEIGHTS, 0)
    rest = w.peak_nbytes - weights - kv - over - sum(extra.values())
    return cls(model_bytes=weights, kv_cache_bytes=kv, activation_bytes=rest, overhead_bytes=over,
               total_bytes=w.peak_nbytes, phase=w.phase_at_peak, **extra)


def estimate_inference_memory(hidden_size: int, intermediate_size: int, n_layers: int, vocab_size: int,
                              n_heads: int, n_kv_heads: int, max_seq_len: int, dtype_bytes: int, *,
                              batch_size: int = 1, prompt_len: int | None = None, new_tokens: int = 0,
                              head_dim: int = 0, tie_word_embeddings: bool = False,
                              attention_bias: bool = False, weight_format: "WeightFormat | None" = None,
                              workspace_nbytes: int = 0, n_experts: int = 0, experts_per_token: int = 0,
                              expert_intermediate_size: int = 0,
                              shared_expert_intermediate_size: int = 0, router_weights_cast: bool = False,
                              sub_norms: bool = False, activation: str = "silu",
                              sliding_window: int = 0, always_masked: bool = False) -> MemoryEstimate:
    """The peak of allocated bytes of Hugging Face ``generate()`` on a Llama-style decoder.

    ``attention_bias``: biases on the q, k and v projections (Qwen2). ``weight_format``: the projections'
    format (:mod:`.formats`; ``dtype_bytes`` is then the activations' and the other weights'), with
    ``workspace_nbytes`` of dequantization workspace (:func:`dequant_workspace_nbytes`). ``n_experts`` and the
    three after it: a mixture-of-experts MLP; ``sub_norms`` and ``activation``: BitNet's block
    (:class:`~gpumem.estimate.shape.ModelShape`).
    ``prompt_len`` defaults to ``max_seq_len - new_tokens``; ``prompt_len + new_tokens`` may not exceed
    ``max_seq_len``. The estimate walks the allocations of :func:`~gpumem.estimate.workload.inference_trace`
    (weights, prefill, one decode step per new token after the first) and reports their peak.
    """
    dtype_bytes = _check_dtype(dtype_bytes)
    # the same in estimate_inference_memory and estimate_training_memory: both take the shape's fields one by one
    shape = ModelShape(hidden_size, intermediate_size, n_layers, vocab_size, n_heads, n_kv_heads, head_dim,
                       tie_word_embeddings, attention_bias, n_experts=n_experts, experts_per_token=experts_per_token,
                       expert_intermediate_size=expert_intermediate_size,
                       shared_expert_intermediate_size=shared_expert_intermediate_size,
                       router_weights_cast=router_weights_cast, sub_norms=sub_norms, activation=activation,
                       sliding_window=sliding_window, always_masked=always_masked)
    _cap("batch_size", batch_size)
    prompt = _prompt(max_seq_len, prompt_len, new_tokens)
    if isinstance(workspace_nbytes, bool) or not isinstance(workspace_nbytes, int) or workspace_nbytes < 0:
        raise InvalidArgumentError(f"workspace_nbytes must be a whole number >= 0, got {workspace_nbytes!r:.40}")
    w = inference_trace(shape, dtype_bytes, batch_size=batch_size, prompt_len=prompt, new_tokens=new_tokens,
                        weight_format=weight_format, workspace_nbytes=workspace_nbytes)
    return _from_trace(shape.n_params * dtype_bytes, w)


def _prompt(max_seq_len: int, prompt_len: int | None, new_tokens: int) -> int:
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0:
        raise InvalidArgumentError(f"max_seq_len must be a positive whole number, got {max_seq_len!r}")
    _cap("max_seq_len", max_seq_len)
    _cap("new_tokens", new_tokens)
    _cap("prompt_len", prompt_len)
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 0:
        raise InvalidArgumentError(f"new_tokens must be a whole number >= 0, got {new_tokens!r}")
    if prompt_len is None and new_tokens >= max_seq_len:
        raise InvalidArgumentError(f"new_tokens {new_tokens} leaves no room for a prompt within max_seq_len "
                                   f"{max_seq_len}")
    prompt = max_seq_len - new_tokens if prompt_len is None else prompt_len
    if isinstance(prompt, bool) or not isinstance(prompt, int) or prompt <= 0:
        raise InvalidArgumentError(f"prompt_len must be a positive whole number, got {prompt!r}")
    if prompt + new_tokens > max_seq_len:
        raise InvalidArgumentError(f"prompt_len {prompt} + new_tokens {new_tokens} exceeds max_seq_len {max_seq_len}")
    return prompt


def estimate_training_memory(hidden_size: int, intermediate_size: int, n_layers: int, vocab_size: int,
                             n_heads: int, n_kv_heads: int, seq_len: int, dtype_bytes: int, *, batch_size: int = 1,
                             optimizer_states: int = 2, head_dim: int = 0,
                             tie_word_embeddings: bool = False, attention_bias: bool = False,
                             gradient_checkpointing: bool = False, optimizer_8bit: bool = False,
                             lora: "LoraConfig | None" = None, n_experts: int = 0, experts_per_token: int = 0,
                             expert_intermediate_size: int = 0,
                             shared_expert_intermediate_size: int = 0, router_weights_cast: bool = False,
                             sub_norms: bool = False, activation: str = "silu", sliding_window: int = 0,
                             always_masked: bool = False, mixed_precision: str | None = None) -> TrainingEstimate:
    """The peak of allocated bytes of full training steps (forward, backward, foreach AdamW with
    ``optimizer_states`` states per parameter in the weights' dtype, or 8-bit with ``optimizer_8bit``), steady
    state included (two steps); ``gradient_checkpointing`` recomputes each block in the backward pass;
    ``lora`` trains adapters on a frozen base (Note [LoRA] in :mod:`.workload`); ``mixed_precision``
    (``"bf16"`` or ``"fp16"``) runs the forward under that ``torch.autocast`` on fp32 master weights, gradients
    and states, ``dtype_bytes`` 4 (Note [Mixed precision] in :mod:`.workload`)."""
    dtype_bytes = _check_dtype(dtype_bytes)
    if isinstance(optimizer_states, bool) or not isinstance(optimizer_states, int) or optimizer_states < 0:
        raise InvalidArgumentError(f"optimizer_states must be a whole number >= 0, got {optimizer_states!r}")
    # the same in estimate_inference_memory and estimate_training_memory: both take the shape's fields one by one
    shape = ModelShape(hidden_size, intermediate_size, n_layers, vocab_size, n_heads, n_kv_heads, head_dim,
                       tie_word_embeddings, attention_bias, n_experts=n_experts, experts_per_token=experts_per_token,
                       expert_intermediate_size=expert_intermediate_size,
                       shared_expert_intermediate_size=shared_expert_intermediate_size,
                       router_weights_cast=router_weights_cast, sub_norms=sub_norms, activation=activation,
                       sliding_window=sliding_window, always_masked=always_masked)
    _cap("batch_size", batch_size)
    _cap("seq_len", seq_len)
    w = training_trace(shape, dtype_bytes, batch_size=batch_size, seq_len=seq_len, n_steps=2,
                       optimizer_states=optimizer_states, gradient_checkpointing=gradient_checkpointing,
                       optimizer_8bit=optimizer_8bit, lora=lora, mixed_precision=mixed_precision)
    return _from_trace(shape.n_params * dtype_bytes, w, TrainingEstimate,
                       gradient_bytes=w.at_peak.get(Category.GRADIENTS, 0),
                       optimizer_bytes=w.at_peak.get(Category.OPTIMIZER, 0))


def dequant_workspace_nbytes(shape: ModelShape, fmt: WeightFormat | None, device: Device) -> int:
    """The dequantization workspace of a ternary format on ``device`` (0 for the others): what
    :func:`gpumem.workspace.size_workspace` gives the largest of the block's projections, from the device's
    memory now (Note [Weight formats] in :mod:`.formats`)."""
    check_weight_format(fmt)
    if fmt is None or not fmt.qtype:
        return 0
    props, mem = device.properties(), device.mem_info()
    h, i, q = shape.hidden_size, shape.intermediate_size, shape.q_dim
    return max(size_workspace(n_in, n_out, fmt.qtype, props, mem, device=device.spec).workspace_bytes
               for n_in, n_out in ((h, q), (q, h), (h, i), (i, h)))
