"""hil/probes/op_cost.py without a GPU: its argument checks, and the table of records (some failed)."""

from __future__ import annotations

import importlib.util

import pytest

from hil.probes import op_cost


def test_a_failed_configuration_is_one_line_in_the_table():
    records = [{"config": "default", "pairs_ns": 2000.0, "burst_ns": 2500.0, "decode_ms_per_token": 8.0,
                "decode_cpu_ms_per_token": 8.0, "num_device_calls": 44},
               {"config": "gpumem", "error": op_cost._last_line("Traceback (most recent call last):\n  File x\n"
                                                                "ModuleNotFoundError: No module named 'torch'\n")}]
    text = op_cost.table(records)
    rows = text.splitlines()
    assert len(rows) == 4
    assert rows[3] == "| gpumem | failed: ModuleNotFoundError: No module named 'torch' | | | | | | |"
    assert "| default | 2000 | 2500 |" in rows[2]


@pytest.mark.parametrize("argv, message", [
    (["--pairs", "0", "--out", "x"], "--pairs must be at least 1"),
    (["--configs", "nope", "--out", "x"], "--configs: unknown"),
    (["--configs", "default"], "--out is required"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        op_cost.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="PyTorch is installed here")
def test_without_pytorch_it_says_so_and_runs_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        op_cost.main(["--out", str(tmp_path / "oc")])
    assert exc.value.code == 2 and "needs PyTorch" in capsys.readouterr().err
    assert not (tmp_path / "oc").exists()
