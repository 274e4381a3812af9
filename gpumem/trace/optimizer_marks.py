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

    Read only where it is unambiguous; otherwise no event is made and :attr:`InferredMarks.reason` says why
    (the replay then predicts a run without plans, as before), never a guess:

    * steps of more than one optimizer class: gpumem.torch marks with one optimizer per device and hands over
      by rules a snapshot cannot follow (it names the class, not the object);
    * op times that go back (several threads allocating): the op before a range's end is not defined.

    Not seen by a snapshot, so not made: a step GradScaler skipped (no range; gpumem.torch marks it all the
    same), a step inside a CUDA-graph capture (a range; gpumem.torch makes no mark there), and two optimizers
    of one class (each range is read as a mark, where gpumem.torch marks with the first only).
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


@dataclass(frozen=True)
class InferredMarks:
    """What a snapshot's annotations say of gpumem.torch's step marks (Note [Step marks read off a snapshot's
    optimizer steps]): the ``events`` to make (none when ``reason`` says why not), the optimizer class whose
    steps marked, and how many of its step ends fell after the last op (not made, as a replay makes no event
    there)."""

    events: tuple[PlanEvent, ...] = ()
    optimizer: str | None = None
    reason: str | None = None
    n_after_last_op: int = 0


def _step_ends(annotations: Any, device: int, where: str) -> list[tuple[float, str]]:
    """``(time_us, optimizer class)`` of every optimizer step range's END on ``device``, in time order."""
    if annotations is None:
        return []
    if not isinstance(annotations, list):
        raise TraceFormatError(where, f"external_annotations is a {type(annotations).__name__}, not a list")
    ends = []
    for i, a in enumerate(annotations):
        if not isinstance(a, dict):
            raise TraceFormatError(where, f"external_annotations[{i}] is a {type(a).__name__}, not a dict")
        name, stage, dev, t = a.get("name"), a.get("stage"), a.get("device"), a.get("time_us")
        if not isinstance(name, str) or not isinstance(stage, str):
            raise TraceFormatError(where, f"external_annotations[{i}] has no string name and stage")
        if not name.startswith(OPTIMIZER_STEP_PREFIX) or stage != "END":
            continue   # the program's own ranges, and every START: not a mark
        if isinstance(dev, bool) or not isinstance(dev, int):
            raise TraceFormatError(where, f"external_annotations[{i}] ({name}) has no integer device")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise TraceFormatError(where, f"external_annotations[{i}] ({name}) has no finite time_us")
        if dev == device:
            cls = name[len(OPTIMIZER_STEP_PREFIX):]
            ends.append((float(t), cls[:-len(".step")] if cls.endswith(".step") else cls))
    ends.sort(key=lambda e: e[0])
    return ends


def infer_step_marks(annotations: Any, device: int, times_us: np.ndarray, where: str = "<snapshot>") -> InferredMarks:
    """The step-plan events gpumem.torch would have made in a program whose snapshot has ``annotations``
    (its ``external_annotations``) and whose ops on ``device`` ran at ``times_us`` (Note [Step marks read off a
    snapshot's optimizer steps]).

    Raises:
        TraceFormatError: the annotations are malformed (not a list of dicts, an optimizer range without a
            device or a finite time).
    """
    ends = _step_ends(annotations, device, where)
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
    at = np.searchsorted(times, [t for t, _ in ends], side="right")
    events = [PlanEvent(0, PlanEventKind.WARMUP_START)]
    events += [PlanEvent(int(k), PlanEventKind.MARK, t) for k, (t, _) in zip(at, ends) if k < n]
    return InferredMarks(tuple(events), classes[0], None, int(np.count_nonzero(at >= n)))
