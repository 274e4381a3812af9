"""The shape of a decoder-only (Llama-style) language model, from numbers or a Hugging Face ``config.json``."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..errors import InvalidArgumentError
from .formats import WEIGHT_FORMATS, WeightFormat


__all__ = ["ModelShape", "from_hf_config", "DTYPE_BYTES", "SHAPE_CAPS", "MAX_CONFIG_BYTES", "SUPPORTED_MODEL_TYPES",
           "config_weight_format", "check_quantization_config"]

#: Sanity caps on the shape (far beyond any real model): larger values are refused, since the estimate's
#: cost grows with them (``n_layers``) and the figures would be meaningless.
SHAPE_CAPS: Mapping[str, int] = {
    "hidden_size": 2**20, "intermediate_size": 2**20, "n_layers": 10_000, "vocab_size": 2**24,
    "n_heads": 2**14, "n_kv_heads": 2**14, "head_dim": 2**20, "sliding_window": 2**24,
    "n_experts": 2**16, "experts_per_token": 2**16, "expert_intermediate_size": 2**20,
    "shared_expert_intermediate_size": 2**20,
}

#: Largest ``config.json`` :func:`from_hf_config` reads (a real one is a few KB).
MAX_CONFIG_BYTES = 16 * 2**20

#: Bytes per element of the dtype names ``gpumem estimate --dtype`` and ``from_hf_config`` understand.
DTYPE_BYTES: Mapping[str, int] = {
    "float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
    "int8": 1, "fp8": 1, "float8": 1,
}


def _positive_int(name: str, value: Any, cap: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be a positive whole number, got {value!r}")
    if value <= 0:
        raise InvalidArgumentError(f"{name} must be positive, got {value}")
    if cap is not None and value > cap:
        raise InvalidArgumentError(f"{name} {value} exceeds the sanity cap of {cap}")
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
    attention_bias: bool = False
    """Biases on the q, k and v projections (Qwen2; ``attention_bias`` in a Llama config)."""
    sliding_window: int = 0
    """Tokens a sliding-window attention sees (0: none). Sequences within it are full attention; longer ones
    attend through a mask to a cache of the window (Note [Sliding window] in :mod:`.workload`)."""
    n_experts: int = 0
    """Mixture-of-experts (Note [Mixture of experts] in :mod:`.workload`): routed experts per block (0: a dense
    gated MLP of ``intermediate_size``)."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k), 1 .. ``n_experts``."""
    expert_intermediate_size: int = 0
    """Intermediate width of one routed expert (0: ``intermediate_size``, as Mixtral)."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert every token goes through, with its sigmoid gate (Qwen2-MoE; 0: none)."""
    router_weights_cast: bool = False
    """The router's top-k weights cast to the model dtype (Qwen2-MoE) rather than kept fp32 (Mixtral)."""
    sub_norms: bool = False
    """BitNet's block: an RMSNorm on the attention output before ``o_proj`` and one on the MLP's product before
    ``down_proj`` (Note [BitNet block] in :mod:`.workload`)."""
    activation: str = "silu"
    """The gated MLP's activation: ``silu`` (Llama) or ``relu2`` (BitNet: ``relu(x)**2``, two temporaries)."""
    always_masked: bool = False
    """Every forward builds a boolean attention mask, within any window (Note [Sliding window] in
    :mod:`.workload`): transformers 5.17's Qwen2-MoE builds its sliding-window mask whenever its config has a
    ``sliding_window``, ``use_sliding_window`` false included."""

    def __post_init__(self) -> None:
        if not isinstance(self.always_masked, bool):
            raise InvalidArgumentError(f"always_masked must be true or false, got {self.always_masked!r:.40}")
        for name in ("hidden_size", "intermediate_size", "n_layers", "vocab_size", "n_heads", "n_kv_heads"):
            _positive_int(name, getattr(self, name), SHAPE_CAPS[name])
        if self.head_dim == 0:
            if self.hidden_size % self.n_heads:
                raise InvalidArgumentError(
                    f"hidden_size {self.hidden_size} is not a multiple of n_heads {self.n_heads}; give head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)
        _positive_int("head_dim", self.head_dim, SHAPE_CAPS["head_dim"])
        if not isinstance(self.tie_word_embeddings, bool):
            raise InvalidArgumentError(f"tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}")
        if self.sliding_window != 0:
            _positive_int("sliding_window", self.sliding_window, SHAPE_CAPS["sliding_window"])
        if not isinstance(self.attention_bias, bool):
            raise InvalidArgumentError(f"attention_bias must be true or false, got {self.attention_bias!r}")
        if self.n_heads % self.n_kv_heads:
            raise InvalidArgumentError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if not isinstance(self.router_weights_cast, bool):
            raise InvalidArgumentError(f"router_weights_cast must be true or false, got {self.router_weights_cast!r:.40}")
        if not isinstance(self.sub_norms, bool):
            raise InvalidArgumentError(f"sub_norms must be true or false, got {self.sub_norms!r:.40}")
        if self.activation not in ("silu", "relu2"):
            raise InvalidArgumentError(f"activation must be 'silu' or 'relu2', got {self.activation!r:.40}")
        moe = ("experts_per_token", "expert_intermediate_size", "shared_expert_intermediate_size",
               "router_weights_cast")
        if self.n_experts == 0:
            given = [f"{k}={getattr(self, k)!r}" for k in moe if getattr(self, k) != 0]
            if given:
                raise InvalidArgumentError(f"{', '.join(given)} given without n_experts (a dense model has none)")
            return
        _positive_int("n_experts", self.n_experts, SHAPE_CAPS["n_experts"])
        _positive_int("experts_per_token", self.experts_per_token, SHAPE_CAPS["experts_per_token"])
        if self.experts_per_token > self.n_experts:
            raise InvalidArgumentError(f"experts_per_token {self.experts_per_token} exceeds n_experts "
                                       f"{self.n_experts}")
        if self.expert_intermediate_size == 0:
            object.__setattr__(self, "expert_intermediate_size", self.intermediate_size)
        _positive_int("expert_intermediate_size", self.expert_intermediate_size,
                      SHAPE_CAPS["expert_intermediate_size"])
        if self.shared_expert_intermediate_size != 0:
            _positive_int("shared_expert_intermediate_size", self.shared_expert_intermediate_size,
                          SHAPE_CAPS["shared_expert_intermediate_size"])

    def check_tokens(self, n_tokens: int) -> None:
        """Note [Sliding window]: sequences of any length are modelled (``workload.window_tokens``); kept for
        the callers that check a length before estimating: ``n_tokens`` must be a positive int."""
        _positive_int("n_tokens", n_tokens, 2**40)

    @property
    def q_dim(self) -> int:
        """Width of the query projection (``n_heads * head_dim``)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection (``n_kv_heads * head_dim``)."""
        return self.n_kv_heads * self.head_dim

    def layer_param_shapes(self) -> list[tuple[str, int]]:
        """Parameters of one block: (name, elements); the projections and norms in the order PyTorch creates
        them, the attention biases (if any) last (the training trace's gradient order reads them by index)."""
        h = self.hidden_size
        out = [("q_proj", h * self.q_dim), ("k_proj", h * self.kv_dim), ("v_proj", h * self.kv_dim),
               ("o_proj", self.q_dim * h), *self.mlp_param_shapes(),
               ("input_layernorm", h), ("post_attention_layernorm", h)]
        if self.attention_bias:
            out += [("q_proj.bias", self.q_dim), ("k_proj.bias", self.kv_dim), ("v_proj.bias", self.kv_dim)]
        if self.sub_norms:
            out += [("attn_sub_norm", self.q_dim), ("ffn_sub_norm", self.intermediate_size)]
        return out

    def mlp_param_shapes(self) -> list[tuple[str, int]]:
        """The MLP's parameters of one block, in creation order: the gated MLP, or (Note [Mixture of experts]
        in :mod:`.workload`) the router, the experts as transformers 5 holds them (one ``gate_up_proj`` and
        one ``down_proj`` tensor for all experts) and the shared expert with its gate."""
        h, i = self.hidden_size, self.intermediate_size
        if not self.n_experts:
            return [("gate_proj", h * i), ("up_proj", h * i), ("down_proj", i * h)]
        e, ie, si = self.n_experts, self.expert_intermediate_size, self.shared_expert_intermediate_size
        out = [("router", e * h), ("experts.gate_up_proj", e * 2 * ie * h), ("experts.down_proj", e * h * ie)]
        if si:
            out += [("shared_expert.gate_proj", h * si), ("shared_expert.up_proj", h * si),
                    ("shared_expert.down_proj", si * h), ("shared_expert_gate", h)]
        return out

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


#: ``model_type`` values whose decoder is the Llama-style block :class:`ModelShape` describes (gated SiLU MLP,
#: RMSNorm, rotary attention; ``qwen2`` with its q/k/v biases). A config without ``model_type`` is taken as one.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "bitnet")

#: The ``architectures`` a config without ``model_type`` may name (it is then read as a Llama-style decoder).
_DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")  # Qwen2: its biases need model_type

#: Mixture-of-experts ``model_type`` -> the MoE keys it is read with (Note [Mixture of experts] in
#: :mod:`.workload`); MoE keys of any other config, or beyond these, are refused (DeepSeek's routed and shared
#: experts with dense first layers, Qwen3-MoE's q/k norms, sparse steps).
MOE_MODEL_KEYS: Mapping[str, tuple[str, ...]] = {
    "mixtral": ("num_local_experts", "num_experts_per_tok"),
    "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "decoder_sparse_step"),
}

#: Config keys that make a model a mixture-of-experts (Note [Refuse what is not modelled]).
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "n_shared_experts", "shared_expert_intermediate_size", "moe_layer_freq",
            "first_k_dense_replace", "decoder_sparse_step")

