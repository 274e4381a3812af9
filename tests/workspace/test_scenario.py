"""The workspace scenario (short runs; the full table is sim/workspace_scenario.py)."""

from __future__ import annotations

import pytest

from gpumem.workspace import QType
from gpumem.workspace.scenario import Layer, Rule, run_scenario

BIG = Layer("70b-mlp", 8192, 28672, QType.TL2)


@pytest.mark.parametrize("profile, pressure", [("jetson-nano-2gb", "ramp"), ("jetson-nano-2gb", "random"),
                                               ("gtx-1050-2gb", "spikes"), ("h200-141gb", "random")])
def test_adaptive_meets_the_goal(profile, pressure):
    r = run_scenario(profile, pressure, Rule.ADAPTIVE, BIG, steps=120)
    assert r.ooms == 0 and r.steps_without_workspace == 0
    assert r.used_share >= 0.90


def test_the_six_gb_rule_runs_out_of_memory_where_the_adaptive_one_does_not():
    six = run_scenario("jetson-nano-2gb", "step", Rule.SIX_GB, BIG, steps=30)
    adaptive = run_scenario("jetson-nano-2gb", "step", Rule.ADAPTIVE, BIG, steps=30)
    assert six.ooms == 30 and six.steps_without_workspace == 30
    assert adaptive.ooms == 0 and adaptive.first_workspace_bytes > 0


def test_the_six_gb_rule_leaves_most_of_a_big_card_s_batch_unused():
    six = run_scenario("h200-141gb", "none", Rule.SIX_GB, BIG, steps=10)
    adaptive = run_scenario("h200-141gb", "none", Rule.ADAPTIVE, BIG, steps=10)
    assert six.first_batch_size == 128 and six.batch_share == pytest.approx(0.25)
    assert adaptive.first_batch_size == 512 and adaptive.batch_share == 1.0 and adaptive.resizes == 0


def test_the_uncapped_share_is_measured_against_what_free_memory_allows_without_the_class_cap():
    # found by review: from 8 GB up the capped share is 100 % by definition; the uncapped one is not
    from gpumem.workspace import ABSOLUTE_MAX_BATCH_SIZE

    adaptive = run_scenario("h200-141gb", "none", Rule.ADAPTIVE, BIG, steps=10)
    dequant, per_sample = 8192 * 28672 * 4, 28672 * 4
    assert adaptive.used_share == 1.0
    assert adaptive.used_share_uncapped == pytest.approx(
        (dequant + 512 * per_sample) / (dequant + ABSOLUTE_MAX_BATCH_SIZE * per_sample))
    # where memory, not the cap, limits the workspace, both shares agree
    small = run_scenario("jetson-nano-2gb", "none", Rule.ADAPTIVE, Layer("big", 32768, 28672, QType.TL2), steps=10)
    assert small.used_share == pytest.approx(small.used_share_uncapped)
