"""Estimates: parts, monotonicity, the H200 measurements, and bad input."""

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumem.errors import InvalidArgumentError
from gpumem.estimate import (
    ModelShape,
    estimate_inference_memory,
    estimate_kv_cache_memory,
    estimate_model_memory,
    estimate_training_memory,
    inference_trace,
    training_trace,
)
from gpumem.estimate.workload import INFERENCE_MISC_NBYTES
from gpumem.units import MiB

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ROOT / "reports" / "hil" / "estimate-hf-memory-h200-2026-11-22.json"
SMALL = dict(hidden_size=256, intermediate_size=688, n_layers=2, vocab_size=1000, n_heads=4, n_kv_heads=2)


def small_args():
    return (SMALL["hidden_size"], SMALL["intermediate_size"], SMALL["n_layers"], SMALL["vocab_size"],
            SMALL["n_heads"], SMALL["n_kv_heads"])


def test_llama2_7b_parameter_count_is_exact():
    # Llama-2-7B: 6,738,415,616 parameters (also what the H200 run counted on the random model)
    assert ModelShape(4096, 11008, 32, 32000, 32, 32).n_params == 6_738_415_616
    assert estimate_model_memory(4096, 11008, 32, 32000, 2, n_heads=32) == 2 * 6_738_415_616


def test_grouped_query_attention_shrinks_weights_and_cache():
    mha = estimate_model_memory(2048, 5632, 22, 32000, 2, n_heads=32, n_kv_heads=32)
    gqa = estimate_model_memory(2048, 5632, 22, 32000, 2, n_heads=32, n_kv_heads=4)
    assert gqa < mha
    assert estimate_kv_cache_memory(22, 4, 64, 1000, 2) * 8 == estimate_kv_cache_memory(22, 32, 64, 1000, 2)


def test_kv_cache_formula():
    assert estimate_kv_cache_memory(32, 32, 128, 4096, 2, batch_size=16) == 2 * 32 * 16 * 4096 * 32 * 128 * 2


def test_parts_add_up_and_helpers_convert():
    e = estimate_inference_memory(*small_args(), 128, 2, batch_size=2, prompt_len=100, new_tokens=8)
    assert e.model_bytes + e.kv_cache_bytes + e.activation_bytes + e.overhead_bytes == e.total_bytes
    assert e.total_gib == e.total_bytes / 2**30 and e.total_mib == e.total_bytes / 2**20
    assert e.model_gib == e.model_bytes / 2**30 and e.kv_cache_gib == e.kv_cache_bytes / 2**30
    assert e.activation_gib == e.activation_bytes / 2**30
    for old, new, field, scale in (("total_gb", "total_gib", "total_bytes", 1e9),
                                   ("total_mb", "total_mib", "total_bytes", 1e6),
                                   ("model_gb", "model_gib", "model_bytes", 1e9),
                                   ("kv_cache_gb", "kv_cache_gib", "kv_cache_bytes", 1e9),
                                   ("activation_gb", "activation_gib", "activation_bytes", 1e9)):
        with pytest.warns(DeprecationWarning, match=new):
            value = getattr(e, old)  # the deprecated alias keeps its decimal figure
        assert value == getattr(e, field) / scale
    assert e.as_dict()["total_bytes"] == e.total_bytes
    # weights are whole at the peak, and the cache holds at least the prompt of every layer
    assert e.model_bytes == ModelShape(**SMALL).n_params * 2
    assert e.kv_cache_bytes >= estimate_kv_cache_memory(2, 2, 64, 100, 2, batch_size=2)


def test_prompt_defaults_to_max_seq_len_minus_new_tokens():
    a = estimate_inference_memory(*small_args(), 128, 2, new_tokens=8)
    b = estimate_inference_memory(*small_args(), 128, 2, prompt_len=120, new_tokens=8)
    assert a == b


@given(b=st.integers(1, 6), p=st.integers(1, 300), n=st.integers(0, 6), db=st.integers(1, 3), dp=st.integers(1, 200))
def test_more_batch_or_prompt_never_needs_less(b, p, n, db, dp):
    base = estimate_inference_memory(*small_args(), p + n, 2, batch_size=b, prompt_len=p, new_tokens=n)
    more_b = estimate_inference_memory(*small_args(), p + n, 2, batch_size=b + db, prompt_len=p, new_tokens=n)
    more_p = estimate_inference_memory(*small_args(), p + dp + n, 2, batch_size=b, prompt_len=p + dp, new_tokens=n)
    assert more_b.total_bytes >= base.total_bytes
    assert more_p.total_bytes >= base.total_bytes


@given(b=st.integers(1, 4), s=st.integers(1, 256))
def test_training_peak_holds_weights_grads_or_states(b, s):
    e = estimate_training_memory(*small_args(), s, 2, batch_size=b)
    w = ModelShape(**SMALL).n_params * 2
    assert e.total_bytes >= 4 * w  # weights, gradients (or the step's temporary) and two AdamW states
    assert e.model_bytes + e.gradient_bytes + e.optimizer_bytes + e.activation_bytes + e.overhead_bytes == e.total_bytes


