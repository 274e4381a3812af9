"""Issue 22 point 4 after the H200's run 5 (``reports/hil/estimate-accuracy-h200-2026-11-28-run5.md``): the two
reserved figures of the tuning part still outside [0 %, +3 %], each traced to its cause
(``reports/estimate-accuracy-run5-misses.md``).

- Tied Qwen2 0.16B generate b4 x 512 + 16 (+4.32 %): the estimate's workload makes the row's segments; what
  differs is which of two equal free blocks PyTorch took, which depends on where the driver put the segments.
- Qwen2 0.16B gradient checkpointing b8 x 1024 (-1.20 % alone): measured third in its process; its own recorded
  operations replayed as a fresh process would run them reserve less than the estimate does.
"""

import dataclasses
import gzip
import json
import sys
from pathlib import Path

import pytest

from gpumem import open_device
from gpumem.allocator import CachingAllocator
from gpumem.allocator.policy import get_policy
from gpumem.units import MiB

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import accuracy_recompute  # noqa: E402

HIL = ROOT / "reports" / "hil"
RUN3 = HIL / "estimate-accuracy-h200-2026-11-25-run3"
RUN5 = HIL / "estimate-accuracy-h200-2026-11-28-run5"
TIED_KEY = "generate b=4 p=512 n=16 ckpt=False"
CKPT_KEY = "train b=8 p=1024 n=0 ckpt=True"
H200 = "sim:h200-141gb"


def _policy(top_down: bool):
    """The ``pytorch`` policy, with equal free blocks going to the newest segment (as it is: Note [Segments
    top-down] in gpumem/allocator/policy.py) or to the oldest one (the simulator's addresses go up)."""
    return get_policy("pytorch") if top_down else dataclasses.replace(get_policy("pytorch"), segments_top_down=False)


def _measured(record: Path, model: str, index: int) -> dict:
    rows = [r for r in json.loads(record.with_suffix(".json").read_text())["rows"] if r["model"] == model]
    return rows[index]


class _Replay:
    """A Python-engine ``pytorch`` allocator on the simulated H200 that records the segments it makes, each with
    the number of allocations made before it."""

    def __init__(self, policy) -> None:
        self.alloc = CachingAllocator(open_device(H200), policy, engine="python")
        self.n_allocs = 0
        self.made: list[tuple[int, int]] = []
        new_segment = self.alloc.backing.new_segment

        def spy(small: bool, stream: int, nbytes: int):
            seg = new_segment(small, stream, nbytes)
            self.made.append((self.n_allocs, seg.nbytes))
            return seg

        self.alloc.backing.new_segment = spy

    def allocate(self, nbytes: int) -> int:
        ptr = self.alloc.allocate(int(nbytes))
        self.n_allocs += 1
        return ptr

    def large_made_from(self, n_allocs: int) -> list[int]:
        """Sizes of the large-pool segments made at or after the ``n_allocs``-th allocation, in order."""
        return [n for at, n in self.made if at >= n_allocs and n > 2 * MiB]


def _replay_estimate(row: dict, top_down: bool) -> tuple[_Replay, int]:
    """The trace ``gpumem estimate`` replays for ``row`` (``accuracy_recompute._workload``), replayed; also the
    number of allocations before the workload's own (the weights and the small buffers)."""
    w = accuracy_recompute._workload({**row, "config": accuracy_recompute._as_hf_config(row)})
    tr = w.trace
    allocs = [(int(op), int(n)) for kind, op, n in zip(tr.kinds, tr.alloc_ids, tr.nbytes) if kind == 0]
    # the weights and the small buffers (1 MiB blocks) first; the workload's first tensor over 1 MiB after them
    n_before = next(k for k, (op, n) in enumerate(allocs) if op not in w.persistent and n > MiB)
    rep = _Replay(_policy(top_down))
    ptrs = {}
    for kind, op, nbytes in zip(tr.kinds, tr.alloc_ids, tr.nbytes):
        if kind == 0:
            ptrs[op] = rep.allocate(nbytes)
        else:
            rep.alloc.free(ptrs.pop(op))
    return rep, n_before


@pytest.fixture(scope="module")
def tied_row() -> dict:
    return _measured(RUN5, "qwen2-small-tied-recheck", 0)


@pytest.fixture(scope="module")
def tied_recorded_large() -> list[int]:
    trace = json.load(gzip.open(RUN5.parent / f"{RUN5.name}-snapshots" /
                                "snapshots-qwen2-small-tied-recheck-row0.json.gz"))[TIED_KEY]["trace"]
    return [e[2] for e in trace if e[0] == "segment_alloc" and e[2] > 2 * MiB]


