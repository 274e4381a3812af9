"""Issue 22 point 1: a config.json field that changes memory and is not modelled stops the estimate with an
error naming it (before: a Mixtral config was read as a dense 7.24B model, a BitNet one as bf16)."""

import json
from pathlib import Path

import pytest

from gpumem.cli import main
from gpumem.errors import InvalidArgumentError
from gpumem.estimate import from_hf_config

CONFIGS = Path(__file__).parent / "configs"


@pytest.mark.parametrize("extra,match", [
    ({"model_type": "gemma2"}, "model_type 'gemma2'"),
    ({"model_type": "gemma"}, "model_type 'gemma'"),
    ({"model_type": "phi3"}, "model_type 'phi3'"),
    ({"model_type": "phi"}, "model_type 'phi'"),
    ({"n_routed_experts": 64, "num_experts_per_tok": 6}, r"mixture-of-experts model \(n_routed_experts=64, "
                                                          r"num_experts_per_tok=6\)"),
    ({"model_type": "qwen3_moe", "num_experts": 128}, "mixture-of-experts model"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
    ({"mlp_bias": True}, "MLP biases"),
    ({"kv_lora_rank": 512}, "latent attention"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"sliding_window": "4096", "use_sliding_window": True}, "sliding_window must be"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "gptq"),
    ({"attention_bias": "yes"}, "attention_bias must be"),
])
def test_each_unmodelled_field_is_named(extra, match):
    base = json.loads((CONFIGS / "qwen2-7b.json").read_text())
    with pytest.raises(InvalidArgumentError, match=match):
        from_hf_config({**base, **extra})


def test_neutral_values_are_accepted():
    base = json.loads((CONFIGS / "qwen2-7b.json").read_text())
    for extra in ({"sliding_window": None}, {"quantization_config": None}, {"num_experts": 0},
                  {"use_sliding_window": False, "sliding_window": 4096}, {"mlp_bias": False},
                  {"layer_types": ["full_attention"] * 28}):
        from_hf_config({**base, **extra})


def test_qwen2_is_read_with_its_qkv_biases():
    shape, nbytes = from_hf_config(CONFIGS / "qwen2-7b.json")
    assert shape.attention_bias and nbytes == 2
    assert shape.n_params == 7_615_616_512  # Qwen2-7B's published count (the q/k/v biases included)


