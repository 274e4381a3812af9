"""The peer benchmark and the fidelity check without a GPU: failing peers are reported, never fatal; the
simulated hazard twin flags a misbehaving allocator and not the real one; the comparisons read right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hil import fidelity, peers

REPO = Path(__file__).resolve().parents[2]
SMALL_TRACE = REPO / "data" / "traces" / "resnet_train.rmm_log.csv.gz"


@pytest.mark.parametrize("fake, status, reason", [
    ("crash:gpumem", "failed", "exited with status"),
    ("missing:gpumem", "unavailable", "GPUMEM_PEERS_FAKE"),
])
def test_a_failing_or_missing_peer_is_reported(monkeypatch: pytest.MonkeyPatch, fake: str, status: str,
                                               reason: str) -> None:
    monkeypatch.setenv(peers.FAKE_ENV, fake)
    cell, live = peers.run_cell("gpumem", SMALL_TRACE, "cuda:0", 1, timeout_s=120)
    assert (cell.status, live) == (status, None)
    assert reason in cell.reason


def test_a_hanging_peer_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(peers.FAKE_ENV, "hang:cupy-pool")
    cell, _ = peers.run_cell("cupy-pool", SMALL_TRACE, "cuda:0", 1, timeout_s=3)
    assert cell.status == "failed" and "timed out after 3 s" in cell.reason


def test_failed_gpumem_peer_fails_the_part_and_others_only_show(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    monkeypatch.setenv(peers.FAKE_ENV, "missing:rmm-pool")
    out = peers.run_benchmark("cuda:0", [SMALL_TRACE], ["rmm-pool"], 1, 60)
    assert out["status"] == "skipped" and "did not run: rmm-pool" in out["summary"]  # nothing measured: not passed
    assert "rmm-pool on resnet_train (RMM log): unavailable" in out["markdown"]
    monkeypatch.setenv(peers.FAKE_ENV, "crash:gpumem")
    out = peers.run_benchmark("cuda:0", [SMALL_TRACE], ["gpumem"], 1, 60)
    assert out["status"] == "failed" and "gpumem failed" in out["reason"]


def test_peers_cli_skips_on_a_simulator_and_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "p.json"
    assert peers.main(["--device", "sim:h200-141gb", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["status"] == "skipped"
    for argv, message in ((["--peers", "gpumem,nope"], "unknown nope"), (["--repeat", "0"], "--repeat"),
                          (["--device", "cuda:x"], "whole number"), (["--traces", str(tmp_path)], "no trace file")):
        assert peers.main(argv) == 2
        assert message in capsys.readouterr().err


def test_simulated_inflight_flags_the_misbehaving_allocator_only() -> None:
    for path in ("steal", "release"):
        assert fidelity.simulated_inflight(path, False, "sim:h200-141gb") == 0
        assert fidelity.simulated_inflight(path, True, "sim:h200-141gb") > 0
    from gpumem.allocator.fences import StreamFences

    assert StreamFences.done.__name__ == "done"  # fences_off put the fences back


def test_latency_comparison_on_the_recorded_calibration() -> None:
    measured = json.loads((REPO / "reports" / "hil" / "calibrate-h200-2026-11-22.json").read_text())
    rows = fidelity.compare_latency(measured)
    assert len(rows) >= 30 and all(r.within for r in rows)  # the model was fitted to this record
    slow = {"costs_us": {"null_call": {"median_us": 0.0}, "cuMemCreate_1GiB": {"median_us": 16.0}}}
    (row,) = fidelity.compare_latency(slow)
    assert not row.within and row.ratio > 2  # a 7x difference is reported


def test_trace_comparison_sim_against_sim() -> None:
    from gpumem.trace import load_trace

    trace = load_trace(SMALL_TRACE)
    a = fidelity.replay_with_checkpoints("sim:h200-141gb", trace)
    b = fidelity.replay_with_checkpoints("sim:h200-141gb", trace)
    same = fidelity.compare_trace("t", a, b)
    assert same.peak_reserved_equal and same.mem_info_within and set(same.free_diff_nbytes) == set(fidelity.CHECKPOINTS)
    other = fidelity.replay_with_checkpoints("sim:a100-80gb", trace)
    diff = fidelity.compare_trace("t", a, other)
    assert not diff.mem_info_within  # another card's free bytes are far off


def test_fidelity_cli_skips_on_a_simulator_and_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "f.json"
    assert fidelity.main(["--device", "sim:t4-16gb", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["status"] == "skipped"
    assert fidelity.main(["--sim", "cuda:0"]) == 2
    assert "not a simulated device" in capsys.readouterr().err
    assert fidelity.main(["--sim", "sim:nope"]) == 2
    assert "unknown simulated profile" in capsys.readouterr().err


def test_fit_latency_prints_the_geometric_mean_and_the_spread(tmp_path, capsys) -> None:
    """sim/fit_latency.py, which the latency model's Note [Latency calibration] is made with."""
    import importlib.util
    import json

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("fit_latency", repo / "sim" / "fit_latency.py")
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    calibration = repo / "reports" / "hil" / "calibrate-h200-2026-11-22.json"
    slower = json.loads(calibration.read_text())
    for cost in slower["costs_us"].values():  # a second run, every call 4x slower (the binding's cost too)
        for key in ("median_us", "p90_us", "min_us"):
            if key in cost:
                cost[key] *= 4
    (tmp_path / "slower.json").write_text(json.dumps(slower))
    assert fit.main([str(calibration), str(tmp_path / "slower.json")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| cuMemMap_1page |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    first, second, mean, spread = float(cells[1]), float(cells[2]), float(cells[3]), cells[4]
    assert second == pytest.approx(4 * first, rel=1e-2) and mean == pytest.approx(2 * first, rel=1e-2)
    assert spread.startswith("4.00x") and "no figure within 2x of all" not in spread  # exactly 2x either way
    assert "cuMemSetAccess:" in out and "cuMemUnmap:" in out
    (tmp_path / "bad.json").write_text("{}")
    assert fit.main([str(tmp_path / "bad.json")]) == 2
    assert "neither a calibration" in capsys.readouterr().err


def test_one_unreadable_trace_costs_its_row_not_the_fidelity_part(tmp_path) -> None:
    """Found by review: a truncated trace file stopped the whole part with a traceback."""
    bad = tmp_path / "broken.trace.pickle.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00truncated")
    result = fidelity.run_fidelity("sim:t4-16gb", "sim:t4-16gb", [bad, SMALL_TRACE], None, 1)
    assert result["status"] == "failed"
    assert any(d.startswith("broken.trace.pickle.gz: cannot be read as a trace") for d in result["differences"])
    assert [t["trace"] for t in result["traces"]] == [SMALL_TRACE.name]  # the good trace was still compared
    assert result["traces"][0]["peak_reserved_equal"]
