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
    (the weights) is made once. Of the step ends before the first op (the annotations' ring keeps as many
    entries as the ops', so it reaches further back), the last marks op 0; after the last op, none; several
    ends at one op make one mark.

    A step GradScaler skips (inf or NaN gradients) has no range, but gpumem.torch marks it all the same, where
    the update would have ended; left out, the replay's plan misses every step after it (GPT-2 fp16 with
    GradScaler, 16 of 40 steps skipped: 88.3 % predicted, 0.87 % live). So the ``Optimizer.zero_grad#`` ranges
    delimit iterations, where no two step ends fall between two of them (a ``zero_grad`` inside a step, a
    closure's, LBFGS's, delimits nothing). An interval between two with no step and at least half the
    allocations of a stepped one less its update's is a skipped iteration (a shorter one, ``zero_grad`` called
    twice, a short pass between, is none), its mark as many ops before the next ``zero_grad`` as every stepped
    iteration's stands, which must be one number. Each END pairs with the START before it (the first with op 0
    where the ops' ring began inside that step). The interval after the last ``zero_grad`` is not read (a loop
    that zeroes after its update ends there; one that zeroes first may have skipped its last step: not made).
    Where skipped steps may be but cannot be placed (ranges that do not pair, iterations that disagree on where
    the mark stands), **no mark is made at all**: a plan that misses every skipped step predicts worse than
    none.

    On eleven H200 programs recorded under both allocators (``reports/snapshot-step-marks.md``), every mark
    stood at the op where gpumem.torch made it but one skipped last step and a GAN's (below), and the replay
    predicted live gpumem.torch within 0.00 points on all but variable lengths (+0.63: timing) and the GAN.
    Where the annotations cannot say (steps of two optimizer classes: gpumem.torch marks with one optimizer
    per device by rules a snapshot cannot follow, as it names the class, not the object; op times that go back;
    skipped steps whose iterations disagree on where their mark stands), no mark is made and a warning says
    why. Two optimizers of one class are told apart by what their steps allocate (Note [Two optimizers of one
    class]). **Marks made where gpumem.torch makes none**, which a snapshot cannot tell: two optimizers of one
    class whose steps allocate alike (each range a mark), a step inside a CUDA-graph capture, a pass that zeroes
    gradients with no step and half an iteration's allocations (read as a skipped step). Not seen: a skipped step in a loop that never calls
    ``optimizer.zero_grad()``, the skipped first step of a loop that zeroes after its update, and steps run on a
    thread other than the one that turned the history on (PyTorch records that thread's ranges only, unless
    told otherwise). ``load_trace(..., step_marks=False)`` reads a trace without marks.

