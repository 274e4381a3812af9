"""Issue 22 point 1: a config.json field that changes memory and is not modelled stops the estimate with an
error naming it (before: a Mixtral config was read as a dense 7.24B model, a BitNet one as bf16)."""

import json
from pathlib import Path

import pytest

from gpumem.cli import main
from gpumem.errors import InvalidArgumentError
from gpumem.estimate import from_hf_config

CONFIGS = Path(__file__).parent / "configs"


@pytest.mark.parametrize("name,match", [
    ("mixtral-8x7b.json", r"mixture-of-experts model \(num_local_experts=8, num_experts_per_tok=2\)"),
    ("qwen2-moe-a2.7b.json", r"mixture-of-experts model \(num_experts=60, num_experts_per_tok=4"),
    ("bitnet-b1.58-2b.json", r"model_type 'bitnet' is not one this estimate models"),
    ("mistral-7b-v0.1.json", r"sliding-window attention \(sliding_window=4096\) is not modelled"),
])
def test_unmodelled_configs_are_refused_naming_the_field(name, match, capsys):
    with pytest.raises(InvalidArgumentError, match=match):
        from_hf_config(CONFIGS / name)
    assert main(["estimate", "--hf-config", str(CONFIGS / name), "--prompt-len", "128", "--no-reserved"]) == 2
    assert name in capsys.readouterr().err


@pytest.mark.parametrize("extra,match", [
    ({"model_type": "gemma2"}, "model_type 'gemma2'"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
    ({"mlp_bias": True}, "MLP biases"),
    ({"kv_lora_rank": 512}, "latent attention"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"sliding_window": 4096, "use_sliding_window": True}, "sliding-window"),
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