#: Other config keys that change memory and that the estimate does not model: any value but the neutral
#: one (``None``, ``False``, ``0`` or an empty list) is refused.
UNMODELLED_KEYS = {
    "quantization": "quantized weights",
    "kv_lora_rank": "multi-head latent attention (DeepSeek's compressed cache)",
    "q_lora_rank": "multi-head latent attention (DeepSeek's compressed cache)",
    "num_nextn_predict_layers": "multi-token prediction layers",
    "cross_attention_layers": "cross-attention layers",
    "mlp_bias": "MLP biases",
    "attn_logit_softcapping": "attention logit soft-capping (eager attention, full score matrices)",
    "is_encoder_decoder": "an encoder besides the decoder",
    "encoder_layers": "an encoder besides the decoder",
    "vision_config": "a vision tower besides the language model (give its text_config as a file of its own to "
                     "estimate the language model alone)",
    "audio_config": "an audio tower besides the language model (give its text_config as a file of its own to "
                    "estimate the language model alone)",
}

_NEUTRAL = (None, False, 0, [], {}, "")

#: The :data:`UNMODELLED_KEYS` that give the weights' format: read as the dense decoder, their weights would be
#: counted as plain 16-bit ones (the other keys are memory of another kind the estimate leaves out).
_WEIGHT_FORMAT_KEYS = ("quantization",)


