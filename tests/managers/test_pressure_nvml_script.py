"""benchmarks/nvml_pressure.py on the simulator: a tenant follows the second process's schedule; the
monitor gives the cache back in time (and, as a control, without release the tenant is refused)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import gpumem

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def nvp():
    spec = importlib.util.spec_from_file_location("gpumem_nvml_pressure", REPO / "benchmarks" / "nvml_pressure.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpumem_nvml_pressure"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpumem_nvml_pressure", None)


def _plan(nvp):
    return nvp.Plan(step_s=0.02, hold_s=0.1, pause_s=0.1, cycles=2, pattern_nbytes=4096)


def test_schedule_ramps_holds_and_returns_everything(nvp):
    plan = nvp.Plan(cycles=2, hog_steps=4)
    sched = plan.schedule(1000 * 2**20)
    assert [t for t, _ in sched] == sorted(t for t, _ in sched)
    assert sum(d for _, d in sched) == 0 and sum(1 for _, d in sched if d > 0) == 8
    assert max(d for _, d in sched) * 4 <= 0.4 * 1000 * 2**20


@pytest.mark.parametrize("profile", ["t4-16gb", "a100-80gb"])
def test_on_the_simulator_the_cache_goes_back_and_nothing_runs_out(nvp, profile, tmp_path):
    with gpumem.open_device(f"sim:{profile}") as dev:
        rec = nvp.run_check(dev, _plan(nvp), out_dir=tmp_path)
    assert rec.problems == [] and rec.ok
    assert rec.hog_ooms == 0 and rec.live_intact and rec.released_nbytes >= rec.cache_nbytes
    assert rec.peak_level in ("HIGH", "CRITICAL")
    md = list(tmp_path.glob("nvml-pressure-sim*.md"))
    js = list(tmp_path.glob("nvml-pressure-sim*.json"))
    assert len(md) == len(js) == 1
    data = json.loads(js[0].read_text())
    assert data["ok"] is True and data["device"] == f"sim:{profile}"
    assert "Result: passed" in md[0].read_text()


def test_control_run_without_release_fails_as_it_should(nvp, tmp_path):
    with gpumem.open_device("sim:t4-16gb") as dev:
        rec = nvp.run_check(dev, _plan(nvp), out_dir=tmp_path, release=False)
    assert not rec.ok and rec.hog_ooms > 0
    assert any("other process ran out of memory" in p for p in rec.problems)
    assert list(tmp_path.glob("*-no-release.md"))


def test_cli_needs_an_out_folder_and_reports_a_missing_device(nvp, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OUT", raising=False)
    with pytest.raises(SystemExit) as info:
        nvp.main(["--device", "sim:t4-16gb"])
    assert info.value.code == 2
    assert nvp.main(["--device", "sim:no-such-gpu", "--out", str(tmp_path)]) == 2
    assert "cannot open" in capsys.readouterr().err


def test_cli_on_the_simulator_passes(nvp, tmp_path, capsys):
    assert nvp.main(["--device", "sim:t4-16gb", "--out", str(tmp_path), "--cycles", "1"]) == 0
    assert "Result: passed" in capsys.readouterr().out
