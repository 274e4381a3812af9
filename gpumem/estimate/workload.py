"""Synthetic allocation traces of Hugging Face ``generate()`` and of training steps.

The sequence follows what PyTorch's caching allocator sees when transformers runs a Llama-style model
with SDPA attention (read off ``torch.cuda.memory._snapshot`` traces recorded on an H200,
``reports/hil/estimate-accuracy-h200-2026-11-22.md``):

Note [Prefill]
    ``generate()`` runs the whole prompt at once (``T = batch * prompt`` tokens). The rotary embedding
    computes cos and sin in fp32 (``freqs``, ``cat(freqs, freqs)``, ``cos()``/``sin()`` times the scaling:
    up to 4.5 ``T*head_dim*4`` tensors at once) before casting them. The embeddings (``T*H``), the layer's
    input and the residual stay live through a block; each RMSNorm upcasts to fp32 (two ``T*H*4`` tensors
    at once); q, k and v are projected, rotated (``q*cos``, ``rotate_half(q)*sin`` and their sum are three
    more q-sized tensors; the unrotated q and k are freed only after both are rotated), k and v are copied
    into the cache (``DynamicLayer.update`` does ``torch.cat``), SDPA writes its output and the ``reshape``
    after the transpose copies it; the normed input is freed before ``o_proj`` allocates, and the residual
    add reuses ``o_proj``'s output (no second hidden-sized tensor); the gated MLP holds ``act(gate)``,
    ``up`` and their product (three ``T*I`` tensors) at once. The peak is the last block's MLP, with the
    whole prompt's cache live. Only the last position's logits are computed (``logits_to_keep=1``), then
    copied to fp32. This order (which of the 512 MiB-class tensors are freed before which allocations) is
    the one of ``tests/allocator/data/generate_7b_b16_p4096_n8.snapshot.pickle.gz``; with it the replay
    makes the recording's segments.

Note [Decode]
    Each new token runs one forward of ``batch`` tokens; every block grows its key and its value cache
    by ``torch.cat`` (a new tensor one token longer is allocated before the old one is freed), so the
    peak of a decode step is the whole cache plus one layer's key or value. ``new_tokens`` tokens need
    ``new_tokens - 1`` decode forwards; before each, ``generate()`` appends the last token to the int64
    input ids and grows the attention mask, both by ``torch.cat``.

Note [Decode steps simulated]
    A decode step repeats the one before it but for the sizes of the cache and of the ids and mask, which
    are one token longer. At every op of step ``s + 1`` the live bytes are therefore at least those at the
    same op of step ``s``: the peak of allocated bytes over all decode steps is the peak of the last one,
    given the cache as the step before left it. :func:`inference_trace` thus holds the prefill, the first
    ``DECODE_HEAD_STEPS`` steps and the last two (the cache jumps in size between them), and its peak and
    the split at the peak are those of the full trace to the byte (``full_decode=True`` keeps every step;
    ``tests/estimate/test_decode_steps.py`` compares both). What an allocator *reserves* depends on the
    whole history of sizes, so it is not taken from that short trace: :func:`stream_inference` makes every
    op of every step and hands each to the replaying allocator at once, keeping none, so memory no longer
    grows with the number of new tokens (the old trace took about 220 KB per token) and the reserved
    figures are those of the full trace.

Note [BitNet block]
    BitNet's decoder (``model_type`` ``bitnet``) is the Llama block with two more RMSNorms, each upcasting to
    fp32 as the others do: ``attn_sub_norm`` on the attention output before ``o_proj`` and ``ffn_sub_norm``
    on ``act(gate) * up`` before ``down_proj``; its activation is ``relu(x)**2`` (``relu`` then ``square``: one
    more intermediate-sized temporary). Its ternary weights are a weight format (``i2s`` from the config's
    ``quantization_config``, :mod:`.formats`) with its dequantization workspace. Modelled from transformers
    5.17's source; unmeasured (no BitNet kernel on the GPU machine). Training it is refused.

Note [Token bookkeeping]
    Beside the tensors of the model, ``generate()`` holds the int64 input ids and attention mask, and each
    forward computes ``position_ids`` from the mask by ``cumsum``: about 24 bytes per token, which the
    H200 runs showed at batch 135 x 4096 (0.55 M tokens: 12.6 MiB).

Note [Backward cuBLAS workspace]
    The backward runs on autograd's thread, whose cuBLAS handle takes its own 32 MiB workspace at its first
    matrix product: lm_head's weight gradient (its input's gradient with LoRA), after the loss's backward has
    freed two fp32 logit-sized tensors. The H200 snapshot of Qwen2 0.16B training b2 x 512 (run 3, op 834) shows
    it cut from the 126 MiB segment the log-softmax gradient had just freed, where it stays for good: the
    segment stays reserved with it, and a logit-sized tensor of step 2 no longer fits there. Made before step 1
    (as before), it took a segment of its own and left every logit-sized segment whole: LoRA b4 x 512 reserved
    5.3 % below the measurement (its step 2 opens one more 250 MiB segment), the fp32-master b2 row 3.7 % above.

Note [Forward cuBLAS workspace]
    The forward's cuBLAS workspace is taken at the forward's first matrix product, which in transformers 5.17
    is the rotary embedding's ``inv_freq @ position_ids`` (``freqs``): after the embeddings' output and the
    attention mask, before the rest of cos and sin. The nine H200 snapshots of runs 3 and 4 whose row came
    first in its process all show it there (Qwen2-MoE generate b16 x 2048: embeddings 64 MiB, mask 64 MiB,
    ``freqs`` 4 MiB, workspace 32 MiB; Llama, Mixtral, and the Qwen2 0.16B generate, LoRA and tied rows
    likewise; the other three ran after a row that had made it), and the model's forward builds the mask
    before the rotary embedding. The trace made the workspace before the forward and the mask after cos and sin, so its
    first segments came in another order than PyTorch's, and under the ``pytorch`` policy (ties to the newest
    segment) Qwen2-MoE generate b8 x 1024 reserved 34 MiB (1.09 %) less than measured; in transformers' order
    it is +0.06 %, and no other row of the records moves (``reports/hil/estimate-accuracy-h200-2026-11-28-run4.md``).
    Training makes it at the first step's rotary embedding likewise (no row moves).

Note [Training backward]
    Replayed under the ``pytorch`` policy from the weights' segments as PyTorch left them, the *recorded* ops of
    the H200 snapshot of Qwen2 0.16B training b2 x 512 (run 3) reserve exactly what PyTorch reserved (2,025,848,832
    B, the same 56 segments; ``tests/allocator/test_pytorch_policy.py``): the +8.6 % of that row was the
    synthetic backward's, not the allocator model's. Its backward was coarse (two intermediate-sized gradients
    per block, every saved tensor freed at the block's end, a new residual gradient per block, no norm
    backward, the final norm without its temporaries), so that early in the backward a free 62.5 MiB block was
    cut by 5.5 MiB gradients PyTorch placed in the forward's freed 20 MiB segments, and step 2 opened a third
    126 MiB segment. The dense block's backward (no autocast, LoRA, mask, experts) now follows the snapshot
    (ops 835-1142): the final norm as a block's (its input freed as it returns), each RMSNorm's backward with
    its temporaries (:func:`_norm_backward`: two 16-bit products, a ``2n``-float reduction, six fp32
    temporaries), the MLP's saved tensors freed as their gradients are made, SDPA's fp32 backward buffer, the
    rotation undone, and every branch gradient added in place into one residual gradient that lives from the
    final norm's backward to the embedding's (:func:`_block_backward`). The synthetic trace then opens the
    snapshot's segments one for one and reserves 28 MiB above it (``MISC_NBYTES`` and ``BACKWARD_MISC_NBYTES``):
    that row +8.59 % -> +1.97 %, no other row moving more than 0.4 points.

Note [What a process keeps]
    The weights and the cuBLAS workspaces outlive a workload: ``empty_cache()`` cannot return a segment that
    holds one of them, so a second workload in the same process starts with those segments (and their free
    space) reserved. :attr:`WorkloadTrace.persistent` names these allocations; the accuracy records' rows that
    ran after another row in the same process are compared with a replay of the process's rows in order
    (``benchmarks/accuracy_recompute.py``, Note [Rows measured after other rows] there).

Note [Weights as PyTorch counts them]
    ``max_memory_allocated`` counts a block's size, and PyTorch's allocator leaves a remainder of 1 MiB or
    less inside a large block rather than splitting it off. Loading the weights into an empty cache, a
    tensor over 10 MiB gets a new segment rounded up to 2 MiB, and one of 1-10 MiB a 20 MiB segment or the
    best-fitting remainder of one: Qwen2-7B's 84 MLP matrices of 129.5 MiB each take 130 MiB blocks, and its
    loaded model measured 43 MiB beyond its parameters on the H200 (Mistral-7B, whose matrices are whole
    MiB multiples, 1.5 KB). :func:`loaded_weight_nbytes` walks those rules over the weights in order.

Note [Overhead]
    cuBLAS takes a 32 MiB workspace through the caching allocator at the first matrix product of each
    stream/handle (one for inference, a second one for the backward pass of training: Note [Backward cuBLAS
    workspace]), and kernels and
    generate's bookkeeping take a few more MiB (measured: 1-7 MiB beyond the parameters once the weights are
    loaded, and 19 MiB more in the decode steps of the multi-head 7B model only).

    Those 19 MiB turned out to be PyTorch's blocks, not requests: a KV-cache ``torch.cat`` gets a cached block
    up to 1 MiB larger than it asks for, which the estimate now reads from the ``pytorch`` replay's peak of
    blocks (Note [Allocated as PyTorch counts it] in :mod:`.fit`); no recorded decode makes such a block. So
    the program's ops are made without it. The decode slack (``DECODE_SLACK_PER_Q_NBYTES``, ``decode_slack=True``)
    stood in for the GPU's lag in the ``gpumem`` replay until the estimate ran the lag itself (Note [The GPU's lag in
    the decode replay] in :mod:`.fit`, ``reports/decode-slack-2026-11-29.md``); it stays for studies of it.

    Those small buffers (``MISC_NBYTES``, and ``BACKWARD_MISC_NBYTES`` in training) are requests of 1 MiB or
    less, which PyTorch serves from its small pool of 2 MiB segments; the trace makes them as 1 MiB blocks
    (:func:`_small_buffers`). Until issue 22 point 4's third round each was one 12 (16) MiB request: a large
    block that took a free remainder of the weights' 20 MiB segments where the workload's tensors go, so that
    a replay also opened a segment PyTorch does not (Llama 0.1B generate b4 x 1024: 24 MiB above PyTorch's
    reserve for 12 MiB of buffers, +4.21 %; +2.11 % as small blocks).

    ``generate()`` holds 5 MiB of them (``INFERENCE_MISC_NBYTES``; 12 MiB before, as training still does).
    Every generate row of the tuning part was 9-15 MiB over in allocated (Llama 0.1B b1 x 128 +5.03 %), and
    the H200 snapshot of Qwen2 0.16B generate b16 x 1024 has no such buffers at its peak: its live tensors are
    the trace's one for one but for 1 MiB. Over whole MiB, only 4 and 5 put no figure of the tuning part
    outside [0 %, +3 %] (0 MiB: 27 below; 6-8 MiB: Llama 0.1B b1 above); 5 keeps more room below. The measured
    1-7 MiB above hold it too. Chosen on the tuning part alone; the check part, recomputed afterwards, has no
    new figure out, but its margin below drops to 0.00-0.01 % on eight figures of the 3B and 7B models, and
    Qwen2-MoE b8 goes from -0.84 % to -1.09 % (``reports/hil/estimate-accuracy-h200-2026-11-25-run3-recomputed3.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from ..errors import InvalidArgumentError
from ..trace.model import Trace
from ..units import MiB
from .formats import WeightFormat
from .shape import ModelShape

__all__ = ["Category", "WorkloadTrace", "inference_trace", "stream_inference", "decode_steps_simulated", "OpSink", "param_nbytes", "LoraConfig",
           "weights_nbytes", "training_trace", "CUBLAS_WORKSPACE_NBYTES",
           "MISC_NBYTES", "INFERENCE_MISC_NBYTES", "DECODE_SLACK_PER_Q_NBYTES", "AUTOCAST_DTYPE_BYTES", "check_mixed_precision",
           "check_weight_format"]

CUBLAS_WORKSPACE_NBYTES = 32 * MiB
"""cuBLAS workspace per handle (Note [Overhead])."""
MISC_NBYTES = 12 * MiB
"""Training: small buffers of kernels and the RNG (Note [Overhead])."""
INFERENCE_MISC_NBYTES = 5 * MiB
"""``generate()``: small buffers of kernels, the RNG and generate's bookkeeping (Note [Overhead])."""
BACKWARD_MISC_NBYTES = 16 * MiB
"""Training: small buffers of autograd and the optimizer beyond the two cuBLAS workspaces (Note [Overhead])."""
DECODE_SLACK_PER_Q_NBYTES = 6 * 1024
"""Multi-head (not grouped) attention: a block held through each decode forward, per query width, in the replay of
policies whose pages are stolen only (Note [Overhead]: 19 MiB measured on the 7B model, q width 4096, none on the
grouped-query models; since found to be PyTorch's block rounding, and kept as the ``gpumem`` replay's stand-in for
the GPU's lag)."""