def config_weight_format(cfg: Mapping[str, Any], origin: str = "config") -> "WeightFormat | None":
    """The weight format a config's ``quantization_config`` names (Note [Weight formats] in :mod:`.formats`),
    ``None`` without one; one this estimate does not read raises ``InvalidArgumentError`` naming it:
    bitsandbytes 8-bit is ``int8``, per-tensor ``fp8`` is ``fp8``, BitNet's packed ``bitlinear`` offline mode
    is ``i2s`` storage (``autobitlinear`` and online quantization are refused); bitsandbytes 4-bit (NF4,
    64-weight blocks), GPTQ/AWQ (zero points, GPTQ's ``g_idx``), block-wise fp8, projections kept out of the
    format and the rest are refused."""
    q = cfg.get("quantization_config")
    if q in _NEUTRAL:
        return None
    if not isinstance(q, Mapping):
        raise InvalidArgumentError(f"{origin}: quantization_config must be a JSON object, got {q!r:.60}")
    method = q.get("quant_method")
    _refuse_kept_16_bit(q, origin)
    if method == "bitsandbytes" and q.get("load_in_8bit") is True and not q.get("load_in_4bit"):
        return WEIGHT_FORMATS["int8"]
    if method == "fp8" and q.get("weight_block_size") in _NEUTRAL:
        return WEIGHT_FORMATS["fp8"]
    if method == "bitnet":
        # transformers' BitLinear (the default linear_class) holds the packed 2-bit weights and unpacks them
        # at each forward; AutoBitLinear unpacks the checkpoint into 16-bit weights at load time (offline) or
        # re-quantizes 16-bit weights at each forward (online): neither is the packed format, nor modelled
        linear_class, mode = q.get("linear_class", "bitlinear"), q.get("quantization_mode", "offline")
        if linear_class == "bitlinear" and mode == "offline":
            return WEIGHT_FORMATS["i2s"]
        raise InvalidArgumentError(f"{origin}: quantization_config (quant_method 'bitnet', linear_class "
                                   f"{linear_class!r:.40}, quantization_mode {mode!r:.40}) is not modelled: only "
                                   "BitLinear's packed offline weights are (AutoBitLinear holds 16-bit weights and "
                                   "quantizes them at each forward); give --weight-format or --weight-bits for what "
                                   "its weights store")
    detail = {"bitsandbytes": "4-bit NF4 (blocks of 64 with their absmax) is not modelled",
              "gptq": "GPTQ also stores zero points and g_idx, not modelled",
              "awq": "AWQ also stores zero points, not modelled",
              "fp8": "block-wise fp8 scales (weight_block_size) are not modelled"}.get(str(method),
                                                                                    "not a format this estimate reads")
    raise InvalidArgumentError(f"{origin}: quantization_config (quant_method {method!r:.40}): {detail}; give "
                               "--weight-format or --weight-bits for what its weights store")


