"""``gpumem estimate`` and ``gpumem fit``."""

import json

import pytest

from gpumem.cli import main

SHAPE = ["--hidden-size", "512", "--intermediate-size", "1376", "--layers", "4", "--vocab-size", "8000",
         "--heads", "8"]
CONFIG = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 8, "vocab_size": 8000, "torch_dtype": "float16"}


def test_estimate_json_per_dtype(capsys):
    assert main(["estimate", *SHAPE, "--prompt-len", "128", "--new-tokens", "4", "--batch-size", "2",
                 "--dtype", "bf16,fp32", "--device", "sim:gtx-1050-2gb", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["dtype"] for r in rows] == ["bf16", "fp32"]
    for r in rows:
        for key in ("peak_allocated_bytes", "peak_reserved_bytes", "model_bytes", "kv_cache_bytes",
                    "activation_bytes"):
            assert isinstance(r[key], int) and r[key] > 0
        assert set(r["peak_reserved_by_policy"]) == {"pytorch", "expandable", "gpumem"}
        assert r["peak_reserved_bytes"] >= r["peak_allocated_bytes"] * 0.99
    assert rows[1]["model_bytes"] == 2 * rows[0]["model_bytes"]


def test_estimate_table_from_config_and_training(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert main(["estimate", "--hf-config", str(path), "--max-seq-len", "64", "--new-tokens", "8",
                 "--policy", "pytorch", "--device", "sim:gtx-1050-2gb"]) == 0
    out = capsys.readouterr().out
    assert "fp16" in out and "PEAK ALLOC" in out and "RES pytorch" in out
    assert main(["estimate", "--hf-config", str(path), "--training", "--prompt-len", "64", "--no-reserved",
                 "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["workload"] == "training" and row["gradient_bytes"] >= 0 and "peak_reserved_bytes" not in row


@pytest.mark.parametrize("argv, match", [
    (["estimate", "--prompt-len", "8"], "missing --hidden-size"),
    (["estimate", *SHAPE], "give --prompt-len or --max-seq-len"),
    (["estimate", *SHAPE, "--prompt-len", "8", "--dtype", "fp64"], "unknown dtype"),
    (["estimate", *SHAPE, "--prompt-len", "8", "--policy", "nope"], "unknown allocator policy"),
    (["estimate", *SHAPE, "--prompt-len", "0"], "prompt_len"),
    (["estimate", "--hf-config", "missing.json", "--prompt-len", "8"], "cannot read"),
    (["fit", *SHAPE, "--margin", "-1"], "margin"),
])
def test_bad_input_exits_2_with_one_line(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1


def test_fit_json(capsys):
    assert main(["fit", *SHAPE, "--device", "sim:gtx-1050-2gb", "--prompt-len", "256", "--new-tokens", "2",
                 "--max", "256", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert 1 <= r["simulated"] <= r["binary_search"] <= r["estimate"]
    assert r["policy"] == "pytorch" and r["margin"] == pytest.approx(0.02)
    assert main(["fit", *SHAPE, "--device", "sim:gtx-1050-2gb", "--prompt-len", "256", "--max", "64"]) == 0
    assert "largest batch" in capsys.readouterr().out
