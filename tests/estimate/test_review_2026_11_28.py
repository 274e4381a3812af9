"""What the attacker's review of 2026-11-28 found in the estimate, each with its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpumem.errors import InvalidArgumentError
from gpumem.estimate import ModelShape, from_hf_config
from gpumem.estimate.workload import LoraConfig

CONFIGS = Path(__file__).parent / "configs"


def test_a_lora_rank_past_the_cap_is_refused():
    with pytest.raises(InvalidArgumentError, match="lora rank must be at most"):
        LoraConfig(10**17)
    assert LoraConfig(2**20).rank == 2**20


def test_a_tensor_past_2_62_bytes_is_a_clear_error(capsys):
    from gpumem.cli import main

    rc = main(["estimate", "--hidden-size", "1048576", "--intermediate-size", "1048576", "--layers", "1",
               "--vocab-size", "16777216", "--heads", "16", "--batch-size", "1048576", "--prompt-len", "16777000",
               "--new-tokens", "1", "--no-reserved"])
    assert rc == 2
    assert "too large to estimate" in capsys.readouterr().err


def _qwen(tmp_path: Path, name: str, **changes) -> ModelShape:
    cfg = json.loads((CONFIGS / name).read_text())
    cfg.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return from_hf_config(path)[0]


def test_qwen2_windows_the_layers_from_max_window_layers_on(tmp_path):
    # transformers: layer i of Qwen2 is windowed when use_sliding_window and i >= max_window_layers (28 layers)
    assert _qwen(tmp_path, "qwen2-7b.json", use_sliding_window=True, sliding_window=1024,
                 max_window_layers=0).sliding_window == 1024
    assert _qwen(tmp_path, "qwen2-7b.json", use_sliding_window=True, sliding_window=1024,
                 max_window_layers=28).sliding_window == 0
    with pytest.raises(InvalidArgumentError, match="24 of 28 layers attend within a window"):
        _qwen(tmp_path, "qwen2-7b.json", use_sliding_window=True, sliding_window=1024, max_window_layers=4)
    with pytest.raises(InvalidArgumentError, match="needs max_window_layers"):
        _qwen(tmp_path, "qwen2-7b.json", use_sliding_window=True, sliding_window=1024, max_window_layers=None)


def test_qwen2_moe_windows_every_other_layer_below_max_window_layers(tmp_path):
    assert _qwen(tmp_path, "qwen2-moe-a2.7b.json", use_sliding_window=True, sliding_window=1024,
                 max_window_layers=0).sliding_window == 0
    with pytest.raises(InvalidArgumentError, match="12 of 24 layers"):
        _qwen(tmp_path, "qwen2-moe-a2.7b.json", use_sliding_window=True, sliding_window=1024, max_window_layers=24)


@pytest.mark.parametrize("flag", [0, 1, "false", None])
def test_use_sliding_window_must_be_a_bool(tmp_path, flag):
    with pytest.raises(InvalidArgumentError, match="use_sliding_window must be JSON true or false"):
        _qwen(tmp_path, "qwen2-7b.json", use_sliding_window=flag)


@pytest.mark.parametrize("fmt", ["i2s", "tl1", "tl2"])
def test_qlora_on_a_ternary_base_is_refused(fmt, capsys):
    """A new user's review: --training --lora-rank 16 --weight-format i2s said its dequantization workspace
    was in OVERHEAD, but the training peak did not hold it."""
    from gpumem.cli import main

    rc = main(["estimate", "--hf-config", str(CONFIGS / "mistral-7b-v0.1.json"), "--training", "--lora-rank", "16",
               "--weight-format", fmt, "--prompt-len", "64", "--no-reserved"])
    assert rc == 2
    assert "is not modelled" in capsys.readouterr().err


def test_fit_by_prompt_length_reports_the_answer_as_prompt_len(capsys):
    """A new user's review: `gpumem fit --search seq_len --json` gave prompt_len 512 (the unused default)."""
    from gpumem.cli import main

    rc = main(["fit", "--hidden-size", "512", "--intermediate-size", "1376", "--layers", "4", "--vocab-size", "8000",
               "--heads", "8", "--search", "seq_len", "--batch-size", "8", "--new-tokens", "2",
               "--device", "sim:gtx-1050-2gb", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["simulated"] > 0
    assert out["prompt_len"] == out["simulated"]


def test_fit_training_header_says_the_length_once(capsys) -> None:
    """New-user finding (second review of 2026-11-28): 'training steps of 2048 tokens, prompt 2048'."""
    from gpumem.cli import main

    argv = ["fit", "--hidden-size", "512", "--intermediate-size", "1376", "--layers", "2", "--vocab-size", "8000",
            "--heads", "8", "--kv-heads", "8", "--training", "--prompt-len", "256", "--device", "sim:gtx-1050-2gb",
            "--max", "8"]
    assert main(argv) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "training steps of 256 tokens;" in head and "prompt 256" not in head