def check_quantization_config(cfg: Mapping[str, Any], origin: str = "config") -> None:
    """The checks of a config's ``quantization_config`` that hold whatever format the caller gives for its
    weights (``--weight-format`` / ``--weight-bits``): it must be a JSON object, and it must not keep
    projections out of the format or 16-bit weights beside the quantized ones (:func:`_refuse_kept_16_bit`).

    Note [A given weight format replaces only the format]: a format given by the caller stands for the one
    ``quant_method`` names (a GPTQ or AWQ config is refused with "give --weight-format"), not for the rest
    of the config: ``modules_to_not_convert`` still keeps those modules 16-bit, and
    ``llm_int8_has_fp16_weight`` still keeps 16-bit copies, whatever the projections' format. Skipping
    these checks with the flag counted those modules in the given format, an under-estimate without a word.
    Raises ``InvalidArgumentError`` naming the field."""
    q = cfg.get("quantization_config")
    if q in _NEUTRAL:
        return
    if not isinstance(q, Mapping):
        raise InvalidArgumentError(f"{origin}: quantization_config must be a JSON object, got {q!r:.60}")
    _refuse_kept_16_bit(q, origin)


def _refuse_kept_16_bit(q: Mapping[str, Any], origin: str) -> None:
    """A quantization_config that keeps projections out of its format (``modules_to_not_convert``,
    bitsandbytes' ``llm_int8_skip_modules``: they stay 16-bit) or keeps 16-bit weights beside the quantized
    ones (``llm_int8_has_fp16_weight``) is refused: counted in the format they were under-estimated. The
    output projection (``lm_head``) is kept 16-bit by the estimate already and may be named."""
    for key in ("modules_to_not_convert", "llm_int8_skip_modules"):
        skip = q.get(key)
        if skip in _NEUTRAL:
            continue
        if not isinstance(skip, list) or any(not isinstance(m, str) or m.rstrip("$") != "lm_head" for m in skip):
            raise InvalidArgumentError(f"{origin}: quantization_config {key} ({skip!r:.60}) keeps modules other "
                                       "than lm_head in 16 bits, which this estimate does not model")
    if q.get("llm_int8_has_fp16_weight") not in _NEUTRAL:
        raise InvalidArgumentError(f"{origin}: quantization_config llm_int8_has_fp16_weight keeps 16-bit weights "
                                   "beside the int8 ones, which this estimate does not model")


