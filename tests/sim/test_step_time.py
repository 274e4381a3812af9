"""sim.step_time and sim.fit_busy_latency: the live figures they read, the fit they make, bad arguments
refused (no replay runs here)."""

from __future__ import annotations

import pytest

from gpumem.sim.latency import MEASURED_BUSY_FACTOR_BASE, MEASURED_BUSY_FACTOR_PER_DECADE
from sim import fit_busy_latency as fb
from sim import step_time as stt


def test_the_live_runs_are_run_4_and_run_2_under_both_settings() -> None:
    lives = {(lv.run, lv.model, lv.setting): lv for lv in stt.live_runs()}
    assert len(lives) == 8
    # run 4's record: +0.67 %, +23.9 %, +0.01 %, +14.4 % against PyTorch's allocator
    for key, want in ((("run 4", "gpt2", "default"), 0.0067), (("run 4", "gpt2", "C"), 0.2393),
                      (("run 4", "resnet50", "default"), 0.0001), (("run 4", "resnet50", "C"), 0.1436)):
        assert lives[key].overhead == pytest.approx(want, abs=6e-5)
    assert lives[("run 2", "gpt2", "C")].overhead == pytest.approx(0.2030, abs=1e-4)
    assert lives[("run 4", "gpt2", "C")].steps == 40 and lives[("run 2", "gpt2", "C")].steps == 80


def test_the_trace_steps_are_the_records_steps() -> None:
    """A bug fixed: the run-2 traces hold 80 steps (the train probe's --steps counts its 20 warm-up steps),
    not 100, so calls per timed step were counted over 80 steps where 60 ran."""
    import json

    for model in stt.TRACES:
        rec = json.loads((stt.RUN2 / f"A-{model}.json").read_text())
        assert (rec["steps"], rec["warmup"]) == (stt.STEPS, stt.WARMUP_STEPS) == (80, 20)


def test_the_shipped_constants_are_the_fit_of_the_shipped_probe_records() -> None:
    base, per_decade = fb.fit(fb.DIR, 2)
    assert round(base, 2) == MEASURED_BUSY_FACTOR_BASE
    assert round(per_decade, 2) == MEASURED_BUSY_FACTOR_PER_DECADE
    assert {lv.part for lv in fb.levels(2)} == {"fit", "check"}
    assert not {(lv.file, lv.queue) for lv in fb.levels(2) if lv.part == "fit"} \
        & {(lv.file, lv.queue) for lv in fb.levels(2) if lv.part == "check"}


@pytest.mark.parametrize("args", [["--max-overhead", "-0.1"], ["--max-step-cost", "1.5"]])
def test_bad_targets_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        stt.main(args)
    assert exc.value.code == 2
    assert "fractions in [0, 1)" in capsys.readouterr().err


def test_the_prediction_is_the_calls_cost_over_pytorchs_less_pytorchs_over_the_live_step() -> None:
    """No replay: made-up replayed costs, the arithmetic of the table."""
    def rep(calls_ms: float, sim_ms: float) -> stt.Replayed:
        return stt.Replayed(0.01, calls_ms, sim_ms, 100.0, 50.0, 0.9)

    preds = {}
    for model in stt.TRACES:
        for lat in stt.LATENCIES:
            preds[(model, "pytorch", lat)] = rep(0.5, 60.0)
            preds[(model, "default", lat)] = rep(0.6, 60.1)
            preds[(model, "C", lat)] = rep(10.5 if lat == "measured" else 5.5, 62.0)
    text, rows = stt.table(stt.live_runs(), preds)
    row = next(r for r in rows if (r["run"], r["model"], r["setting"]) == ("run 4", "gpt2", "C"))
    assert row["calls_measured"] == pytest.approx(10.0 / row["live_pytorch_ms"])
    assert row["calls_idle-priced"] == pytest.approx(5.0 / row["live_pytorch_ms"])
    assert row["sim_measured"] == pytest.approx(2.0 / row["live_pytorch_ms"])
    assert text.count("\n") == 1 + len(rows)


@pytest.mark.parametrize("argv, what", [(["--us-per-call", "nan"], "finite"), (["--us-per-call", "-5"], "finite"),
                                        (["--json", "no-such-folder/x.json"], "no folder")])
def test_steal_frontier_refuses_bad_options_before_the_long_run(argv, what, capsys):
    from sim import steal_frontier

    with pytest.raises(SystemExit) as exc:
        steal_frontier.main(argv)
    assert exc.value.code == 2 and what in capsys.readouterr().err
