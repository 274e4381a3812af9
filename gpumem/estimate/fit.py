"""Peak reserved memory by replay, and the largest batch (or prompt) that fits a device.

The peak of *allocated* bytes (:mod:`.formulas`) is not what runs out of memory: the allocator reserves
more, in segments it cannot always reuse. :func:`estimate_peak_reserved` replays the workload's synthetic
trace (:mod:`.workload`) through gpumem's model of an allocator on a simulated device and reports what it
reserved. :func:`find_max_batch` searches the largest batch (or prompt length) whose replay fits the
device with a margin for fragmentation, and sets it beside the answers of a formula, of a halving retry
and of a plain binary search.

Note [Fragmentation margin]
    gpumem's ``pytorch`` policy reproduces what PyTorch's allocator reserves on *recorded* traces, and the
    synthetic ``generate()`` trace follows the recorded order (Note [Prefill] in ``.workload``), but not
    every small tensor of a real run: on the H200 the replay without margin fitted batch 33 where 33 ran
    (34 did not), 155 where 155 ran, but 135 where only 134 ran (7B, prompt 1024, 64 new tokens;
    ``reports/hil/estimate-fit-h200-2026-11-22.json``). The weights are one allocation each and do not
    fragment, so the margin applies to the rest: a size fits when its replay fits
    ``weights + (free - weights) / (1 + margin)``. :data:`DEFAULT_MARGINS` use 2 % for ``pytorch`` (33, 132
    and 152 on those three), 25 % for the other segment policies (not checked against a device) and 1 % for
    the virtual-memory ones, whose reserve tracks the live bytes (expandable segments: the replay without
    margin gave exactly the batch that ran, 53).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ..device import Device
from ..specs import open_device
from ..errors import InvalidArgumentError, OutOfMemoryError
from ..replay import replay_trace
from .shape import ModelShape
from .workload import WorkloadTrace, inference_trace, training_trace

__all__ = ["ReservedEstimate", "FitResult", "FitTry", "estimate_peak_reserved", "find_max_batch",
           "DEFAULT_MARGINS"]

log = logging.getLogger(__name__)

DEFAULT_MARGINS: dict[str, float] = {"pytorch": 0.02, "bestfit": 0.25, "cupy": 0.25, "gpumem": 0.01,
                                     "expandable": 0.01}
"""Extra share of the memory beyond the weights held back per policy when fitting (Note [Fragmentation
margin])."""


@dataclass(frozen=True)
class ReservedEstimate:
    """What a replay of a workload's trace reserved under one policy on one simulated device."""

    policy: str
    device: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    fits: bool
    oom_message: str = ""


def _replay(w: WorkloadTrace, device: "str | Device", policy: str, limit: int | None = None) -> ReservedEstimate:
    opts: dict[str, Any] = {} if limit is None else {"limit": limit}
    r = replay_trace(w.trace, device, policy, stop_on_oom=True, progress=False, **opts)
    spec = device if isinstance(device, str) else device.spec
    return ReservedEstimate(policy, spec, w.peak_nbytes, r.peak_reserved_bytes, r.oom_message is None,
                            r.oom_message or "")


def estimate_peak_reserved(w: WorkloadTrace, policies: "tuple[str, ...] | list[str]" = ("pytorch", "gpumem"), *,
                           device: "str | Device" = "sim:h200-141gb") -> list[ReservedEstimate]:
    """Replay ``w`` (from :func:`~gpumem.estimate.workload.inference_trace` or ``training_trace``) under each
    policy on ``device`` and return what each reserved at its peak. A replay that runs out of memory is
    reported with ``fits=False`` and the peak it reached."""
    if not policies:
        raise InvalidArgumentError("estimate_peak_reserved: give at least one policy")
    return [_replay(w, device, p) for p in policies]


@dataclass(frozen=True)
class FitTry:
    """One size tried by a search: whether it fits, and by which rule."""

    value: int
    fits: bool
    rule: str


@dataclass
class FitResult:
    """The largest batch (or prompt length) that fits, by four rules, for one workload and device.

    ``simulated``: the largest value whose replay fits within ``limit_bytes`` = weights + (``usable_bytes`` -
    weights) / (1 + ``margin``) (the answer).
    ``estimate``: the largest value whose estimated peak *allocated* bytes fit ``usable_bytes`` (no
    allocator, no margin: what a formula alone says). ``halving``: where a retry that starts at ``start`` and
    halves on each out-of-memory error settles (accelerate's ``find_executable_batch_size``).
    ``binary_search``: where doubling then bisection on the replay without margin settles (Lightning's
    ``binsearch`` finder): the most that fits once, with nothing to spare.
    """

    search: str
    policy: str
    device: str
    usable_bytes: int
    limit_bytes: int
    margin: float
    simulated: int
    estimate: int
    halving: int
    binary_search: int
    start: int
    tries: list[FitTry] = field(default_factory=list)
    weights_bytes: int = 0
    reason: str = ""
    """Why not even 1 fits (empty when ``simulated >= 1``)."""

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