def _refuse_unmodelled(cfg: Mapping[str, Any], origin: str, read_quantization_config: bool = True, *,
                       wrapper: bool = False) -> None:
    """Note [Refuse what is not modelled]: a config field that changes memory and that this estimate does not
    model stops it with ``InvalidArgumentError`` naming the field: read as the dense Llama-style decoder it
    otherwise describes, a Mixtral-8x7B config came out as 7.24B parameters (13.49 GiB) instead of 46.7B, and
    a BitNet config as bf16 weights four times their packed size, without a word. Better no answer than a
    wrong one: what is refused here is what this module does not read yet.

    The ``model_type`` is checked first: a model this estimate does not read at all is named as such, not by
    the first of its fields that happens to be checked (a Gemma-2 config was refused for its soft-capping)."""
    # a vision or audio tower first: its message says how to estimate the language model alone, which a
    # refusal of the wrapper's model_type (llava, ...) would not (second attacker review)
    for key in ("vision_config", "audio_config"):
        if cfg.get(key) not in _NEUTRAL:
            raise InvalidArgumentError(f"{origin}: {key} means {UNMODELLED_KEYS[key]}, which this estimate does not "
                                       "model")
    moe = {k: cfg[k] for k in MOE_KEYS if cfg.get(k) not in _NEUTRAL}
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures")
    if model_type is None and archs not in _NEUTRAL:  # taken as Llama-style: its architectures must agree
        others = [a for a in archs if a not in _DENSE_ARCHITECTURES] if isinstance(archs, list) else [archs]
        if others:
            raise InvalidArgumentError(f"{origin}: a config without model_type naming architectures "
                                       f"{others!r:.80} is not read (without model_type it is taken as the "
                                       f"Llama-style {', '.join(_DENSE_ARCHITECTURES)})")
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        kind = (f" (a mixture-of-experts model: {', '.join(f'{k}={v!r:.40}' for k, v in moe.items())})"
                if moe else "")
        raise InvalidArgumentError(f"{origin}: model_type {model_type!r:.60}{kind} is not one this estimate models "
                                   f"(it reads {', '.join(SUPPORTED_MODEL_TYPES)}: Llama-style decoders); its "
                                   "layers may hold other weights and temporaries")
    read = MOE_MODEL_KEYS.get(str(model_type), ())
    if moe and (not read or any(k not in read for k in moe)):
        fields = ", ".join(f"{k}={v!r:.40}" for k, v in moe.items() if k not in read)
        raise InvalidArgumentError(f"{origin}: a mixture-of-experts model ({fields}) is not supported by this "
                                   "estimate (it reads Mixtral and Qwen2-MoE configs): read as a dense model it "
                                   "would count one expert's weights only")
    if read:
        if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers") not in _NEUTRAL:
            raise InvalidArgumentError(f"{origin}: dense MLP layers among the expert layers (decoder_sparse_step "
                                       f"{cfg.get('decoder_sparse_step')!r:.20}, mlp_only_layers "
                                       f"{cfg.get('mlp_only_layers')!r:.40}) are not modelled")
        if cfg.get("output_router_logits") not in _NEUTRAL:
            raise InvalidArgumentError(f"{origin}: output_router_logits keeps every layer's router logits for "
                                       "the auxiliary loss, which this estimate does not model")
        q = cfg.get("quantization_config")
        if q not in _NEUTRAL:
            # refused whatever format is given for it: --weight-format / --weight-bits would not help (the
            # experts are 3-D tensors packed per expert, param_nbytes in .workload refuses them quantized)
            shown = q.get("quant_method", q) if isinstance(q, Mapping) else q
            raise InvalidArgumentError(f"{origin}: a {model_type} config with a quantization_config (quant_method "
                                       f"{shown!r:.40}): quantized experts of a mixture-of-experts model are not "
                                       "modelled, whatever --weight-format or --weight-bits is given")
    if read_quantization_config:
        config_weight_format(cfg, origin)  # a quantization_config it does not read raises
    else:
        check_quantization_config(cfg, origin)
    for key, what in UNMODELLED_KEYS.items():
        value = cfg.get(key)
        if value not in _NEUTRAL:
            shown = value.get("quant_method", value) if isinstance(value, Mapping) else value
            # only a weight-format field would be counted as plain 16-bit weights; the others (soft-capping,
            # MLP biases, an encoder, cross-attention, ...) are other memory the estimate leaves out
            tail = ": it would be read as plain 16-bit dense weights" if key in _WEIGHT_FORMAT_KEYS else ""
            raise InvalidArgumentError(f"{origin}: {key} ({shown!r:.80}) means {what}, which this estimate does "
                                       f"not model{tail}")
    # a config may name its activation hidden_act (Llama) or hidden_activation (Gemma): each one given (not
    # null) is checked; an explicit null beside the other key hid the other one
    acts = {k: cfg[k] for k in ("hidden_act", "hidden_activation") if cfg.get(k) is not None}
    # ``wrapper``: the outer config of a text_config, whose activation is the inner one's (checked after)
    if model_type == "bitnet" and (acts or not wrapper) and (not acts or any(a != "relu2" for a in acts.values())):
        key, act = next(((k, a) for k, a in acts.items() if a != "relu2"), ("hidden_act", None))
        raise InvalidArgumentError(f"{origin}: a bitnet config with {key} {act!r:.40} is not modelled (BitNet's "
                                   "MLP is relu2)")
    for key, act in acts.items():
        if act not in ("silu", "swish") and model_type != "bitnet":
            raise InvalidArgumentError(f"{origin}: {key} {act!r:.60} is not modelled (the estimate's MLP is "
                                       "the gated SiLU of Llama); its temporaries differ")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and not isinstance(layer_types, list):
        raise InvalidArgumentError(f"{origin}: layer_types must be a JSON list of each layer's attention, got "
                                   f"{layer_types!r:.40}")
    if isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types):
        raise InvalidArgumentError(f"{origin}: layer_types names layers other than full attention "
                                   f"({sorted({str(t)[:40] for t in layer_types} - {'full_attention'})}), "
                                   "which this estimate does not model")


