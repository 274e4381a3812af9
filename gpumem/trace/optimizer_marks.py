"""Step marks of a PyTorch snapshot, read off its optimizer steps.

Note [Step marks read off a snapshot's optimizer steps]
    gpumem.torch marks a step plan's step at the end of every optimizer step and begins the plans' memory-first
    warm-up when the first optimizer on a GPU is made (Note [Automatic step marks] in :mod:`gpumem.torch`, on
    by default); its own traces record both (:class:`~gpumem.trace.model.PlanEvent`). A PyTorch snapshot records
    neither, so its replay under the ``gpumem`` policy predicted a run without plans: 5.5 % above peak live on
    GPT-2 fp32 where gpumem.torch held 0.56 % live on the same program. But ``_record_memory_history`` keeps the
    program's ``record_function`` ranges (``external_annotations``), and every optimizer's step runs inside
    one named ``Optimizer.step#<class>.step`` whose global post-hooks, gpumem.torch's mark among them, run just
    before the range ends. So a mark stands after the last op at or before each such range's END, and the
    warm-up begins at op 0: the optimizer is made before its first step, and what is allocated before it
    (the weights) is made once. Step ends before the first op (the annotations' ring keeps as many entries as
    the ops', so it reaches further back) or after the last make no mark; several at one op make one.

    A step GradScaler skips (inf or NaN gradients) has no range, but gpumem.torch marks it all the same, where
    the update would have ended; left out, the replay's plan misses every step after it (GPT-2 fp16 with
    GradScaler, 16 of 40 steps skipped: 88.3 % predicted, 0.87 % live). So where ``Optimizer.zero_grad#``
    ranges start at most once per step, an interval between two of them with no step and at least as many ops
    as a stepped one less its update's is a skipped iteration (a shorter one, zero_grad called twice, is
    none), its mark as many ops before the next ``zero_grad`` as every stepped iteration's stands, which must
    be one number. The interval after the last ``zero_grad`` is not read (a loop that zeroes after its update
    ends there; one that zeroes first may have skipped its last step: not made).

    On eleven H200 programs recorded under both allocators (``reports/snapshot-step-marks.md``), every mark
    stood at the op where gpumem.torch made it but one skipped last step and a GAN's (below), and the replay
    predicted live gpumem.torch within 0.00 points on all but variable lengths (+0.63: timing) and the GAN.
    Where the annotations cannot say (steps of two optimizer classes: gpumem.torch marks with one optimizer
    per device by rules a snapshot cannot follow, as it names the class, not the object; op times that go back;
    skipped steps whose iterations disagree on where their mark stands), no mark is made and a warning says
    why. **Marks made where gpumem.torch makes none**, which a snapshot cannot tell: two optimizers of one
    class (each range a mark, where gpumem.torch marks with the first: a GAN predicted 3.82 % for 1.05 % live),
    a step inside a CUDA-graph capture, an evaluation pass that zeroes gradients and is as long as a step.
    Not seen: a skipped step in a loop that never calls ``optimizer.zero_grad()``, and a skipped first step of
    a loop that zeroes after its update. ``load_trace(..., step_marks=False)`` reads a trace without marks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import TraceFormatError
from .limits import shorten
from .model import PlanEvent, PlanEventKind

__all__ = ["InferredMarks", "OPTIMIZER_STEP_PREFIX", "infer_step_marks"]

#: The name PyTorch gives every optimizer's step range (``torch.optim.Optimizer.profile_hook_step``).
OPTIMIZER_STEP_PREFIX = "Optimizer.step#"
#: The name PyTorch gives every optimizer's ``zero_grad`` range.
ZERO_GRAD_PREFIX = "Optimizer.zero_grad#"
_PREFIXES = (OPTIMIZER_STEP_PREFIX, ZERO_GRAD_PREFIX)
_OFF = " (step_marks=False, gpumem replay --no-step-marks, reads the trace without them)"


@dataclass(frozen=True)
class InferredMarks:
    """What a snapshot's annotations say of gpumem.torch's step marks (Note [Step marks read off a snapshot's
    optimizer steps]): the ``events`` to make (none when ``reason`` says why not), the optimizer class whose
    steps marked, how many step ends fell before the first op or after the last (not made: the annotations'
    ring reaches further back than the ops', and a replay makes no event after its last op), and how many
    steps GradScaler skipped (marked, placed by their iterations)."""

    events: tuple[PlanEvent, ...] = ()
    optimizer: str | None = None
    reason: str | None = None
    n_before_first_op: int = 0
    n_after_last_op: int = 0
    n_skipped: int = 0


@dataclass
class _Ranges:
    """The optimizer ranges of one device, in time order: each step's START and END, each ``zero_grad``'s START,
    with the optimizer's class."""

    step_starts: list[tuple[float, str]]
    step_ends: list[tuple[float, str]]
    zeros: list[tuple[float, str]]


def _finite(t: Any) -> bool:
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return False
    try:
        return math.isfinite(t)
    except OverflowError:   # an int past a float's range
        return False


_KINDS = ((OPTIMIZER_STEP_PREFIX, "START", ".step", "step_starts"), (OPTIMIZER_STEP_PREFIX, "END", ".step", "step_ends"),
          (ZERO_GRAD_PREFIX, "START", ".zero_grad", "zeros"))


def _ranges(annotations: Any, device: int | None, where: str) -> dict[int, _Ranges]:
    """The optimizer ranges of every device (``device`` None) or of one, by device."""
    if annotations is None:
        return {}
    if not isinstance(annotations, list):
        raise TraceFormatError(where, f"external_annotations is a {type(annotations).__name__}, not a list")
    out: dict[int, _Ranges] = {}
    for i, a in enumerate(annotations):
        if not isinstance(a, dict):
            raise TraceFormatError(where, f"external_annotations[{i}] is a {type(a).__name__}, not a dict{_OFF}")
        name = a.get("name")
        if not isinstance(name, str) or not name.startswith(_PREFIXES):
            continue   # the program's own ranges: not ours to read
        stage, dev, t = a.get("stage"), a.get("device"), a.get("time_us")
        if not isinstance(stage, str):
            raise TraceFormatError(where, f"external_annotations[{i}] ({shorten(name, 60)}) has no string stage{_OFF}")
        if isinstance(dev, bool) or not isinstance(dev, int):
            raise TraceFormatError(where, f"external_annotations[{i}] ({shorten(name, 60)}) has no integer "
                                          f"device{_OFF}")
        if not _finite(t):
            raise TraceFormatError(where, f"external_annotations[{i}] ({shorten(name, 60)}) has no finite "
                                          f"time_us{_OFF}")
        if device is not None and dev != device:
            continue
        for prefix, want, suffix, field_name in _KINDS:
            if name.startswith(prefix) and stage == want:
                cls = name[len(prefix):]
                cls = cls[:-len(suffix)] if cls.endswith(suffix) else cls
                got = out.setdefault(dev, _Ranges([], [], []))
                getattr(got, field_name).append((float(t), cls))
    for got in out.values():
        for lst in (got.step_starts, got.step_ends, got.zeros):
            lst.sort(key=lambda e: e[0])
    return out


def _skipped_steps(r: _Ranges, cls: str, times: np.ndarray) -> tuple[list[int], str | None]:
    """The ops of the marks gpumem.torch made for the steps GradScaler skipped (Note [Step marks read off a
    snapshot's optimizer steps]), and why none can be read (None: all placed, or none skipped)."""
    zeros_us = [t for t, c in r.zeros if c == cls]
    ends_us = [t for t, _ in r.step_ends]
    starts_us = [t for t, c in r.step_starts if c == cls]
    if len(zeros_us) < 2 or not ends_us or len(starts_us) != len(ends_us):
        return [], None
    z_us = np.asarray(zeros_us)
    e_us = np.asarray(ends_us)
    first_end = np.searchsorted(e_us, z_us, side="left")          # the first step ending after each zero_grad
    per_iteration = first_end[1:] - first_end[:-1]                  # steps ending in [zero_grad i, zero_grad i+1)
    if (per_iteration > 1).any() or not (per_iteration > 0).any():
        return [], None   # zero_grad not once per step: what it delimits is not an iteration
    z_ops = np.searchsorted(times, z_us, side="right")
    e_ops = np.searchsorted(times, e_us, side="right")
    s_ops = np.searchsorted(times, np.asarray(starts_us), side="right")
    stepped = np.flatnonzero(per_iteration == 1)
    k = first_end[stepped]                                          # each stepped iteration's step
    gaps = set((z_ops[stepped + 1] - e_ops[k]).tolist())
    # a skipped iteration is a stepped one short of its optimizer's ops; a step-less interval shorter than that
    # (zero_grad called twice, an evaluation pass that zeroes) is no iteration
    shortest = int(((z_ops[stepped + 1] - z_ops[stepped]) - (e_ops[k] - s_ops[k])).min())
    lengths = z_ops[1:] - z_ops[:-1]
    skipped = [int(i) for i in np.flatnonzero(per_iteration == 0) if lengths[i] >= shortest]
    if not skipped:
        return [], None
    if len(gaps) != 1:
        return [], (f"{len(skipped)} optimizer step(s) skipped (GradScaler) and the ops from a step's end to the "
                    "next zero_grad differ from one iteration to the next, so where gpumem.torch marked the "
                    "skipped ones is not in the snapshot")
    gap = gaps.pop()
    placed = [int(z_ops[i + 1]) - gap for i in skipped]
    if any(op <= z_ops[i] for op, i in zip(placed, skipped)):
        return [], ("a skipped optimizer step's mark would stand before its iteration's zero_grad: where "
                    "gpumem.torch marked it is not in the snapshot")
    return placed, None


def infer_step_marks(annotations: Any, device: int, times_us: np.ndarray, where: str = "<snapshot>", *,
                     sole_device: bool = False) -> InferredMarks:
    """The step-plan events gpumem.torch would have made in a program whose snapshot has ``annotations``
    (its ``external_annotations``) and whose ops on ``device`` ran at ``times_us`` (Note [Step marks read off a
    snapshot's optimizer steps]). ``sole_device``: ``device`` is the only one with ops, so optimizer ranges
    recorded on one other device are its program's (PyTorch records a range on the thread's current device).

    Raises:
        TraceFormatError: the annotations are malformed (not a list of dicts, an optimizer range without a
            stage, a device or a finite time).
    """
    by_device = _ranges(annotations, None, where)
    r = by_device.get(device)
    if (r is None or not r.step_ends) and sole_device:
        others = [d for d, got in by_device.items() if got.step_ends]
        if len(others) == 1:
            r = by_device[others[0]]
    if r is None or not r.step_ends:
        elsewhere = sorted(d for d, got in by_device.items() if got.step_ends)
        return InferredMarks(reason=None if not elsewhere else
                             f"its optimizer steps are recorded on device(s) {elsewhere[:4]}, its ops on {device}")
    classes = sorted({c for _, c in r.step_ends})
    if len(classes) > 1:
        return InferredMarks(reason=f"steps of {len(classes)} optimizer classes "
                                    f"({', '.join(shorten(c, 40) for c in classes[:4])}): which one gpumem.torch "
                                    "marks with is not in a snapshot")
    cls = classes[0]
    times = np.asarray(times_us, dtype=np.float64)
    n = len(times)
    if n > 1 and bool((np.diff(times) < 0).any()):
        return InferredMarks(optimizer=cls, reason="the ops' times go back (several threads): the op before an "
                                                   "optimizer step's end is not defined")
    before = sum(1 for t, _ in r.step_ends if n and t < times[0])
    ends = [(t, c) for t, c in r.step_ends if not (n and t < times[0])]
    kept = _Ranges([(t, c) for t, c in r.step_starts if not (n and t < times[0])], ends,
                   [(t, c) for t, c in r.zeros if not (n and t < times[0])])
    skipped, why = _skipped_steps(kept, cls, times)
    if why is not None:
        return InferredMarks(optimizer=cls, reason=why)
    at = np.searchsorted(times, [t for t, _ in ends], side="right")
    marks: dict[int, float] = {}
    for k, (t, _) in zip(at.tolist(), ends):
        marks.setdefault(int(k), t)
    for k in skipped:
        marks.setdefault(k, 0.0)
    events = [PlanEvent(0, PlanEventKind.WARMUP_START)]
    events += [PlanEvent(k, PlanEventKind.MARK, marks[k]) for k in sorted(marks) if k < n]
    return InferredMarks(tuple(events), cls, None, before, sum(1 for k in marks if k >= n), len(skipped))
