"""Step marks read off a PyTorch snapshot's optimizer steps (Note [Step marks read off a snapshot's optimizer
steps] in gpumem/trace/optimizer_marks.py): where they stand, when none are read, hostile annotations, and the
replay against the live run's own trace."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem.cli import main as cli_main
from gpumem.errors import InvalidArgumentError, TraceFormatError
from gpumem.replay import replay_trace
from gpumem.trace import load_trace
from gpumem.trace.model import PlanEvent, PlanEventKind
from gpumem.trace.optimizer_marks import infer_step_marks

ROOT = Path(__file__).resolve().parents[2]
PAIRS = ROOT / "reports" / "hil" / "live-vs-predicted-h200-2026-11-29-default-marks"
RUN_A = ROOT / "reports" / "hil" / "workloads-today-h200-2026-11-30" / "run-a"


def ann(name: str, stage: str, time_us: float, device: int = 0) -> dict[str, Any]:
    return {"stage": stage, "name": name, "device": device, "time_us": time_us}


def step(time_end: float, cls: str = "AdamW", device: int = 0) -> list[dict[str, Any]]:
    name = f"Optimizer.step#{cls}.step"
    return [ann(name, "START", time_end - 1, device), ann(name, "END", time_end, device)]


def snapshot(n_pairs: int, annotations: Any) -> dict[str, Any]:
    """A snapshot of ``n_pairs`` alloc/free pairs at times 0, 1, 2, ... (one op per microsecond)."""
    entries = []
    for i in range(n_pairs):
        entries.append({"action": "alloc", "addr": 0x1000 * (i + 1), "size": 4096, "stream": 0, "time_us": 2 * i,
                        "frames": []})
        entries.append({"action": "free_requested", "addr": 0x1000 * (i + 1), "size": 4096, "stream": 0,
                        "time_us": 2 * i + 1, "frames": []})
    snap = {"segments": [], "device_traces": [entries]}
    if annotations is not None:
        snap["external_annotations"] = annotations
    return snap


def write(path: Path, snap: dict[str, Any]) -> Path:
    path.write_bytes(gzip.compress(pickle.dumps(snap, protocol=4)))
    return path


# -- where the marks stand ----------------------------------------------------------------------------------------


def test_a_mark_after_the_last_op_at_or_before_each_step_end() -> None:
    times = np.arange(10, dtype=np.float64)
    a = step(3.0) + [ann("my range", "END", 5.0)] + step(6.5) + step(20.0)
    got = infer_step_marks(a, 0, times)
    assert got.reason is None and got.optimizer == "AdamW"
    assert got.events == (PlanEvent(0, PlanEventKind.WARMUP_START), PlanEvent(4, PlanEventKind.MARK, 3.0),
                          PlanEvent(7, PlanEventKind.MARK, 6.5))
    assert got.n_after_last_op == 1   # the step ending at 20 is after op 9: a replay makes no event there


def test_no_optimizer_step_no_event() -> None:
    assert infer_step_marks(None, 0, np.arange(4.0)).events == ()
    assert infer_step_marks([ann("Optimizer.zero_grad#AdamW.zero_grad", "END", 1.0)], 0, np.arange(4.0)).events == ()


def test_another_devices_steps_are_not_this_devices_marks() -> None:
    got = infer_step_marks(step(1.0, device=1) + step(2.0), 0, np.arange(4.0))
    assert [e.at_op for e in got.events] == [0, 3]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=40),
       st.lists(st.floats(-5, 120, allow_nan=False), max_size=12))
def test_each_mark_follows_exactly_the_ops_at_or_before_its_step(op_times: list[float], ends: list[float]) -> None:
    """One mark at each op that follows a step's end (several ends there: one mark); of the ends before the first
    op (the annotations' ring reaches further back than the ops'), the last marks op 0; none after the last. Ranges that overlap
    (no program's) do not pair: no mark, and a reason (the test below)."""
    times = np.sort(np.asarray(op_times, dtype=np.float64))
    ends = sorted(set(ends))
    name = "Optimizer.step#AdamW.step"   # ranges that do not overlap, as a program's steps
    ranges = [a for k, t in enumerate(ends)
              for a in (ann(name, "START", t - 1 if k == 0 else (ends[k - 1] + t) / 2), ann(name, "END", t))]
    got = infer_step_marks(ranges, 0, times)
    marks = [e.at_op for e in got.events if e.kind is PlanEventKind.MARK]
    inside = [t for t in ends if t >= times[0]]
    want = sorted({int(np.count_nonzero(times <= t)) for t in inside} - {len(times)}
                  | ({0} if len(inside) < len(ends) else set()))   # the last end before the first op marks op 0
    assert marks == want
    assert got.n_before_first_op == max(0, len(ends) - len(inside) - 1)
    assert got.n_after_last_op == sum(1 for t in inside if np.count_nonzero(times <= t) == len(times))


def test_an_annotation_not_an_optimizers_is_not_read_even_malformed() -> None:
    got = infer_step_marks([{"name": "my range"}, {"stage": "END"}, *step(2.0)], 0, np.arange(4.0))
    assert [e.at_op for e in got.events] == [0, 3]


def test_huge_times_are_refused_as_not_finite_and_another_devices_ranges_serve_a_sole_device() -> None:
    with pytest.raises(TraceFormatError, match="no finite time_us"):
        infer_step_marks([ann("Optimizer.step#A.step", "END", 10 ** 400)], 0, np.arange(4.0))
    ranges = step(2.0, device=0)   # PyTorch records a range on the thread's current device
    assert infer_step_marks(ranges, 1, np.arange(4.0)).events == ()
    assert "recorded on device(s) [0]" in infer_step_marks(ranges, 1, np.arange(4.0)).reason
    assert [e.at_op for e in infer_step_marks(ranges, 1, np.arange(4.0), sole_device=True).events] == [0, 3]


def test_zero_grad_twice_an_iteration_is_no_skipped_step() -> None:
    """zero_grad at the top and again right after the update (review 42): the short interval between the two is
    no iteration, so no mark is made there."""
    a = []
    for i in range(5):
        a += zero_grad(i * 10 + 0.5) + step(i * 10 + 6.0) + zero_grad(i * 10 + 9.6)   # the second ends the loop
    got = infer_step_marks(a, 0, np.arange(50.0))
    assert [e.at_op for e in got.events if e.kind is PlanEventKind.MARK] == [7, 17, 27, 37, 47]
    assert got.n_skipped == 0


def test_a_skipped_first_iteration_is_marked_and_a_zero_grad_before_the_loop_is_not() -> None:
    got = infer_step_marks(loop(4, {0}), 0, np.arange(40.0))
    assert [e.at_op for e in got.events if e.kind is PlanEventKind.MARK] == [7, 17, 27, 37]


def test_zero_grad_after_the_update_ends_no_iteration_at_the_trace_end() -> None:
    """A loop that zeroes after its update leaves the interval after its last zero_grad without a step: not a
    skipped step (review 42: it was counted one, and dropped every mark where the gaps varied)."""
    a = []
    for i in range(5):
        a += step(10 * i + 6.5) + zero_grad(10 * i + 7.5 + (i % 2))
    got = infer_step_marks(a, 0, np.arange(50.0))
    assert got.reason is None and got.n_skipped == 0
    assert [e.at_op for e in got.events if e.kind is PlanEventKind.MARK] == [7, 17, 27, 37, 47]


def zero_grad(time_start: float, cls: str = "AdamW") -> list[dict[str, Any]]:
    name = f"Optimizer.zero_grad#{cls}.zero_grad"
    return [ann(name, "START", time_start), ann(name, "END", time_start + 0.1)]


def loop(n_iters: int, skipped: set[int], step_at: float = 6.0, length: int = 10) -> list[dict[str, Any]]:
    """A loop of ``n_iters`` iterations of ``length`` ops each (one op per microsecond): zero_grad at the top
    (time ``i * length + 0.5``), the step ending at ``step_at`` into it unless skipped."""
    out = zero_grad(-0.5)   # a zero_grad before the loop: no iteration of it
    for i in range(n_iters):
        out += zero_grad(i * length + 0.5)
        if i not in skipped:
            out += step(i * length + step_at)
    return out


def test_a_step_gradscaler_skipped_is_marked_where_the_others_stand_in_their_iteration() -> None:
    got = infer_step_marks(loop(5, {2, 4}), 0, np.arange(50, dtype=np.float64))
    assert got.reason is None and got.n_skipped == 1
    # each mark 7 ops into its iteration (after ops at times 0..6), the skipped third's too; the last iteration's
    # skipped step has no zero_grad after it to place it by
    assert [e.at_op for e in got.events if e.kind is PlanEventKind.MARK] == [7, 17, 27, 37]


def test_skipped_steps_whose_place_the_iterations_do_not_fix_make_no_event() -> None:
    a = loop(4, {2}) + step(18.0)   # iteration 1 steps twice: zero_grad is not once per step, nothing skipped
    assert infer_step_marks(a, 0, np.arange(40.0)).n_skipped == 0
    b = [x for x in loop(5, {2}) if x["time_us"] not in (15.0, 16.0)] + step(18.0)   # iteration 1's ends later
    got = infer_step_marks(b, 0, np.arange(50.0))
    assert got.events == () and "differ from one iteration to the next" in got.reason


# -- where none are read: said, never guessed ---------------------------------------------------------------------


def test_step_ranges_that_do_not_pair_make_no_event_and_say_why() -> None:
    a = [ann("Optimizer.step#AdamW.step", "START", 1.0), ann("Optimizer.step#AdamW.step", "END", 2.0),
         ann("Optimizer.step#AdamW.step", "END", 3.0)] + zero_grad(0.5) + zero_grad(2.5)
    got = infer_step_marks(a, 0, np.arange(6.0))
    assert got.events == () and "do not pair" in got.reason


def test_a_ring_that_begins_inside_a_step_still_reads_the_skipped_ones() -> None:
    """The ops' ring began inside a step (review 42): its START is gone, its END pairs with op 0, and the steps
    GradScaler skipped later are read as before."""
    times = np.arange(5.5, 50.0)   # step 0 runs from 5 to 6
    got = infer_step_marks(loop(5, {2}), 0, times)
    assert got.reason is None and got.n_skipped == 1
    assert [e.at_op for e in got.events if e.kind is PlanEventKind.MARK] == [1, 11, 21, 31, 41]


def test_a_closures_zero_grad_inside_the_step_delimits_no_iteration() -> None:
    """LBFGS calls its closure, which zeroes the gradients, inside its step (review 42): 18 marks were read for 6
    steps."""
    a = []
    for i in range(6):
        a.append(ann("Optimizer.step#LBFGS.step", "START", i * 10 + 0.5))
        for c in range(3):
            a += zero_grad(i * 10 + 1.5 + 2 * c, "LBFGS")
        a.append(ann("Optimizer.step#LBFGS.step", "END", i * 10 + 8.5))
    got = infer_step_marks(a, 0, np.arange(60.0))
    assert got.reason is None and got.n_skipped == 0
    assert [e.at_op for e in got.events if e.kind is PlanEventKind.MARK] == [9, 19, 29, 39, 49, 59]


def test_two_optimizer_classes_make_no_event_and_say_why() -> None:
    got = infer_step_marks(step(1.0, "AdamW") + step(2.0, "SGD"), 0, np.arange(4.0))
    assert got.events == () and "2 optimizer classes" in got.reason


def test_op_times_that_go_back_make_no_event_and_say_why() -> None:
    got = infer_step_marks(step(1.0), 0, np.array([0.0, 3.0, 2.0, 4.0]))
    assert got.events == () and "go back" in got.reason


@pytest.mark.parametrize("bad, says", [
    ({"a": 1}, "not a list"),
    (["x"], "external_annotations[0] is a str"),
    ([{"stage": 3, "name": "Optimizer.step#A.step", "device": 0, "time_us": 1.0}], "no string stage"),
    ([{"stage": "END", "name": "Optimizer.step#A.step", "time_us": 1.0}], "no device in [-1, 65536)"),
    ([{"stage": "END", "name": "Optimizer.step#A.step", "device": True, "time_us": 1.0}], "no device in [-1, 65536)"),
    ([{"stage": "END", "name": "Optimizer.step#A.step", "device": 0, "time_us": float("nan")}], "no finite time_us"),
    ([{"stage": "END", "name": "Optimizer.step#A.step", "device": 0, "time_us": "1"}], "no finite time_us"),
])
def test_malformed_annotations_are_refused_naming_the_file(tmp_path: Path, bad: Any, says: str) -> None:
    path = write(tmp_path / "bad.pickle.gz", snapshot(3, bad))
    with pytest.raises(TraceFormatError, match=r"bad\.pickle\.gz") as err:
        load_trace(path, progress=False)
    assert says in str(err.value)


def test_a_snapshot_file_gives_its_marks_and_step_marks_false_leaves_them_out(tmp_path: Path) -> None:
    path = write(tmp_path / "s.pickle.gz", snapshot(4, step(2.5) + step(5.5)))
    t = load_trace(path, progress=False)
    assert [(e.at_op, e.kind) for e in t.plan_events] == [(0, PlanEventKind.WARMUP_START), (3, PlanEventKind.MARK),
                                                           (6, PlanEventKind.MARK)]
    assert load_trace(path, progress=False, step_marks=False).plan_events == ()
    assert load_trace(write(tmp_path / "n.pickle.gz", snapshot(4, None)), progress=False).plan_events == ()


# -- against the live run: the snapshot and gpumem.torch's own trace of the same program --------------------------


@pytest.mark.parametrize("folder, workload", [(PAIRS, "unet_train"), (PAIRS, "resnet50_train"),
                                              (RUN_A, "gpt2_train_fp16_scaler")])
def test_the_marks_are_where_gpumem_torch_made_them_and_the_replay_is_the_live_runs(folder: Path, workload: str) -> None:
    """Both runs of one program on the H200 (PyTorch's allocator recording a snapshot, gpumem.torch its own trace
    with the marks it made): every mark read off the snapshot stands at the op where gpumem.torch made it, and
    the snapshot's replay under the gpumem policy holds what the gpumem trace's does to the byte (the live
    overhead: UNet 0.69 %, ResNet-50 0.80 %, GPT-2 fp16 with GradScaler 0.87 %: 16 of its 40 steps skipped, the
    last iteration's skipped mark not placed); without the marks it predicted an unplanned run."""
    snap = load_trace(folder / f"{workload}.default.snapshot.pickle.gz", progress=False)
    own = load_trace(folder / f"{workload}.gpumem.gmt.gz", progress=False, step_marks=True)
    marks = [e.at_op for e in snap.plan_events if e.kind is PlanEventKind.MARK]
    made = [e.at_op for e in own.plan_events if e.kind is PlanEventKind.MARK]
    assert len(made) == 40 and len(marks) >= 39 and marks == made[:len(marks)]
    got = replay_trace(snap, progress=False, gpu_timing="trace")
    want = replay_trace(own, progress=False, gpu_timing="trace")
    assert got.peak_reserved_bytes == want.peak_reserved_bytes and got.peak_live_bytes == want.peak_live_bytes
    unplanned = replay_trace(load_trace(folder / f"{workload}.default.snapshot.pickle.gz", progress=False,
                                        step_marks=False), progress=False)
    assert unplanned.overhead > got.overhead + 0.01


def test_cli_replay_says_so_and_no_step_marks_leaves_them_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = PAIRS / "unet_train.default.snapshot.pickle.gz"
    assert cli_main(["replay", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "40 step marks and 1 warm-up switch(es), read off the snapshot's optimizer steps" in out
    assert "made" not in out and "0.69%" in out
    assert cli_main(["replay", str(trace), "--no-step-marks"]) == 0
    out = capsys.readouterr().out
    assert "step marks     left out (--no-step-marks)" in out and "4.00%" in out
    assert cli_main(["replay", str(trace), "--policy", "pytorch"]) == 0
    assert "(not made: this policy has no step plans)" in capsys.readouterr().out


# -- two optimizers of one class (Note [Two optimizers of one class]) ---------------------------------------------


def _two_optimizer_ops(pattern: str, sizes: dict[str, int | tuple[int, ...]], state: str | None = None,
                       free_state: bool = False
                       ) -> tuple[list[dict[str, Any]], np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Annotations and ops of a loop whose steps are ``pattern`` (one letter per optimizer step, e.g. "ababab"):
    each step range allocates and frees ``sizes[letter]`` bytes (one size or several), after a forward op pair;
    the first step of each letter in ``state`` (default: every letter) also makes its state, one allocation of
    its first size, never freed (``free_state``: freed after the loop, as a snapshot dumped after the optimizers
    were deleted has it). Returns the annotations, times, kinds, sizes, allocation ids and each step's last op."""
    state = set(pattern) if state is None else set(state)
    annotations, times, kinds, nbytes, ids, last = [], [], [], [], [], []
    t, next_id, seen, states = 0.0, 0, set(), []

    def op(kind: int, n: int, i: int) -> None:
        nonlocal t
        times.append(t), kinds.append(kind), nbytes.append(n), ids.append(i)
        t += 1

    for letter in pattern:
        op(0, 1 << 20, next_id), op(1, 1 << 20, next_id)   # the forward/backward's op pair
        next_id += 1
        annotations.append(ann("Optimizer.step#AdamW.step", "START", t))
        t += 1
        step_sizes = sizes[letter] if isinstance(sizes[letter], tuple) else (sizes[letter],)
        if letter in state and letter not in seen:
            op(0, step_sizes[0], next_id)   # the optimizer's state, live to the end
            states.append((step_sizes[0], next_id))
            next_id += 1
        seen.add(letter)
        for size in step_sizes:
            op(0, size, next_id), op(1, size, next_id)
            next_id += 1
        last.append(len(times) - 1)
        annotations.append(ann("Optimizer.step#AdamW.step", "END", t))
        t += 1
    op(0, 1 << 20, next_id), op(1, 1 << 20, next_id)   # the next forward: the last step's mark stands before it
    for size, i in states if free_state else ():
        op(1, size, i)
    return (annotations, np.asarray(times), np.asarray(kinds, np.int8), np.asarray(nbytes, np.int64),
            np.asarray(ids, np.int64), last)


def _marked_steps(pattern: str, sizes: dict[str, int | tuple[int, ...]], state: str | None = None,
                  free_state: bool = False) -> tuple[list[int], int]:
    annotations, times, kinds, nbytes, ids, last = _two_optimizer_ops(pattern, sizes, state, free_state)
    got = infer_step_marks(annotations, 0, times, kinds=kinds, nbytes=nbytes, alloc_ids=ids)
    at = {op + 1: k for k, op in enumerate(last)}   # a mark stands after its step's last op
    return [at[e.at_op] for e in got.events if e.kind is PlanEventKind.MARK], got.n_optimizers


def test_a_gans_two_optimizers_of_one_class_mark_with_the_first_that_stepped() -> None:
    """Before: each range a mark (the GAN of snapshot-marks-h200-2026-12-01 predicted 3.82 % for 1.05 % live)."""
    assert _marked_steps("ab" * 6, {"a": 4096, "b": 8192}) == ([0, 2, 4, 6, 8, 10], 2)
    assert _marked_steps("ba" * 6, {"a": 4096, "b": 8192}) == ([0, 2, 4, 6, 8, 10], 2)


def test_a_gan_recorded_after_its_first_steps_or_dumped_after_its_optimizers_went_is_still_two() -> None:
    """Re-check 43 (F1, F2): a history turned on after warm-up steps (or a run resumed from a checkpoint) has no
    step that makes state, and a snapshot dumped after the optimizers were deleted has none live at its end; both
    were read as one optimizer, each range a mark (the GAN back to 48 marks). Steps whose sets neither contains
    the other, or a first step's allocation outliving its set's next step, are two optimizers."""
    gan = {"a": (4096, 512), "b": (8192, 512)}
    assert _marked_steps("ab" * 6, gan, state="") == ([0, 2, 4, 6, 8, 10], 2)
    assert _marked_steps("ab" * 6, gan, free_state=True) == ([0, 2, 4, 6, 8, 10], 2)
    assert _marked_steps("ab" * 6, {"a": (4096, 512), "b": (4096, 512, 8192)}, free_state=True) \
        == ([0, 2, 4, 6, 8, 10], 2)   # b's steps allocate a's sizes and more, but both made state


def test_steps_alike_or_one_after_the_other_are_one_optimizers() -> None:
    """Steps that allocate alike cannot be told apart (every range marks, a stated limit); a step whose
    allocations change once (a first step making its state, a fine-tune that unfreezes) is no second optimizer."""
    assert _marked_steps("ab" * 4, {"a": 4096, "b": 4096}) == (list(range(8)), 1)
    assert _marked_steps("aaaabbbb", {"a": 4096, "b": 8192}) == (list(range(8)), 1)
    assert _marked_steps("c" + "ab" * 4, {"a": 4096, "b": 8192, "c": 512}) == (list(range(9)), 1)


def test_one_optimizer_whose_steps_vary_is_one_optimizer() -> None:
    """Attacker 43: a set of sizes met between another's steps is not enough. A preconditioner refreshed every
    tenth step (Shampoo, SOAP) or a set that changes and changes back (unfreeze, refreeze): every range marks,
    as gpumem.torch's one optimizer does, since the second set's first step makes no state or it is not
    between two of the other's."""
    refresh = {"a": (4096, 512), "b": (4096, 512, 8192)}   # the refresh step updates as every step does, and more
    assert _marked_steps(("b" + "a" * 9) * 5, refresh, state="b") == (list(range(50)), 1)
    assert _marked_steps(("b" + "a" * 9) * 5, refresh, state="") == (list(range(50)), 1)
    assert _marked_steps("a" * 5 + "b" * 5 + "a" * 5, {"a": 4096, "b": 8192}) == (list(range(15)), 1)
    assert _marked_steps("ab" * 6, refresh, state="a") == (list(range(12)), 1)


def test_sizes_of_another_length_than_the_ops_are_refused() -> None:
    annotations, times, kinds, nbytes, ids, _ = _two_optimizer_ops("abab", {"a": 4096, "b": 8192})
    with pytest.raises(InvalidArgumentError, match="one integer per op"):
        infer_step_marks(annotations, 0, times, kinds=kinds, nbytes=nbytes[:-1], alloc_ids=ids)


@pytest.mark.parametrize("bad", ["float", "bool", "short", "kinds", "one_end"])
def test_ids_sizes_and_kinds_not_one_integer_per_op_are_refused(bad) -> None:
    """Attacker 44: float or bool ids raised IndexError, a wrong length went unchecked with one step END or
    failed inside the skipped-step reading first."""
    pattern = "a" if bad == "one_end" else "abab"
    annotations, times, kinds, nbytes, ids, _ = _two_optimizer_ops(pattern, {"a": 4096, "b": 8192})
    if bad == "float":
        ids = ids.astype(float)
    elif bad == "bool":
        ids = ids % 2 == 0
    elif bad in ("short", "one_end"):
        nbytes = nbytes[:-1]
    else:
        kinds = kinds[:-1]
    with pytest.raises(InvalidArgumentError, match="one integer per op"):
        infer_step_marks(annotations, 0, times, kinds=kinds, nbytes=nbytes, alloc_ids=ids)


def test_sparse_huge_ids_are_read_in_the_ops_count() -> None:
    """Attacker 44: the free of each op was looked up in an array as long as the largest id (2**40: 8 TiB)."""
    annotations, times, kinds, nbytes, ids, last = _two_optimizer_ops("ab" * 6, {"a": 4096, "b": 8192})
    got = infer_step_marks(annotations, 0, times, kinds=kinds, nbytes=nbytes, alloc_ids=ids + (1 << 40))
    want = infer_step_marks(annotations, 0, times, kinds=kinds, nbytes=nbytes, alloc_ids=ids)
    assert got.events == want.events and got.n_optimizers == want.n_optimizers == 2


def test_many_distinct_step_sets_are_read_in_linear_time() -> None:
    """Attacker 43: each range's set looked up in a list of the sets (16,000 sets: 3.3 s, 64,000: 107 s). Not a
    timed test: 40,000 ranges of 20,000 sets must simply finish (in about a second)."""
    k = 20_000
    pattern = [i for i in range(k)] * 2
    annotations, times, kinds, nbytes, ids = [], [], [], [], []
    for j, i in enumerate(pattern):
        annotations += [ann("Optimizer.step#AdamW.step", "START", 4 * j + 0.5),
                        ann("Optimizer.step#AdamW.step", "END", 4 * j + 2.5)]
        times += [4 * j, 4 * j + 1, 4 * j + 2]
        kinds += [0, 0, 1]
        nbytes += [512, 1024 * (i + 1), 1024 * (i + 1)]
        ids += [2 * j, 2 * j + 1, 2 * j + 1]
    got = infer_step_marks(annotations, 0, np.asarray(times, float), kinds=np.asarray(kinds, np.int8),
                           nbytes=np.asarray(nbytes), alloc_ids=np.asarray(ids))
    assert got.n_optimizers == 1 and len(got.events) == 2 * k   # no state made: one optimizer, every range marks


def test_a_critic_that_steps_first_hands_the_marks_to_the_rarer_generator() -> None:
    """The WGAN of two-optimizers-h200-2026-12-01: five critic steps per generator step, the critic's first;
    gpumem.torch's MarkerRule hands the marks to the generator at its second step (each after five of the critic's)."""
    steps, n = _marked_steps("cccccg" * 4, {"c": 4096, "g": 8192})
    assert n == 2 and steps == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 17, 23]


def test_the_marker_rule_keeps_a_gans_and_a_finders_marks_where_it_did() -> None:
    from gpumem.torch import HANDOVER_MIN_STEPS, MarkerRule

    rule = MarkerRule()
    assert [rule.stepped(k) for k in "abababab"] == [True, False] * 4
    rule = MarkerRule()   # an LR finder's three steps, then the real optimizer: the floor hands over
    got = [rule.stepped(k) for k in "aaa" + "b" * (HANDOVER_MIN_STEPS + 2) + "a"]
    assert got == [True] * 3 + [False] * (HANDOVER_MIN_STEPS - 1) + [True] * 3 + [False]
    rule = MarkerRule()   # a generator that stepped first keeps the marks over a critic's ten steps
    assert [rule.stepped(k) for k in ("g" + "c" * 10) * 3] == ([True] + [False] * 10) * 3
    rule = MarkerRule()   # an auxiliary optimizer stepping once per hundred steps never takes over (attacker 43)
    assert [rule.stepped(k) for k in ("a" * 100 + "b") * 6] == ([True] * 100 + [False]) * 6
    rule = MarkerRule()   # a WGAN's generator, once it took over, keeps the marks (it learnt the critic's gap)
    got = [rule.stepped(k) for k in ("c" * 5 + "g") * 30]
    assert got[12:] == ([False] * 5 + [True]) * 28
    # new user 43: a critic of 20 steps per generator step, and WGAN's schedule (100 critic steps per generator
    # step for 25, then 5), flapped between the two every few iterations; now at most one hand-over
    for pattern in (("c" * 20 + "g") * 10, ("c" * 100 + "g") * 25 + ("c" * 5 + "g") * 35):
        rule, owners = MarkerRule(), []
        for k in pattern:
            rule.stepped(k)
            owners.append(rule.marker)
        assert sum(1 for a, b in zip(owners, owners[1:]) if a != b) <= 1


@pytest.mark.parametrize("folder, workload, n", [
    (ROOT / "reports" / "hil" / "snapshot-marks-h200-2026-12-01" / "check", "gan_train", 24),
    (ROOT / "reports" / "hil" / "two-optimizers-h200-2026-12-01" / "check", "gan_gen_first_train", 24)])
def test_a_gans_marks_are_where_gpumem_torch_made_them(folder: Path, workload: str, n: int) -> None:
    """Two AdamW, told apart by their steps' allocations: every mark at gpumem.torch's op, the replay its own
    trace's to the byte (live 1.05 % and 6.62 %)."""
    snap = load_trace(folder / f"{workload}.default.snapshot.pickle.gz", progress=False)
    own = load_trace(folder / f"{workload}.gpumem.gmt.gz", progress=False)
    marks = [e.at_op for e in snap.plan_events if e.kind is PlanEventKind.MARK]
    assert marks == [e.at_op for e in own.plan_events if e.kind is PlanEventKind.MARK] and len(marks) == n
    got = replay_trace(snap, progress=False, gpu_timing="trace")
    assert got.peak_reserved_bytes == replay_trace(own, progress=False, gpu_timing="trace").peak_reserved_bytes


def test_load_trace_refuses_a_step_marks_that_is_not_a_bool(tmp_path: Path) -> None:
    """New user 43: ``step_marks='off'`` was read as true."""
    path = write(tmp_path / "s.pickle.gz", snapshot(4, step(3.5)))
    for bad in ("off", 0, None):
        with pytest.raises(InvalidArgumentError, match="step_marks must be True or False"):
            load_trace(path, progress=False, step_marks=bad)  # type: ignore[arg-type]
