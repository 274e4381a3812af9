"""``gpumem report`` and ``gpumem sweep`` read a trace's step marks as ``gpumem replay`` does, and leave them out
with ``--no-step-marks`` (the gpumem policy then replays a run without step plans)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpumem.cli import main as cli_main
from gpumem.errors import InvalidArgumentError
from gpumem.report import ReportOptions
from gpumem.report.sweep import SweepError, make_cases, run_sweep

ROOT = Path(__file__).resolve().parents[2]
# a small GAN whose snapshot carries 24 step marks: 6.62 % above peak live with them, 9.25 % without
SNAP = ROOT / "reports" / "hil" / "two-optimizers-h200-2026-12-01" / "check" / "gan_gen_first_train.default.snapshot.pickle.gz"
# without the marks no warm-up begins, so the steal before a warm-up holds (on by default since 2026-12-04: Note [The
# ordered steal before a warm-up]); 9.25 % before it
NO_MARKS = 0.0575


def test_sweep_reads_the_marks_and_leaves_them_out_when_told() -> None:
    rows = [run_sweep([str(SNAP)], ["sim:h200-141gb"], ["gpumem"], jobs=1, progress=False, step_marks=marks).rows[0]
            for marks in (True, False)]
    assert [r.status for r in rows] == ["ok", "ok"] and [r.step_marks for r in rows] == [True, False]
    assert rows[0].overhead == pytest.approx(0.0662, abs=5e-4) and rows[1].overhead == pytest.approx(NO_MARKS, abs=5e-4)


def test_sweep_and_report_refuse_a_step_marks_that_is_not_a_bool() -> None:
    with pytest.raises(SweepError, match="step_marks must be True or False"):
        make_cases([str(SNAP)], ["sim:h200-141gb"], ["gpumem"], step_marks="no")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="step_marks must be True or False"):
        ReportOptions(step_marks=0)  # type: ignore[arg-type]


def test_cli_report_no_step_marks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    got = {}
    for flag in ([], ["--no-step-marks"]):
        out = tmp_path / f"r{len(flag)}"
        assert cli_main(["report", str(SNAP), "--policy", "gpumem", "--no-fit", "--samples", "50", "--out", str(out),
                         "--json", *flag]) == 0
        summary = json.loads(capsys.readouterr().out)
        row = summary["summary"][0] if "summary" in summary else summary["rows"][0]
        got[bool(flag)] = row["overhead"]
        assert ("--no-step-marks" in (out / "index.html").read_text()) == bool(flag)
    assert got[False] == pytest.approx(0.0662, abs=5e-4) and got[True] == pytest.approx(NO_MARKS, abs=5e-4)


def test_a_sweep_case_refuses_a_step_marks_that_is_not_a_bool() -> None:
    """Attacker 43: ``SweepCase(step_marks="no")`` ran with the marks and wrote "no" in its row."""
    from gpumem.report.sweep import SweepCase

    with pytest.raises(SweepError, match="step_marks must be True or False"):
        SweepCase(0, "t", "/t", "sim:h200-141gb", "gpumem", step_marks="no")  # type: ignore[arg-type]


def test_a_sweep_folder_written_before_the_step_marks_column_is_replaced(tmp_path: Path) -> None:
    """Attacker 43: a folder an earlier version wrote (no ``step_marks`` column) was refused as not a sweep's."""
    from gpumem.report.sweep import COLUMNS, write_sweep

    out = tmp_path / "sweep"
    result = run_sweep([str(SNAP)], ["sim:h200-141gb"], ["pytorch"], jobs=1, progress=False)
    write_sweep(result, out, plots=False)
    data = json.loads((out / "sweep.json").read_text())
    data["columns"] = [c for c in COLUMNS if c != "step_marks"]
    (out / "sweep.json").write_text(json.dumps(data))
    write_sweep(result, out, plots=False)
    assert json.loads((out / "sweep.json").read_text())["columns"] == list(COLUMNS)
