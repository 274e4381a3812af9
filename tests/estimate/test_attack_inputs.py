"""Hostile inputs to the estimate: special files, mistyped and deeply nested configs, absurd sizes, and
conflicting command-line options. Each must be a clear ``InvalidArgumentError`` (exit 2), fast."""

import json
import os
import threading

import pytest

from gpumem.cli import main
from gpumem.errors import InvalidArgumentError
from gpumem.estimate.formulas import (estimate_inference_memory, estimate_kv_cache_memory,
                                      estimate_training_memory)
from gpumem.estimate.shape import ModelShape, from_hf_config

SHAPE = ["--hidden-size", "512", "--intermediate-size", "1376", "--layers", "4", "--vocab-size", "8000",
         "--heads", "8"]
CONFIG = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 8, "vocab_size": 8000, "torch_dtype": "float16"}
DIMS = (512, 1376, 4, 8000, 8, 8)


def _in_thread(fn, timeout=10.0):
    """Run fn in a thread; fail (rather than hang the suite) when it does not return in time."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "did not return (blocked on the input?)"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# --- finding 5: FIFOs, devices, directories, huge files ---------------------------------------------------

@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_hf_config_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "f.json"
    os.mkfifo(fifo)
    with pytest.raises(InvalidArgumentError, match="not a regular file") as info:
        _in_thread(lambda: from_hf_config(fifo))
    assert "not a JSON file" not in str(info.value)
    assert _in_thread(lambda: main(["estimate", "--hf-config", str(fifo), "--max-seq-len", "64"])) == 2


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_hf_config_device_is_refused():
    with pytest.raises(InvalidArgumentError, match="not a regular file"):
        _in_thread(lambda: from_hf_config("/dev/zero"))
    assert _in_thread(lambda: main(["fit", "--hf-config", "/dev/zero"])) == 2


def test_hf_config_directory_is_refused(tmp_path):
    with pytest.raises(InvalidArgumentError):
        from_hf_config(tmp_path)
    assert main(["estimate", "--hf-config", str(tmp_path), "--max-seq-len", "64"]) == 2


def test_hf_config_over_the_size_cap_is_refused(tmp_path, monkeypatch):
    import gpumem.estimate.shape as shape_mod
    monkeypatch.setattr(shape_mod, "MAX_CONFIG_BYTES", 1024)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "pad": "x" * 2000}))
    with pytest.raises(InvalidArgumentError, match="limit"):
        from_hf_config(path)


# --- finding 6: types of config values ----------------------------------------------------------------------

def test_tie_word_embeddings_string_is_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match="tie_word_embeddings"):
        from_hf_config({**CONFIG, "tie_word_embeddings": "false"})
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "tie_word_embeddings": "false"}))
    assert main(["estimate", "--hf-config", str(path), "--max-seq-len", "64", "--no-reserved"]) == 2


def test_tie_word_embeddings_booleans_are_taken():
    tied, _ = from_hf_config({**CONFIG, "tie_word_embeddings": True})
    untied, _ = from_hf_config({**CONFIG, "tie_word_embeddings": False})
    assert untied.n_params - tied.n_params == 8000 * 512
    with pytest.raises(InvalidArgumentError):
        ModelShape(512, 1376, 4, 8000, 8, 8, 0, "false")


@pytest.mark.parametrize("key,value", [("hidden_size", "512"), ("hidden_size", 512.5), ("hidden_size", 512.0),
                                       ("num_hidden_layers", True), ("num_key_value_heads", "8"),
                                       ("head_dim", 64.0), ("vocab_size", [8000])])
def test_integer_keys_must_be_json_integers(key, value):
    with pytest.raises(InvalidArgumentError, match=key):
        from_hf_config({**CONFIG, key: value})


# --- finding 7: deep nesting ----------------------------------------------------------------------------------

def test_deeply_nested_config_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InvalidArgumentError, match="not a valid JSON config"):
        from_hf_config(path)
    assert main(["estimate", "--hf-config", str(path), "--max-seq-len", "64"]) == 2


# --- finding 10: sanity caps ----------------------------------------------------------------------------------

@pytest.mark.parametrize("index,name,value", [(0, "hidden_size", 2**20 + 8), (1, "intermediate_size", 2**20 + 1),
                                              (2, "n_layers", 10_001), (3, "vocab_size", 2**24 + 1)])
def test_shape_caps(index, name, value):
    dims = list(DIMS)
    dims[index] = value
    with pytest.raises(InvalidArgumentError, match=f"{name} {value} exceeds the sanity cap"):
        ModelShape(*dims)


def test_heads_cap():
    with pytest.raises(InvalidArgumentError, match="n_heads 32768 exceeds the sanity cap of 16384"):
        ModelShape(2**15, 1376, 4, 8000, 2**15, 1)


def test_workload_caps():
    with pytest.raises(InvalidArgumentError, match="batch_size .* exceeds the sanity cap of 1048576"):
        estimate_inference_memory(*DIMS, 64, 2, batch_size=10**11)
    with pytest.raises(InvalidArgumentError, match="max_seq_len .* exceeds the sanity cap"):
        estimate_inference_memory(*DIMS, 2**24 + 1, 2)
    with pytest.raises(InvalidArgumentError, match="seq_len .* exceeds the sanity cap"):
        estimate_training_memory(*DIMS, 2**24 + 1, 2)
    with pytest.raises(InvalidArgumentError, match="batch_size .* exceeds the sanity cap"):
        estimate_kv_cache_memory(4, 8, 64, 64, 2, batch_size=2**20 + 1)
    with pytest.raises(InvalidArgumentError, match="n_layers .* exceeds the sanity cap"):
        estimate_kv_cache_memory(10**6, 8, 64, 64, 2)


def test_cli_caps_exit_2_fast(capsys):
    argv = ["estimate", "--hidden-size", "512", "--intermediate-size", "1376", "--layers", "1000000",
            "--vocab-size", "8000", "--heads", "8", "--max-seq-len", "64"]
    assert _in_thread(lambda: main(argv), timeout=20) == 2
    assert "--layers 1000000 exceeds the sanity cap" in capsys.readouterr().err
    assert main(["estimate", *SHAPE, "--max-seq-len", "64", "--batch-size", str(10**11)]) == 2
    assert "--batch-size 100000000000 exceeds the sanity cap" in capsys.readouterr().err


# --- finding 11: command-line options -------------------------------------------------------------------------

def test_kv_heads_zero_is_an_error(capsys):
    assert main(["estimate", *SHAPE, "--kv-heads", "0", "--max-seq-len", "64", "--no-reserved"]) == 2
    assert "--kv-heads must be positive" in capsys.readouterr().err


def test_empty_policy_list_is_an_error(capsys):
    assert main(["estimate", *SHAPE, "--max-seq-len", "64", "--policy", ","]) == 2
    assert "--policy" in capsys.readouterr().err


def test_duplicate_dtype_is_an_error(capsys):
    assert main(["estimate", *SHAPE, "--max-seq-len", "64", "--dtype", "bf16,bf16", "--no-reserved"]) == 2
    assert "bf16 twice" in capsys.readouterr().err


def test_training_with_conflicting_lengths_is_an_error(capsys):
    assert main(["estimate", *SHAPE, "--training", "--max-seq-len", "64", "--prompt-len", "128",
                 "--no-reserved"]) == 2
    assert "--training takes one sequence length" in capsys.readouterr().err


def test_new_tokens_filling_max_seq_len(capsys):
    assert main(["estimate", *SHAPE, "--max-seq-len", "64", "--new-tokens", "100", "--no-reserved"]) == 2
    err = capsys.readouterr().err
    assert "--new-tokens 100 leaves no room for a prompt within --max-seq-len 64" in err
    assert "-36" not in err
    with pytest.raises(InvalidArgumentError, match="leaves no room for a prompt"):
        estimate_inference_memory(*DIMS, 64, 2, new_tokens=64)


_SMALL = ["--hidden-size", "64", "--intermediate-size", "128", "--layers", "2", "--vocab-size", "100",
          "--heads", "4", "--prompt-len", "8", "--no-reserved", "--json"]


@pytest.mark.parametrize("extra, expected", [(["--head-dim", "0"], "--head-dim must be positive"),
                                             (["--dtype", ""], "unknown dtype ''")])
def test_a_zero_head_dim_or_an_empty_dtype_is_refused_not_taken_for_the_default(capsys, extra, expected):
    """issue 20 review: `--head-dim 0` silently meant hidden/heads, `--dtype ''` silently the default dtype."""
    assert main(["estimate", *_SMALL, *extra]) == 2
    captured = capsys.readouterr()
    assert expected in captured.err and not captured.out


def test_a_config_head_dim_of_zero_is_refused():
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 100,
           "num_attention_heads": 4, "head_dim": 0}
    with pytest.raises(InvalidArgumentError, match="head_dim must be positive"):
        from_hf_config(cfg)


_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 100,
         "num_attention_heads": 4}


@pytest.mark.parametrize("cfg, expected", [
    ({"text_config": _TEXT, "vision_config": {"hidden_size": 1024, "num_hidden_layers": 24}}, "vision tower"),
    ({"text_config": _TEXT, "num_local_experts": 8}, "mixture-of-experts"),
    ({"text_config": _TEXT, "quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({**_TEXT, "is_encoder_decoder": True}, "an encoder"),
    ({**_TEXT, "encoder_layers": 12}, "an encoder"),
])
def test_fields_that_change_memory_are_refused_also_outside_text_config(cfg, expected):
    """issue 20 review: a multimodal config's vision tower, and every field outside its text_config (MoE
    keys, a GPTQ quantization_config), were silently dropped; an encoder was silently not counted."""
    with pytest.raises(InvalidArgumentError, match=expected):
        from_hf_config(cfg)