def _sliding_window(cfg: dict, origin: str) -> int:
    """The window every layer attends within (0: none), as transformers derives it (Note [Sliding window]).

    Qwen2 and Qwen2-MoE window only some layers: Qwen2 the layers from ``max_window_layers`` on, Qwen2-MoE
    the even layers below it (transformers' ``layer_types``). A config whose layers would mix windowed
    and full attention is refused: the estimate models one kind for all layers, and never guesses.
    """
    use = cfg.get("use_sliding_window", True)
    if not isinstance(use, bool):
        raise InvalidArgumentError(f"{origin}: use_sliding_window must be JSON true or false, got {use!r:.40}")
    window = cfg.get("sliding_window")
    if window in _NEUTRAL or not use:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise InvalidArgumentError(f"{origin}: sliding_window must be a JSON integer or null, got {window!r:.40}")
    model_type = cfg.get("model_type")
    if model_type not in ("qwen2", "qwen2_moe") or window == 0:
        return window
    layers, first = cfg.get("num_hidden_layers"), cfg.get("max_window_layers")
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise InvalidArgumentError(f"{origin}: a {model_type} config with use_sliding_window true needs "
                                   f"max_window_layers (a non-negative JSON integer), got {first!r:.40}")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        return window   # the layer count is checked, with its own error, where the shape is read
    if model_type == "qwen2":
        windowed = [i >= first for i in range(layers)]
    else:
        windowed = [i % 2 == 0 and i < first for i in range(layers)]
    if all(windowed):
        return window
    if not any(windowed):
        return 0
    raise InvalidArgumentError(
        f"{origin}: with use_sliding_window true and max_window_layers {first}, {sum(windowed)} of {layers} "
        f"layers attend within a window of {window} and the others attend to everything; the estimate models one "
        "kind of attention for every layer (not supported, not guessed)")



