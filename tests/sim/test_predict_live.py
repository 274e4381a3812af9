"""sim.predict_live: the live rows it reads, the split, the candidates, the choice and its margin, one replay."""

from __future__ import annotations

import math

import pytest

from gpumem.errors import InvalidArgumentError
from sim import predict_live as pl


def test_every_traced_live_row_of_runs_1_to_3_split_by_workload() -> None:
    rows = pl.live_rows()
    assert len(rows) == 24
    assert sum(r.part == "tuning" for r in rows) == 12 and sum(r.part == "check" for r in rows) == 12
    # the corpus split: a workload is in one part in every run
    parts = {}
    for r in rows:
        assert parts.setdefault(r.workload, r.part) == r.part
    assert {w for w, p in parts.items() if p == "tuning"} == {"gpt2_train", "resnet50_train", "moe_train",
                                                             "gpt2_train_bf16"}
    live = {r.key: r.live for r in rows}
    # the records' figures (live-vs-predicted-h200-2026-11-25*.md)
    for key, want in (("run 1 gpt2_train busy_slack=inf", 0.0552), ("run 2 C gpt2_train C", 0.0173),
                      ("run 2 C resnet50_train C", 0.0087), ("run 3 multistream_infer default", 0.0543),
                      ("run 1 multistream_infer busy_slack=inf", 0.5004)):
        assert live[key] == pytest.approx(want, abs=5e-5)
    # run 2 B and C recorded no trace: they replay run 2 A's
    assert {r.key for r in rows if not r.own_trace} == {
        "run 2 B gpt2_train default", "run 2 B resnet50_train default", "run 2 C gpt2_train C",
        "run 2 C resnet50_train C"}


def test_a_record_that_ran_another_policy_is_refused(tmp_path) -> None:
    rec = tmp_path / "workloads.json"
    rec.write_text('{"runs": [{"workload": "gpt2_train", "allocator": "gpumem", "policy": "gpumem:busy_slack=0", '
                   '"trace_file": "x.gmt.gz", "peak_allocated_bytes": 100, "peak_reserved_bytes": 101}]}')
    with pytest.raises(InvalidArgumentError, match="busy_slack=0"):
        pl.live_rows([pl.Record("run x", rec, "C", "workloads")])


def test_the_candidates_and_todays_default() -> None:
    cands = pl.candidates()
    labels = [c.label for c in cands]
    assert len(labels) == len(set(labels)) == 1 + 2 + 2 * len(pl.SYNC_GAPS_MS)
    default = pl.default_candidate()
    assert default == pl.Candidate("trace", "idle-priced", 2.0) and default in cands
    assert pl.Candidate("trace", "as-measured", math.inf).gpu_model().sync_gap_us == pl.NO_SYNC_US
    assert pl.Candidate("model", "idle-priced").gpu_model() is None


def _errs(values: dict[str, float]) -> dict[str, pl.Errors]:
    return {k: pl.Errors(v, v, "r", v, 1, 1) for k, v in values.items()}


def test_choose_takes_the_least_error_and_breaks_ties_toward_today_then_the_middle() -> None:
    d = pl.Candidate("trace", "idle-priced", 2.0)
    gaps = [pl.Candidate("trace", "idle-priced", g) for g in (1.0, 2.0, 3.0, 4.0, 5.0)]
    assert pl.choose(gaps, _errs({"trace, sync 1 ms, idle-priced": 0.5, "trace, sync 2 ms, idle-priced": 0.3,
                                  "trace, sync 3 ms, idle-priced": 0.2, "trace, sync 4 ms, idle-priced": 0.2,
                                  "trace, sync 5 ms, idle-priced": 0.2}), d) == gaps[3]
    assert pl.choose(gaps, _errs({c.label: 0.2 for c in gaps}), d) == d


def _rows_preds(lives: list[float], a: list[float], b: list[float]):
    rows = [pl.Row("r", f"w{i}", "p", "t", True, "tuning", lv) for i, lv in enumerate(lives)]
    return rows, [{"a": x, "b": y} for x, y in zip(a, b)]


def test_a_candidate_replaces_the_default_only_beyond_the_rows_noise() -> None:
    d, c = pl.Candidate("trace", "idle-priced", 2.0), pl.Candidate("model", "idle-priced")
    # better on every row by 0.1 pp: adopted
    rows, preds = _rows_preds([0.01] * 6, [0.011] * 6, [0.012] * 6)
    v = pl.paired(rows, preds, "a", "b")
    assert (v.better, v.worse) == (6, 0) and v.mean_diff_pp == pytest.approx(-0.1) and v.high_pp < 0
    assert pl.adopt(c, d, v) == c
    # better on average by one row's luck, worse on two: kept
    rows, preds = _rows_preds([0.01] * 6, [0.0095, 0.0115, 0.0115, 0.01, 0.01, 0.01],
                              [0.0, 0.011, 0.011, 0.01, 0.01, 0.01])
    v = pl.paired(rows, preds, "a", "b")
    assert v.mean_diff_pp < 0 and (v.better, v.worse) == (1, 2)
    assert pl.adopt(c, d, v) == d
    assert pl.adopt(d, d, v) == d


def test_errors_are_percentage_points_with_the_worst_row() -> None:
    rows, preds = _rows_preds([0.02, 0.05], [0.025, 0.035], [0.0, 0.0])
    e = pl.errors(rows, preds, "a")
    assert e.mean_abs_pp == pytest.approx(1.0) and e.worst_abs_pp == pytest.approx(1.5)
    assert e.worst_row == "r w1 p" and e.mean_pp == pytest.approx(-0.5) and e.within_1pp == 1
    with pytest.raises(InvalidArgumentError):
        pl.errors([], [], "a")


def test_the_run_3_rows_replay_as_recorded() -> None:
    """One replay per candidate on the two smallest traces (run 3's; 347 allocations): the figures of
    live-vs-predicted-h200-2026-11-25-run3.md, and idle the same under both latency models."""
    rows = [r for r in pl.live_rows() if r.run == "run 3"]
    cands = [pl.Candidate("idle", "idle-priced"), pl.Candidate("trace", "idle-priced", 2.0),
             pl.Candidate("trace", "idle-priced", 1.5), pl.Candidate("trace", "idle-priced", math.inf)]
    got = {r.policy: pl.replay_row(r, cands) for r in rows}
    assert got["default"]["trace, sync 2 ms, idle-priced"] == pytest.approx(0.0543, abs=5e-5)
    assert got["C"]["trace, sync 2 ms, idle-priced"] == pytest.approx(0.0559, abs=5e-5)
    assert got["C"]["trace, sync 1.5 ms, idle-priced"] == pytest.approx(0.0387, abs=5e-5)
    assert got["C"]["trace, sync none, idle-priced"] == pytest.approx(0.1089, abs=5e-5)
    assert got["C"]["idle, idle-priced"] == pytest.approx(0.0060, abs=5e-5)


def test_bad_jobs_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        pl.main(["--jobs", "0"])
    assert exc.value.code == 2 and "--jobs must be >= 1" in capsys.readouterr().err
