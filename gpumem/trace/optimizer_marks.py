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
    (the weights) is made once. On the four programs recorded both ways on the H200
    (``reports/hil/live-vs-predicted-h200-2026-11-29-default-marks``), the snapshot replayed with these events
    gives the live gpumem.torch figures to 0.01 point: 0.56, 0.80, 1.01, 0.69 %.

    A step GradScaler skips (inf or NaN gradients) has no range, but gpumem.torch marks it all the same, where
    the update would have ended; left out, the replay's plan misses every step after it (GPT-2 fp16 with
    GradScaler, 16 of 40 steps skipped: 88.3 % predicted, 0.87 % live). Where each iteration's
    ``Optimizer.zero_grad#`` range starts once and the ops from a step's end to the next iteration's
    ``zero_grad`` are as many in every iteration, an iteration without a step is a skipped one, its mark that
    many ops before the next ``zero_grad`` (every one of the 39 placed stands where gpumem.torch made it; the
    last iteration's, with no ``zero_grad`` after it, is not made).

    Read only where it is unambiguous; otherwise no event is made and :attr:`InferredMarks.reason` says why
    (the replay then predicts a run without plans, as before), never a guess: steps of more than one
    optimizer class (gpumem.torch marks with one optimizer per device and hands over by rules a snapshot cannot
    follow: it names the class, not the object); op times that go back (several threads); skipped steps whose
    place the iterations do not fix. Not seen by a snapshot, so not made: a skipped step in a loop that calls
    no ``optimizer.zero_grad()``, a step inside a CUDA-graph capture (gpumem.torch makes no mark there), and two
    optimizers of one class (each range is read as a mark, where gpumem.torch marks with the first only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import TraceFormatError
from .model import PlanEvent, PlanEventKind

__all__ = ["InferredMarks", "OPTIMIZER_STEP_PREFIX", "infer_step_marks"]

#: The name PyTorch gives every optimizer's step range (``torch.optim.Optimizer.profile_hook_step``).
OPTIMIZER_STEP_PREFIX = "Optimizer.step#"
#: The name PyTorch gives every optimizer's ``zero_grad`` range.
ZERO_GRAD_PREFIX = "Optimizer.zero_grad#"


@dataclass(frozen=True)
class InferredMarks:
    """What a snapshot's annotations say of gpumem.torch's step marks (Note [Step marks read off a snapshot's
    optimizer steps]): the ``events`` to make (none when ``reason`` says why not), the optimizer class whose
    steps marked, how many of its marks fell after the last op (not made, as a replay makes no event there),
    how many steps GradScaler skipped and, of those, how many could not be placed (the last iteration's)."""

    events: tuple[PlanEvent, ...] = ()
    optimizer: str | None = None
    reason: str | None = None
    n_after_last_op: int = 0
    n_skipped: int = 0
    n_skipped_unplaced: int = 0


def _ranges(annotations: Any, device: int, where: str) -> tuple[list[tuple[float, str]], list[tuple[float, str]]]:
    """``(time_us, optimizer class)`` of every optimizer step range's END and every ``zero_grad`` range's START on
    ``device``, each in time order."""
    if annotations is None:
        return [], []
    if not isinstance(annotations, list):
        raise TraceFormatError(where, f"external_annotations is a {type(annotations).__name__}, not a list")
    ends: list[tuple[float, str]] = []
    zeros: list[tuple[float, str]] = []
    for i, a in enumerate(annotations):
        if not isinstance(a, dict):
            raise TraceFormatError(where, f"external_annotations[{i}] is a {type(a).__name__}, not a dict")
        name, stage, dev, t = a.get("name"), a.get("stage"), a.get("device"), a.get("time_us")
        if not isinstance(name, str) or not isinstance(stage, str):
            raise TraceFormatError(where, f"external_annotations[{i}] has no string name and stage")
        if name.startswith(OPTIMIZER_STEP_PREFIX) and stage == "END":
            into, prefix, suffix = ends, OPTIMIZER_STEP_PREFIX, ".step"
        elif name.startswith(ZERO_GRAD_PREFIX) and stage == "START":
            into, prefix, suffix = zeros, ZERO_GRAD_PREFIX, ".zero_grad"
        else:
            continue   # the program's own ranges, and the other stages: not a mark
        if isinstance(dev, bool) or not isinstance(dev, int):
            raise TraceFormatError(where, f"external_annotations[{i}] ({name}) has no integer device")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise TraceFormatError(where, f"external_annotations[{i}] ({name}) has no finite time_us")
        if dev == device:
            cls = name[len(prefix):]
            into.append((float(t), cls[:-len(suffix)] if cls.endswith(suffix) else cls))
    ends.sort(key=lambda e: e[0])
    zeros.sort(key=lambda e: e[0])
    return ends, zeros


def _skipped_steps(ends_us: list[float], zeros_us: list[float], times: np.ndarray) -> tuple[list[int], int, str | None]:
    """Where gpumem.torch marked the steps GradScaler skipped (Note [Step marks read off a snapshot's optimizer
    steps]): the ops of those marks, how many skipped steps could not be placed (the last iteration's, with no
    ``zero_grad`` after it), and why none can be read (None: all placed, or none skipped)."""
    if len(zeros_us) < 2 or not ends_us:
        return [], 0, None
    e_us = np.asarray(ends_us)
    z_us = np.asarray(zeros_us + [math.inf])
    per_iteration = np.searchsorted(e_us, z_us[1:], side="left") - np.searchsorted(e_us, z_us[:-1], side="left")
    if (per_iteration > 1).any():
        return [], 0, None   # zero_grad not once per step: iterations are not what it delimits
    if not (per_iteration > 0).any():
        return [], 0, None
    first = int(np.argmax(per_iteration > 0))   # before the first step no step is skipped (zero_grad before the loop)
    skipped = [i for i in range(first, len(zeros_us)) if per_iteration[i] == 0]
    if not skipped:
        return [], 0, None
    z_ops = np.searchsorted(times, zeros_us, side="right")
    e_ops = np.searchsorted(times, ends_us, side="right")
    k = np.searchsorted(e_us, z_us[:-1], side="left")   # the step of iteration i, where it has one
    gaps = {int(z_ops[i + 1] - e_ops[k[i]]) for i in range(first, len(zeros_us) - 1) if per_iteration[i] == 1}
    if len(gaps) != 1:
        return [], 0, (f"{len(skipped)} optimizer step(s) skipped (GradScaler) and the ops from a step's end to the "
                       "next zero_grad differ from one iteration to the next, so where gpumem.torch marked the "
                       "skipped ones is not in the snapshot")
    gap = gaps.pop()
    placed = [int(z_ops[i + 1]) - gap for i in skipped if i + 1 < len(zeros_us)]
    if any(op <= z_ops[i] for op, i in zip(placed, skipped)):
        return [], 0, ("a skipped optimizer step's mark would stand before its iteration's zero_grad: where "
                       "gpumem.torch marked it is not in the snapshot")
    return placed, len(skipped) - len(placed), None


def infer_step_marks(annotations: Any, device: int, times_us: np.ndarray, where: str = "<snapshot>") -> InferredMarks:
    """The step-plan events gpumem.torch would have made in a program whose snapshot has ``annotations``
    (its ``external_annotations``) and whose ops on ``device`` ran at ``times_us`` (Note [Step marks read off a
    snapshot's optimizer steps]).

    Raises:
        TraceFormatError: the annotations are malformed (not a list of dicts, an optimizer range without a
            device or a finite time).
    """
    ends, zeros = _ranges(annotations, device, where)
    if not ends:
        return InferredMarks()
    classes = sorted({c for _, c in ends})
    if len(classes) > 1:
        return InferredMarks(reason=f"steps of {len(classes)} optimizer classes ({', '.join(classes[:4])}): "
                                    "which one gpumem.torch marks with is not in a snapshot")
    times = np.asarray(times_us, dtype=np.float64)
    n = len(times)
    if n > 1 and bool((np.diff(times) < 0).any()):
        return InferredMarks(optimizer=classes[0], reason="the ops' times go back (several threads): the op "
                                                          "before an optimizer step's end is not defined")
    skipped, unplaced, why = _skipped_steps([t for t, _ in ends], [t for t, c in zeros if c == classes[0]], times)
    if why is not None:
        return InferredMarks(optimizer=classes[0], reason=why)
    at = np.searchsorted(times, [t for t, _ in ends], side="right")
    marks = sorted([(int(k), t) for k, (t, _) in zip(at, ends)] + [(k, 0.0) for k in skipped])
    events = [PlanEvent(0, PlanEventKind.WARMUP_START)]
    events += [PlanEvent(k, PlanEventKind.MARK, t) for k, t in marks if k < n]
    return InferredMarks(tuple(events), classes[0], None, sum(1 for k, _ in marks if k >= n), len(skipped) + unplaced,
                         unplaced)