def test_qwen2_estimate_runs_from_the_config(capsys):
    assert main(["estimate", "--hf-config", str(CONFIGS / "qwen2-7b.json"), "--prompt-len", "512",
                 "--policy", "gpumem", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["n_params"] == 7_615_616_512 and row["fits"]


def test_a_sliding_window_holds_within_it_and_is_modelled_past_it(capsys):
    path = str(CONFIGS / "mistral-7b-v0.1.json")
    shape, _ = from_hf_config(path)
    assert shape.sliding_window == 4096
    # within the window a sliding-window attention is full attention: the same estimate as without one
    assert main(["estimate", "--hf-config", path, "--prompt-len", "2048", "--new-tokens", "16", "--no-reserved",
                 "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    base = json.loads((CONFIGS / "mistral-7b-v0.1.json").read_text())
    from gpumem.estimate import estimate_inference_memory
    e = estimate_inference_memory(4096, 14336, 32, 32000, 32, 8, 2064, 2, prompt_len=2048, new_tokens=16)
    assert row["peak_allocated_bytes"] == e.total_bytes and base["sliding_window"] == 4096
    # past it (Note [Sliding window] in gpumem.estimate.workload; before, refused): the decode steps' cache is
    # the window, so the estimate is no more than full attention's over the same tokens
    assert main(["estimate", "--hf-config", path, "--prompt-len", "4090", "--new-tokens", "16", "--no-reserved",
                 "--json"]) == 0
    (past,) = json.loads(capsys.readouterr().out)
    full = estimate_inference_memory(4096, 14336, 32, 32000, 32, 8, 4106, 2, prompt_len=4090, new_tokens=16)
    assert 0 < past["peak_allocated_bytes"] <= full.total_bytes + 64 * 2**20  # the masks, repeated keys/values
    assert main(["fit", "--hf-config", path, "--search", "seq_len", "--batch-size", "1", "--device",
                 "sim:a100-80gb", "--max", "100000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["simulated"] <= 4096 - 16
    assert from_hf_config({**base, "use_sliding_window": False})[0].sliding_window == 0


# -- mixture-of-experts configs are read (Note [Mixture of experts] in gpumem.estimate.workload) --------------

def test_mixtral_and_qwen2_moe_configs_count_every_expert(capsys):
    mixtral, _ = from_hf_config(CONFIGS / "mixtral-8x7b.json")
    assert (mixtral.n_experts, mixtral.experts_per_token, mixtral.expert_intermediate_size) == (8, 2, 14336)
    assert mixtral.n_params == 46_702_792_704  # Mixtral-8x7B's 46.7B (read as dense before: 7.24B)
    qwen, _ = from_hf_config(CONFIGS / "qwen2-moe-a2.7b.json")
    assert (qwen.n_experts, qwen.experts_per_token, qwen.expert_intermediate_size,
            qwen.shared_expert_intermediate_size, qwen.attention_bias) == (60, 4, 1408, 5632, True)
    assert round(qwen.n_params / 1e9, 2) == 14.32  # Qwen1.5-MoE-A2.7B: 14.3B in all
    assert main(["estimate", "--hf-config", str(CONFIGS / "mixtral-8x7b.json"), "--prompt-len", "128",
                 "--no-reserved", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["n_params"] == 46_702_792_704 and row["model_bytes"] >= 2 * 46_702_792_704


@pytest.mark.parametrize("extra,match", [
    ({"decoder_sparse_step": 2}, "dense MLP layers"),
    ({"mlp_only_layers": [0]}, "dense MLP layers"),
    ({"output_router_logits": True}, "output_router_logits"),
    ({"num_experts_per_tok": 61}, "exceeds n_experts"),
    ({"num_experts": 0}, "positive number of experts"),
    ({"moe_intermediate_size": "1408"}, "moe_intermediate_size must be a JSON integer"),
    ({"first_k_dense_replace": 1}, "mixture-of-experts model"),
])
def test_moe_fields_not_modelled_are_refused(extra, match):
    base = json.loads((CONFIGS / "qwen2-moe-a2.7b.json").read_text())
    with pytest.raises(InvalidArgumentError, match=match):
        from_hf_config({**base, **extra})


def test_moe_training_and_quantized_experts_are_refused(capsys):
    cfg = str(CONFIGS / "mixtral-8x7b.json")
    assert main(["estimate", "--hf-config", cfg, "--prompt-len", "128", "--training", "--no-reserved"]) == 2
    assert "training a mixture-of-experts model is not modelled" in capsys.readouterr().err
    assert main(["estimate", "--hf-config", cfg, "--prompt-len", "128", "--weight-format", "int4",
                 "--no-reserved"]) == 2
    assert "quantized experts" in capsys.readouterr().err


# -- BitNet's block (Note [BitNet block] in gpumem.estimate.workload) --------------------------------------------

def test_bitnet_config_is_read_with_its_sub_norms_relu2_and_ternary_weights(capsys):
    shape, _ = from_hf_config(CONFIGS / "bitnet-b1.58-2b.json")
    assert (shape.sub_norms, shape.activation, shape.tie_word_embeddings) == (True, "relu2", True)
    dense = from_hf_config({**json.loads((CONFIGS / "bitnet-b1.58-2b.json").read_text()), "model_type": "llama",
                            "hidden_act": "silu"})[0]
    assert shape.n_params - dense.n_params == 30 * (2560 + 6912)  # one attn_sub_norm and one ffn_sub_norm a block
    assert main(["estimate", "--hf-config", str(CONFIGS / "bitnet-b1.58-2b.json"), "--prompt-len", "128",
                 "--no-reserved", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["weight_format"] == "i2s" and row["dequant_workspace_bytes"] > 0
    assert row["model_bytes"] < 2 * shape.n_params / 2  # packed ternary projections: far below bf16


@pytest.mark.parametrize("extra,match", [({"hidden_act": "silu"}, "bitnet config with hidden_act"),
                                         ({"model_type": "gemma"}, "model_type 'gemma'")])
def test_bitnet_variants_not_modelled_are_refused(extra, match):
    base = json.loads((CONFIGS / "bitnet-b1.58-2b.json").read_text())
    with pytest.raises(InvalidArgumentError, match=match):
        from_hf_config({**base, **extra})


def test_bitnet_training_is_refused(capsys):
    cfg = {**json.loads((CONFIGS / "bitnet-b1.58-2b.json").read_text())}
    del cfg["quantization_config"]  # 16-bit weights: full training would be asked for
    from gpumem.estimate.workload import training_trace
    with pytest.raises(InvalidArgumentError, match="training a BitNet model"):
        training_trace(from_hf_config(cfg)[0], 2, seq_len=16)
