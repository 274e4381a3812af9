"""Findings of the eighth adversarial review and the seventh new-user review on ``gpumem estimate`` and
``gpumem fit``: options that change memory are never dropped without a word, and a search answer at its upper
bound says so."""

import json

import pytest

from gpumem.cli import main
from gpumem.commands._model_args import params_text
from gpumem.errors import InvalidArgumentError
from gpumem.estimate import find_max_batch
from gpumem.estimate.shape import ModelShape, check_quantization_config, from_hf_config

CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
          "vocab_size": 1000, "num_attention_heads": 4, "num_key_value_heads": 4, "torch_dtype": "bfloat16"}
SHAPE = ["--hidden-size", "256", "--intermediate-size", "688", "--layers", "2", "--vocab-size", "1000",
         "--heads", "4"]


def _config(tmp_path, **extra):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, **extra}))
    return str(path)


@pytest.mark.parametrize("command", ["estimate", "fit"])
@pytest.mark.parametrize("option", [["--kv-heads", "1"], ["--head-dim", "256"], ["--tie-word-embeddings"]])
def test_shape_options_beside_hf_config_are_refused(tmp_path, capsys, command, option):
    # they change the KV cache, the projections and the output matrix: they were dropped without a word,
    # the config's figures printed as if the option had been read
    extra = ["--prompt-len", "64", "--no-reserved"] if command == "estimate" else ["--max", "2"]
    assert main([command, "--hf-config", _config(tmp_path), *option, *extra]) == 2
    err = capsys.readouterr().err
    assert "not both" in err and option[0] in err


@pytest.mark.parametrize("command", ["estimate", "fit"])
@pytest.mark.parametrize("qcfg,field,flag", [
    ({"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_has_fp16_weight": True},
     "llm_int8_has_fp16_weight", ["--weight-format", "int8"]),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]},
     "modules_to_not_convert", ["--weight-format", "int4"]),
    ({"quant_method": "awq", "bits": 4, "modules_to_not_convert": ["o_proj"]}, "modules_to_not_convert",
     ["--weight-bits", "4.5"]),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_skip_modules": ["q_proj"]},
     "llm_int8_skip_modules", ["--weight-bits", "8"]),
    ("int4", "must be a JSON object", ["--weight-format", "int4"]),
])
def test_a_given_weight_format_keeps_the_16_bit_refusals(tmp_path, capsys, command, qcfg, field, flag):
    # the given format stands for the one quant_method names, not for modules kept in 16 bits or 16-bit
    # copies beside the quantized weights: those were refused without the flag and accepted with it
    path = _config(tmp_path, quantization_config=qcfg)
    extra = ["--prompt-len", "64", "--no-reserved"] if command == "estimate" else ["--max", "2"]
    for given in ([], flag):
        assert main([command, "--hf-config", path, *given, *extra]) == 2
        assert field in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError, match=field):
        from_hf_config(path, read_quantization_config=False)


def test_check_quantization_config_passes_what_the_format_replaces():
    check_quantization_config({})
    check_quantization_config({"quantization_config": None})
    check_quantization_config({"quantization_config": {"quant_method": "gptq", "bits": 4,
                                                       "modules_to_not_convert": ["lm_head"]}})
    with pytest.raises(InvalidArgumentError, match="llm_int8_has_fp16_weight"):
        check_quantization_config({"quantization_config": {"llm_int8_has_fp16_weight": True}})


