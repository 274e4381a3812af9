"""The simulated soak (sim/soak.py), short: four unequal devices under every pressure preset and
injected faults; no lost or overlapping buffer, stats that add up, nothing held after close."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from test_multi_helpers import manager_factories

REPO = Path(__file__).resolve().parents[2]
FACTORIES = manager_factories()


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("gpumem_soak_bench", REPO / "sim" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpumem_soak_bench"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpumem_soak_bench", None)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_short_soak_passes_its_checks_and_prints_what_it_held(soak, name):
    result = soak.run_soak(2500, seed=3, fail_rate=0.002, poll_every=100, manager_factory=FACTORIES[name],
                           show_progress=False)
    assert result.problems == []
    assert result.ops == 2500 and result.allocs == result.frees > 1000
    assert sum(d.injected_faults for d in result.devices) > 0  # the faults really were injected
    assert sum(d.allocs for d in result.devices) == result.allocs
    assert {d.pressure for d in result.devices} == {"step", "ramp", "spikes", "random"}
    text = soak.render(result)
    assert "all passed" in text and "sim:a100-80gb" in text and "| workload |" in text


def test_the_soak_reports_a_broken_check(soak, monkeypatch):
    """A check that fails is reported, not hidden: patterns written and expected differ every other call."""
    name = sorted(FACTORIES)[0]
    calls = {"n": 0}
    real = soak._pattern

    def flaky(serial):
        calls["n"] += 1
        return real(serial) if calls["n"] % 2 else real(serial + 1)

    monkeypatch.setattr(soak, "_pattern", flaky)
    result = soak.run_soak(300, seed=1, manager_factory=FACTORIES[name], show_progress=False)
    assert not result.ok and any("lost its pattern" in p for p in result.problems)
    assert "failed" in soak.render(result)