Note [Two optimizers of one class]
    gpumem.torch marks a device with one optimizer's steps (:class:`gpumem.torch.MarkerRule`: the first to step,
    handing over by its rules), and a snapshot names an optimizer's class, not the object: a GAN's two AdamW
    were read as 48 marks where gpumem.torch made 24 (3.82 % predicted, 1.05 % live). But an optimizer's step
    allocates what its own parameters' shapes ask (foreach temporaries, state made at its first step), so the
    set of sizes a step range allocates names its optimizer, and the ranges go through the same ``MarkerRule``.
    The evidence must hold three ways, since one optimizer's steps can vary too (a preconditioner refreshed
    every tenth step, parameters unfrozen and frozen again: attacker 43): each set met in two ranges or more
    (a first step with other sizes, SGD's momentum, leaves one met once), each between two ranges of another
    set at least once (sets one after the other are one optimizer whose step changed, or a hand-over the floor
    covers), and each set either making state in its first range (an allocation outliving the set's next range:
    a refresh step's temporaries do not) or neither holding nor held by another set (a refresh step allocates
    what every step does, and more). The second way is what a history turned on after the first steps, a run
    resumed from a checkpoint, or a snapshot dumped after the optimizers were deleted leaves (re-check 43);
    at most eight sets are judged by it. Else, as before, each range a mark; also where the ops' ring cut a
    range, a step ended before the first op or GradScaler skipped one (whose optimizer is not in the snapshot).
    Still misread as two: one optimizer whose steps alternate between sets that each make state first or
    neither hold the other (heads of a multi-task model stepped on alternate steps, ``a5 b5`` repeated, a
    lazily made refresh state). Two optimizers whose steps allocate alike or nothing (two SGD with momentum
    after their first steps) are read as one: each range a mark. Built on the GAN of
    ``reports/hil/snapshot-marks-h200-2026-12-01``; checked on three programs written after it
    (``reports/two-optimizers.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, TraceFormatError
from .limits import shorten
from ..marker_rule import MarkerRule
from .model import PlanEvent, PlanEventKind

__all__ = ["InferredMarks", "OPTIMIZER_STEP_PREFIX", "infer_step_marks"]

#: The name PyTorch gives every optimizer's step range (``torch.optim.Optimizer.profile_hook_step``).
OPTIMIZER_STEP_PREFIX = "Optimizer.step#"
#: The name PyTorch gives every optimizer's ``zero_grad`` range.
ZERO_GRAD_PREFIX = "Optimizer.zero_grad#"
_PREFIXES = (OPTIMIZER_STEP_PREFIX, ZERO_GRAD_PREFIX)
_OFF = " (step_marks=False, gpumem replay --no-step-marks, reads the trace without them)"
#: The most step sets made without state that are still told apart by their sizes alone (Note [Two optimizers of
#: one class]); each is compared with every other set.
_MAX_STATELESS_SETS = 8
#: Devices an annotation may name (PyTorch's device indices are small; -1: no device).
_MAX_DEVICE = 1 << 16


@dataclass(frozen=True)
class InferredMarks:
    """What a snapshot's annotations say of gpumem.torch's step marks (Note [Step marks read off a snapshot's
    optimizer steps]): the ``events`` to make (none when ``reason`` says why not), the optimizer class whose
    steps marked, how many step ends fell before the first op (but the last, which marks op 0) or after the
    last op (not made: the annotations' ring reaches further back than the ops', and a replay makes no event
    after its last op), and how many marks
    stand for steps GradScaler skipped."""

    events: tuple[PlanEvent, ...] = ()
    optimizer: str | None = None
    reason: str | None = None
    n_before_first_op: int = 0
    n_after_last_op: int = 0
    n_skipped: int = 0
    n_optimizers: int = 1
    """Optimizers of the class told apart by their steps' allocations (Note [Two optimizers of one class]); 1
    where they are not."""


@dataclass
class _Ranges:
    """The optimizer ranges of a device, each list in time order with the optimizer's class."""

    step_starts: list[tuple[float, str]] = field(default_factory=list)
    step_ends: list[tuple[float, str]] = field(default_factory=list)
    zeros: list[tuple[float, str]] = field(default_factory=list)

    def lists(self) -> tuple[list[tuple[float, str]], ...]:
        return self.step_starts, self.step_ends, self.zeros


def _finite(t: Any) -> bool:
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return False
    try:
        return math.isfinite(t)
    except OverflowError:   # an int past a float's range
        return False


#: (name prefix, stage, class suffix, index into _Ranges.lists()) of the ranges read.
_KINDS = ((OPTIMIZER_STEP_PREFIX, "START", ".step", 0), (OPTIMIZER_STEP_PREFIX, "END", ".step", 1),
          (ZERO_GRAD_PREFIX, "START", ".zero_grad", 2))


def _ranges(annotations: Any, where: str) -> dict[int, _Ranges]:
    """The optimizer ranges of the snapshot, by device."""
    if annotations is None:
        return {}
    if not isinstance(annotations, list):
        raise TraceFormatError(where, f"external_annotations is a {type(annotations).__name__}, not a list{_OFF}")
    out: dict[int, _Ranges] = {}
    classes: dict[str, str] = {}   # name -> class: one string per distinct name, however often a file repeats it
    for i, a in enumerate(annotations):
        if not isinstance(a, dict):
            raise TraceFormatError(where, f"external_annotations[{i}] is a {type(a).__name__}, not a dict{_OFF}")
        name = a.get("name")
        if not isinstance(name, str) or not name.startswith(_PREFIXES):
            continue   # the program's own ranges: not ours to read
        stage, dev, t = a.get("stage"), a.get("device"), a.get("time_us")
        if not isinstance(stage, str):
            raise TraceFormatError(where, f"external_annotations[{i}] ({shorten(name, 60)}) has no string stage{_OFF}")
        if isinstance(dev, bool) or not isinstance(dev, int) or not -1 <= dev < _MAX_DEVICE:
            raise TraceFormatError(where, f"external_annotations[{i}] ({shorten(name, 60)}) has no device in "
                                          f"[-1, {_MAX_DEVICE}){_OFF}")
        if not _finite(t):
            raise TraceFormatError(where, f"external_annotations[{i}] ({shorten(name, 60)}) has no finite "
                                          f"time_us{_OFF}")
        for prefix, want, suffix, k in _KINDS:
            if name.startswith(prefix) and stage == want:
                cls = classes.get(name)
                if cls is None:
                    cls = name[len(prefix):]
                    cls = classes[name] = cls[:-len(suffix)] if cls.endswith(suffix) else cls
                out.setdefault(dev, _Ranges()).lists()[k].append((float(t), cls))
    for got in out.values():
        for lst in got.lists():
            lst.sort(key=lambda e: e[0])
    return out


def _merged(by_device: dict[int, _Ranges]) -> _Ranges:
    out = _Ranges()
    for got in by_device.values():
        for mine, theirs in zip(out.lists(), got.lists()):
            mine.extend(theirs)
    for lst in out.lists():
        lst.sort(key=lambda e: e[0])
    return out


def _updates(starts_us: list[float], ends_us: list[float], t0_us: float) -> list[tuple[float, float]] | None:
    """Each step's ``(start, end)``: an END paired with the last START before it and after the END before it, or
    with ``t0_us`` for the first END when no START precedes it (the ops' ring began inside that step); a START
    with no END after it (a snapshot taken mid-step) is left. None where they do not pair."""
    out = []
    j = 0
    prev = -math.inf
    for end in ends_us:
        if out and end == prev:
            continue   # one step's END twice (a file that repeats it): one step
        start = None
        while j < len(starts_us) and starts_us[j] < end:
            if starts_us[j] >= prev:
                start = starts_us[j]
            j += 1
        if start is None:
            if out:
                return None   # two ENDs with no START between
            start = min(t0_us, end)
        out.append((start, end))
        prev = end
    return out


def _skipped_steps(r: _Ranges, cls: str, times: np.ndarray, kinds: np.ndarray) -> tuple[list[int], str | None]:
    """The ops of the marks gpumem.torch made for the steps GradScaler skipped (Note [Step marks read off a
    snapshot's optimizer steps]), and why skipped steps could not be read where the ranges say there may be
    some (None: read, or none)."""
    updates = _updates([t for t, c in r.step_starts if c == cls], [t for t, _ in r.step_ends], float(times[0]))
    if updates is None:
        return [], "the optimizer step ranges' starts and ends do not pair"
    # a zero_grad inside a step (a closure optimizer's, LBFGS) delimits no iteration
    zeros_us = [t for t, c in r.zeros if c == cls and not any(s <= t <= e for s, e in updates)]
    if len(zeros_us) < 2:
        return [], None
    z_us = np.asarray(zeros_us)
    e_us = np.asarray([e for _, e in updates])   # one per step
    first_end = np.searchsorted(e_us, z_us, side="left")          # the first step ending after each zero_grad
    per_iteration = first_end[1:] - first_end[:-1]                  # steps ending in [zero_grad i, zero_grad i+1)
    if (per_iteration > 1).any() or not (per_iteration > 0).any():
        return [], None   # no zero_grad between two steps: what it delimits is not an iteration
    # lengths in allocations, which a ring that begins mid-iteration keeps (it drops frees of what it never saw)
    allocs = np.concatenate(([0], np.cumsum(kinds == 0)))
    z_ops = np.searchsorted(times, z_us, side="right")
    e_ops = np.searchsorted(times, e_us, side="right")
    s_ops = np.searchsorted(times, np.asarray([s for s, _ in updates]), side="right")
    stepped = np.flatnonzero(per_iteration == 1)
    k = first_end[stepped]                                          # each stepped iteration's step
    gaps = set((z_ops[stepped + 1] - e_ops[k]).tolist())
    # a skipped iteration is a stepped one short of its update's allocations; an interval with less than half
    # of that (zero_grad called twice, a short pass between) is no iteration
    iteration = (allocs[z_ops[stepped + 1]] - allocs[z_ops[stepped]]) - (allocs[e_ops[k]] - allocs[s_ops[k]])
    if int(iteration.min()) <= 0:
        return [], None
    lengths = allocs[z_ops[1:]] - allocs[z_ops[:-1]]
    skipped = [int(i) for i in np.flatnonzero(per_iteration == 0) if 2 * lengths[i] >= int(iteration.min())]
    if not skipped:
        return [], None
    if len(gaps) != 1:
        return [], (f"{len(skipped)} iteration(s) with no optimizer step (GradScaler skipped it?), and the ops "
                    "from a step's end to the next zero_grad differ from one iteration to the next, so where "
                    "gpumem.torch marked them is not in the snapshot")
    gap = gaps.pop()
    placed = [int(z_ops[i + 1]) - gap for i in skipped]
    if any(op <= z_ops[i] for op, i in zip(placed, skipped)):
        return [], ("an iteration with no optimizer step would be marked before its zero_grad: where "
                    "gpumem.torch marked it is not in the snapshot")
    return placed, None


def _freed_at(kinds: np.ndarray, alloc_ids: np.ndarray) -> np.ndarray:
    """Per op, the index of the op that frees its allocation (``len(kinds)`` where the trace never frees it; for a
    free, its own index)."""
    n = len(kinds)
    out = np.full(n, n, dtype=np.int64)
    frees = np.flatnonzero(kinds == 1)
    if len(alloc_ids) and int(alloc_ids.min()) >= 0 and int(alloc_ids.max()) < 4 * n + 1024:   # dense ids
        at = np.full(int(alloc_ids.max()) + 1, n, dtype=np.int64)
        at[alloc_ids[frees]] = frees
        out = at[alloc_ids]
    else:   # ids not dense (never from build_trace): a dict, in the ops' count whatever the ids
        at_d = {int(alloc_ids[k]): int(k) for k in frees}
        out = np.fromiter((at_d.get(int(a), n) for a in alloc_ids), dtype=np.int64, count=n)
    out[frees] = frees
    return out


def _optimizers(updates: list[tuple[float, float]], times: np.ndarray, kinds: np.ndarray, nbytes: np.ndarray,
                freed_at: np.ndarray) -> list[int] | None:
    """Which optimizer made each step range of one class (Note [Two optimizers of one class]): a label per range,
    or None where they are not told apart (one optimizer as far as the ops say). ``freed_at``: per op, the op
    that frees its allocation (:func:`_freed_at`)."""
    t0 = float(times[0])
    sigs: list[frozenset[int] | None] = []
    spans: list[tuple[int, int]] = []
    for s, e in updates:
        i, j = int(np.searchsorted(times, s, side="left")), int(np.searchsorted(times, e, side="right"))
        spans.append((i, j))
        # a range the ops' ring cut (it keeps the newest ops): its allocations are not all here
        sigs.append(None if s <= t0 else frozenset(nbytes[i:j][kinds[i:j] == 0].tolist()))
    count: dict[frozenset[int], int] = {}
    for g in sigs:
        if g is not None:
            count[g] = count.get(g, 0) + 1
    index = {g: k for k, g in enumerate(g for g, c in count.items() if c >= 2)}
    if len(index) < 2 or any(g is None or g not in index for g in sigs):
        return None
    labels = [index[g] for g in sigs]   # type: ignore[index]
    runs: dict[int, int] = {}
    met: dict[int, list[int]] = {}
    for k, lab in enumerate(labels):
        met.setdefault(lab, []).append(k)
        if k == 0 or labels[k - 1] != lab:
            runs[lab] = runs.get(lab, 0) + 1
    if min(runs.values()) < 2:
        return None   # not each between two of another's steps: one optimizer whose step changed
    stateless = []
    for lab, ks in met.items():
        (i, j), (_, j_next) = spans[ks[0]], spans[ks[1]]
        if not (freed_at[i:j][kinds[i:j] == 0] >= j_next).any():   # nothing of its first outlives its next
            stateless.append(lab)
    if len(stateless) > _MAX_STATELESS_SETS:
        return None
    sets = list(index)
    for lab in stateless:
        mine = sets[lab]
        if any(k != lab and (mine <= g or g <= mine) for k, g in enumerate(sets)):
            return None   # a step that makes no state and allocates a part of another's (or more): one optimizer
    return labels


def infer_step_marks(annotations: Any, device: int, times_us: np.ndarray, where: str = "<snapshot>", *,
                     sole_device: bool = False, kinds: np.ndarray | None = None,
                     nbytes: np.ndarray | None = None, alloc_ids: np.ndarray | None = None) -> InferredMarks:
    """The step-plan events gpumem.torch would have made in a program whose snapshot has ``annotations``
    (its ``external_annotations``) and whose ops on ``device`` ran at ``times_us`` (Note [Step marks read off a
    snapshot's optimizer steps]); ``kinds``, the ops' kinds (0 alloc, 1 free; default: all allocations), measure
    its iterations. ``sole_device``: ``device`` is the only one with ops, so every optimizer range is its
    program's, whatever device it was recorded on (PyTorch records a range on the thread's current device).
    ``nbytes`` and ``alloc_ids``, the ops' sizes and allocation ids (given together, and with ``kinds``), tell two
    optimizers of one class apart (Note [Two optimizers of one class]); left out, every step range marks.

    Raises:
        TraceFormatError: the annotations are malformed (not a list of dicts, an optimizer range without a
            stage, a device or a finite time).
        InvalidArgumentError: ``nbytes`` or ``alloc_ids`` given without the other or without ``kinds``, or any of
            them not one integer per op.
    """
    if (nbytes is None) != (alloc_ids is None) or (nbytes is not None and kinds is None):
        raise InvalidArgumentError("infer_step_marks: nbytes and alloc_ids tell optimizers apart only together and "
                                   "with kinds (the ops' sizes, allocation ids and kinds); got "
                                   f"kinds={'None' if kinds is None else 'given'}, "
                                   f"nbytes={'None' if nbytes is None else 'given'}, "
                                   f"alloc_ids={'None' if alloc_ids is None else 'given'}")
    by_device = _ranges(annotations, where)
    r = _merged(by_device) if sole_device else by_device.get(device, _Ranges())
    if not r.step_ends:
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
    if kinds is not None:
        kinds = np.asarray(kinds)
        arrays = {"kinds": kinds} if nbytes is None else \
            {"kinds": kinds, "nbytes": np.asarray(nbytes), "alloc_ids": np.asarray(alloc_ids)}
        for what, a in arrays.items():
            if a.shape != (n,) or not np.issubdtype(a.dtype, np.integer):
                raise InvalidArgumentError(f"infer_step_marks: {what} must hold one integer per op ({n}), got "
                                           f"shape {a.shape} of {a.dtype}")
        if nbytes is not None:
            nbytes, ids = arrays["nbytes"], arrays["alloc_ids"]
    if n == 0:
        return InferredMarks(optimizer=cls)
    if n > 1 and bool((np.diff(times) < 0).any()):
        return InferredMarks(optimizer=cls, reason="the ops' times go back (several threads): the op before an "
                                                   "optimizer step's end is not defined")
    t0 = times[0]
    before = sum(1 for t, _ in r.step_ends if t < t0)
    # what the annotations' ring kept from before the ops' first: not this trace's (a step that began before it
    # and ended after keeps its END, paired from op 0)
    kept = _Ranges(*([e for e in lst if e[0] >= t0] for lst in r.lists()))
    ends = kept.step_ends
    kinds = np.zeros(n, np.int8) if kinds is None else np.asarray(kinds)
    skipped, unread = _skipped_steps(kept, cls, times, kinds)
    if unread is not None:   # a plan that misses every skipped step predicts worse than none: make none
        return InferredMarks(optimizer=cls, reason=unread, n_before_first_op=before)
    n_optimizers = 1
    if nbytes is not None and len(ends) > 1:   # Note [Two optimizers of one class]
        updates = _updates([t for t, c in kept.step_starts if c == cls], [t for t, _ in ends], float(t0))
        labels = None if updates is None else _optimizers(updates, times, kinds, nbytes, _freed_at(kinds, ids))
        if labels is not None and (before or skipped):
            labels = None   # whose steps the ring's lost ends or the skipped ones were is not here
        if labels is not None:
            n_optimizers = len(set(labels))
            rule = MarkerRule()
            marking = {e: rule.stepped(lab) for (_, e), lab in zip(updates, labels)}
            ends = [(t, c) for t, c in ends if marking.get(t, True)]
    at = np.searchsorted(times, [t for t, _ in ends], side="right")
    marks: dict[int, float] = {}
    if before:   # the last step that ended before the first op was marked there, before op 0
        marks[0] = max(t for t, _ in r.step_ends if t < t0)
    for k, (t, _) in zip(at.tolist(), ends):
        marks.setdefault(int(k), t)
    n_skipped = sum(1 for k in skipped if marks.setdefault(k, 0.0) == 0.0)
    events = [PlanEvent(0, PlanEventKind.WARMUP_START)]
    events += [PlanEvent(k, PlanEventKind.MARK, marks[k]) for k in sorted(marks) if k < n]
    return InferredMarks(tuple(events), cls, None, max(0, before - 1), int(np.count_nonzero(at >= n)), n_skipped,
                         n_optimizers)