def test_tied_generate_row_makes_the_recorded_segments_when_ties_go_to_the_oldest(tied_row, tied_recorded_large):
    """The H200 placed the row's segments bottom-up (each above the one before, in the free address range above
    the weights that the tied model's freed lm_head weight and the driver's first region left), so PyTorch's
    lowest-address tie went to the oldest segment. With that tie the estimate's trace makes the recorded row's
    large segments one for one (20, 32, 20, 12, 12 MiB) and reserves 4 MiB (+1.08 %) above the measurement,
    allocated +0.59 %: the workload is the row's."""
    assert tied_recorded_large == [20 * MiB, 32 * MiB, 20 * MiB, 12 * MiB, 12 * MiB]
    rep, n_before = _replay_estimate(tied_row, top_down=False)
    try:
        assert rep.large_made_from(n_before) == tied_recorded_large
        reserved = rep.alloc.stats.peak_reserved_nbytes
        assert reserved - tied_row["peak_reserved_bytes"] == 4 * MiB
        assert 0 <= reserved / tied_row["peak_reserved_bytes"] - 1 <= 0.03
    finally:
        rep.alloc.close()


def test_tied_generate_row_is_in_bounds_under_the_pytorch_policy(tied_row, tied_recorded_large):
    """Until 2026-11-29 the ``pytorch`` policy sent ties to the newest segment (``segments_top_down``) and this row
    was +4.32 %: the prefill's first block put a hidden-sized tensor into the newer of its two 20 MiB activation
    segments where PyTorch used the older, and a third 12 MiB segment followed. The simulated device now places
    segments as the driver does (Note [Where the driver places a segment] in ``gpumem/sim/device.py``) and the
    policy breaks ties by address, so the policy as shipped is the test above's: the recorded segments, +1.08 %."""
    from gpumem.allocator.policy import get_policy

    assert not get_policy("pytorch").segments_top_down
    rep, n_before = _replay_estimate(tied_row, top_down=False)
    try:
        assert rep.large_made_from(n_before) == tied_recorded_large
        assert round(rep.alloc.stats.peak_reserved_nbytes / tied_row["peak_reserved_bytes"] - 1, 4) == 0.0108
    finally:
        rep.alloc.close()


def _replay_recorded_ckpt(fresh: bool) -> int:
    """Peak reserved of run 3's Qwen2 0.16B gradient-checkpointing b8 row replayed from its own operations under
    the ``pytorch`` policy, from the segments PyTorch held when the row began (each rebuilt with its size and
    the bytes it held then) or, ``fresh``, as a process of its own would run it: without the two segments the
    rows before it had made and left holding the cuBLAS workspaces (126 MiB with 94 MiB of it free, and 32 MiB),
    each workspace made in the row instead (the forward's before the row's first allocation, the backward's
    after the loss's backward has freed the two fp32 logit-sized tensors: Note [Backward cuBLAS workspace])."""
    row = json.load(gzip.open(RUN3.parent / f"{RUN3.name}-snapshots" /
                              "snapshots-qwen2-small-recheck.json.gz"))[CKPT_KEY]
    workspaces = {126 * MiB, 32 * MiB}
    backward = {"made": not fresh, "logits_freed": 0}

    def after_free(a, nbytes: int) -> None:
        backward["logits_freed"] += nbytes == 1000 * MiB
        if not backward["made"] and backward["logits_freed"] == 3:  # the forward's and the loss backward's two
            a.allocate(32 * MiB)
            backward["made"] = True

    a = accuracy_recompute.replay_recorded_row(
        row, "pytorch", device=H200, after_free=after_free,
        skip_segment=lambda base, nbytes, kind: fresh and kind == "large" and nbytes in workspaces,
        before_ops=lambda a: a.allocate(32 * MiB) if fresh else None)
    try:
        return a.stats.peak_reserved_nbytes
    finally:
        a.close()


def test_checkpointed_b8_row_is_not_below_what_a_fresh_process_reserves():
    """Note [Rows measured after other rows] (benchmarks/accuracy_recompute.py): the row ran third in its process
    (runs 1, 2 and 3 alike) and started with two segments the rows before it had left holding the cuBLAS
    workspaces, 94 MiB of them free. Its recorded operations replayed from that state reserve exactly the
    measurement (5,334 MiB); replayed as a fresh process runs them, 5,216 MiB. The estimate alone (a fresh
    process: 5,270 MiB, -1.20 % against the measurement) is +1.04 % above that, and the as-run figure +1.01 %:
    the -1.20 % compares a fresh-process estimate with a measurement that was not one, and is no miss."""
    meas = _measured(RUN3, "qwen2-small-recheck", 2)
    assert meas["kind"] == "train" and meas["batch_size"] == 8 and meas["extra"]["gradient_checkpointing"]
    assert _replay_recorded_ckpt(fresh=False) == meas["peak_reserved_bytes"] == 5334 * MiB
    fresh = _replay_recorded_ckpt(fresh=True)
    assert fresh == 5216 * MiB
    (est,) = [r for r in accuracy_recompute.recompute([RUN3.with_suffix(".json")], H200)
              if r["model"] == "qwen2-small-recheck" and r["extra"].get("gradient_checkpointing")]
    assert est["estimated_reserved"] == 5270 * MiB
    assert 0 <= est["estimated_reserved"] / fresh - 1 <= 0.03
    assert 0 <= est["as_run_reserved_error"] <= 0.03
