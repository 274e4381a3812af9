"""benchmarks/sim_replay_speed.py: bad input refused with a message, and a short run beside HEAD gives the
same figures."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def speed():
    spec = importlib.util.spec_from_file_location("sim_replay_speed", REPO / "benchmarks" / "sim_replay_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rounds_below_one_are_refused(speed, capsys):
    with pytest.raises(SystemExit) as exc:
        speed.main(["--rounds", "0"])
    assert exc.value.code == 2 and "--rounds must be at least 1" in capsys.readouterr().err


def test_an_unknown_trace_is_named(speed):
    with pytest.raises(SystemExit, match="no trace named 'no_such_trace'"):
        speed.main(["--only", "no_such_trace"])


def test_an_unknown_revision_is_named(speed):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    with pytest.raises(SystemExit, match="git archive no-such-revision"):
        speed.main(["--base", "no-such-revision", "--only", "multistream_infer_h200", "--rounds", "1"])


def test_a_short_run_beside_head_prints_the_table_with_the_same_figures(speed, capsys, tmp_path):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    assert speed.main(["--base", "HEAD", "--only", "multistream_infer_h200", "--rounds", "1",
                       "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "| multistream_infer_h200 trace | 648 |" in out and "| NO |" not in out
    assert (tmp_path / "out.json").read_text().count('"same_figures": true') == 3