DECODE_HEAD_STEPS = 2
"""Decode steps simulated one by one before the jump to the last (Note [Decode steps simulated])."""

_ROUND = 512  # PyTorch rounds every block to 512 bytes; max_memory_allocated counts rounded blocks


class Category(str, Enum):
    """What an allocation of a synthetic trace holds."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    ACTIVATIONS = "activations"
    GRADIENTS = "gradients"
    OPTIMIZER = "optimizer"
    OVERHEAD = "overhead"


@dataclass
class WorkloadTrace:
    """A synthetic trace and its peak, split by :class:`Category` at the moment of the peak."""

    trace: Trace
    peak_nbytes: int
    at_peak: dict[Category, int]
    phase_at_peak: str
    complete: bool = True
    """False when decode steps were left out (Note [Decode steps simulated]): the peak is exact, but a replay
    of this trace is not the workload's (:func:`gpumem.estimate.fit.estimate_peak_reserved` refuses it)."""
    persistent: dict[int, str] = field(default_factory=dict)
    """Note [What a process keeps]: the allocations that outlive the workload in its process (op id -> what it
    is: ``weight N``, ``cublas forward``, ``cublas backward``); a later workload of the same process finds them
    made."""


class OpSink(Protocol):
    """What an emitter also sends its ops to, as it makes them (Note [Decode steps simulated])."""

    def alloc(self, op_id: int, nbytes: int) -> None:
        """An allocation of ``nbytes`` named ``op_id``."""

    def free(self, op_id: int) -> None:
        """The free of allocation ``op_id``."""


#: The largest LoRA rank: a rank above a projection's width adds nothing a smaller one does not.
_MAX_LORA_RANK = 2**20

#: The largest tensor a modelled workload may hold: the traces and replays count bytes in int64, and a
#: shape inside every cap (batch, sequence, widths) can still ask for more than 2**63 bytes at once.
_MAX_TENSOR_NBYTES = 2**62