def from_hf_config(path_or_dict: "str | os.PathLike[str] | Mapping[str, Any]", *,
                   read_quantization_config: bool = True) -> tuple[ModelShape, int]:
    """Read a Hugging Face ``config.json`` (a path, or the parsed dict) of a Llama-style decoder.

    Returns ``(shape, dtype_bytes)``; ``dtype_bytes`` comes from ``torch_dtype`` / ``dtype`` (2 when
    absent). A multimodal config (a ``text_config`` beside a vision or audio tower) is refused: give its
    ``text_config`` as a file of its own to estimate the language model alone; the outer config's fields
    (its ``model_type`` included, which a ``text_config`` without one takes) are checked as the inner ones,
    and a ``text_config`` nested in the ``text_config`` is refused. A ``quantization_config``
    this estimate does not read is refused (:func:`config_weight_format`) unless ``read_quantization_config``
    is False: the caller then gives the projections' format itself (``--weight-format``); one that keeps
    modules or copies in 16 bits is refused either way (:func:`check_quantization_config`). Raises
    ``InvalidArgumentError`` when the file cannot be read, is not JSON, or lacks a field the estimate needs.
    """
    if isinstance(path_or_dict, Mapping):
        cfg: Mapping[str, Any] = path_or_dict
        origin = "config"
    elif not isinstance(path_or_dict, (str, bytes, os.PathLike)):
        raise InvalidArgumentError(f"from_hf_config takes a config.json path or its parsed dict, got "
                                   f"{type(path_or_dict).__name__}")
    else:
        origin = str(path_or_dict)
        try:
            cfg = json.loads(_read_config(path_or_dict, origin))
        except InvalidArgumentError:
            raise
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read {origin}: {exc.strerror or exc}") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgumentError(f"{origin} is not a JSON file: {exc}") from None
        except (RecursionError, MemoryError):
            raise InvalidArgumentError(f"{origin} is not a valid JSON config (nested too deeply or too large)") from None
        if not isinstance(cfg, dict):
            raise InvalidArgumentError(f"{origin}: expected a JSON object, got {type(cfg).__name__}")
    if cfg.get("text_config") is not None and not isinstance(cfg.get("text_config"), Mapping):
        raise InvalidArgumentError(f"{origin}: text_config must be a JSON object, got {cfg['text_config']!r:.40}")
    if isinstance(cfg.get("text_config"), Mapping):
        inner = cfg["text_config"]
        if inner.get("text_config") is not None:
            raise InvalidArgumentError(f"{origin}: text_config holds a text_config of its own, which is not read "
                                       "(give the innermost text_config as a file of its own)")
        # the outer config's own fields are checked too: a vision tower, MoE keys or a quantization_config
        # there change memory as much as inside (they were silently dropped with the outer config); so is its
        # model_type and architectures (a gemma3 config with a Llama-like text_config was read as a Llama);
        # a text_config without a model_type of its own takes the outer one
        outer_type = cfg.get("model_type")
        _refuse_unmodelled({k: v for k, v in cfg.items() if k != "text_config"}, origin, read_quantization_config,
                           wrapper=True)
        cfg = {**inner, **{k: v for k, v in cfg.items() if k in ("torch_dtype", "dtype")}}
        if inner.get("model_type") is None and outer_type is not None:
            cfg["model_type"] = outer_type
    _refuse_unmodelled(cfg, origin, read_quantization_config)
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
    if cfg.get("head_dim") == 0 and not isinstance(cfg.get("head_dim"), bool):  # 0 would mean "the default"
        raise InvalidArgumentError(f"{origin}: head_dim must be positive, got 0")
    aliases = {"hidden_size": ("hidden_size", "n_embd", "d_model"),
               "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim"),
               "n_layers": ("num_hidden_layers", "n_layer", "num_layers"), "vocab_size": ("vocab_size",),
               "n_heads": ("num_attention_heads", "n_head")}
    for key, value in (*fields.items(), ("num_key_value_heads", n_kv), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int):
            key = next((k for k in aliases.get(key, ()) if cfg.get(k) is not None), key)
            raise InvalidArgumentError(f"{origin}: {key} must be a JSON integer, got {value!r}")
    tie = cfg.get("tie_word_embeddings", False)
    if tie is None:
        tie = False
    if not isinstance(tie, bool):
        raise InvalidArgumentError(f"{origin}: tie_word_embeddings must be JSON true or false, got {tie!r}")
    dtype_name = str(_first(cfg, "torch_dtype", "dtype", default="bfloat16")).replace("torch.", "")
    if dtype_name not in DTYPE_BYTES:
        raise InvalidArgumentError(f"{origin}: unknown dtype {dtype_name!r}; known: {', '.join(DTYPE_BYTES)}")
    # Qwen2's and Qwen2-MoE's q/k/v always have biases
    bias = cfg.get("attention_bias", cfg.get("qkv_bias", cfg.get("model_type") in ("qwen2", "qwen2_moe")))
    if not isinstance(bias, bool):
        raise InvalidArgumentError(f"{origin}: attention_bias must be JSON true or false, got {bias!r:.40}")
    window = _sliding_window(cfg, origin)
    moe: dict[str, int] = {}
    if cfg.get("model_type") in MOE_MODEL_KEYS:
        keys = {"n_experts": ("num_local_experts", "num_experts"), "experts_per_token": ("num_experts_per_tok",),
                "expert_intermediate_size": ("moe_intermediate_size",),
                "shared_expert_intermediate_size": ("shared_expert_intermediate_size",)}
        if cfg.get("model_type") == "qwen2_moe":  # its widths default to transformers' 1408 and 5632: never guessed
            absent = [k for k in ("moe_intermediate_size", "shared_expert_intermediate_size") if k not in cfg]
            if absent:
                raise InvalidArgumentError(f"{origin}: a qwen2_moe config without {' and '.join(absent)} (transformers "
                                           "then takes its defaults) is not read: give the widths")
        for field, names in keys.items():
            name = next((k for k in names if cfg.get(k) is not None), names[0])
            value = cfg.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(f"{origin}: {name} must be a JSON integer, got {value!r:.40}")
            moe[field] = value
        moe["router_weights_cast"] = cfg.get("model_type") == "qwen2_moe"
        if moe["n_experts"] <= 0 or moe["experts_per_token"] <= 0:
            raise InvalidArgumentError(f"{origin}: a {cfg.get('model_type')} config needs a positive number of "
                                       "experts and of num_experts_per_tok")
    shape = ModelShape(fields["hidden_size"], fields["intermediate_size"], fields["n_layers"], fields["vocab_size"],
                       fields["n_heads"], n_kv, head_dim, tie, bias, window, **moe,
                       sub_norms=cfg.get("model_type") == "bitnet",
                       activation="relu2" if cfg.get("model_type") == "bitnet" else "silu",
                       always_masked=cfg.get("model_type") == "qwen2_moe" and cfg.get("sliding_window") not in _NEUTRAL)
    return shape, DTYPE_BYTES[dtype_name]


def read_config_text(path: "str | os.PathLike[str]") -> str:
    """The text of ``path``, refusing what is not a regular file (a FIFO, a device, a directory) and files
    over :data:`MAX_CONFIG_BYTES`; raises ``InvalidArgumentError``."""
    origin = str(path)
    try:
        return _read_config(path, origin)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read {origin}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(f"{origin} is not a JSON file: {exc}") from None


def _read_config(path: "str | os.PathLike[str]", origin: str) -> str:
    # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgumentError(f"{origin} is not a regular file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise InvalidArgumentError(f"{origin} is {st.st_size} bytes, over the {MAX_CONFIG_BYTES}-byte limit "
                                       "for a config.json")
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            data = f.read(MAX_CONFIG_BYTES + 1)
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidArgumentError(f"{origin} is over the {MAX_CONFIG_BYTES}-byte limit for a config.json")
    return data.decode("utf-8")
