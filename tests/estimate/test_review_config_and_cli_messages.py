"""Review findings on config refusals and the estimate/fit command-line messages: a refusal says what the
field is (no "read as 16-bit weights" tail for soft-capping or MLP biases), an unsupported model_type is named
first, a quantized mixture-of-experts is refused with the real reason, ``hidden_act: null`` no longer hides
``hidden_activation``, the outer model_type of a text_config is checked, a nested text_config is refused, a bad
max_position_embeddings is named, the command line names its options (--batch-size, --heads, --head-dim), and
the context warning is shown once."""

from __future__ import annotations

import json

import pytest

from gpumem.cli import main
from gpumem.errors import InvalidArgumentError
from gpumem.estimate import from_hf_config

LLAMA = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 4096, "model_type": "llama",
         "torch_dtype": "bfloat16"}
SHAPE = ["--hidden-size", "256", "--intermediate-size", "688", "--layers", "2", "--vocab-size", "1000",
         "--heads", "4"]
TAIL = "it would be read as plain 16-bit dense weights"


def _write(tmp_path, cfg, name="config.json"):
    path = tmp_path / name
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(path)


def _estimate_err(argv, capsys):
    assert main(["estimate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err  # one line, no traceback
    return captured.err


# finding 1: the message says what the field is, the 16-bit tail only for a weight-format field

@pytest.mark.parametrize("extra, named", [
    ({"attn_logit_softcapping": 50.0},
     "attn_logit_softcapping (50.0) means attention logit soft-capping (eager attention, full score matrices)"),
    ({"mlp_bias": True}, "mlp_bias (True) means MLP biases"),
    ({"is_encoder_decoder": True}, "is_encoder_decoder (True) means an encoder besides the decoder"),
    ({"cross_attention_layers": [3, 8]}, "cross_attention_layers ([3, 8]) means cross-attention layers"),
])
def test_a_field_not_modelled_is_named_without_the_weights_tail(tmp_path, capsys, extra, named):
    err = _estimate_err(["--hf-config", _write(tmp_path, {**LLAMA, **extra}), "--prompt-len", "8",
                         "--no-reserved"], capsys)
    assert f"{named}, which this estimate does not model" in err
    assert "16-bit" not in err


def test_a_weight_format_field_keeps_the_weights_tail():
    with pytest.raises(InvalidArgumentError, match=f"quantization .*does not model: {TAIL}"):
        from_hf_config({**LLAMA, "quantization": {"quant_method": "foo"}})


def test_an_unsupported_model_type_is_named_before_its_fields(tmp_path, capsys):
    gemma2 = {**LLAMA, "model_type": "gemma2", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
              "hidden_activation": "gelu_pytorch_tanh"}
    err = _estimate_err(["--hf-config", _write(tmp_path, gemma2), "--prompt-len", "8", "--no-reserved"], capsys)
    assert "model_type 'gemma2' is not one this estimate models" in err
    assert "attn_logit_softcapping" not in err


# finding 2: a quantized mixture-of-experts is refused at once with the real reason

MIXTRAL_GPTQ = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
                "quantization_config": {"quant_method": "gptq", "bits": 4}}


@pytest.mark.parametrize("extra", [[], ["--weight-format", "int4"], ["--weight-bits", "4"]])
def test_a_quantized_moe_config_is_refused_for_its_experts(tmp_path, capsys, extra):
    err = _estimate_err(["--hf-config", _write(tmp_path, MIXTRAL_GPTQ), "--prompt-len", "8", "--no-reserved",
                         *extra], capsys)
    assert "quantized experts of a mixture-of-experts model are not modelled" in err
    assert "give --weight-format" not in err


def test_a_quantized_moe_config_is_refused_by_the_library_too():
    for read in (True, False):
        with pytest.raises(InvalidArgumentError, match="quant_method 'gptq'.*quantized experts"):
            from_hf_config(MIXTRAL_GPTQ, read_quantization_config=read)


# finding 3: hidden_act null does not hide hidden_activation

@pytest.mark.parametrize("acts, key", [
    ({"hidden_act": None, "hidden_activation": "gelu_pytorch_tanh"}, "hidden_activation 'gelu_pytorch_tanh'"),
    ({"hidden_act": "silu", "hidden_activation": "gelu_pytorch_tanh"}, "hidden_activation 'gelu_pytorch_tanh'"),
    ({"hidden_activation": None, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_each_activation_key_given_is_checked(acts, key):
    with pytest.raises(InvalidArgumentError, match=f"{key} is not modelled"):
        from_hf_config({**LLAMA, **acts})


def test_both_activation_keys_null_or_absent_read_as_before():
    base = from_hf_config(LLAMA)
    assert from_hf_config({**LLAMA, "hidden_act": None, "hidden_activation": None}) == base
    assert from_hf_config({**LLAMA, "hidden_act": "silu", "hidden_activation": None}) == base


# finding 4: the outer model_type of a text_config is checked (and taken by a text_config without one)

def test_the_outer_model_type_of_a_text_config_is_checked(tmp_path, capsys):
    inner = {k: v for k, v in LLAMA.items() if k != "model_type"}
    with pytest.raises(InvalidArgumentError, match="model_type 'gemma3' is not one this estimate models"):
        from_hf_config({"model_type": "gemma3", "text_config": inner})
    err = _estimate_err(["--hf-config", _write(tmp_path, {"model_type": "gemma3", "text_config": inner}),
                         "--prompt-len", "8", "--no-reserved"], capsys)
    assert "model_type 'gemma3'" in err


def test_a_text_config_without_model_type_takes_the_outer_one():
    inner = {k: v for k, v in LLAMA.items() if k != "model_type"}
    shape, _ = from_hf_config({"model_type": "qwen2", "text_config": inner})
    assert shape.attention_bias  # read as qwen2 (its q/k/v biases), not as a Llama
    assert from_hf_config({"model_type": "llama", "text_config": inner}) == from_hf_config(LLAMA)


# finding 5: a text_config inside a text_config is refused

def test_a_nested_text_config_is_refused(tmp_path, capsys):
    cfg = {"model_type": "llama", "text_config": {**LLAMA, "text_config": {**LLAMA, "num_hidden_layers": 80}}}
    with pytest.raises(InvalidArgumentError, match="text_config holds a text_config of its own"):
        from_hf_config(cfg)
    err = _estimate_err(["--hf-config", _write(tmp_path, cfg), "--prompt-len", "8", "--no-reserved"], capsys)
    assert "text_config holds a text_config of its own" in err


# finding 6: a max_position_embeddings not understood is named with its value

@pytest.mark.parametrize("text, shown", [
    ('-1', "-1"), ('"4096"', "'4096'"), ('true', "True"), ('1e400', "inf"), ('4096.0', "4096.0"), ('0', "0"),
])
@pytest.mark.parametrize("extra", [[], ["--prompt-len", "8"]])
def test_a_bad_max_position_embeddings_is_named(tmp_path, capsys, text, shown, extra):
    raw = json.dumps({**LLAMA, "max_position_embeddings": "X"}).replace('"X"', text)
    err = _estimate_err(["--hf-config", _write(tmp_path, raw), "--no-reserved", *extra], capsys)
    assert f"max_position_embeddings must be a positive JSON integer (the model's context), got {shown}" in err
    assert "give --prompt-len" not in err


def test_a_null_max_position_embeddings_is_absent(tmp_path, capsys):
    path = _write(tmp_path, {**LLAMA, "max_position_embeddings": None})
    assert "give --prompt-len or --max-seq-len" in _estimate_err(["--hf-config", path, "--no-reserved"], capsys)
    assert main(["estimate", "--hf-config", path, "--prompt-len", "8", "--no-reserved", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["context_len"] is None


# finding 7: the command line names its options, not the library's parameters

@pytest.mark.parametrize("value", ["0", "-2"])
def test_estimate_batch_size_is_refused_by_its_option(tmp_path, capsys, value):
    err = _estimate_err(["--hf-config", _write(tmp_path, LLAMA), "--batch-size", value, "--prompt-len", "8",
                         "--no-reserved"], capsys)
    assert f"--batch-size must be a whole number >= 1, got {value}" in err
    assert "batch_size" not in err


@pytest.mark.parametrize("argv, expected", [
    (["--hidden-size", "4096", "--heads", "30"], "--hidden-size 4096 is not a multiple of --heads 30; give --head-dim"),
    (["--kv-heads", "3"], "--heads 4 is not a multiple of --kv-heads 3"),
    (["--head-dim", "99999999"], "--head-dim 99999999 exceeds the sanity cap"),
])
def test_estimate_shape_options_are_named(capsys, argv, expected):
    shape = list(SHAPE)
    for flag, value in zip(argv[::2], argv[1::2]):
        if flag in shape:
            shape[shape.index(flag) + 1] = value
        else:
            shape += [flag, value]
    err = _estimate_err([*shape, "--prompt-len", "8", "--no-reserved"], capsys)
    assert expected in err
    assert not any(name in err for name in ("n_heads", "hidden_size", "head_dim", "n_kv_heads"))


def test_the_python_api_keeps_its_parameter_names():
    from gpumem.estimate import ModelShape

    with pytest.raises(InvalidArgumentError, match="hidden_size 4096 is not a multiple of n_heads 30; give head_dim"):
        ModelShape(4096, 688, 2, 1000, 30, 30)


@pytest.mark.parametrize("argv, expected", [
    (["--search", "seq_len", "--batch-size", "0"], "--batch-size must be a whole number >= 1, got 0"),
    (["--prompt-len", "0"], "--prompt-len must be a whole number >= 1, got 0"),
])
def test_fit_names_batch_size_and_prompt_len_options(capsys, argv, expected):
    assert main(["fit", *SHAPE, "--device", "sim:gtx-1050-2gb", "--max", "4", *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err and "batch_size" not in err and "prompt_len" not in err


def test_estimate_sequence_caps_are_named_by_option(capsys):
    err = _estimate_err([*SHAPE, "--prompt-len", "16777210", "--no-reserved"], capsys)
    assert "(--prompt-len 16777210 + --new-tokens 16) exceeds the sanity cap" in err
    assert "max_seq_len" not in err


# finding 8: the context warning is shown once

@pytest.mark.parametrize("command, argv", [
    ("fit", ["--prompt-len", "8000", "--device", "sim:gtx-1050-2gb", "--max", "2"]),
    ("estimate", ["--prompt-len", "8000", "--no-reserved"]),
])
def test_the_context_warning_is_shown_once(tmp_path, capsys, caplog, command, argv):
    caplog.clear()
    assert main([command, "--hf-config", _write(tmp_path, LLAMA), *argv]) == 0
    out, err = capsys.readouterr()
    text = "8016 tokens exceed the model's context of 4096"
    assert out.count(text) == 1 and f"warning: {text}" in out
    assert text not in err
    assert not any(text in r.getMessage() for r in caplog.records)


BITNET = {**LLAMA, "model_type": "bitnet", "hidden_act": "relu2",
          "quantization_config": {"quant_method": "bitnet", "linear_class": "bitlinear", "quantization_mode": "offline"}}


def test_a_bitnet_text_config_wrapper_reads_as_the_bitnet_inside() -> None:
    """Second attacker review: the outer config, checked with its model_type, has no activation of its own, and
    was refused as 'a bitnet config with hidden_act None' (mixtral and qwen2_moe wrappers read)."""
    inner = {k: v for k, v in BITNET.items() if k != "model_type"}
    wrapped = from_hf_config({"model_type": "bitnet", "text_config": inner})
    assert wrapped == from_hf_config(BITNET)
    with pytest.raises(InvalidArgumentError, match="hidden_act 'silu'"):   # the inner one is still checked
        from_hf_config({"model_type": "bitnet", "text_config": {**inner, "hidden_act": "silu"}})


def test_a_vision_tower_is_named_before_the_wrappers_model_type() -> None:
    """A llava config (a Llama text_config beside a vision tower) keeps the refusal that says how to estimate
    the language model alone, not 'model_type llava is not one this estimate models'."""
    cfg = {"model_type": "llava", "vision_config": {"model_type": "clip_vision_model"}, "text_config": LLAMA}
    with pytest.raises(InvalidArgumentError, match="vision_config means a vision tower.*text_config as a file of its own"):
        from_hf_config(cfg)
    assert from_hf_config(LLAMA)   # which, given alone, reads