class _Emitter:
    """Builds the ops of a trace and tracks live bytes per category (no lock: one thread builds it)."""

    def __init__(self, name: str, *, record: bool = True, sinks: "tuple[OpSink, ...]" = ()) -> None:
        self.name = name
        self.record = record
        self.sinks = sinks
        self.kinds: list[int] = []
        self.ids: list[int] = []
        self.sizes: list[int] = []
        self.alloc_nbytes: list[int] = []  # by id: the size asked for (a free repeats it)
        self.live: dict[int, tuple[int, Category]] = {}  # id -> (rounded size, category)
        self.by_cat: dict[Category, int] = {c: 0 for c in Category}
        self.cur = 0
        self.peak = 0
        self.at_peak: dict[Category, int] = {}
        self.phase = ""
        self.phase_at_peak = ""
        self.next_id = 0
        self.persistent: dict[int, str] = {}  # Note [What a process keeps]

    def alloc(self, nbytes: int, cat: Category = Category.ACTIVATIONS, counted: int | None = None) -> int:
        """Append an alloc of ``nbytes``; return its id. ``counted``: the bytes PyTorch counts as allocated
        for it, when not ``nbytes`` rounded to 512 (Note [Weights as PyTorch counts them])."""
        nbytes = int(nbytes)
        if nbytes > _MAX_TENSOR_NBYTES:   # traces, peaks and replays count bytes in int64
            raise InvalidArgumentError(f"the workload needs one tensor of {nbytes:,} bytes (more than 2**62): "
                                       "the shape is too large to estimate")
        rounded = -(-max(nbytes, 1) // _ROUND) * _ROUND if counted is None else counted
        i = self.next_id
        self.next_id += 1
        if self.record:
            self.alloc_nbytes.append(nbytes)
            self.kinds.append(0)
            self.ids.append(i)
            self.sizes.append(nbytes)
        for sink in self.sinks:
            sink.alloc(i, nbytes)
        self.live[i] = (rounded, cat)
        self.by_cat[cat] += rounded
        self.cur += rounded
        if self.cur > self.peak:
            self.peak = self.cur
            self.at_peak = dict(self.by_cat)
            self.phase_at_peak = self.phase
        return i

    def free(self, *ids: int) -> None:
        """Append a free of each id."""
        for i in ids:
            rounded, cat = self.live.pop(i)
            if self.record:
                self.kinds.append(1)
                self.ids.append(i)
                self.sizes.append(self.alloc_nbytes[i])
            for sink in self.sinks:
                sink.free(i)
            self.by_cat[cat] -= rounded
            self.cur -= rounded

    def build(self) -> WorkloadTrace:
        """The trace (one stream, times 0, 1, 2, ... µs, no addresses) and its peak."""
        n = len(self.kinds)
        trace = Trace(self.name, "gpumem.estimate", np.array(self.kinds, np.int8), np.array(self.ids, np.int64),
                      np.array(self.sizes, np.int64), np.zeros(n, np.int64), np.arange(n, dtype=np.float64),
                      np.zeros(n, np.int64))
        return WorkloadTrace(trace, self.peak, self.at_peak, self.phase_at_peak, persistent=dict(self.persistent))


def _check(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name} must be a whole number >= {minimum}, got {value!r}")


DTYPE_BYTES_MODELLED = (1, 2, 4)
"""Bytes per element of the dtypes the traces model: int8/fp8 weights (16-bit compute), 16-bit and fp32."""


def _check_dtype_bytes(dtype_bytes: object) -> None:
    """Refuse a ``dtype_bytes`` no torch dtype the traces model has (3 or 100 bytes were traced as given)."""
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes not in DTYPE_BYTES_MODELLED:
        raise InvalidArgumentError(f"dtype_bytes must be 1 (int8/fp8 weights), 2 (bf16/fp16) or 4 (fp32), "
                                   f"got {dtype_bytes!r:.40}")


def check_weight_format(fmt: object) -> None:
    """Refuse a ``weight_format`` that is not a :class:`WeightFormat` (a name given as a string, say)."""
    if fmt is not None and not isinstance(fmt, WeightFormat):
        raise InvalidArgumentError(f"weight_format must be a WeightFormat (gpumem.estimate.formats.weight_format"
                                   f"('int4'), custom_bits(4)) or None, got {fmt!r:.40}")


def _norm(e: _Emitter, x_nbytes_fp32: int, out_nbytes: int) -> int:
    """RMSNorm as transformers writes it: fp32 upcast, pow, rsqrt-scale, cast back, weight multiply."""
    up = e.alloc(x_nbytes_fp32)
    sq = e.alloc(x_nbytes_fp32)
    e.free(sq)
    scaled = e.alloc(x_nbytes_fp32)
    e.free(up)
    cast = e.alloc(out_nbytes)
    out = e.alloc(out_nbytes)
    e.free(cast, scaled)
    return out


def _rope(e: _Emitter, nbytes: int) -> int:
    """``x*cos + rotate_half(x)*sin``: three x-sized temporaries and a half-sized one."""
    a = e.alloc(nbytes)
    neg = e.alloc(nbytes // 2)
    cat = e.alloc(nbytes)
    e.free(neg)
    b = e.alloc(nbytes)
    e.free(cat)
    out = e.alloc(nbytes)
    e.free(a, b)
    return out


def _rotary(e: _Emitter, n: int, d: int, first_product: Callable[[], None] | None = None) -> tuple[int, int]:
    """The rotary embedding's cos and sin (``n`` = tokens x head_dim values each), computed in fp32 as
    transformers writes it: ``freqs`` (half width), ``emb = cat(freqs, freqs)``, ``emb.cos() * scaling`` and
    ``emb.sin() * scaling``, then cast to the activation dtype; the fp32 temporaries go only after the casts.
    ``freqs`` is the forward's first matrix product: ``first_product`` (when given) makes what cuBLAS allocates
    there (Note [Forward cuBLAS workspace])."""
    freqs = e.alloc(n // 2 * 4)
    if first_product is not None:
        first_product()
    emb = e.alloc(n * 4)
    c = e.alloc(n * 4)
    cs = e.alloc(n * 4)
    e.free(c)
    si = e.alloc(n * 4)
    ss = e.alloc(n * 4)
    e.free(si)
    cos = e.alloc(n * d)
    sin = e.alloc(n * d)
    e.free(freqs, emb, cs, ss)
    return cos, sin


def window_tokens(s: ModelShape, cache_tokens_after: int, q_len: int) -> tuple[int, bool]:
    """The tokens of the key/value states a forward of ``q_len`` tokens attends to when the cache has seen
    ``cache_tokens_after`` tokens after it, and whether attention takes a mask (else SDPA runs causal without).

    Note [Sliding window]: transformers 5.17's ``DynamicSlidingWindowLayer.update`` concatenates the cached
    states (at most ``window - 1`` tokens) with the new ones, keeps a view of the last ``window - 1`` tokens
    and returns the whole concatenation: the prefill stores all ``prompt`` tokens (the view holds the whole
    tensor), and each decode step makes a tensor of ``min(seen, window)`` tokens that replaces the previous one.
    A forward whose key length reaches the window cannot skip the mask (``_ignore_causal_mask_sdpa``): the
    model makes one boolean ``[batch, 1, q, kv]`` mask per forward (SDPA takes it as it is: the H200's
    snapshot of Qwen2-MoE, run 3, shows no converted copy), and, with a mask, transformers repeats the keys and
    values to every query head (``repeat_kv``: it uses SDPA's own GQA only without a mask). In training, SDPA's
    backward keeps the repeated keys and values, and makes their gradients before summing them per group; the
    measured row also holds one mask-sized tensor in the compute dtype per layer, kept here to the layer's
    backward (not identified: no snapshot of that row). Qwen2-MoE builds its sliding mask within any window
    (``ModelShape.always_masked``): run 2's batch 16 x 2048 row was 1.1 % below for want of its 64 MiB. Measured
    on the H200 (run 3: a Mistral-style 0.16B model with a 256-token window, prompts of 1024 and 2048 tokens,
    training on 1024); before, sequences past the window were refused. Mixed precision past the window is
    refused (autocast's casts of the mask are not modelled)."""
    if not s.sliding_window:
        return cache_tokens_after, s.always_masked
    kv = min(cache_tokens_after - q_len, s.sliding_window - 1) + q_len
    return kv, kv >= s.sliding_window


def _bool_mask(e: _Emitter, batch: int, q_len: int, kv_tokens: int) -> int:
    """Note [Sliding window]: ``sdpa_mask`` of transformers 5.17 (as the H200's snapshot of Qwen2-MoE shows it):
    the padding, causal and window conditions as ``[q, kv]`` booleans combined pairwise (two live at a time),
    then the ``[batch, 1, q, kv]`` mask; returns the mask."""
    n = q_len * kv_tokens
    t1 = e.alloc(n)
    t2 = e.alloc(n)
    e.free(t1)
    t3 = e.alloc(n)
    t4 = e.alloc(n)
    e.free(t3, t2)
    t5 = e.alloc(n)
    e.free(t4)
    mask = e.alloc(batch * n)
    e.free(t5)
    return mask


def _masked_attention_inputs(e: _Emitter, s: ModelShape, batch: int, q_len: int, kv_tokens: int, d: int, *,
                             training: bool = False) -> list[int]:
    """Note [Sliding window]: what a masked attention adds: the keys and values repeated to every query head
    (transformers uses SDPA's own GQA only without a mask) and, in training, one mask-sized tensor in the
    compute dtype per layer. The caller frees them (or keeps them for the backward)."""
    out = []
    if s.n_kv_heads != s.n_heads:
        out += [e.alloc(batch * kv_tokens * s.q_dim * d), e.alloc(batch * kv_tokens * s.q_dim * d)]
    if training:
        out.append(e.alloc(batch * q_len * kv_tokens * d))
    return out


def _forward_block(e: _Emitter, s: ModelShape, tokens: int, d: int, cache: list[int], layer: int,
                   cache_tokens_after: int, batch: int, q_len: int) -> int:
    """One decoder block on ``tokens`` tokens; grows ``cache[2*layer:2*layer+2]``; returns the block output id
    (the caller frees the block input)."""
    h, i = s.hidden_size, s.intermediate_size
    th, tq, tkv, ti = tokens * h * d, tokens * s.q_dim * d, tokens * s.kv_dim * d, tokens * i * d
    n1 = _norm(e, tokens * h * 4, th)
    q = e.alloc(tq)
    k = e.alloc(tkv)
    v = e.alloc(tkv)
    qe = _rope(e, tq)
    ke = _rope(e, tkv)
    e.free(q, k)  # the unrotated q and k go only once both are rotated (apply_rotary_pos_emb returns both)
    kv_tokens, masked = window_tokens(s, cache_tokens_after, q_len)
    layer_nbytes = batch * kv_tokens * s.kv_dim * d
    for j, src in enumerate((ke, v)):  # DynamicLayer.update: torch.cat([old, new]) allocates before freeing
        new = e.alloc(layer_nbytes, Category.KV_CACHE)
        old = cache[2 * layer + j]
        if old >= 0:
            e.free(old)
        cache[2 * layer + j] = new
    e.free(ke, v)
    extra = _masked_attention_inputs(e, s, batch, q_len, kv_tokens, d) if masked else []
    out = e.alloc(tq)
    lse = e.alloc(batch * s.n_heads * q_len * 4)
    if extra:
        e.free(*extra)
    flat = e.alloc(tq)
    if s.sub_norms:  # Note [BitNet block]: attn_sub_norm before o_proj
        normed = _norm(e, tokens * s.q_dim * 4, tq)
        e.free(flat)
        flat = normed
    e.free(out, lse, qe, n1)  # the normed input goes before o_proj allocates
    h1 = e.alloc(th)  # o_proj; the residual add reuses it (the recording shows no second hidden-sized tensor)
    e.free(flat)
    n2 = _norm(e, tokens * h * 4, th)
    if s.n_experts:
        dn = _moe(e, s, tokens, d, batched=q_len == 1)  # Note [Mixture of experts]: decode steps gather
        e.free(n2)
    else:
        g = e.alloc(ti)
        a = e.alloc(ti)
        if s.activation == "relu2":  # relu(x), then its square: relu's output goes when the square returns
            sq = e.alloc(ti)
            e.free(a)
            a = sq
        e.free(g)
        u = e.alloc(ti)
        m = e.alloc(ti)
        e.free(a, u)
        if s.sub_norms:  # ffn_sub_norm before down_proj
            normed = _norm(e, tokens * i * 4, ti)
            e.free(m)
            m = normed
        dn = e.alloc(th)
        e.free(m, n2)
    h2 = e.alloc(th)
    e.free(dn, h1)
    return h2


def _gated_mlp(e: _Emitter, tokens: int, width: int, h: int, d: int, fused: bool) -> int:
    """A gated SiLU MLP of ``width`` on ``tokens`` tokens; returns its output (``tokens x h``). ``fused``: one
    ``gate_up`` product whose halves are views (transformers 5's experts), else separate gate and up."""
    if fused:
        gu = e.alloc(tokens * 2 * width * d)
        a = e.alloc(tokens * width * d)
        m = e.alloc(tokens * width * d)
        e.free(a, gu)
    else:
        g = e.alloc(tokens * width * d)
        a = e.alloc(tokens * width * d)
        e.free(g)
        u = e.alloc(tokens * width * d)
        m = e.alloc(tokens * width * d)
        e.free(a, u)
    out = e.alloc(tokens * h * d)
    e.free(m)
    return out


def _moe(e: _Emitter, s: ModelShape, tokens: int, d: int, batched: bool = False) -> int:
    """Note [Mixture of experts]: a sparse MoE block as transformers 5.17 runs it on ``tokens`` tokens (its
    default experts path on an H200, ``grouped_mm``, recorded in the run2 accuracy report); returns its output
    (``tokens x h``). The router keeps its logits to the block's end (``_, weights, index = self.gate(x)``)
    and takes the softmax in fp32; Mixtral's top-k weights stay fp32, Qwen2-MoE's are cast to the model dtype.
    The experts sort the ``S = tokens x k`` token-expert pairs by expert (``sort``: ids and permutation),
    gather the hidden states in that order, run one grouped ``gate_up`` product (its output masked into a new
    tensor), ``act(gate) * up``, one grouped ``down`` product (masked again), weight it (fp32 with Mixtral's
    fp32 weights), put it back in order and sum over the ``k`` experts of each token; the function's locals
    live until it returns. None of these sizes depends on how the router spreads the tokens. Decode steps
    (``batched``) run the experts by ``batched_mm`` instead (:func:`_batched_experts`: the H200's snapshots of
    run 3 show it in every decode step of both models, ``grouped_mm`` in the prefill). Qwen2-MoE runs
    its shared expert first and holds its output while the routed experts run, then gates it by a sigmoid
    and adds it (a new tensor). Training a MoE model is refused (not modelled)."""
    h, k, n_exp = s.hidden_size, s.experts_per_token, s.n_experts
    w_bytes = d if s.router_weights_cast else 4
    shared = _gated_mlp(e, tokens, s.shared_expert_intermediate_size, h, d, fused=False) \
        if s.shared_expert_intermediate_size else -1
    logits = e.alloc(tokens * n_exp * d)  # router: held to the block's end
    up = e.alloc(tokens * n_exp * 4)  # .float() (or softmax's dtype=float)
    probs = e.alloc(tokens * n_exp * 4)
    e.free(up)
    top_w = e.alloc(tokens * k * 4)
    top_i = e.alloc(tokens * k * 8)
    if not s.router_weights_cast:
        total = e.alloc(tokens * 4)  # top_w /= top_w.sum(-1): in place
        e.free(total)
    else:
        cast_w = e.alloc(tokens * k * d)
        e.free(top_w)
        top_w = cast_w
    e.free(probs)
    out = (_batched_experts if batched else _grouped_experts)(e, s, tokens, d, w_bytes)
    if shared >= 0:
        gate = e.alloc(tokens * d)
        sig = e.alloc(tokens * d)
        e.free(gate)
        g_out = e.alloc(tokens * h * d)
        e.free(sig, shared)
        summed = e.alloc(tokens * h * d)
        e.free(out, g_out)
        out = summed
    e.free(top_w, top_i, logits)
    return out


def _grouped_experts(e: _Emitter, s: ModelShape, tokens: int, d: int, w_bytes: int) -> int:
    """The routed experts of :func:`_moe` by ``grouped_mm`` (transformers 5.17's prefill); returns their sum."""
    h, n_exp, ie, pairs = s.hidden_size, s.n_experts, s.expert_intermediate_size, tokens * s.experts_per_token
    ids_g, perm = e.alloc(pairs * 8), e.alloc(pairs * 8)  # torch.sort(expert_ids)
    div = e.alloc(pairs * 8)  # perm // k
    sel = e.alloc(pairs * h * d)  # hidden_states[perm // k]
    e.free(div)
    kept = [ids_g, perm, sel, e.alloc(pairs * w_bytes), e.alloc(pairs * 4)]  # weights by expert, ids .int()
    kept += [e.alloc(n_exp * 4), e.alloc(n_exp * 4), e.alloc(pairs)]  # histc, offsets, sentinel mask
    proj = e.alloc(pairs * 2 * ie * d)  # grouped gate_up
    masked = e.alloc(pairs * 2 * ie * d)  # .masked_fill (not in place)
    e.free(proj)
    act = e.alloc(pairs * ie * d)
    gated = e.alloc(pairs * ie * d)
    e.free(act, masked)
    proj = e.alloc(pairs * h * d)  # grouped down
    e.free(gated)
    masked = e.alloc(pairs * h * d)
    e.free(proj)
    weighted = e.alloc(pairs * h * w_bytes)
    inv = e.alloc(pairs * 8)  # empty_like(perm), filled from an arange
    ar = e.alloc(pairs * 8)
    e.free(ar)
    ordered = e.alloc(pairs * h * w_bytes)  # weighted[inv_perm]
    e.free(weighted)
    out = e.alloc(tokens * h * w_bytes)  # .view(T, k, h).sum(1)
    if w_bytes != d:
        cast = e.alloc(tokens * h * d)  # .to(hidden_states.dtype)
        e.free(out)
        out = cast
    e.free(*kept, masked, inv, ordered)
    return out


def _batched_experts(e: _Emitter, s: ModelShape, tokens: int, d: int, w_bytes: int) -> int:
    """The routed experts of :func:`_moe` by ``batched_mm`` (transformers 5.17's decode steps, in the H200's
    snapshots of run 3): each token-expert pair's ``gate_up`` and ``down`` weights gathered into new tensors
    (``gate_up_proj[expert_ids]``: ``S x 2I x H``, then ``S x H x I``, both live while the second is made), the
    hidden states repeated ``k`` times, batched products, weighted (fp32 with Mixtral's fp32 weights) and summed
    per token; returns the sum."""
    h, ie, pairs = s.hidden_size, s.expert_intermediate_size, tokens * s.experts_per_token
    sel, ids = e.alloc(pairs * h * d), e.alloc(pairs * 8)  # repeat_interleave, expert ids
    w_gate_up = e.alloc(pairs * 2 * ie * h * d)
    proj = e.alloc(pairs * 2 * ie * d)
    act = e.alloc(pairs * ie * d)
    gated = e.alloc(pairs * ie * d)
    e.free(act, proj)
    w_down = e.alloc(pairs * h * ie * d)
    e.free(w_gate_up)
    down = e.alloc(pairs * h * d)
    e.free(gated)
    weighted = e.alloc(pairs * h * w_bytes)
    out = e.alloc(tokens * h * w_bytes)  # .view(T, k, h).sum(1)
    if w_bytes != d:
        cast = e.alloc(tokens * h * d)  # .to(hidden_states.dtype)
        e.free(out)
        out = cast
    e.free(sel, ids, w_down, down, weighted)
    return out

def _forward(e: _Emitter, s: ModelShape, batch: int, q_len: int, d: int, cache: list[int], cache_tokens_after: int,
             slack: int, first_product: Callable[[], None] | None = None) -> None:
    """One model forward of ``batch * q_len`` tokens that keeps only the last position's logits, in the order of
    transformers 5.17's model forward: the embeddings, the mask, the rotary embedding (whose first matrix product
    calls ``first_product``: Note [Forward cuBLAS workspace]), the blocks."""
    tokens = batch * q_len
    pos = e.alloc(tokens * 8)  # position_ids = attention_mask.cumsum(-1) - 1 (int64), and the cumsum
    cum = e.alloc(tokens * 8)
    emb = e.alloc(tokens * s.hidden_size * d)
    kv_tokens, masked = window_tokens(s, cache_tokens_after, q_len)
    mask = _bool_mask(e, batch, q_len, kv_tokens) if masked else -1  # Note [Sliding window]
    cos, sin = _rotary(e, tokens * s.head_dim, d, first_product)
    ws = e.alloc(slack, Category.OVERHEAD) if slack else -1
    x = emb
    for layer in range(s.n_layers):
        y = _forward_block(e, s, tokens, d, cache, layer, cache_tokens_after, batch, q_len)
        if x != emb:
            e.free(x)
        x = y
    if mask >= 0:
        e.free(mask)
    nf = _norm(e, tokens * s.hidden_size * 4, tokens * s.hidden_size * d)
    logits = e.alloc(batch * s.vocab_size * d)
    e.free(nf, x, emb, cos, sin, pos, cum)
    if ws >= 0:
        e.free(ws)
    # generate: next-token logits copied to fp32, logits processors work on copies, then argmax
    f32 = e.alloc(batch * s.vocab_size * 4)
    e.free(logits)
    p1 = e.alloc(batch * s.vocab_size * 4)
    p2 = e.alloc(batch * s.vocab_size * 4)
    e.free(p1, p2, f32)


def decode_steps_simulated(new_tokens: int, *, full: bool = False) -> list[int]:
    """The decode steps (1 .. ``new_tokens - 1``) an inference trace simulates (Note [Decode steps
    simulated]): all of them with ``full=True``, else the first :data:`DECODE_HEAD_STEPS` and the last."""
    n = max(new_tokens - 1, 0)
    if full or n <= DECODE_HEAD_STEPS + 2:
        return list(range(1, n + 1))
    return [*range(1, DECODE_HEAD_STEPS + 1), n - 1, n]


def inference_trace(shape: ModelShape, dtype_bytes: int, *, batch_size: int = 1, prompt_len: int,
                    new_tokens: int = 0, full_decode: bool = False, weight_format: WeightFormat | None = None,
                    workspace_nbytes: int = 0, decode_slack: bool = False) -> WorkloadTrace:
    """The allocations of loading the weights and running ``generate()`` (greedy, DynamicCache, SDPA).

    Only the decode steps of :func:`decode_steps_simulated` are in the trace (all of them with
    ``full_decode=True``, the reference: Note [Decode steps simulated]); its size does not grow with
    ``new_tokens``. ``weight_format``: the projections' format (:mod:`.formats`; ``dtype_bytes`` is then the
    rest's and the activations'), ``workspace_nbytes`` a dequantization workspace held from the start.
    ``decode_slack``: the decode slack of Note [Overhead] in every decode forward (not the program's own requests;
    the estimate gave it to policies whose pages are stolen until it ran the GPU's lag, Note [The GPU's lag in the
    decode replay] in :mod:`.fit`).
    """
    _check("batch_size", batch_size)
    _check("prompt_len", prompt_len)
    _check("new_tokens", new_tokens, 0)
    _check_dtype_bytes(dtype_bytes)
    check_weight_format(weight_format)
    e = _Emitter(f"generate b={batch_size} p={prompt_len} n={new_tokens}")
    steps = decode_steps_simulated(new_tokens, full=full_decode)
    _emit_inference(e, shape, dtype_bytes, batch_size, prompt_len, new_tokens, steps, None, weight_format,
                    workspace_nbytes, decode_slack=decode_slack)
    w = e.build()
    w.complete = len(steps) == max(new_tokens - 1, 0)
    return w


def stream_inference(shape: ModelShape, dtype_bytes: int, sinks: Sequence[OpSink], *, batch_size: int = 1,
                     prompt_len: int, new_tokens: int = 0, on_step: Callable[[int], None] | None = None,
                     weight_format: WeightFormat | None = None, workspace_nbytes: int = 0,
                     jump: "Callable[[int, _Emitter, list[int], list[int]], int] | None" = None,
                     decode_slack: bool = False) -> None:
    """Send every op of ``generate()`` (every decode step, as ``inference_trace(..., full_decode=True)``
    makes them) to ``sinks`` as they are made, keeping none: memory does not grow with ``new_tokens``.
    ``on_step(step)`` is called after the prefill (0) and each decode step; ``jump``: see
    :func:`_emit_inference` (:mod:`.fastreplay` makes the decode steps from a template); ``decode_slack``: as in
    :func:`inference_trace`."""
    _check("batch_size", batch_size)
    _check("prompt_len", prompt_len)
    _check("new_tokens", new_tokens, 0)
    _check_dtype_bytes(dtype_bytes)
    check_weight_format(weight_format)
    e = _Emitter(f"generate b={batch_size} p={prompt_len} n={new_tokens}", record=False, sinks=tuple(sinks))
    _emit_inference(e, shape, dtype_bytes, batch_size, prompt_len, new_tokens,
                    range(1, max(new_tokens, 1)), on_step, weight_format, workspace_nbytes, jump,
                    decode_slack=decode_slack)


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def param_nbytes(shape: ModelShape, dtype_bytes: int, fmt: WeightFormat | None = None) -> list[int]:
    """Bytes of every parameter tensor in creation order: the projections in ``fmt`` when given (Note [Weight
    formats] in :mod:`.formats`), the rest in ``dtype_bytes``."""
    check_weight_format(fmt)
    if fmt is None:
        return [n * dtype_bytes for _, n in shape.param_shapes()]
    if shape.n_experts:
        raise InvalidArgumentError(f"weight format {fmt.name!r}: quantized experts of a mixture-of-experts model "
                                   "are not modelled (its experts are 3-D tensors packed per expert)")
    dims = _projection_dims(shape)
    out = []
    for name, n in shape.param_shapes():
        local = name.rsplit(".", 1)[-1]
        out.append(fmt.nbytes(*dims[local]) if local in _PROJECTIONS and name.startswith("layers.")
                   else n * dtype_bytes)
    return out


_SMALL_NBYTES = 1 << 20  # PyTorch: kSmallSize
_LARGE_BUFFER_NBYTES = 20 << 20  # kLargeBuffer
_MIN_LARGE_ALLOC_NBYTES = 10 << 20  # kMinLargeAlloc
_ROUND_LARGE_NBYTES = 2 << 20  # kRoundLarge


def loaded_weight_nbytes(sizes: list[int]) -> list[int]:
    """What ``torch.cuda.memory_allocated`` counts for each of ``sizes``, allocated in order into an empty
    caching allocator with nothing freed (Note [Weights as PyTorch counts them])."""
    free: list[int] = []  # the large pool's free remainders
    out = []
    for n in sizes:
        r = -(-max(n, 1) // _ROUND) * _ROUND
        if r <= _SMALL_NBYTES:  # small pool: 2 MiB segments, every remainder of 512 B or more is split off
            out.append(r)
            continue
        fits = [b for b in free if b >= r]
        if fits:
            block = min(fits)
            free.remove(block)
        else:
            block = (_LARGE_BUFFER_NBYTES if r < _MIN_LARGE_ALLOC_NBYTES
                     else -(-r // _ROUND_LARGE_NBYTES) * _ROUND_LARGE_NBYTES)
        if block - r > _SMALL_NBYTES:
            free.append(block - r)
            out.append(r)
        else:
            out.append(block)  # a remainder of 1 MiB or less stays in the block and is counted with it
    return out


def _small_buffers(e: _Emitter, nbytes: int) -> None:
    """``nbytes`` of small buffers (Note [Overhead]) as blocks of 1 MiB, the largest request of PyTorch's small
    pool, so that a replay keeps them in 2 MiB small segments."""
    for _ in range(nbytes // MiB):
        e.alloc(MiB, Category.OVERHEAD)
    if nbytes % MiB:
        e.alloc(nbytes % MiB, Category.OVERHEAD)


def weights_nbytes(shape: ModelShape, dtype_bytes: int, fmt: WeightFormat | None = None) -> int:
    """Bytes of all the weights (:func:`param_nbytes`)."""
    return sum(param_nbytes(shape, dtype_bytes, fmt))


def _emit_inference(e: _Emitter, shape: ModelShape, dtype_bytes: int, batch_size: int, prompt_len: int,
                    new_tokens: int, steps: Iterable[int], on_step: Callable[[int], None] | None = None,
                    fmt: WeightFormat | None = None, workspace_nbytes: int = 0,
                    jump: "Callable[[int, _Emitter, list[int], list[int]], int] | None" = None, *,
                    decode_slack: bool = False) -> None:
    """The ops of loading the weights and ``generate()`` into ``e``. ``jump(step, e, [ids, mask], cache)``,
    called after each decode step (``steps`` then contiguous), may make the ops of the steps after it itself
    and return the last step it made, having updated ``e``, ids, mask and cache as those steps leave them."""
    d_act = max(dtype_bytes, 2)  # int8/fp8 weights still compute in 16-bit
    e.phase = "weights"
    sizes = param_nbytes(shape, dtype_bytes, fmt)
    for j, (n, counted) in enumerate(zip(sizes, loaded_weight_nbytes(sizes))):
        e.persistent[e.alloc(n, Category.WEIGHTS, counted)] = f"weight {j}"
    _small_buffers(e, INFERENCE_MISC_NBYTES)
    if workspace_nbytes:  # the ternary formats' dequantization workspace, one layer at a time (.formats)
        e.alloc(workspace_nbytes, Category.OVERHEAD)
    e.phase = "prefill"
    ids = e.alloc(batch_size * prompt_len * 8)  # the int64 input ids; each new token grows them by torch.cat
    mask = e.alloc(batch_size * prompt_len * 8)  # the int64 attention mask generate() is given
    def first_product() -> None:  # Note [Forward cuBLAS workspace]
        e.persistent[e.alloc(CUBLAS_WORKSPACE_NBYTES, Category.OVERHEAD)] = "cublas forward"
    cache = [-1] * (2 * shape.n_layers)
    _forward(e, shape, batch_size, prompt_len, d_act, cache, prompt_len, 0, first_product)
    if on_step is not None:
        on_step(0)
    steps = list(steps)
    at = 0
    while at < len(steps):
        step = steps[at]
        e.phase = "decode"
        grown = e.alloc(batch_size * (prompt_len + step) * 8)  # generate() appends the token to the ids,
        e.free(ids)
        ids = grown
        grown = e.alloc(batch_size * (prompt_len + step) * 8)  # then grows the mask, both by torch.cat
        e.free(mask)
        mask = grown
        slack = DECODE_SLACK_PER_Q_NBYTES * shape.q_dim if decode_slack and shape.n_kv_heads == shape.n_heads else 0
        _forward(e, shape, batch_size, 1, d_act, cache, prompt_len + step, slack)
        if on_step is not None:
            on_step(step)
        if jump is not None:  # Note [Decode step template] in .fastreplay: the steps after this one made at once
            live = [ids, mask]
            last = jump(step, e, live, cache)
            if last != step:
                ids, mask = live
                at += last - step
        at += 1
    e.phase = "end"
    if new_tokens:
        grown = e.alloc(batch_size * (prompt_len + new_tokens) * 8)  # the last token appended
        e.free(ids)
        ids = grown
    e.free(ids, mask)
    for c in cache:
        if c >= 0:
            e.free(c)


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on frozen base weights (Note [LoRA]): ``rank``, the projections that get one
    (``targets``), the adapters' bytes per element (fp32, as PEFT casts them) and the frozen base's
    format (``None``: the model dtype; ``int4`` etc.: QLoRA)."""

    rank: int
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapter_bytes: int = 4
    base_format: WeightFormat | None = None

    def __post_init__(self) -> None:
        _check("lora rank", self.rank)
        if self.rank > _MAX_LORA_RANK:
            raise InvalidArgumentError(f"lora rank must be at most {_MAX_LORA_RANK} (the widest projection the "
                                       f"shapes admit), got {self.rank}")
        if isinstance(self.adapter_bytes, bool) or self.adapter_bytes not in (2, 4) \
                or not isinstance(self.adapter_bytes, int):
            raise InvalidArgumentError(f"adapter_bytes must be 2 or 4, got {self.adapter_bytes!r}")
        if isinstance(self.targets, list):  # the tuple it means (the dataclass is frozen and hashable)
            object.__setattr__(self, "targets", tuple(self.targets))
        if not isinstance(self.targets, tuple) or not self.targets \
                or any(t not in _PROJECTIONS for t in self.targets):
            raise InvalidArgumentError(f"LoRA targets must be among {', '.join(_PROJECTIONS)}, got "
                                       f"{self.targets!r:.80}")
        twice = sorted({t for t in self.targets if self.targets.count(t) > 1})
        if twice:  # PEFT adapts a module once; counting it twice would double its adapter
            raise InvalidArgumentError(f"LoRA targets name {', '.join(twice)} twice")
        if self.base_format is not None and not isinstance(self.base_format, WeightFormat):
            raise InvalidArgumentError(f"base_format must be a WeightFormat (gpumem.estimate.formats."
                                       f"weight_format('int4')) or None, got {self.base_format!r:.40}")
        if self.base_format is not None and self.base_format.qtype:
            # its forward would dequantize into a workspace the training trace does not hold: refused, not guessed
            raise InvalidArgumentError(f"LoRA on a base in {self.base_format.name} is not modelled: the ternary "
                                       "formats' kernels are for inference (use int8, int4 or fp8 for QLoRA)")


def _projection_dims(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """``name -> (out_features, in_features)`` of a block's projections."""
    h, i, q, kv = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}


OPTIM_8BIT_BLOCK = 2048
"""Elements per fp32 absmax of an 8-bit optimizer state (bitsandbytes' block-wise quantization)."""
OPTIM_8BIT_MIN_ELEMENTS = 4096
"""Tensors with fewer elements keep 32-bit optimizer states (bitsandbytes' ``min_8bit_size``)."""


def _optimizer_state_nbytes(n_elements: int, param_nbytes: int, eight_bit: bool) -> int:
    """One optimizer state of a parameter (Note [8-bit optimizer states])."""
    if not eight_bit:
        return param_nbytes
    if n_elements < OPTIM_8BIT_MIN_ELEMENTS:
        return n_elements * 4
    return n_elements + -(-n_elements // OPTIM_8BIT_BLOCK) * 4


AUTOCAST_DTYPE_BYTES: Mapping[str, int] = MappingProxyType({"bf16": 2, "fp16": 2})
"""The compute dtypes of ``torch.autocast`` that mixed precision on fp32 master weights models (Note [Mixed
precision])."""


def check_mixed_precision(mixed_precision: object, dtype_bytes: int, *, lora: bool = False,
                          optimizer_8bit: bool = False) -> None:
    """Refuse a mixed-precision training the trace does not model (Note [Mixed precision])."""
    if not isinstance(mixed_precision, str) or mixed_precision not in AUTOCAST_DTYPE_BYTES:
        raise InvalidArgumentError(f"mixed_precision must be one of {', '.join(AUTOCAST_DTYPE_BYTES)} (the autocast "
                                   f"dtype) or None, got {mixed_precision!r}")
    if dtype_bytes != 4:
        raise InvalidArgumentError(f"mixed precision ({mixed_precision} autocast) keeps fp32 master weights: the "
                                   f"weights' dtype must be fp32 (4 bytes), got {dtype_bytes} bytes")
    if lora:
        raise InvalidArgumentError("mixed precision with LoRA is not modelled (PEFT's adapters under autocast on a "
                                   "frozen base)")
    if optimizer_8bit:
        raise InvalidArgumentError("mixed precision with 8-bit optimizer states is not modelled")


def _rope_fp32(e: _Emitter, n: int, d: int) -> int:
    """Under autocast (Note [Mixed precision]): ``x*cos + rotate_half(x)*sin`` of ``n`` 16-bit values against
    fp32 cos and sin; the products and the result are fp32."""
    a = e.alloc(n * 4)
    half = e.alloc(n * d // 2)
    rh = e.alloc(n * d)
    e.free(half)
    b = e.alloc(n * 4)
    e.free(rh)
    out = e.alloc(n * 4)
    e.free(a, b)
    return out


def _amp_block(e: _Emitter, s: ModelShape, t: int, d: int, cast_elements: list[int]) -> tuple[list[int], int]:
    """One block's training forward under autocast on fp32 weights (Note [Mixed precision]): what autograd
    keeps (autocast's weight copies first, ``len(cast_elements)`` of them) and the block's fp32 output. The
    block input, which norm 1 saves, is the caller's."""
    h, i, q, kv = s.hidden_size, s.intermediate_size, s.q_dim, s.kv_dim
    keep = [e.alloc(n * d) for n in cast_elements]  # autocast's cached copies of the block's weights
    keep.append(e.alloc(t * h * 4))  # norm 1: x * rsqrt(var) in fp32, saved by the weight multiply
    n1 = e.alloc(t * h * 4)  # its fp32 output, live through the attention
    keep += [e.alloc(t * h * d) for _ in range(3)]  # q_proj's, k_proj's and v_proj's own casts of it
    qp, kp, v = e.alloc(t * q * d), e.alloc(t * kv * d), e.alloc(t * kv * d)
    keep.append(v)
    rotated = [_rope_fp32(e, t * width, d) for width in (q, kv)]
    e.free(qp, kp)
    keep += [e.alloc(t * q * d), e.alloc(t * kv * d)]  # SDPA's casts of the rotated q and k
    keep += [e.alloc(t * q * d), e.alloc(t * s.n_heads * 4), e.alloc(t * q * d)]  # out, logsumexp, reshaped
    o = e.alloc(t * h * d)
    e.free(*rotated, n1)
    h1 = e.alloc(t * h * 4)  # fp32 residual + bf16 o_proj output: fp32
    e.free(o)
    keep += [h1, e.alloc(t * h * 4)]  # norm 2's input (saved by its pow) and its normalized fp32
    n2 = e.alloc(t * h * 4)
    keep += [e.alloc(t * h * d) for _ in range(2)]  # gate_proj's and up_proj's casts of it
    keep += [e.alloc(t * i * d) for _ in range(4)]  # gate, act, up, product
    dn = e.alloc(t * h * d)
    e.free(n2)
    y = e.alloc(t * h * 4)
    e.free(dn)
    return keep, y


def _nograd_block(e: _Emitter, s: ModelShape, t: int, d: int, cast_elements: list[int] | None, *,
                  batch: int = 1, masked: bool = False,
                  after_proj: Callable[[str, int], int] | None = None) -> tuple[list[int], int]:
    """One block's forward without grad (the first pass of gradient checkpointing, Note [Gradient
    checkpointing]): each tensor goes as soon as it is dead, as in the ``generate()`` prefill. ``cast_elements``:
    under autocast (Note [Mixed precision]), the block's weights, whose copies autocast caches (returned, first)
    while the residual stream and the norms are fp32; None: all in ``d`` bytes. ``masked``: attention past a
    sliding window, over ``batch`` sequences (Note [Sliding window]). Returns the cached copies and the block's
    output; the block input is the caller's. ``after_proj(name, out)``: called as each projection's output is
    made, returns what stands for it from then on (LoRA's adapters run there, Note [LoRA])."""
    h, i, q, kv = s.hidden_size, s.intermediate_size, s.q_dim, s.kv_dim
    amp = cast_elements is not None

    def proj(name: str, out: int) -> int:
        return out if after_proj is None else after_proj(name, out)
    copies = [e.alloc(n * d) for n in cast_elements] if amp else []

    def norm() -> int:
        if not amp:
            return _norm(e, t * h * 4, t * h * d)
        normalized = e.alloc(t * h * 4)
        out = e.alloc(t * h * 4)
        e.free(normalized)
        return out

    def linear(width: int) -> int:
        """A projection of the normed input: under autocast, the input's cast lives while it runs."""
        cast = e.alloc(t * h * d) if amp else -1
        out = e.alloc(t * width * d)
        if cast >= 0:
            e.free(cast)
        return out

    n1 = norm()
    qp = proj("q_proj", linear(q))
    kp = proj("k_proj", linear(kv))
    v = proj("v_proj", linear(kv))
    if amp:
        rotated = [_rope_fp32(e, t * width, d) for width in (q, kv)]
        e.free(qp, kp)
        qe, ke = e.alloc(t * q * d), e.alloc(t * kv * d)  # SDPA's casts
        e.free(*rotated)
    else:
        qe, ke = _rope(e, t * q * d), _rope(e, t * kv * d)
        e.free(qp, kp)
    extra = _masked_attention_inputs(e, s, batch, t // batch, t // batch, d) if masked else []
    out = e.alloc(t * q * d)
    lse = e.alloc(t * s.n_heads * 4)
    e.free(qe, ke, v, lse, *extra)
    flat = e.alloc(t * q * d)
    e.free(out)
    o = proj("o_proj", e.alloc(t * h * d))
    e.free(flat, n1)
    h1 = e.alloc(t * h * (4 if amp else d))
    e.free(o)
    n2 = norm()
    g = proj("gate_proj", linear(i))
    a = e.alloc(t * i * d)
    e.free(g)
    u = proj("up_proj", linear(i))
    m = e.alloc(t * i * d)
    e.free(a, u)
    dn = proj("down_proj", e.alloc(t * h * d))
    e.free(m, n2)
    y = e.alloc(t * h * (4 if amp else d))
    e.free(dn, h1)
    return copies, y


def _lora_result(e: _Emitter, base_out: int, n_out: int, adapter_bytes: int, d: int) -> int:
    """PEFT's ``result = result + lora_B(lora_A(x)) * scaling; return result.to(dtype)`` after the base
    projection made ``base_out`` (Note [LoRA]): B's output, its scaled copy, the sum in the adapters' dtype (the
    base output goes as ``result`` is rebound), and the cast back, which is the projection's output from then on.
    Returns its id."""
    b = e.alloc(n_out * adapter_bytes)
    scaled = e.alloc(n_out * adapter_bytes)
    e.free(b)
    total = e.alloc(n_out * adapter_bytes)
    e.free(scaled, base_out)
    cast = e.alloc(n_out * d)
    e.free(total)
    return cast


def _norm_backward(e: _Emitter, n: int, d: int, g: int, cast: int, fp32: int) -> int:
    """An RMSNorm's backward over ``n`` values (tokens x hidden) as the H200 snapshot records it (Note [Training
    backward]): the incoming gradient ``g`` times the weight and times the saved cast (for the weight's gradient,
    reduced through a ``2n``-float temporary), then the fp32 chain of ``x * rsqrt(mean(x**2))``'s backward; frees
    ``g`` and the norm's saved ``cast`` and ``fp32`` input, returns the input's gradient (16-bit)."""
    a, b = e.alloc(n * d), e.alloc(n * d)
    e.free(e.alloc(n * 8))
    e.free(b, g, cast)
    g32 = e.alloc(n * 4)
    e.free(a)
    x1, x2 = e.alloc(n * 4), e.alloc(n * 4)
    e.free(x1, g32)
    y = [e.alloc(n * 4) for _ in range(4)]
    e.free(y[2], y[1], y[0], fp32, y[3])
    out = e.alloc(n * d)
    e.free(x2)
    return out


def _block_backward(e: _Emitter, s: ModelShape, t: int, d: int, parts: dict[str, int], saved: list[int],
                    grad: Callable[..., None]) -> None:
    """One dense block's backward as recorded (Note [Training backward]): ``parts`` are its saved tensors by name
    (the rest of ``saved`` goes with the attention's); ``grad(n)`` makes a weight's gradient (kept). Every branch
    gradient is added in place into the residual stream's, which lives from the final norm's backward to the
    embedding's: the block makes none of its own."""
    h, i = s.hidden_size, s.intermediate_size
    per = s.layer_param_shapes()
    (_, q_n), (_, k_n), (_, v_n), (_, o_n), (_, gate_n), (_, up_n), (_, down_n) = per[:7]
    q, kv = t * s.q_dim * d, t * s.kv_dim * d
    grad(down_n)
    d1 = e.alloc(t * i * d)  # down's input gradient
    e.free(parts["prod"])
    t1, t2 = e.alloc(t * i * d), e.alloc(t * i * d)  # the product's gradients (up's, act's)
    e.free(d1, parts["up"], parts["act"])
    grad(up_n)
    xu = e.alloc(t * h * d)
    e.free(t1)
    gg = e.alloc(t * i * d)  # silu's backward
    e.free(t2, parts["gate"])
    grad(gate_n)
    xg = e.alloc(t * h * d)
    e.free(gg, parts["n2o"])
    s2 = e.alloc(t * h * d)  # gate's and up's input gradients summed
    e.free(xu, xg)
    e.free(_norm_backward(e, t * h, d, s2, parts["n2c"], parts["n2f"]))  # added into the residual's in place
    grad(o_n)
    do = e.alloc(q)  # o_proj's input gradient
    dq = e.alloc(q)
    dk, dv = e.alloc(kv), e.alloc(kv)
    e.free(e.alloc(t * s.q_dim * 8 + t * s.n_heads * 4))  # SDPA's backward buffer (fp32)
    e.free(do)
    named = {parts[k] for k in ("n1f", "n1c", "n1o", "n2f", "n2c", "n2o", "gate", "act", "up", "prod")}
    e.free(*[x for x in saved if x not in named])  # q and k rotated, v, SDPA's output and logsumexp
    e.free(dk, dv)  # k's rotation undone, k and v projected back (small)
    x1 = e.alloc(q)  # q's rotation undone
    half = e.alloc(q // 2)
    x2 = e.alloc(q)
    e.free(half)
    x3 = e.alloc(q)
    e.free(x1, x3)
    x4 = e.alloc(q)
    e.free(dq, x4)
    x5, x6 = e.alloc(t * h * d), e.alloc(t * h * d)  # q's, k's and v's input gradients
    e.free(x6)
    x7, x8 = e.alloc(t * h * d), e.alloc(t * h * d)
    e.free(x8)
    g1 = e.alloc(t * h * d)  # their sum
    e.free(x5, x7)
    x9 = e.alloc(t * h * d)
    e.free(x2)
    x10 = e.alloc(t * h * d)
    for n in (q_n, k_n, v_n):
        grad(n)
    e.free(e.alloc(t * h * 8))
    e.free(x9, parts["n1o"], x10)
    for name, n in per[7:]:
        grad(n, cast="norm" not in name)
    e.free(_norm_backward(e, t * h, d, g1, parts["n1c"], parts["n1f"]))


def training_trace(shape: ModelShape, dtype_bytes: int, *, batch_size: int = 1, seq_len: int,
                   n_steps: int = 2, optimizer_states: int = 2,
                   gradient_checkpointing: bool = False, optimizer_8bit: bool = False,
                   lora: LoraConfig | None = None, mixed_precision: str | None = None) -> WorkloadTrace:
    """The allocations of ``n_steps`` training steps (forward with labels, backward, foreach AdamW step,
    ``zero_grad(set_to_none=True)``), weights, gradients and ``optimizer_states`` states per parameter in
    ``dtype_bytes``; with ``mixed_precision`` (``"bf16"``/``"fp16"``) the forward runs under that autocast on
    fp32 master weights (Note [Mixed precision]).

    Note [Training activations]: autograd keeps, per block and token, the fp32 input, the 16-bit cast and the
    output of each RMSNorm (``4H + 2H + 2H`` twice), the rotated q and k, v, the SDPA output (``2*2Q +
    2*2KV``), and ``gate``, ``act(gate)``, ``up`` and their product (``4*2I``). The loss keeps the bf16 logits
    and the fp32 log-softmax; its backward holds two more fp32 logit-sized gradients.
    Each RMSNorm keeps its fp32 input and the cast of ``x * rsqrt`` that the weight multiply saves (with pow's
    and ``x * rsqrt``'s fp32 temporaries live while it runs), and SDPA's output is o_proj's input as it is (its
    transpose is contiguous: no copy), as the H200 snapshot of Qwen2 0.16B training b2 (run 3) shows each layer;
    before, the two casts were modelled as "the attention output's reshaped copy" and "one more hidden-sized
    tensor measured" further on (the same bytes, other lifetimes), with no norm temporaries: the replay cut its
    segments otherwise (LoRA b8 x 1024 reserved -9.0 % -> +1.4 %, tied training +11.0 % -> +1.3 %).
    q, k and v are projected and rotated as in the prefill (:func:`_rope`: three q-sized temporaries and a
    half-sized one, the unrotated q and k freed once both are rotated), as the H200 snapshot of Qwen2 0.16B
    training b2 (run 3) shows each layer; before, one q-sized temporary stood for all of them, and the replay cut
    its 20 MiB segments differently (Qwen2 0.16B b8 reserved -0.13 % -> +0.03 %, Llama 3B b1 +2.77 % -> +1.49 %).

    Note [Optimizer step]: the harness (as most training loops) runs ``loss.backward(); opt.step();
    opt.zero_grad(); del out``: the model's output, and with it the bf16 logits, lives through the optimizer
    step. Foreach AdamW makes its states at the first step (``exp_avg`` then ``exp_avg_sq``, parameter by
    parameter) and, at every step, one ``sqrt(exp_avg_sq)`` per parameter in order, freed when the list goes
    (Python frees a list's items last first). So the H200 snapshot of Qwen2 0.16B training b2 (run 3, ops
    2883-3610) shows it; the "embedding-sized buffer" modelled before was those logits (the same 62.5 MiB in
    that row, another size elsewhere): Llama 3B b1 reserved +3.45 % -> +2.77 %, Llama 0.1B b1
    +3.52 % -> +2.79 %. Each block's backward makes the gradient of its input, which
    replaces that of its output (one hidden-sized gradient at a time, a new tensor per block).

    Note [Gradient checkpointing]: with ``gradient_checkpointing`` each block's forward keeps only its input:
    the block runs without grad, each tensor freed as soon as it is dead (:func:`_nograd_block`; holding a
    block's saved set to its end, as before, made the replay reserve 0.2-0.8 GiB too much in step 1 on the
    H200 rows), and the backward runs the block's forward again with grad just before its gradients, holding
    that one block's tensors (the list above) until they are done.

    Note [Mixed precision]: with ``mixed_precision`` (``"bf16"`` or ``"fp16"``, ``dtype_bytes`` 4) the
    weights, their gradients and AdamW's states are fp32 and the forward runs under ``torch.autocast``.
    Autocast casts each projection's fp32 weight (and bias) to a 16-bit copy at its first use and caches it
    until the autocast context ends; the linears save the copies for the backward, which frees a block's
    copies with its other saved tensors (under gradient checkpointing the no-grad pass's copies stay cached
    to the end of the forward, and the recompute makes new ones). The embeddings' output, the residual
    stream, RMSNorm (its input and ``x * rsqrt`` saved, its output fp32) and cos/sin are fp32; every
    projection casts its input to 16 bits itself (three copies of norm 1's output, two of norm 2's, all
    saved); q and k rotated against fp32 cos/sin are fp32 until SDPA casts them (the casts saved); the
    projections' outputs and the MLP are 16-bit. In the backward each weight's gradient is made in 16 bits
    then cast to fp32 (both live at once), and the inputs' gradients are cast back to fp32 before each norm.
    Modelled from torch 2.11's autocast and transformers 5.17's source; the H200 rows (run 2: Qwen2 0.16B,
    with and without gradient checkpointing): peak allocated 0.4-1.3 % above the measurement.

    Note [Tied embeddings]: with ``tie_word_embeddings`` the embedding matrix is lm_head's weight. Its gradient
    is first made by lm_head's backward (the first of the backward, as an untied lm_head's is) and held through
    the whole backward; the embedding's backward then makes a second matrix-sized gradient, which autograd adds
    into the first in place and frees (before, the tied gradient was made at the embedding's backward only). The
    H200's tied training row (run 3) peaks at the loss's backward, before lm_head's: 0.3 % below, unexplained.

    Note [8-bit optimizer states]: with ``optimizer_8bit`` each state of a tensor of ``m`` elements is
    bitsandbytes' block-wise 8-bit layout, ``m`` bytes and one fp32 absmax per block of
    :data:`OPTIM_8BIT_BLOCK` elements, except tensors under :data:`OPTIM_8BIT_MIN_ELEMENTS` elements
    (the norms), whose states stay fp32. The update's parameter-sized temporaries of the foreach AdamW
    are kept (bitsandbytes' fused kernel has none: an upper bound). Modelled only: bitsandbytes is not on
    the GPU machine, so this figure is unmeasured.

    Note [LoRA]: with ``lora`` the base weights (in ``lora.base_format``, QLoRA) are frozen: no gradient,
    no optimizer state. Each targeted projection of each block gets A (``rank x in``) and B (``out x rank``)
    in ``lora.adapter_bytes``; its forward keeps the input cast to the adapters' dtype (``T x in``) and A's
    output (``T x rank``), and makes B's output, its scaled copy, the sum and its cast back (PEFT's
    ``lora.Linear.forward``) as each projection runs, in the no-grad pass of gradient checkpointing too (before,
    every adapter ran after the block's output: LoRA with gradient checkpointing b8 x 1024 reserved -4.84 % ->
    -2.18 %, its other rows 0.4-0.7 points nearer); a quantized base is dequantized to 16 bits for each matrix product, forward and
    backward (one ``out x in`` temporary at a time). Gradients and AdamW states are the adapters'. Autograd
    saves a matrix product's input only for its weight's gradient (torch's derivative formulas save a tensor
    only when the gradient that needs it is computed): with the weights frozen, the inputs of the base
    projections (the norms' outputs, the MLP product) and the norms' casts (saved for the norm weights'
    gradients only) are not kept. Measured on the H200 (run 3, adapters added by hand as
    PEFT adds them; no PEFT, no bitsandbytes there: QLoRA stays unmeasured): before this, peak allocated was
    12 % (all seven projections) and 15 % (q and v) above the measurement at batch 8 x 1024.
    """
    if not isinstance(optimizer_8bit, bool):
        raise InvalidArgumentError(f"optimizer_8bit must be True or False, got {optimizer_8bit!r}")
    amp = mixed_precision is not None
    if amp:
        check_mixed_precision(mixed_precision, dtype_bytes, lora=lora is not None, optimizer_8bit=optimizer_8bit)
    if shape.sub_norms or shape.activation != "silu":
        raise InvalidArgumentError("training a BitNet model (quantization-aware training of its ternary weights) "
                                   "is not modelled; its generate() is")
    if shape.n_experts:
        raise InvalidArgumentError("training a mixture-of-experts model is not modelled (what autograd keeps "
                                   "per expert and the router's auxiliary loss); its generate() is")
    if lora is not None and not isinstance(lora, LoraConfig):
        raise InvalidArgumentError(f"lora must be a LoraConfig or None, got {type(lora).__name__}")
    if not isinstance(gradient_checkpointing, bool):
        raise InvalidArgumentError(f"gradient_checkpointing must be True or False, got {gradient_checkpointing!r}")
    _check("batch_size", batch_size)
    _check("seq_len", seq_len)
    _check("n_steps", n_steps)
    _check_dtype_bytes(dtype_bytes)
    if dtype_bytes == 1 and lora is None:
        raise InvalidArgumentError("full training of 1-byte (int8/fp8) weights is not modelled: PyTorch has no "
                                   "1-byte gradients or AdamW states for them; train 16-bit or fp32 weights, or "
                                   "LoRA adapters on the frozen 1-byte base")
    _, masked = window_tokens(shape, seq_len, seq_len)
    if masked and amp:
        raise InvalidArgumentError(f"mixed precision past the sliding window ({seq_len} tokens, window "
                                   f"{shape.sliding_window}) is not modelled (autocast's casts of the repeated "
                                   "keys and values and of the mask)")
    d = AUTOCAST_DTYPE_BYTES[mixed_precision] if amp else max(dtype_bytes, 2)
    r = 4 if amp else d  # Note [Mixed precision]: the residual stream, the embeddings' output and cos/sin in fp32
    s = shape
    h, i, t = s.hidden_size, s.intermediate_size, batch_size * seq_len
    per_layer = s.layer_param_shapes()
    cast_elements = [n for name, n in per_layer if "norm" not in name]  # what autocast casts (no norm weights)
    # Note [Training backward]: the dense block's backward as recorded; the other kinds keep the coarser one
    as_recorded = not amp and lora is None and not masked and not s.n_experts and not s.sub_norms
    e = _Emitter(f"train b={batch_size} s={seq_len}")
    e.phase = "weights"
    params = param_nbytes(s, dtype_bytes, lora.base_format if lora else None)
    for j, (n, counted) in enumerate(zip(params, loaded_weight_nbytes(params))):
        e.persistent[e.alloc(n, Category.WEIGHTS, counted)] = f"weight {j}"
    dims = _projection_dims(s)
    adapters: list[tuple[int, int]] = []  # trainable tensors: (elements, bytes)
    if lora is not None:
        for _ in range(s.n_layers):
            for target in lora.targets:
                out_f, in_f = dims[target]
                adapters += [(lora.rank * in_f, lora.rank * in_f * lora.adapter_bytes),
                             (out_f * lora.rank, out_f * lora.rank * lora.adapter_bytes)]
        for j, (_, n) in enumerate(adapters):
            e.persistent[e.alloc(n, Category.WEIGHTS)] = f"adapter {j}"
    quantized_base = lora is not None and lora.base_format is not None

    def dequantized(out_f: int, in_f: int) -> None:
        """QLoRA: one projection's weights dequantized to 16 bits for a matrix product, then dropped."""
        e.free(e.alloc(out_f * in_f * 2))
    _small_buffers(e, MISC_NBYTES)
    _small_buffers(e, BACKWARD_MISC_NBYTES)
    states: list[int] = []
    backward_workspace = [-1]  # Note [Backward cuBLAS workspace]: made at the backward's first matrix product

    def first_backward_product() -> None:
        if backward_workspace[0] < 0:
            backward_workspace[0] = e.alloc(CUBLAS_WORKSPACE_NBYTES, Category.OVERHEAD)
            e.persistent[backward_workspace[0]] = "cublas backward"
    for step in range(n_steps):
        e.phase = f"forward {step + 1}"
        ids = e.alloc(t * 8)
        emb = e.alloc(t * h * r)
        mask = _bool_mask(e, batch_size, seq_len, seq_len) if masked else -1  # Note [Sliding window]
        if step == 0:  # Note [Forward cuBLAS workspace]: at the rotary embedding's matrix product
            e.persistent[e.alloc(CUBLAS_WORKSPACE_NBYTES, Category.OVERHEAD)] = "cublas forward"
        cos, sin = e.alloc(t * s.head_dim * r), e.alloc(t * s.head_dim * r)
        saved: list[list[int]] = []
        inputs: list[int] = []  # gradient checkpointing: each block's input, kept for the recompute
        cached: list[int] = []  # Note [Mixed precision]: autocast's weight copies of a no-grad forward

        def block(input_needs_grad: bool = True, parts: dict[str, int] | None = None) -> tuple[list[int], int]:
            """One block's forward: the tensors autograd keeps, and the block's output; ``parts`` (when given)
            gets the saved tensors by name, for the backward as recorded (Note [Training backward])."""
            if amp:
                return _amp_block(e, s, t, d, cast_elements)
            if parts is None:
                parts = {}
            keep: list[int] = []
            # Note [LoRA]: tensors only the frozen weights' gradients would need are not saved: they die in the
            # block (held to its end here, an upper bound), where full training keeps them
            weight_only = [] if lora is not None else keep

            def adapter(target: str, out: int) -> int:
                """Note [LoRA]: PEFT's adapter of ``target`` after its base projection made ``out``: the input cast
                to the adapters' dtype and A's output, kept; then :func:`_lora_result`, whose cast replaces
                ``out``."""
                if lora is None or target not in lora.targets:
                    return out
                out_f, in_f = dims[target]
                if quantized_base:
                    dequantized(out_f, in_f)
                keep.extend([e.alloc(t * in_f * lora.adapter_bytes), e.alloc(t * lora.rank * lora.adapter_bytes)])
                return _lora_result(e, out, t * out_f, lora.adapter_bytes, d)

            def norm(saved: bool = True) -> tuple[int, int, int]:
                """RMSNorm as the snapshot shows it: the fp32 input (saved by pow and the multiply), pow's
                temporary, ``x * rsqrt`` (fp32), its cast (saved by the weight multiply: for the weight's
                gradient only) and the output (the projections' input), then ``x * rsqrt`` goes. ``saved``
                False: nothing before it needs a gradient, so it saves nothing (Note [LoRA])."""
                fp32 = e.alloc(t * h * 4)
                e.free(e.alloc(t * h * 4))
                scaled = e.alloc(t * h * 4)
                cast = e.alloc(t * h * d)
                out = e.alloc(t * h * d)
                weight_only.append(out)
                if lora is not None:  # a frozen norm weight: nothing saves the cast
                    e.free(cast)
                else:
                    keep.append(cast)
                e.free(scaled)
                if saved:
                    keep.append(fp32)
                else:
                    e.free(fp32)
                return fp32, cast, out
            parts["n1f"], parts["n1c"], parts["n1o"] = norm(input_needs_grad)
            # q, k, v projected, then rotated as in generate's prefill (Note [Training activations]: the unrotated
            # q and k live through both rotations and their temporaries, H200 snapshot of run 3, ops 254-287)
            qp = adapter("q_proj", e.alloc(t * s.q_dim * d))
            kp = adapter("k_proj", e.alloc(t * s.kv_dim * d))
            v = adapter("v_proj", e.alloc(t * s.kv_dim * d))
            parts["q"] = _rope(e, t * s.q_dim * d)  # q rotated
            keep.append(parts["q"])
            kv = [_rope(e, t * s.kv_dim * d), v]  # k rotated, v
            parts["k"], parts["v"] = kv
            e.free(qp, kp)
            if masked:  # Note [Sliding window]: SDPA saves the repeated keys and values and the additive mask
                extra = _masked_attention_inputs(e, s, batch_size, seq_len, seq_len, d, training=True)
                keep += extra
                if len(extra) == 3:  # repeated: the unrepeated ones are saved by nothing
                    e.free(*kv)
                else:
                    keep += kv
            else:
                keep += kv
            parts["sdpa"] = e.alloc(t * s.q_dim * d)  # sdpa out, o_proj's input (its transpose is contiguous)
            keep.append(parts["sdpa"])
            keep.append(e.alloc(t * s.n_heads * 4))  # logsumexp
            o = adapter("o_proj", e.alloc(t * h * d))
            h1 = e.alloc(t * h * d)
            e.free(o)
            parts["n2f"], parts["n2c"], parts["n2o"] = norm()  # norm 2 (gate/up's input)
            parts["gate"] = adapter("gate_proj", e.alloc(t * i * d))
            parts["act"] = e.alloc(t * i * d)
            parts["up"] = adapter("up_proj", e.alloc(t * i * d))
            keep.extend([parts["gate"], parts["act"], parts["up"]])
            parts["prod"] = e.alloc(t * i * d)  # their product (down's input)
            weight_only.append(parts["prod"])
            dn = adapter("down_proj", e.alloc(t * h * d))
            y = e.alloc(t * h * d)
            e.free(dn, h1)
            if lora is not None:
                e.free(*weight_only)
            return keep, y

        def nograd_adapter(target: str, out: int) -> int:
            """Note [LoRA]: an adapter without grad (checkpointing's first pass): its tensors die as made."""
            if lora is None or target not in lora.targets:
                return out
            out_f, in_f = dims[target]
            if quantized_base:
                dequantized(out_f, in_f)
            cast = e.alloc(t * in_f * lora.adapter_bytes)
            a_out = e.alloc(t * lora.rank * lora.adapter_bytes)
            e.free(cast)
            e.free(a_out)
            return _lora_result(e, out, t * out_f, lora.adapter_bytes, d)

        x = emb
        layer_parts: list[dict[str, int]] = [{} for _ in range(s.n_layers)]
        for _ in range(s.n_layers):
            if gradient_checkpointing:  # no_grad forward: nothing is kept but the block input
                copies, y = _nograd_block(e, s, t, d, cast_elements if amp else None, batch=batch_size,
                                          masked=masked, after_proj=nograd_adapter if lora is not None else None)
                cached += copies  # under autocast the weight copies stay in its cache until the forward ends
                inputs.append(x)
                x = y
                saved.append([])
                continue
            # Note [LoRA]: the frozen embedding's output needs no gradient (unless gradient checkpointing's hook
            # asks for one), so the first block's norm saves nothing
            keep, y = block(input_needs_grad=lora is None or x != emb, parts=layer_parts[len(saved)])
            if amp and x != emb:
                keep.append(x)  # the block input is norm 1's input, which it saves in fp32
            elif x != emb:
                e.free(x)  # the block input: the norm saved its fp32 copy, the residual add saves nothing
            x = y
            saved.append(keep)
        if mask >= 0:  # the model's forward returns: its boolean mask goes
            e.free(mask)
        if amp:  # final norm in fp32, its output cast for lm_head, whose weight is cast too
            nf32 = e.alloc(t * h * 4)
            out32 = e.alloc(t * h * 4)
            lm_copy = e.alloc(s.vocab_size * h * d)
            nf = e.alloc(t * h * d)
            e.free(out32)
        elif as_recorded:  # the final norm as a block's (Note [Training backward]); its input goes as it returns
            nf32 = e.alloc(t * h * 4)
            e.free(e.alloc(t * h * 4))
            scaled = e.alloc(t * h * 4)
            ncast, nf = e.alloc(t * h * d), e.alloc(t * h * d)
            e.free(scaled, x)
        else:
            nf32, nf = e.alloc(t * h * 4), e.alloc(t * h * d)
        logits = e.alloc(t * s.vocab_size * d)
        up = e.alloc(t * s.vocab_size * 4)
        lsm = e.alloc(t * s.vocab_size * 4)
        e.free(up)
        if cached:  # autocast's exit clears its cache: the copies no saved tensor holds go
            e.free(*cached)
        e.phase = f"backward {step + 1}"
        g1 = e.alloc(t * s.vocab_size * 4)
        g2 = e.alloc(t * s.vocab_size * 4)
        e.free(g1, lsm)
        g3 = e.alloc(t * s.vocab_size * d)
        e.free(g2)
        grads: list[int] = []

        def grad(n_elements: int, cast: bool = True) -> None:
            """A weight's gradient in the weights' dtype; under autocast first in the compute dtype (the
            matrix product's), then cast by the copy's backward (Note [Mixed precision])."""
            tmp = e.alloc(n_elements * d) if amp and cast else -1
            grads.append(e.alloc(n_elements * dtype_bytes, Category.GRADIENTS))
            if tmp >= 0:
                e.free(tmp)
        if lora is None:  # lm_head's gradient; tied (Note [Tied embeddings]): the shared matrix's, made here
            grad(s.vocab_size * h)
            first_backward_product()
        gx = e.alloc(t * h * r)
        first_backward_product()
        if amp:  # lm_head's input gradient in bf16, cast back to fp32 for the norm's backward
            e.free(e.alloc(t * h * d))
            e.free(lm_copy)
        if as_recorded:  # Note [Training backward]: the final norm's backward makes the residual stream's gradient
            e.free(g3, nf)
            gx = _norm_backward(e, t * h, d, gx, ncast, nf32)
        else:
            e.free(g3, nf32, nf, x)  # Note [Optimizer step]: the logits stay with the model's output
        for layer in reversed(range(s.n_layers)):
            per = per_layer
            if gradient_checkpointing:  # the block's forward again, with grad, from its saved input
                layer_parts[layer] = {}
                saved[layer], y = block(parts=layer_parts[layer])
                e.free(y)
            if as_recorded:
                _block_backward(e, s, t, d, layer_parts[layer], saved[layer], grad)
                if gradient_checkpointing and inputs[layer] != emb:
                    e.free(inputs[layer])
                continue
            if lora is not None:
                per = []  # the base is frozen: its gradients are none, the adapters' come below
            gi = e.alloc(t * i * d)
            gi2 = e.alloc(t * i * d)
            for _, n in per[4:7]:
                grad(n)
            e.free(gi, gi2)
            if amp:  # gate's and up's input gradients, cast to fp32 and summed for norm 2's backward
                e.free(e.alloc(t * h * 4))
            for _, n in per[:4]:
                grad(n)
            gq = e.alloc(t * s.q_dim * d)
            if masked and s.n_kv_heads != s.n_heads:  # the repeated keys' and values' gradients, summed per group
                e.free(e.alloc(t * s.q_dim * d), e.alloc(t * s.q_dim * d))
            e.free(gq)
            for name, n in per[7:]:
                grad(n, cast="norm" not in name)
            if amp:  # q's, k's and v's input gradients in fp32 for norm 1's backward
                e.free(e.alloc(t * h * 4))
            if lora is not None:
                for target in lora.targets:
                    out_f, in_f = dims[target]
                    if quantized_base:
                        dequantized(out_f, in_f)
                    grads.append(e.alloc(lora.rank * in_f * lora.adapter_bytes, Category.GRADIENTS))
                    grads.append(e.alloc(out_f * lora.rank * lora.adapter_bytes, Category.GRADIENTS))
            grown = e.alloc(t * h * r)  # the gradient of the block's input replaces that of its output
            e.free(gx)
            gx = grown
            e.free(*saved[layer])
            if gradient_checkpointing and inputs[layer] != emb:
                e.free(inputs[layer])
        if lora is None:
            if s.tie_word_embeddings:  # the embedding's gradient, added in place into the tied matrix's, then freed
                e.free(e.alloc(params[0]))
            else:
                grads.append(e.alloc(params[0], Category.GRADIENTS))
            grads.append(e.alloc(h * dtype_bytes, Category.GRADIENTS))
        e.free(gx, emb, cos, sin, ids)
        e.phase = f"optimizer {step + 1}"
        trainable = adapters if lora is not None else [(m, n) for (_, m), n in zip(s.param_shapes(), params)]
        if not states:
            for m, n in trainable:
                for _ in range(optimizer_states):
                    states.append(e.alloc(_optimizer_state_nbytes(m, n, optimizer_8bit), Category.OPTIMIZER))
        # Note [Optimizer step]: foreach AdamW's sqrt(exp_avg_sq), one per trainable tensor in order, freed as
        # Python frees a list (last first); zero_grad, then the model's output (its logits) goes
        tmp_ids = [e.alloc(n) for _, n in trainable]
        e.free(*reversed(tmp_ids))
        e.free(*grads)
        e.free(logits)
    e.phase = "end"
    return e.build()