def _largest(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest ``v`` in ``[lo, hi]`` with ``fits(v)``, given ``fits`` is monotone; 0 if none."""
    if not fits(lo):
        return 0
    good = lo
    step = lo
    while good < hi:  # gallop up
        nxt = min(hi, good + step)
        if fits(nxt):
            good, step = nxt, step * 2
        else:
            hi = nxt - 1
            break
    while good < hi:  # bisect (good fits, hi+1 does not or is past the range)
        mid = (good + hi + 1) // 2
        if fits(mid):
            good = mid
        else:
            hi = mid - 1
    return good


def find_max_batch(shape: ModelShape, dtype_bytes: int, *, device: "str | Device" = "sim:h200-141gb",
                   prompt_len: int = 512, new_tokens: int = 16, batch_size: int = 1, search: str = "batch",
                   training: bool = False, policy: str = "pytorch", margin: float | None = None,
                   max_value: int = 4096, start: int | None = None) -> FitResult:
    """The largest batch (``search="batch"``) or prompt/sequence length (``search="seq_len"``, at
    ``batch_size``) that runs on ``device`` without out-of-memory, by replaying the workload's allocations
    under ``policy`` with ``margin`` of the memory beyond the weights held back (default
    :data:`DEFAULT_MARGINS`, Note [Fragmentation margin]).

    ``training=True`` fits training steps of ``prompt_len`` tokens (``new_tokens`` is ignored). Returns a
    :class:`FitResult`; its ``simulated`` is 0 when not even 1 fits. ``max_value`` bounds the search.
    """
    if search not in ("batch", "seq_len"):
        raise InvalidArgumentError(f"search must be 'batch' or 'seq_len', got {search!r}")
    if isinstance(max_value, bool) or not isinstance(max_value, int) or max_value < 1:
        raise InvalidArgumentError(f"max_value must be a positive whole number, got {max_value!r}")
    if margin is None:
        margin = DEFAULT_MARGINS.get(policy, 0.20)
    if not (isinstance(margin, (int, float)) and 0.0 <= margin <= 10.0):
        raise InvalidArgumentError(f"margin must be a number in [0, 10], got {margin!r}")
    own = not isinstance(device, Device)
    dev = open_device(device) if own else device
    try:
        usable = dev.mem_info().free_nbytes
        weights = min(usable, shape.n_params * dtype_bytes)
        limit = int(weights + (usable - weights) / (1.0 + margin))
        tries: list[FitTry] = []

        def workload(v: int) -> WorkloadTrace:
            b, p = (v, prompt_len) if search == "batch" else (batch_size, v)
            if training:
                return training_trace(shape, dtype_bytes, batch_size=b, seq_len=p)
            return inference_trace(shape, dtype_bytes, batch_size=b, prompt_len=p, new_tokens=new_tokens)

        cache: dict[tuple[int, int | None], bool] = {}

        def replay_fits(v: int, lim: int | None, rule: str) -> bool:
            key = (v, lim)
            if key not in cache:
                w = workload(v)
                if w.peak_nbytes > (lim or usable):
                    cache[key] = False  # cannot fit: its live bytes alone exceed the room
                else:
                    cache[key] = _replay(w, dev, policy, lim if lim else None).fits
                tries.append(FitTry(v, cache[key], rule))
            return cache[key]

        def estimate_fits(v: int) -> bool:
            ok = workload(v).peak_nbytes <= usable
            tries.append(FitTry(v, ok, "estimate"))
            return ok

        simulated = _largest(lambda v: replay_fits(v, limit, "simulated"), 1, max_value)
        estimate = _largest(estimate_fits, 1, max_value)
        first = start if start is not None else min(max_value, 1 << max(0, (2 * max(estimate, 1) - 1).bit_length() - 1))
        halving = first
        while halving >= 1 and not replay_fits(halving, None, "halving"):
            halving //= 2
        binary = _largest(lambda v: replay_fits(v, None, "binary_search"), 1, max_value)
        reason = ""
        if simulated < 1:
            what = "batch 1" if search == "batch" else f"a prompt of 1 token at batch {batch_size}"
            if shape.n_params * dtype_bytes > usable:
                reason = (f"the weights alone ({shape.n_params * dtype_bytes / 2**30:.2f} GiB) exceed what "
                          f"{dev.spec} has free ({usable / 2**30:.2f} GiB)")
            else:
                reason = (f"not even {what} fits: its replay under {policy} needs more than "
                          f"{limit / 2**30:.2f} GiB (the free {usable / 2**30:.2f} GiB less the margin)")
        return FitResult(search, policy, dev.spec, usable, limit, margin, simulated, estimate, halving, binary, first,
                         tries, shape.n_params * dtype_bytes, reason)
    except OutOfMemoryError as exc:  # the device itself could not be opened with room: report as no fit
        raise InvalidArgumentError(f"find_max_batch: {exc}") from exc
    finally:
        if own:
            dev.close()