def test_fit_refuses_a_dtype_list(capsys):
    # fit searched the first dtype and dropped the others
    assert main(["fit", *SHAPE, "--dtype", "bf16,fp32", "--max", "2"]) == 2
    assert "one dtype per run" in capsys.readouterr().err
    assert main(["fit", *SHAPE, "--dtype", "fp32", "--max", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "fp32"


@pytest.mark.parametrize("command", ["estimate", "fit"])
def test_training_refuses_new_tokens(capsys, command):
    # a training step generates nothing: --new-tokens was ignored (the same answer with and without it)
    extra = ["--prompt-len", "64", "--no-reserved"] if command == "estimate" else ["--prompt-len", "64", "--max", "2"]
    assert main([command, *SHAPE, "--training", "--new-tokens", "500", *extra]) == 2
    assert "--new-tokens 500 is for generate()" in capsys.readouterr().err
    assert main([command, *SHAPE, "--training", *extra]) == 0
    capsys.readouterr()
    assert main([command, *SHAPE, "--new-tokens", "4", *extra]) == 0  # without --training: read
    capsys.readouterr()


def test_estimate_default_new_tokens_unchanged(capsys):
    assert main(["estimate", *SHAPE, "--prompt-len", "64", "--no-reserved", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["new_tokens"] == 16


TINY = ModelShape(256, 688, 2, 1000, 4, 4)


def test_fit_answer_at_max_is_a_lower_bound():
    r = find_max_batch(TINY, 2, device="sim:gtx-1050-2gb", prompt_len=16, new_tokens=2, max_value=8)
    assert r.simulated == 8 and r.max_value == 8 and r.at_max
    assert "at least 8" in r.at_max_note() and "raise --max" in r.at_max_note()
    assert r.as_dict()["at_max"] is True
    # below the bound: a real answer, no note
    r = find_max_batch(TINY, 2, device="sim:gtx-1050-2gb", prompt_len=16, new_tokens=2, max_value=1 << 20)
    assert 8 < r.simulated < (1 << 20) and not r.at_max and r.at_max_note() == ""


def test_fit_seq_len_at_a_window_is_not_at_max():
    # the window bounds the search for real: that answer is the largest, and ``bound`` says why
    shape = ModelShape(256, 688, 2, 1000, 4, 4, sliding_window=32)
    r = find_max_batch(shape, 2, device="sim:gtx-1050-2gb", search="seq_len", new_tokens=2, max_value=4096)
    assert r.simulated == 30 and r.bound and not r.at_max


def test_fit_cli_says_at_least(capsys):
    # the second example of `gpumem fit --help` answered --max's default on a device with room for more
    assert main(["fit", *SHAPE, "--search", "seq_len", "--batch-size", "2", "--new-tokens", "4", "--max", "64"]) == 0
    out = capsys.readouterr().out
    assert ">= 64" in out and "at least 64" in out and "raise --max" in out
    assert main(["fit", *SHAPE, "--search", "seq_len", "--batch-size", "2", "--new-tokens", "4", "--max", "64",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["at_max"] is True and doc["max_value"] == 64 and any("at least 64" in w for w in doc["warnings"])


def test_params_text_fits_small_models():
    assert params_text(6_738_415_616) == "6.74B"
    assert params_text(2_094_336) == "2.09M"
    assert params_text(950) == "950"


# -- gpumem fit takes LoRA as gpumem estimate does (new-user review F4) ----------------------------------
def test_fit_lora_answer_is_the_largest_batch_whose_replay_fits():
    from gpumem.estimate.fit import estimate_peak_reserved
    from gpumem.estimate.formats import weight_format
    from gpumem.estimate.workload import LoraConfig, training_trace, weights_nbytes

    lora = LoraConfig(8, base_format=weight_format("int4"))
    r = find_max_batch(TINY, 2, device="sim:gtx-1050-2gb", prompt_len=256, training=True, lora=lora, max_value=4096)
    assert 1 <= r.simulated < 4096 and r.lora_rank == 8
    assert r.weights_bytes == weights_nbytes(TINY, 2, lora.base_format)  # the frozen base, in int4
    for batch, fits in ((r.simulated, True), (r.simulated + 1, False)):
        w = training_trace(TINY, 2, batch_size=batch, seq_len=256, lora=lora)
        assert estimate_peak_reserved(w, ["pytorch"], device="sim:gtx-1050-2gb", limit=r.limit_bytes)[0].fits is fits
    full = find_max_batch(TINY, 2, device="sim:gtx-1050-2gb", prompt_len=256, training=True, max_value=4096)
    assert full.lora_rank is None and full.simulated != r.simulated  # the adapters' workload, not full training's


def test_fit_lora_cli(capsys):
    argv = ["fit", *SHAPE, "--device", "sim:gtx-1050-2gb", "--training", "--prompt-len", "64", "--max", "4"]
    assert main([*argv, "--lora-rank", "8", "--lora-targets", "q_proj,v_proj", "--weight-format", "int8",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["lora_rank"] == 8 and doc["weight_format"] == "int8" and doc["training"] is True
    assert main([*argv, "--lora-rank", "8"]) == 0
    assert "LoRA (rank 8) training steps" in capsys.readouterr().out


@pytest.mark.parametrize("extra,match", [
    (["--lora-rank", "8"], "--lora-rank is for --training"),
    (["--training", "--lora-targets", "q_proj"], "--lora-targets needs --lora-rank"),
    (["--training", "--weight-format", "int4"], "only with --lora-rank"),
    (["--training", "--lora-rank", "8", "--lora-targets", "nope"], "LoRA targets must be among"),
    (["--training", "--lora-rank", "8", "--weight-format", "i2s"], "not modelled"),
])
def test_fit_lora_refusals(capsys, extra, match):
    assert main(["fit", *SHAPE, "--device", "sim:gtx-1050-2gb", "--prompt-len", "64", "--max", "2", *extra]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1


def test_find_max_batch_lora_argument_checks():
    from gpumem.estimate.workload import LoraConfig

    with pytest.raises(InvalidArgumentError, match="LoraConfig"):
        find_max_batch(TINY, 2, training=True, lora=8)
    with pytest.raises(InvalidArgumentError, match="for training=True"):
        find_max_batch(TINY, 2, lora=LoraConfig(8))
