"""Issue 22 point 3: weight formats (bits, packing, scales), the ternary formats' dequantization workspace,
and quantization_config read from configs."""

import json
from pathlib import Path

import pytest

from gpumem.cli import main
from gpumem.errors import InvalidArgumentError
from gpumem.estimate import ModelShape, estimate_inference_memory, from_hf_config, inference_trace
from gpumem.estimate.formats import WEIGHT_FORMATS, custom_bits, weight_format
from gpumem.estimate.formulas import dequant_workspace_nbytes
from gpumem.estimate.shape import config_weight_format
from gpumem.estimate.workload import loaded_weight_nbytes, param_nbytes, weights_nbytes
from gpumem.specs import open_device
from gpumem.workspace.sizing import size_workspace

CONFIGS = Path(__file__).parent / "configs"
SHAPE = ModelShape(1024, 2816, 4, 32000, 16, 4)


@pytest.mark.parametrize("name,expected", [
    ("int8", 4096 * 4096 + 4096 * 4),                       # a byte a weight, an fp32 scale a row
    ("int4", 4096 * 4096 // 2 + 4096 * (4096 // 128) * 2),  # half a byte, an fp16 scale per 128 inputs
    ("fp8", 4096 * 4096 + 4),                               # per-tensor fp32 scale
    ("i2s", 4096 * 4096 // 4 + 4),                          # 2 bits, one scale
    ("tl1", 4096 * 4096 // 4 + 4),
    ("tl2", 4096 * -(-4096 * 5 // 24) + 4),                 # 5 bits per 3 weights, rows padded to bytes
])
def test_format_nbytes(name, expected):
    assert WEIGHT_FORMATS[name].nbytes(4096, 4096) == expected
    assert weight_format(name.upper()) is WEIGHT_FORMATS[name]


def test_ternary_names_and_bad_formats():
    assert weight_format("I2_S") is WEIGHT_FORMATS["i2s"]
    for bad in ("int3", "", "nf4"):
        with pytest.raises(InvalidArgumentError, match="unknown weight format"):
            weight_format(bad)
    assert custom_bits(1.58).nbytes(100, 100) == -(-10000 * 158 // 800)
    for bad in (0.5, 33, float("nan"), True, "4"):
        with pytest.raises(InvalidArgumentError, match="weight bits"):
            custom_bits(bad)


def test_only_the_projections_take_the_format_and_the_peak_follows():
    bf16 = weights_nbytes(SHAPE, 2)
    int4 = weights_nbytes(SHAPE, 2, WEIGHT_FORMATS["int4"])
    proj = sum(n for name, n in SHAPE.param_shapes() if name.startswith("layers.") and name.endswith("proj"))
    assert bf16 - int4 == proj * 2 - sum(WEIGHT_FORMATS["int4"].nbytes(o, i) for o, i in
                                         [(1024, 1024), (256, 1024), (256, 1024), (1024, 1024), (2816, 1024),
                                          (2816, 1024), (1024, 2816)]) * 4
    e16 = estimate_inference_memory(1024, 2816, 4, 32000, 16, 4, 272, 2, prompt_len=256, new_tokens=16)
    e4 = estimate_inference_memory(1024, 2816, 4, 32000, 16, 4, 272, 2, prompt_len=256, new_tokens=16,
                                   weight_format=WEIGHT_FORMATS["int4"])
    rounded = sum(loaded_weight_nbytes(param_nbytes(SHAPE, 2, WEIGHT_FORMATS["int4"])))
    assert e4.model_bytes == rounded < e16.model_bytes
    assert e16.total_bytes - e4.total_bytes == e16.model_bytes - e4.model_bytes


def test_ternary_workspace_is_the_workspace_sizing_of_the_largest_projection():
    dev = open_device("sim:t4-16gb")
    try:
        ws = dequant_workspace_nbytes(SHAPE, WEIGHT_FORMATS["tl2"], dev)
        props, mem = dev.properties(), dev.mem_info()
        expected = max(size_workspace(a, b, "tl2", props, mem, device=dev.spec).workspace_bytes
                       for a, b in ((1024, 1024), (1024, 2816), (2816, 1024)))
        assert ws == expected > 0
        assert dequant_workspace_nbytes(SHAPE, WEIGHT_FORMATS["int4"], dev) == 0
    finally:
        dev.close()
    plain = inference_trace(SHAPE, 2, prompt_len=64, new_tokens=4, weight_format=WEIGHT_FORMATS["tl2"])
    held = inference_trace(SHAPE, 2, prompt_len=64, new_tokens=4, weight_format=WEIGHT_FORMATS["tl2"],
                           workspace_nbytes=ws)
    assert held.peak_nbytes - plain.peak_nbytes == -(-ws // 512) * 512


@pytest.mark.parametrize("qcfg,expected", [
    ({"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False}, "int8"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8"),
    ({"quant_method": "bitnet", "linear_class": "bitlinear", "quantization_mode": "offline"}, "i2s"),
])
def test_quantization_config_is_read(qcfg, expected):
    fmt = config_weight_format({"quantization_config": qcfg})
    assert (fmt.name if fmt else None) == expected


@pytest.mark.parametrize("qcfg,match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "NF4"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "zero points"),
    ({"quant_method": "awq", "bits": 4}, "zero points"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
    ({"quant_method": "hqq"}, "not a format"),
    ("int4", "JSON object"),
])
def test_unread_quantization_configs_are_refused(qcfg, match):
    base = json.loads((CONFIGS / "qwen2-7b.json").read_text())
    with pytest.raises(InvalidArgumentError, match=match):
        from_hf_config({**base, "quantization_config": qcfg})


def test_cli_weight_format_from_option_and_config(tmp_path, capsys):
    base = json.loads((CONFIGS / "qwen2-7b.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, "quantization_config": {"quant_method": "bitsandbytes",
                                                                 "load_in_8bit": True}}))
    assert main(["estimate", "--hf-config", str(path), "--prompt-len", "128", "--no-reserved", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["weight_format"] == "int8" and row["weight_bits"] == 8
    assert main(["estimate", "--hf-config", str(path), "--prompt-len", "128", "--no-reserved", "--json",
                 "--weight-format", "tl1", "--device", "sim:t4-16gb"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["weight_format"] == "tl1" and row["dequant_workspace_bytes"] > 0
    assert main(["estimate", "--hf-config", str(path), "--prompt-len", "128", "--no-reserved", "--json",
                 "--weight-bits", "1.58"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["weight_bits"] == 1.58 and "scales (if any) are not counted" in row["warnings"][-1]
    assert main(["estimate", "--hf-config", str(path), "--prompt-len", "128", "--weight-format", "int9"]) == 2
    assert "unknown weight format" in capsys.readouterr().err
    assert main(["estimate", "--hf-config", str(path), "--prompt-len", "128", "--training",
                 "--weight-format", "int4"]) == 2
    assert "modelled only with --lora-rank" in capsys.readouterr().err
    assert main(["fit", "--hf-config", str(path), "--device", "sim:t4-16gb", "--max", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weight_format"] == "int8" and out["weights_bytes"] < from_hf_config(path)[0].n_params * 2


@pytest.mark.parametrize("cmd", ["estimate", "fit"])
def test_training_a_ternary_base_is_refused_without_sending_the_user_to_lora(cmd, capsys):
    """New user 10: --training on a BitNet config (i2s) said "modelled only with --lora-rank (QLoRA)", and with
    --lora-rank "LoRA on a i2s base is not modelled": two refusals in a row. Now the first says it."""
    path = str(CONFIGS / "bitnet-b1.58-2b.json")
    assert main([cmd, "--hf-config", path, "--prompt-len", "128", "--training"]) == 2
    err = capsys.readouterr().err
    assert f"gpumem {cmd}: --training with i2s weights is not modelled: the ternary formats' kernels are for " \
           "inference (generate() only)" in err
    assert "--lora-rank" not in err
    assert main([cmd, "--hf-config", path, "--prompt-len", "128", "--training", "--lora-rank", "8"]) == 2
    assert "LoRA on a base in i2s is not modelled" in capsys.readouterr().err
