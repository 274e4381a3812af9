"""Training's peak reserved against the H200 rows of run 2
(``reports/hil/estimate-accuracy-h200-2026-11-25-run2.json``), through the accuracy harness's own estimate (``gpumem estimate``'s code, the ``pytorch`` policy)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import hf_memory_configs as harness  # noqa: E402

RUN2 = json.loads((ROOT / "reports" / "hil" / "estimate-accuracy-h200-2026-11-25-run2.json").read_text())


def _row(model: str, batch: int, seq: int, ckpt: bool) -> dict:
    (row,) = [r for r in RUN2["rows"] if r["kind"] == "train" and r["model"] == model and r["batch_size"] == batch
              and r["prompt_len"] == seq and r["extra"]["gradient_checkpointing"] == ckpt]
    return row


@pytest.mark.parametrize("model, batch, seq", [
    ("qwen2-small", 16, 2048),  # +4.41 % before the no-grad pass freed its tensors as they die
    ("qwen2-small-fp32-master", 8, 1024),  # -9.14 % before, with the same no-grad pass under autocast
])
def test_gradient_checkpointing_reserved_is_at_or_above_and_within_3_percent(model, batch, seq):
    row = _row(model, batch, seq, True)
    est = harness.estimate(row, RUN2["meta"]["estimate_device"])
    for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
        err = est[key] / row[key] - 1
        assert 0 <= err <= 0.03, (key, err)


def test_mixed_precision_rows_reserved_within_bounds_where_the_replay_allows():
    """The fp32-master rows without checkpointing: batch 8 is within bounds; batch 2's replay reserves one
    step-1 layout too many segments (+3.71 %, in the accuracy report; +4.07 % before each block's backward made
    a new gradient of its input in place of its output's), which this pins from growing."""
    row = _row("qwen2-small-fp32-master", 8, 1024, False)
    est = harness.estimate(row, RUN2["meta"]["estimate_device"])
    assert 0 <= est["peak_reserved_bytes"] / row["peak_reserved_bytes"] - 1 <= 0.03
    small = _row("qwen2-small-fp32-master", 2, 512, False)
    est = harness.estimate(small, RUN2["meta"]["estimate_device"])
    assert 0 <= est["peak_reserved_bytes"] / small["peak_reserved_bytes"] - 1 <= 0.04