def test_synthetic_traces_are_valid_and_leave_nothing_but_weights():
    shape = ModelShape(**SMALL)
    w = inference_trace(shape, 2, batch_size=2, prompt_len=16, new_tokens=3)
    w.trace.validate()
    # weights, the misc buffers (1 MiB blocks, Note [Overhead] in gpumem.estimate.workload), cuBLAS workspace
    assert w.trace.n_live_at_end == len(shape.param_shapes()) + INFERENCE_MISC_NBYTES // MiB + 1
    t = training_trace(shape, 2, batch_size=2, seq_len=16)
    t.trace.validate()
    assert t.trace.peak_live_nbytes <= t.peak_nbytes


def test_estimates_match_the_h200_measurements():
    """The accuracy bar on the recorded H200 grid: never below the measured peak, at most 10 % above."""
    doc = json.loads(MEASURED.read_text())
    rows = [r for r in doc["rows"] if r["status"] == "ok"]
    assert len(rows) >= 20
    for r in rows:
        c = r["config"]
        args = (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"],
                c["num_attention_heads"], c["num_key_value_heads"])
        b, p, n = r["batch_size"], r["prompt_len"], r["new_tokens"]
        if r["kind"] == "train":
            est = estimate_training_memory(*args, p, 2, batch_size=b)
            # Note [Allocated as PyTorch counts it] (gpumem.estimate.fit): what gpumem estimate reports for
            # training is the pytorch replay's peak of blocks; the trace's sum of requests may be up to 1 % below
            from gpumem.estimate.fit import estimate_peak_reserved
            from gpumem.estimate.shape import ModelShape
            from gpumem.estimate.workload import training_trace

            (rep,) = estimate_peak_reserved(training_trace(ModelShape(*args), 2, batch_size=b, seq_len=p),
                                            ("pytorch",))
            assert -0.01 <= est.total_bytes / r["peak_allocated_bytes"] - 1 <= 0.10
            total = rep.peak_block_allocated_bytes
        else:
            # as gpumem estimate reports it (Note [Allocated as PyTorch counts it]): the larger of the requests'
            # peak and the pytorch replay's peak of blocks; the requests alone may be below PyTorch's count
            from gpumem.estimate.fit import allocated_as_pytorch_counts, replay_inference
            from gpumem.estimate.shape import ModelShape

            est = estimate_inference_memory(*args, p + n, 2, batch_size=b, prompt_len=p, new_tokens=n)
            (rep,) = replay_inference(ModelShape(*args), 2, ("pytorch",), "sim:h200-141gb", batch_size=b,
                                      prompt_len=p, new_tokens=n, peak_nbytes=est.total_bytes)
            assert -0.01 <= est.total_bytes / r["peak_allocated_bytes"] - 1 <= 0.10
            total = allocated_as_pytorch_counts(est.total_bytes, rep)
        err = total / r["peak_allocated_bytes"] - 1
        assert 0 <= err <= 0.10, (r["kind"], r["model"], b, p, n, err)


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=0), "batch_size"),
    (dict(batch_size=True), "batch_size"),
    (dict(prompt_len=0), "prompt_len"),
    (dict(prompt_len=120, new_tokens=20), "exceeds max_seq_len"),
    (dict(new_tokens=-1), "new_tokens"),
])
def test_bad_workload_is_refused(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        estimate_inference_memory(*small_args(), 128, 2, **kwargs)


@pytest.mark.parametrize("dtype_bytes", [0, 3, 8, -2, True, 2.0])
def test_bad_dtype_is_refused(dtype_bytes):
    with pytest.raises(InvalidArgumentError, match="dtype_bytes"):
        estimate_inference_memory(*small_args(), 128, dtype_bytes)


@pytest.mark.parametrize("kwargs, match", [
    (dict(hidden_size=0), "hidden_size"),
    (dict(n_heads=3), "multiple"),
    (dict(n_kv_heads=3), "multiple of n_kv_heads"),
    (dict(vocab_size=-5), "vocab_size"),
])
def test_bad_shape_is_refused(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        ModelShape(**{**SMALL, **kwargs})


def test_bad_training_input_is_refused():
    with pytest.raises(InvalidArgumentError, match="optimizer_states"):
        estimate_training_memory(*small_args(), 64, 2, optimizer_states=-1)
    with pytest.raises(InvalidArgumentError, match="seq_len"):
        estimate_training_memory(*small_args(), 0, 2)
    with pytest.raises(InvalidArgumentError, match="seq_len"):
        estimate_kv_cache_memory(2, 2, 64, 0, 2)


def test_gradient_checkpointing_keeps_block_inputs_and_recomputes_one_block():
    from gpumem.estimate import ModelShape, training_trace
    from gpumem.estimate.workload import Category

    shape = ModelShape(512, 1376, 8, 3000, 8, 2)
    full = training_trace(shape, 2, batch_size=4, seq_len=256)
    ckpt = training_trace(shape, 2, batch_size=4, seq_len=256, gradient_checkpointing=True)
    assert ckpt.peak_nbytes < full.peak_nbytes
    t, h, q, kv, i = 1024, 512, 512, 128, 1376
    kept_per_block = t * (h * 4 + h * 2 + q * 2 + 2 * kv * 2 + 2 * q * 2 + 8 * 4 + h * 4 + h * 2 + 4 * i * 2 + h * 2)
    # the recomputed block's kept tensors (Note [Training activations]) are live at the peak
    assert ckpt.at_peak[Category.ACTIVATIONS] >= kept_per_block
    t = ckpt.trace
    assert t.n_allocs > full.trace.n_allocs  # the recompute allocates again
    with pytest.raises(InvalidArgumentError, match="gradient_checkpointing"):
        training_trace(shape, 2, seq_len=16, gradient_checkpointing="yes")


def test_8bit_optimizer_states_are_blockwise_bytes_and_small_tensors_stay_fp32():
    from gpumem.estimate.workload import OPTIM_8BIT_BLOCK, _optimizer_state_nbytes

    args = (1024, 2816, 2, 32000, 16, 4, 128, 2)
    full = estimate_training_memory(*args, batch_size=1)
    small = estimate_training_memory(*args, batch_size=1, optimizer_8bit=True)
    assert small.optimizer_bytes < full.optimizer_bytes
    assert _optimizer_state_nbytes(4096 * 4096, 2 * 4096 * 4096, True) == 4096 * 4096 + 4096 * 4096 // OPTIM_8BIT_BLOCK * 4
    assert _optimizer_state_nbytes(1024, 2048, True) == 4096  # a norm: fp32 state
    with pytest.raises(InvalidArgumentError, match="optimizer_8bit"):
        estimate_training_memory(*args, optimizer_8bit=1)


def test_training_flags_need_training(capsys):
    from gpumem.cli import main

    for flag in ("--gradient-checkpointing", "--optimizer-8bit"):
        assert main(["estimate", "--hidden-size", "256", "--intermediate-size", "688", "--layers", "2",
                     "--vocab-size", "1000", "--heads", "4", "--prompt-len", "16", flag]) == 2
        assert "is for --training" in capsys.readouterr().err
    assert main(["estimate", "--hidden-size", "256", "--intermediate-size", "688", "--layers", "2",
                 "--vocab-size", "1000", "--heads", "4", "--prompt-len", "16", "--training", "--optimizer-8bit",
                 "--gradient-checkpointing", "--json"]) == 0
    (row,) = __import__("json").loads(capsys.readouterr().out)
    assert row["optimizer_8bit"] and row["gradient_checkpointing"]


def test_lora_trains_only_the_adapters_and_qlora_freezes_a_quantized_base():
    from gpumem.estimate.formats import WEIGHT_FORMATS
    from gpumem.estimate.workload import LoraConfig, weights_nbytes
    from gpumem.estimate import ModelShape

    args = (1024, 2816, 2, 32000, 16, 4, 256, 2)
    shape = ModelShape(*args[:6])
    full = estimate_training_memory(*args, batch_size=2)
    lora = LoraConfig(8, ("q_proj", "v_proj"))
    lo = estimate_training_memory(*args, batch_size=2, lora=lora)
    adapters = 2 * (8 * 1024 * 4 + 1024 * 8 * 4) + 2 * (8 * 1024 * 4 + 256 * 8 * 4)  # 2 layers: q and v, A and B
    assert lo.optimizer_bytes == 2 * adapters  # two fp32 states per adapter parameter, none for the base
    assert lo.gradient_bytes <= adapters and lo.total_bytes < full.total_bytes
    q = estimate_training_memory(*args, batch_size=2,
                                 lora=LoraConfig(8, ("q_proj", "v_proj"), base_format=WEIGHT_FORMATS["int4"]))
    assert q.model_bytes < lo.model_bytes
    assert weights_nbytes(shape, 2, WEIGHT_FORMATS["int4"]) < weights_nbytes(shape, 2)
    for bad in (dict(rank=0), dict(rank=8, targets=("lm_head",)), dict(rank=8, targets=())):
        with pytest.raises(InvalidArgumentError):
            LoraConfig(**bad)


def test_lora_from_the_command_line(capsys):
    from gpumem.cli import main

    base = ["estimate", "--hidden-size", "256", "--intermediate-size", "688", "--layers", "2", "--vocab-size",
            "1000", "--heads", "4", "--prompt-len", "64", "--json"]
    assert main([*base, "--lora-rank", "8"]) == 2
    assert "is for --training" in capsys.readouterr().err
    assert main([*base, "--training", "--lora-rank", "8", "--weight-format", "int4", "--lora-targets",
                 "q_proj,v_proj"]) == 0
    (row,) = __import__("json").loads(capsys.readouterr().out)
    assert row["lora_rank"] == 8 and row["weight_format"] == "int4"
    assert main([*base, "--training", "--weight-format", "int4"]) == 2
    assert "--lora-rank" in capsys.readouterr().err
