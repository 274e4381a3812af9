"""The multistream inference trace of the H200 run (two towers on two streams, inputs copied on a third,
record_stream on tensors used across streams) replayed with its steps marked: no plan forms, and the
engine holds what it holds without marks (Note [Step plans and record_stream] in gpumem/allocator/plan.py;
38.81 % held above peak before it, 5.43 % without a plan)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumem.allocator.policy import DEFAULT_POLICY, get_policy
from gpumem.trace import load_trace
from sim.step_plan import MEMORY_FIRST_POLICY
from sim.step_plan_engine import run

TRACE = (Path(__file__).resolve().parents[2]
         / "reports/hil/live-step-plan-h200-2026-11-28/all/multistream_infer.gpumem.gmt.gz")


@pytest.mark.parametrize("policy", [get_policy(DEFAULT_POLICY), MEMORY_FIRST_POLICY], ids=lambda p: p.name)
def test_marked_multistream_inference_holds_what_it_holds_without_marks(policy):
    trace = load_trace(TRACE)
    marked = run(trace, "multistream_infer", policy, "trace", marked=True)
    unmarked = run(trace, "multistream_infer", policy, "trace", marked=False)
    assert marked.marks > 10
    assert marked.plan["plans_installed"] == 0 and marked.plan["arena_calls"] == 0
    assert marked.peak_reserved_nbytes == unmarked.peak_reserved_nbytes
    assert marked.overhead < 0.06   # 5.43 % (default policy), 5.12 % (memory-first); 38.81 % before
