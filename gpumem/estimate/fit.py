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
    ``weights + (usable - weights) / (1 + margin)``. :data:`DEFAULT_MARGINS` use 2 % for ``pytorch`` (33, 132
    and 152 on those three), 25 % for the other segment policies (not checked against a device) and 1 % for
    the virtual-memory ones, whose reserve tracks the live bytes (expandable segments: the replay without
    margin gave exactly the batch that ran, 53). Those figures were found against the device's whole free
    memory; the room is now the usable memory a ``GpuMemoryManager`` keeps (Note [One usable memory]), which
    is smaller, so the answers are below what ran there, never above.

Note [One usable memory]
    ``gpumem fit``, ``gpumem estimate`` (its FITS column and the replays' limit) and ``GpuMemoryManager`` all
    size against :func:`gpumem.managers.reserve.default_usable_nbytes`: before, fit used the free memory
    (78.94 GiB on ``sim:a100-80gb``) while the manager allowed 71.00 GiB, so a batch fit approved could be
    refused by the manager on the same device.

Note [Allocated as PyTorch counts it]
    ``torch.cuda.max_memory_allocated`` counts the *blocks* the allocator hands out, and PyTorch leaves a
    remainder of 1 MiB or less inside a large block rather than splitting it off (the rule
    :func:`~gpumem.estimate.workload.loaded_weight_nbytes` applies to the weights). A training step's trace
    asks for many sizes that land in such blocks (the optimizer's states and temporaries, the norms'
    gradients), so the trace's own sum of requests was up to 1.5 % below the measured peak on the H200 rows
    (fp32 master b2, Llama 0.1B b1) once the optimizer step was modelled as the snapshots show it (Note
    [Optimizer step] in ``.workload``). The ``pytorch`` replay follows PyTorch's block rules, so
    ``gpumem estimate --training`` reports the replay's peak of allocated blocks
    (:attr:`ReservedEstimate.peak_block_allocated_bytes`) as the peak allocated when that replay ran and fit;
    every training row of the records is then 0.1-2.6 % above its measurement. ``generate()`` does the same
    (the larger of the two) since a 4,500-token decode on the H200 measured 0.16 % above the requests, its KV
    caches' large blocks keeping their remainders (``reports/hil/long-decode-p4096-h200-2026-11-29.md``); on the
    accuracy rows that moved the allocated figure by 0.00-0.75 points (up to 0.45 of them the fast path's bound,
    Note [The peak of blocks on the fast path] in :mod:`.fastreplay`), every row still within [0, +3 %].
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ..device import Device
from ..errors import GpumemError, InternalError, InvalidArgumentError, OutOfMemoryError, UnsupportedOperationError
from ..managers.reserve import default_usable_nbytes
from ..progress import NoProgress, progress as progress_bar
from ..allocator import make_allocator
from ..allocator.bucket import is_bucket_policy
from ..allocator.policy import VmmMode, get_policy
from ..allocator.native import NativeEngine
from ..native import load_engine
from ..replay import replay_trace
from ..specs import open_device
from ..units import format_bytes
from .shape import ModelShape
from .formats import WeightFormat
from .formulas import dequant_workspace_nbytes
from .probe_pool import (EAGER_STEP_LAYERS, PACKAGE_DIR, POOL_AFTER_S, PoolBroken, ProbePool, ahead, check_jobs,
                         check_not_bootstrapping, pool_refused, usable_cpus)
from .policy_workers import APART_STEP_LAYERS, PolicyWorkers, split_policies
from .fastreplay import (AllStopped, NativeSkippingSink, PlainSink, SinkGroup, SkippingSink, StepJumper, TwinLag,
                         make_sink)
from ..sim.gpu_work import GpuTiming, GpuWorkModel, ModelGpu
from .workload import DECODE_HEAD_STEPS, LoraConfig, check_mixed_precision, weights_nbytes, WorkloadTrace, inference_trace, stream_inference, training_trace

__all__ = ["ReservedEstimate", "FitResult", "FitTry", "estimate_peak_reserved", "find_max_batch",
           "DEFAULT_MARGINS", "DEFAULT_NEW_TOKENS", "training_reserved_nbytes", "allocated_as_pytorch_counts", "TRAINING_RESERVED_MARGIN", "DEFAULT_PROMPT_LEN", "InjectedFaultError", "usable_memory",
           "replay_inference", "replay_sequence"]

DEFAULT_NEW_TOKENS = 16
"""New tokens of a ``generate()`` workload when none are given, for ``gpumem estimate``, ``gpumem fit`` and
:func:`find_max_batch` alike (printed with every answer)."""
DEFAULT_PROMPT_LEN = 512
"""Prompt length ``gpumem fit`` searches the batch at when none is given."""


TRAINING_RESERVED_MARGIN = 0.005
"""Note [Training reserved margin]: on the H200 (``reports/hil/estimate-accuracy-h200-2026-11-22.md``) the
``pytorch`` replay of training steps reserved up to 0.33 % less than PyTorch did, on 3 of 9 rows, all with
the peak in the backward pass (autograd's small temporaries are not all in the trace); every generate() row
was at or above. The estimate of training's peak reserved under ``pytorch`` is therefore the replay's plus
0.5 %, rounded up to 2 MiB (what a segment of PyTorch's large pool rounds to): never below on those rows,
at the cost of the two rows already +2.9 % above (peak in the optimizer step) going to +3.4 % and +3.5 %."""


def training_reserved_nbytes(replayed_nbytes: int) -> int:
    """The estimate of training's peak reserved under ``pytorch`` from its replay (Note [Training reserved
    margin])."""
    grain = 2 * 2**20
    return -(-int(replayed_nbytes * (1 + TRAINING_RESERVED_MARGIN)) // grain) * grain


def allocated_as_pytorch_counts(requests_nbytes: int, replay: "ReservedEstimate") -> int | None:
    """The peak allocated as ``torch.cuda.max_memory_allocated`` counts it (Note [Allocated as PyTorch counts
    it]): the larger of the requests' peak and the ``pytorch`` ``replay``'s peak of blocks; None where ``replay``
    is not a ``pytorch`` replay that fitted (then only the requests are known)."""
    if replay.policy != "pytorch" or not replay.fits or replay.peak_block_allocated_bytes is None:
        return None
    return max(requests_nbytes, replay.peak_block_allocated_bytes)


class InjectedFaultError(GpumemError, RuntimeError):
    """A replay failed because the device spec injects faults (``?fail_rate=``...): nothing was out of
    memory, and no size can be judged on such a device."""


def usable_memory(device: Device) -> int:
    """The usable memory of ``device`` as a ``GpuMemoryManager`` with the default config sees it
    (:func:`gpumem.managers.reserve.default_usable_nbytes`): what estimates and fits are sized against."""
    return default_usable_nbytes(device.mem_info())

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
    injected_fault: bool = False
    """The replay failed on a fault the device spec injects, not for want of memory."""
    peak_block_allocated_bytes: int | None = field(default=None, compare=False)
    """Note [Allocated as PyTorch counts it]: the replay's peak of allocated *blocks* (a request's block keeps a
    remainder the allocator does not split off), what ``torch.cuda.max_memory_allocated`` reports. A replay that
    left out small ops gives a bound at or above it (Note [The peak of blocks on the fast path] in
    :mod:`.fastreplay`), so it is not compared with ``==``."""
    alloc_retries: int = field(default=0, compare=False)
    """Out-of-memory retries the replay made (the allocator gave cached memory back to stay within the limit). A
    replay that made none is the replay under any limit at or above its peak reserved (Note [Probes share
    replays])."""


def _replay(w: WorkloadTrace, device: "str | Device", policy: str, limit: int | None = None,
            gpu_timing: str | None = None) -> ReservedEstimate:
    opts: dict[str, Any] = {} if limit is None else {"limit": limit}
    r = replay_trace(w.trace, device, policy, stop_on_oom=True, progress=False, gpu_timing=gpu_timing, **opts)
    spec = device if isinstance(device, str) else device.spec
    return ReservedEstimate(policy, spec, w.peak_nbytes, r.peak_reserved_bytes, r.oom_message is None,
                            r.oom_message or "", bool(getattr(r.oom_error, "injected", False)),
                            r.stats.peak_allocated_nbytes, r.stats.num_alloc_retries)


def decode_lag_for(policy: Any) -> bool:
    """Whether ``policy``'s replay of ``generate()`` runs the program's GPU work (the ``model`` GPU timing): a
    policy over virtual memory whose pages are stolen (``gpumem``), whose steals wait for the GPU (Note [The GPU's
    lag in the decode replay]). Raises :class:`~gpumem.errors.InvalidArgumentError` for an unknown policy name."""
    if is_bucket_policy(policy):
        return False
    pol = get_policy(policy)
    return pol.vmm is not VmmMode.NEVER and pol.steal_empty_pages


def _decode_timing(policy: Any) -> str | None:
    """The GPU timing of ``policy``'s replays of ``generate()`` traces: ``model`` where it steals pages (Note [The
    GPU's lag in the decode replay]), else the replay's default."""
    return GpuTiming.MODEL.value if decode_lag_for(policy) else None


# Note [The GPU's lag in the decode replay]
#   A policy that steals idle pages (``gpumem``) may unmap a page only once the GPU has run the work that last used
#   it; an idle replay completes every fence at once and steals pages the live GPU is still reading, so its figure
#   fell under gpumem.torch's live peak reserved on long decodes (-0.07 %, -0.19 % at 2,048-token prompts). The
#   estimate stood a 24 MiB block in every decode step for that lag (the "decode slack" of Note [Overhead] in
#   .workload) until 2026-11-30: up to 54 MiB above live, and a storm of page moves every step that made long
#   estimates slow (1,116,458 device calls by 6,000 tokens, where live made 16,148). Now the decode of such a
#   policy runs the program's GPU work of the simulator's ``model`` timing (Note [The GPU runs behind the CPU] in
#   gpumem.sim.gpu_work), which predicted seven live decodes 4-6 MiB from above, two of them before they ran
#   (``reports/decode-lag-2026-11-29.md``, ``reports/hil/lag-check-h200-2026-11-29.md``): on a device the estimate
#   opened, in the native engine's twin (Note [A twin that runs the program's GPU work] in
#   ``gpumem/_native/pybackend.cpp``), else through :class:`~gpumem.sim.gpu_work.ModelGpu` on the device given;
#   the prefix and full paths replay the trace with ``gpu_timing="model"``: the same clock, to the bit
#   (``tests/estimate/test_gpu_lag_twin.py``). Every op is sent (the small pool's skip would leave the skipped ops'
#   time out). Policies that steal nothing replay as before: on one stream their decisions do not wait for the GPU.
#   The lag runs through the whole request, prefill included, where the idle replay had been under live too: 7B at
#   batch 16 and 8 x 4,096 tokens, -0.58 % and -0.36 %, now -6 MiB (-0.011 %, still under: a fence's race with the
#   GPU at the prefill's first growth, not the matrix products' time, measured) and +4 MiB; nine live decodes 4-6 MiB
#   above
#   (``reports/hil/estimate-lag-h200-2026-11-30.md``). Training keeps its replay: two live gpumem.torch runs held
#   0.03-0.18 % above allocated, the replay was above them already and the lag put it further above (same report).


def _check_policies(policies: object) -> None:
    if isinstance(policies, str):  # iterated, "pytorch" was the policies "p", "y", ...
        raise InvalidArgumentError(f"policies must be a sequence of policy names, e.g. ({policies!r:.40},), got a "
                                   "string")


def replay_inference(shape: ModelShape, dtype_bytes: int, policies: "tuple[str, ...] | list[str]",
                     device: "str | Device", *, batch_size: int = 1, prompt_len: int,
                     new_tokens: int = DEFAULT_NEW_TOKENS, limit: int | None = None, peak_nbytes: int | None = None,
                     bar: Any = None, weight_format: WeightFormat | None = None,
                     workspace_nbytes: int = 0, full_replay: bool = False, jobs: int = 1) -> list[ReservedEstimate]:
    """Peak reserved of ``generate()`` under each policy: every op of every decode step replayed as it is
    made (:func:`~gpumem.estimate.workload.stream_inference`), so memory stays bounded while the figures
    are those of replaying ``inference_trace(..., full_decode=True)`` with ``gpu_timing="model"`` where the policy
    steals pages (Note [The GPU's lag in the decode replay]); ``peak_allocated_bytes`` is the program's requests'
    peak. ``bar`` (a progress bar) advances by one per step and policy.

    The default path makes the ops once for all policies and leaves out small-pool ops where they cannot
    change anything (Notes [One stream, every policy], [Small pool skipped at a fixed point] and [Expandable's
    small pool skipped] in :mod:`.fastreplay`), and replays only the prefix trace where the full path would
    start with it (Note [Stopped where the prefix trace stops too]); ``full_replay=True`` is the reference, one stream per policy with every op sent,
    and gives the same figures to the byte.

    ``jobs``: processes to replay on (at most the CPUs usable). With more than one, a long decode on a device
    spec that runs alone replays its policies in groups side by side, the same figures sooner (Note [Policies
    replayed apart] in :mod:`.policy_workers`); a script that calls it so must do it under ``if __name__ ==
    "__main__":``."""
    _check_policies(policies)
    if not isinstance(full_replay, bool):
        raise InvalidArgumentError(f"full_replay must be True or False, got {full_replay!r}")
    jobs = check_jobs(jobs)
    if peak_nbytes is None:
        peak_nbytes = inference_trace(shape, dtype_bytes, batch_size=batch_size, prompt_len=prompt_len,
                                      new_tokens=new_tokens, weight_format=weight_format,
                                      workspace_nbytes=workspace_nbytes).peak_nbytes
    bar = bar if bar is not None else NoProgress()
    out: dict[int, ReservedEstimate | None] = {}
    head = min(new_tokens, DECODE_HEAD_STEPS + 1)
    kw = dict(batch_size=batch_size, prompt_len=prompt_len, new_tokens=new_tokens, weight_format=weight_format,
              workspace_nbytes=workspace_nbytes)
    full = list(range(len(policies)))
    for p in policies:
        decode_lag_for(p)  # an unknown policy name raises before anything runs
    if (jobs > 1 and not full_replay and head < new_tokens and isinstance(device, str) and len(policies) > 1
            and new_tokens * shape.n_layers >= APART_STEP_LAYERS):
        got = _replay_apart(shape, dtype_bytes, tuple(policies), device, limit, peak_nbytes, bar, kw, jobs)
        if got is not None:
            return got
    if not full_replay and head < new_tokens:
        # the fast path: one stream for all (Note [One stream, every policy]), each policy on a device of its own
        # as in the full path (a Device given is one device: its policies take turns); a policy that ran out of
        # memory (or retried) within the prefix goes to the full path, which replays the prefix as a trace
        groups = [[k] for k in full] if isinstance(device, Device) else [full]
        for group in groups:
            got = _stream_policies(shape, dtype_bytes, [policies[k] for k in group], device, limit, peak_nbytes,
                                   bar, False, kw)
            out.update((k, est) for k, est in zip(group, got))
        full = [k for k in full if out[k] is None]
    if full:
        _full_path(shape, dtype_bytes, [policies[k] for k in full], full, device, limit, peak_nbytes, bar, head, kw,
                   out)
    return [out[k] for k in range(len(policies))]  # type: ignore[misc]


def _replay_apart(shape: ModelShape, dtype_bytes: int, policies: "tuple[str, ...]", device: str,
                  limit: int | None, peak_nbytes: int, bar: Any, kw: dict[str, Any],
                  jobs: int) -> "list[ReservedEstimate] | None":
    """Note [Policies replayed apart]: the groups of :func:`split_policies` but the first on worker processes, the
    first here; None where the device spec shares what a fresh device would not (tenants, faults): one process."""
    probe = open_device(device)
    try:
        if not _alone_without_faults(probe):
            return None
        profile = getattr(probe, "profile", None)
        for p in policies:  # what refuses a policy on this device (no virtual memory) refuses it now, not after
            _replay_allocator(probe, p, limit, fast=True).close()  # the replay in this process (attacker 2026-12-03)
    finally:
        probe.close()
    check_not_bootstrapping("replay_inference")
    jobs = min(jobs, usable_cpus())
    groups = split_policies(policies, jobs)
    if len(groups) < 2:
        return None

    def job(group: "tuple[int, ...]") -> PolicyGroupJob:
        names = tuple(policies[k] for k in group)
        return PolicyGroupJob(shape, dtype_bytes, names, device, kw["batch_size"], kw["prompt_len"],
                              kw["new_tokens"], limit, peak_nbytes, kw["weight_format"], kw["workspace_nbytes"],
                              tuple(_policy_rules(p) for p in names), profile)

    bar = bar if bar is not None else NoProgress()
    jobs_apart = [job(g) for g in groups[1:]]
    workers = PolicyWorkers(jobs_apart, bar)
    out: dict[int, ReservedEstimate] = {}
    try:
        log.info("replay_inference: policies %s replayed on %d processes", [[policies[k] for k in g] for g in groups],
                 len(groups))
        mine = job(groups[0]).run(workers.bar())
        out.update(zip(groups[0], mine))
        for i, (g, j) in enumerate(zip(groups[1:], jobs_apart)):
            got = workers.result(i)
            if got is None:
                got = j.run(workers.replay_bar(i))
            out.update(zip(g, got))
    finally:
        workers.close()
    return [out[k] for k in range(len(policies))]


def _full_path(shape: ModelShape, dtype_bytes: int, policies: list[str], keys: list[int], device: "str | Device",
               limit: int | None, peak_nbytes: int, bar: Any, head: int, kw: dict[str, Any],
               out: "dict[int, ReservedEstimate | None]") -> None:
    """The reference path: the prefix replayed as a trace per policy, then (if it fits and there is more) a
    stream of every op per policy (Note [Prefix first])."""
    # Note [Prefix first]: the trace of the first DECODE_HEAD_STEPS + 1 tokens is a prefix of the full
    # workload's ops (its end frees, and its one allocation is the next step's first op), so a replay that
    # runs out of memory there does so in the full replay too, at the same op with the same reserve; one
    # that does not and covers every token is the full replay. Only the rest is streamed.
    new_tokens = kw["new_tokens"]
    prefix = _prefix_trace(shape, dtype_bytes, head, kw)
    for k, policy in zip(keys, policies):
        first = _prefix_result(prefix, device, policy, limit, peak_nbytes)
        if not first.fits or head == new_tokens:
            bar.update(max(new_tokens, 1))
            out[k] = first
        else:
            out[k] = _stream_policies(shape, dtype_bytes, [policy], device, limit, peak_nbytes, bar, True, kw)[0]


def _prefix_trace(shape: ModelShape, dtype_bytes: int, head: int, kw: dict[str, Any]) -> WorkloadTrace:
    """The trace of the first ``head`` tokens (Note [Prefix first])."""
    return inference_trace(shape, dtype_bytes, batch_size=kw["batch_size"], prompt_len=kw["prompt_len"],
                           new_tokens=head, weight_format=kw["weight_format"], workspace_nbytes=kw["workspace_nbytes"])


def _prefix_result(prefix: WorkloadTrace, device: "str | Device", policy: str, limit: int | None,
                   peak_nbytes: int) -> ReservedEstimate:
    """The replay of the prefix trace as the full path reports it."""
    first = _replay(prefix, device, policy, limit, _decode_timing(policy))
    return ReservedEstimate(policy, first.device, peak_nbytes, first.peak_reserved_bytes, first.fits,
                            first.oom_message, first.injected_fault, first.peak_block_allocated_bytes,
                            first.alloc_retries)


# Note [The fast path on the native engine]
#   The fast replay (``full_replay=False``) runs every caching policy on the native engine where it is built
#   (``engine="native"``: virtual ranges, malloc'd segments and pools with their own page size alike), and sends
#   each step made from the template in one ``run_ops`` call (Note [A step's ops in one call]). Why: the Python
#   engine costs about 2 us an op, the native one 0.16 us called op by op from Python and about 0.05 us inside
#   ``run_ops`` (``reports/segment-engine.md``, ``reports/estimate-native-batch-2026-11-28.md``). The small pool is
#   skipped there too, whole steps at a time (Note [The small pool skipped on the native engine] in
#   :mod:`.fastreplay`): a skipped step sends only its large ops, in one call. The figures do not change: both
#   engines make the same decisions
#   (``tests/allocator/test_native_differential.py``), and the full path (``full_replay=True``) keeps the default
#   engine (Python in segment mode), so ``tests/estimate/test_fast_replay.py``, which holds the two paths equal
#   to the byte, compares the engines too. Without the native engine the fast path is the Python one as before.
#   On a device the estimate opened itself and that runs alone, a virtual-memory engine also makes the device's
#   map, access, unmap and event calls in C++ (Note [An idle device's bookkeeping calls made here] in
#   ``gpumem/_native/pybackend.cpp``): the calls of a long decode's page moves, the same results
#   (``tests/estimate/test_idle_twin.py``).
def _replay_allocator(device: Device, policy: Any, limit: int | None, fast: bool, own: bool = False) -> Any:
    """The allocator of one policy: on the fast path the native engine where it is built (Note [The fast path on
    the native engine]), on the full path the default engine. ``own``: ``device`` was opened for this allocator
    alone."""
    opts: dict[str, Any] = {} if limit is None else {"limit": limit}
    if fast and not is_bucket_policy(policy) and load_engine() is not None:
        opts["engine"] = "native"
    allocator = make_allocator(device, policy, **opts)
    engine = getattr(allocator, "_engine", None)
    if own and isinstance(engine, NativeEngine):
        try:
            engine.use_idle_twin(GpuWorkModel() if decode_lag_for(policy) else None)
        except UnsupportedOperationError:
            pass  # not a simulated device in virtual-memory mode that runs alone: its own calls, as before
        except BaseException:
            allocator.close()
            raise
    return allocator


def _decode_gpu(allocator: Any, device: Device, policy: Any) -> Any:
    """The program's GPU work beside ``policy``'s decode replay (Note [The GPU's lag in the decode replay]): None
    where the policy does not wait for the GPU or the device is not simulated, the engine's twin where it runs it,
    else a :class:`~gpumem.sim.gpu_work.ModelGpu` on ``device``."""
    from ..sim import SimDevice

    if not decode_lag_for(policy) or not isinstance(device, SimDevice):
        return None
    engine = getattr(allocator, "_engine", None)
    if isinstance(engine, NativeEngine) and engine.lag_stats() is not None:
        return TwinLag(engine)
    return ModelGpu(device)


def _stream_policies(shape: ModelShape, dtype_bytes: int, policies: list[str], device: "str | Device",
                     limit: int | None, peak_nbytes: int, bar: Any, full_replay: bool,
                     kw: dict[str, Any]) -> "list[ReservedEstimate | None]":
    """Replay ``generate()``'s ops under each of ``policies`` from one stream (Note [One stream, every policy]),
    each on a device of its own (``device`` opened anew when a spec; a :class:`Device` takes one policy);
    ``None`` for a policy whose fast replay is void (to be redone by the full path)."""
    own = not isinstance(device, Device)
    if not own and len(policies) > 1:
        raise InvalidArgumentError("one Device replays one policy at a time")
    devs: list[Device] = []
    allocators: list[Any] = []
    gpus: list[Any] = []
    try:
        for p in policies:
            devs.append(open_device(device) if own else device)  # type: ignore[arg-type]
            allocators.append(_replay_allocator(devs[-1], p, limit, fast=not full_replay, own=own))
            gpus.append(_decode_gpu(allocators[-1], devs[-1], p))
        sinks: list[PlainSink] = [make_sink(a, skip=not full_replay, gpu=g) for a, g in zip(allocators, gpus)]
        group = SinkGroup(sinks)
        n = len(policies)

        def on_step(step: int) -> None:
            group.end_step(step)
            bar.update(n)
        try:
            if full_replay or shape.sliding_window:  # Note [Decode step template]: no window, sizes affine
                stream_inference(shape, dtype_bytes, (group,), on_step=on_step, **kw)
            else:
                jumper = StepJumper(group, lambda _step: bar.update(n), kw["new_tokens"] - 1)
                stream_inference(shape, dtype_bytes, (jumper,), on_step=jumper.end_step, jump=jumper.jump, **kw)
            for s in sinks:
                if isinstance(s, (SkippingSink, NativeSkippingSink)):
                    s.finish()
        except AllStopped:
            pass
        out: list[ReservedEstimate | None] = []
        check: list[int] = []
        for p, a, s, d in zip(policies, allocators, sinks, devs):
            if not full_replay and s.voided:
                out.append(None)
                continue
            if not full_replay and s.needs_prefix_trace:
                check.append(len(out))
            err = s.error
            st = a.snapshot_stats()
            out.append(ReservedEstimate(p, d.spec, peak_nbytes, st.peak_reserved_nbytes,
                                        err is None, "" if err is None else str(err),
                                        bool(getattr(err, "injected", False)), s.peak_block_allocated_nbytes(),
                                        st.num_alloc_retries))
    finally:
        for g in gpus:
            if isinstance(g, ModelGpu):
                g.finish()  # the device given runs no work past the replay (its next policy, its owner)
        for a in allocators:
            a.close()
        if own:
            for d in devs:
                d.close()
    if check:
        # Note [Stopped where the prefix trace stops too] in .fastreplay: the full path's first replay, on a device
        # of its own as there (after this stream's allocators are closed)
        prefix = _prefix_trace(shape, dtype_bytes, min(kw["new_tokens"], DECODE_HEAD_STEPS + 1), kw)
        for k in check:
            first = _prefix_result(prefix, device, policies[k], limit, peak_nbytes)
            if not first.fits:
                out[k] = first
    return out


def replay_sequence(workloads: "list[WorkloadTrace] | tuple[WorkloadTrace, ...]", *,
                    device: "str | Device" = "sim:h200-141gb", policy: str = "pytorch") -> list[ReservedEstimate]:
    """Replay ``workloads`` one after the other in one process (Note [What a process keeps] in ``.workload``):
    one allocator on ``device`` under ``policy``; after each workload everything it made is freed but what it
    marks persistent (:attr:`WorkloadTrace.persistent`: the weights, the cuBLAS workspaces), then
    ``empty_cache()``; a later workload does not make again what an earlier one kept under the same name.
    Returns, per workload, the peak reserved from its start (the segments it found included, as
    ``torch.cuda.max_memory_reserved`` after ``reset_peak_memory_stats`` reports) and the peak of allocated
    blocks; ``fits`` is False where it ran out of memory (the rest are not replayed)."""
    if not isinstance(workloads, (list, tuple)) or not workloads \
            or not all(isinstance(w, WorkloadTrace) for w in workloads):
        raise InvalidArgumentError("replay_sequence: give a non-empty list of WorkloadTrace")
    for w in workloads:
        if not w.complete:
            raise InvalidArgumentError(f"replay_sequence: {w.trace.name!r} leaves decode steps out (Note [Decode "
                                       "steps simulated]); make it with inference_trace(..., full_decode=True)")
    own = not isinstance(device, Device)
    dev = open_device(device) if own else device  # type: ignore[arg-type]
    out: list[ReservedEstimate] = []
    try:
        alloc = make_allocator(dev, policy)
        try:
            kept: dict[str, int] = {}  # what a workload left for good, by name -> pointer
            for w in workloads:
                kinds, ids, sizes, _ = w.trace.as_lists()
                skip = {i for i, name in w.persistent.items() if name in kept}
                ptrs: dict[int, int] = {}
                peak_reserved = alloc.reserved_nbytes
                peak_allocated = alloc.allocated_nbytes
                error = ""
                try:
                    for k, i, n in zip(kinds, ids, sizes):
                        if i in skip:
                            continue
                        if k == 0:
                            ptrs[i] = alloc.allocate(n, 0) if n else 0
                            peak_reserved = max(peak_reserved, alloc.reserved_nbytes)
                            peak_allocated = max(peak_allocated, alloc.allocated_nbytes)
                        else:
                            p = ptrs.pop(i)
                            if p:
                                alloc.free(p)
                except OutOfMemoryError as exc:
                    error = str(exc)
                out.append(ReservedEstimate(policy, dev.spec, w.peak_nbytes, peak_reserved, not error, error,
                                            False, peak_allocated))
                if error:
                    break
                for i, p in ptrs.items():
                    if i in w.persistent:
                        kept[w.persistent[i]] = p
                    elif p:
                        alloc.free(p)
                alloc.empty_cache()
        finally:
            alloc.close()
    finally:
        if own:
            dev.close()
    return out


def estimate_peak_reserved(w: WorkloadTrace, policies: "tuple[str, ...] | list[str]" = ("pytorch", "gpumem"), *,
                           device: "str | Device" = "sim:h200-141gb",
                           limit: int | None = None) -> list[ReservedEstimate]:
    """Replay ``w`` (from :func:`~gpumem.estimate.workload.inference_trace` or ``training_trace``) under each
    policy on ``device`` (within ``limit`` bytes when given) and return what each reserved at its peak. A
    replay that runs out of memory is reported with ``fits=False`` and the peak it reached.

    An inference trace holds only some decode steps (Note [Decode steps simulated]); the reserved figures of
    ``generate()`` come from :func:`replay_inference`, which replays every step, and gives a policy whose pages
    are stolen the GPU's lag (Note [The GPU's lag in the decode replay]): a trace replayed here runs the replay's
    default GPU timing."""
    _check_policies(policies)
    if not policies:
        raise InvalidArgumentError("estimate_peak_reserved: give at least one policy")
    if not w.complete:
        raise InvalidArgumentError("estimate_peak_reserved: this generate() trace leaves decode steps out (Note "
                                   "[Decode steps simulated]); use replay_inference(), or inference_trace(..., "
                                   "full_decode=True)")
    return [_replay(w, device, p, limit) for p in policies]


@dataclass(frozen=True)
class FitTry:
    """One size tried by a search: whether it fits, and by which rule (``"simulated"``, ``"estimate"``,
    ``"halving"``, ``"binary_search"``; ``"..., power of two"``: replayed to find the largest power of two that
    fits, ``"..., assumed"``: answered "fits" without a replay, Note [Gallop skipped])."""

    value: int
    fits: bool
    rule: str


@dataclass
class FitResult:
    """The largest batch (or prompt length) that fits, by four rules, for one workload and device.

    ``simulated``: the largest value whose replay fits within ``limit_bytes`` = weights + (``usable_bytes`` -
    weights) / (1 + ``margin``) (the answer); ``usable_bytes`` is what a ``GpuMemoryManager`` may hand out
    on the device (:func:`usable_memory`).
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
    prompt_len: int = DEFAULT_PROMPT_LEN
    """The prompt (training: sequence) length of a batch search; the last tried length of a seq_len search
    is ``simulated``."""
    new_tokens: int = DEFAULT_NEW_TOKENS
    """New tokens generated per sequence (0 for training)."""
    batch_size: int = 1
    """The batch of a ``seq_len`` search."""
    training: bool = False
    bound: str = ""
    """Why the search stopped below the ``max_value`` it was given (empty when it did not): a sliding window
    bounds a ``seq_len`` search (Note [Sliding window])."""
    max_value: int = 0
    """The largest value the search tried: the ``max_value`` given, or the sliding window's bound."""
    lora_rank: int | None = None
    """The LoRA adapters' rank of a LoRA training search (``None``: full training, or generate())."""
    at_max: bool = False
    """Whether the answer (``simulated``) is ``max_value`` itself, the one the caller gave: larger values were
    never tried, so it is a lower bound ("at least"), not the largest that fits (Note [An answer at the
    search's upper bound])."""

    def at_max_note(self) -> str:
        """The warning for :attr:`at_max` (``""`` when the answer is below the search's upper bound)."""
        if not self.at_max:
            return ""
        what = "batch" if self.search == "batch" else ("sequence length" if self.training else "prompt length")
        return (f"the answer {self.simulated} is the search's upper bound (--max {self.max_value}): the {what} "
                f"that fits is at least {self.simulated}, larger ones were not tried; raise --max to search further")

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


class _Probes:
    """Whether a size fits under a limit, each replayed at most once (Note [Probes share replays]), or taken as
    fitting where Note [Gallop skipped] allows; every answer is appended to ``tries``."""

    def __init__(self, workload: Callable[[int], WorkloadTrace],
                 replay: Callable[[WorkloadTrace, int, int], ReservedEstimate],
                 fault: Callable[[int, ReservedEstimate], Exception], usable: int, full_replay: bool, bar: Any,
                 tries: list[FitTry], jobs: int = 1, job: "Callable[[int, int], ProbeJob | None] | None" = None,
                 explore: "Callable[[_Probes], object] | None" = None,
                 pool_factory: "Callable[[int], Any] | None" = None, pool_after_s: float | None = None,
                 eager: bool = False) -> None:
        self._jobs = jobs
        self._eager = eager  # the pool starts with the first replay (a long decode: EAGER_STEP_LAYERS)
        # jobs -> a ProbePool (tests give one that runs in this process); both read when the search starts
        self._pool_factory = ProbePool if pool_factory is None else pool_factory
        self._pool_after_s = POOL_AFTER_S if pool_after_s is None else pool_after_s
        self._job = job  # (value, room) -> the replay as a worker runs it, None where it stays here
        self._explore = explore  # runs the search over a _Probes (Note [Probes replayed ahead])
        self._pool: ProbePool | None = None
        self._pool_broken = False
        self._workload = workload
        self._replay = replay
        self._fault = fault
        self._usable = usable
        self._full_replay = full_replay
        self._bar = bar
        self.tries = tries
        self._cache: dict[tuple[int, int], bool] = {}
        self._fitted: dict[int, int] = {}  # value -> the least peak reserved seen to fit
        self._peaks: dict[int, int] = {}
        self.assumed_below: dict[int, int] = {}
        """limit -> the power of two below which the gallop's sizes are taken as fitting (Note [Gallop
        skipped]); 0 (nothing taken) where absent."""

    def peak(self, v: int) -> int:
        """The workload's peak of allocated bytes at ``v``."""
        if v not in self._peaks:
            self._peaks[v] = self._workload(v).peak_nbytes
        return self._peaks[v]

    def estimate_fits(self, v: int, room: int) -> bool:
        ok = self.peak(v) <= room
        self.tries.append(FitTry(v, ok, "estimate"))
        return ok

    def replayed(self, v: int, lim: int) -> bool:
        """Whether ``v``'s replay fits within ``lim`` bytes (shared, bounded by the live bytes, or replayed),
        appending no try."""
        key = (v, lim)
        if key not in self._cache:
            known = self._answer_without_replay(v, lim)
            if known is not None:
                self._cache[key] = known
            else:
                r = self._take_replay(v, lim)
                if r.injected_fault:
                    raise self._fault(v, r)
                self._cache[key] = r.fits
                if r.fits and not r.alloc_retries:  # Note [Probes share replays]
                    self._fitted[v] = min(self._fitted.get(v, r.peak_reserved_bytes), r.peak_reserved_bytes)
                self._bar.update(1)
        return self._cache[key]

    def _answer_without_replay(self, v: int, lim: int) -> bool | None:
        """``v`` under ``lim`` answered by a replay of it made under another limit, or by its live bytes; None
        where it must be replayed."""
        if not self._full_replay and self._fitted.get(v, self._usable + 1) <= (lim or self._usable):
            return True  # Note [Probes share replays]
        if self.peak(v) > (lim or self._usable):
            return False  # cannot fit: its live bytes alone exceed the room
        return None

    def _take_replay(self, v: int, lim: int) -> ReservedEstimate:
        """``v``'s replay under ``lim``: from the pool where one runs (with the sizes the search may ask next
        replayed ahead: Note [Probes replayed ahead]), else here, starting the pool after a long one. Whatever goes
        wrong with the pool (it cannot start, a worker died, a replay failed there) leaves the search to this
        process, which then replays every size itself: the answer is the same."""
        room = lim or self._usable
        job = None if self._job is None or self._pool_broken else self._job(v, room)
        if self._eager and self._pool is None and job is not None:
            self._start_pool(job, "long replays ahead")
        if self._pool is not None and job is not None:
            try:
                return self._from_pool((v, lim), job)
            except PoolBroken:
                self._pool_broken = True
                self.close()
        t0 = time.perf_counter()
        r = self._replay(self._workload(v), v, room)
        elapsed_s = time.perf_counter() - t0
        if self._pool is None and job is not None and elapsed_s >= self._pool_after_s:
            self._start_pool(job, f"a replay took {elapsed_s:.2f} s")
        return r

    def _start_pool(self, job: ProbeJob, why: str) -> None:
        """Start the pool (more than one job, a search to run dry, the pool not given up, workers allowed here)."""
        if self._jobs < 2 or self._explore is None or self._pool_broken:
            return
        refused = pool_refused(job)
        if refused:
            log.info("find_max_batch: %s, but %s: one process", why, refused)
            self._pool_broken = True
            return
        try:
            self._pool = self._pool_factory(self._jobs)
        except Exception as exc:  # noqa: BLE001 - no semaphores (no /dev/shm), no processes: one process then
            log.warning("find_max_batch: worker processes could not start (%s: %s); the search goes on in this "
                        "process alone, with the same answer", type(exc).__name__, exc)
            self._pool_broken = True
            return
        log.info("find_max_batch: %s; the next replays on %d processes, sizes the search may ask next asked ahead",
                 why, self._jobs)

    def _from_pool(self, key: "tuple[int, int]", job: ProbeJob) -> ReservedEstimate:
        """``key``'s replay from the pool, the sizes the search may ask next submitted first; PoolBroken where the
        pool cannot give it."""
        pool = self._pool
        idle = self._jobs - pool.in_flight()  # workers free for sizes asked ahead; this one asked at least
        if not pool.pending(key):
            idle = max(idle, 1)
        if idle > 0:
            for k in ahead(key, self._first_unknown, idle, pool.pending, pool.answers()):
                pool.submit(k, self._job(k[0], k[1] or self._usable))
        return pool.take(key, job)

    def _first_unknown(self, assumed: "dict[Any, bool]") -> "tuple[int, int] | None":
        """The first size the search would replay with the answers known and those ``assumed`` (Note [Probes
        replayed ahead]); None where it would end first, or fail (the search itself says why if it gets there)."""
        if self._explore is None:
            return None
        try:
            self._explore(_DryProbes(self, assumed))
        except _Unknown as u:
            return u.key
        except Exception:  # noqa: BLE001 - a branch the search may never take: nothing to replay ahead there
            return None
        return None

    def close(self) -> None:
        """End the pool's workers (replays asked ahead and not taken are dropped)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def fits(self, v: int, lim: int, rule: str) -> bool:
        """The answer the search asks for: ``v`` within ``lim`` bytes, under ``rule``."""
        below = self.assumed_below.get(lim, 0)
        if v < below and v & (v - 1) == 0 and (v, lim) not in self._cache:
            self.tries.append(FitTry(v, True, f"{rule}, assumed"))  # Note [Gallop skipped]
            return True
        ok = self.replayed(v, lim)
        self.tries.append(FitTry(v, ok, rule))
        return ok

    def skip_gallop(self, lim: int, max_value: int, rule: str, known: int = 0) -> None:
        """Note [Gallop skipped]: replay powers of two downwards from the largest whose live bytes fit ``lim``
        (reached by doubling from ``known`` or 1, at most ``max_value``) to the first that fits, ``P``; the
        gallop's sizes below ``P`` are then taken as fitting. ``known``: a power of two known to fit within
        ``lim`` (``P`` when none above it fits), its live bytes and those of the powers of two below it
        within ``lim``."""
        if max_value < 1:
            raise InvalidArgumentError(f"max_value must be a positive whole number, got {max_value!r}")
        top = max(known, 1)
        if known < 1 and self.peak(1) > lim:
            top = 0
        else:  # doubling, not halving from max_value: Note [Gallop skipped], workloads built
            while top * 2 <= max_value and self.peak(top * 2) <= lim:
                top *= 2
        p = top
        while p > known:
            ok = self.replayed(p, lim)
            self.tries.append(FitTry(p, ok, f"{rule}, power of two"))
            if ok:
                break
            p //= 2
        self.assumed_below[lim] = max(p, known)


@dataclass(frozen=True)
class ProbeJob:
    """One ``generate()`` replay of :func:`replay_inference` under one policy, as a worker process of a
    :class:`~gpumem.estimate.probe_pool.ProbePool` runs it (Note [Probes replayed ahead]; every field can be pickled;
    ``device`` is a spec, opened anew by the replay)."""

    shape: ModelShape
    dtype_bytes: int
    policy: str
    device: str
    batch_size: int
    prompt_len: int
    new_tokens: int
    limit: int
    peak_nbytes: int
    weight_format: WeightFormat | None
    workspace_nbytes: int
    full_replay: bool
    policy_rules: Any = None
    """The policy ``policy`` names where the job was made (an ``AllocatorPolicy``): a worker refuses the job where
    its own differs (one added or changed at run time in the search's process), and the search makes it itself."""
    device_profile: Any = None
    """The profile ``device`` opened with where the job was made: a worker whose spec opens another refuses the
    job (a profile changed at run time), and the search makes it itself."""
    package_dir: str | None = field(default_factory=lambda: PACKAGE_DIR)
    """Where the search's process imported gpumem from: a worker that imported another copy refuses the job."""

    def run(self) -> Any:
        """The replay's :class:`ReservedEstimate` (in whichever process calls it)."""
        _check_here(self.package_dir, (self.policy,), (self.policy_rules,), self.device, self.device_profile)
        return replay_inference(self.shape, self.dtype_bytes, (self.policy,), self.device,
                                batch_size=self.batch_size, prompt_len=self.prompt_len, new_tokens=self.new_tokens,
                                limit=self.limit, peak_nbytes=self.peak_nbytes, weight_format=self.weight_format,
                                workspace_nbytes=self.workspace_nbytes, full_replay=self.full_replay)[0]



@dataclass(frozen=True)
class PolicyGroupJob:
    """``generate()`` replayed under a group of policies by :func:`replay_inference`, as a worker process of
    :class:`~gpumem.estimate.policy_workers.PolicyWorkers` runs it (Note [Policies replayed apart]; every field can
    be pickled; ``device`` is a spec, opened anew for each policy)."""

    shape: ModelShape
    dtype_bytes: int
    policies: "tuple[str, ...]"
    device: str
    batch_size: int
    prompt_len: int
    new_tokens: int
    limit: int | None
    peak_nbytes: int
    weight_format: WeightFormat | None
    workspace_nbytes: int
    policy_rules: "tuple[Any, ...]"
    """The policy each name gives where the job was made (``None`` for a name that is not an ``AllocatorPolicy``'s):
    a worker whose own differ refuses the job (a policy added or changed at run time), and it is replayed there."""
    device_profile: Any = None
    """The profile ``device`` opened with where the job was made: a worker whose spec opens another refuses the
    job (a profile changed at run time: attacker 2026-12-03), and it is replayed there."""
    package_dir: str | None = field(default_factory=lambda: PACKAGE_DIR)
    """Where the caller's process imported gpumem from: a worker that imported another copy refuses the job."""

    def run(self, bar: Any = None) -> "list[ReservedEstimate]":
        """The group's figures, in its order (in whichever process calls it); ``bar`` moves by one per decode step
        and policy."""
        _check_here(self.package_dir, self.policies, self.policy_rules, self.device, self.device_profile)
        return replay_inference(self.shape, self.dtype_bytes, self.policies, self.device,
                                batch_size=self.batch_size, prompt_len=self.prompt_len, new_tokens=self.new_tokens,
                                limit=self.limit, peak_nbytes=self.peak_nbytes, weight_format=self.weight_format,
                                workspace_nbytes=self.workspace_nbytes, bar=bar)


def _check_here(package_dir: "str | None", policies: "tuple[str, ...]", rules: "tuple[Any, ...]", device: str,
                profile: Any) -> None:
    """InternalError where this process (a worker) would replay a job otherwise than the process that made it did:
    gpumem imported from elsewhere than ``package_dir`` (the forkserver found another copy on its own path: attacker
    2026-12-03, a script in a clone with gpumem installed too), a policy other than its ``rules`` (added or changed
    at run time there), or ``device`` opening another profile than ``profile`` (changed at run time there). The
    caller then makes the job itself."""
    if package_dir is not None and package_dir != PACKAGE_DIR:
        raise InternalError(f"gpumem is imported from {PACKAGE_DIR} here, from {package_dir} by the caller")
    for p, r in zip(policies, rules):
        if r is not None:
            _check_policy_here(p, r)
    if profile is not None:
        dev = open_device(device)
        try:
            if getattr(dev, "profile", None) != profile:
                raise InternalError(f"device {device!r} is not the caller's here: its profile was changed at run time")
        finally:
            dev.close()


def _policy_rules(policy: str) -> Any:
    """What ``policy`` names here (an ``AllocatorPolicy``), None for a bucket policy or one the replay refuses."""
    try:
        return get_policy(policy)
    except InvalidArgumentError:
        return None


def _check_policy_here(policy: str, rules: Any) -> None:
    """InternalError where ``policy`` does not name ``rules`` in this process (a worker started before it was added
    or changed at run time in the caller's)."""
    if _policy_rules(policy) != rules:
        raise InternalError(f"policy {policy!r} is not the caller's here: added or changed at run time")


class _Unknown(Exception):
    """A dry search reached a size it would replay (Note [Probes replayed ahead])."""

    def __init__(self, key: "tuple[int, int]") -> None:
        super().__init__(key)
        self.key = key


class _DryProbes(_Probes):
    """The search's probes with nothing replayed: answers known to ``real`` (replayed, shared or bounded), then
    those ``assumed``; any other raises :class:`_Unknown` (Note [Probes replayed ahead]). Its tries and gallop
    bounds are its own; the answers, the fitted peaks and the workloads' peaks are ``real``'s."""

    def __init__(self, real: _Probes, assumed: "dict[Any, bool]") -> None:  # noqa: super-init-not-called
        self.__dict__.update(real.__dict__)
        self.tries = []
        self.assumed_below = {}
        self._bar = NoProgress()
        self._pool = None
        self._real = real
        self._assumed = assumed

    def replayed(self, v: int, lim: int) -> bool:
        key = (v, lim)
        if key in self._cache:
            return self._cache[key]
        known = self._real._answer_without_replay(v, lim)
        if known is not None:
            return known
        if key in self._assumed:
            return self._assumed[key]
        raise _Unknown(key)


def _alone_without_faults(dev: Device) -> bool:
    """Note [Each probe on a device of its own]: a simulated device that runs alone and injects no fault of any
    kind (so a fresh one behaves as this one would)."""
    runs_alone = getattr(dev, "runs_alone", None)
    faults = getattr(dev, "faults", None)
    return (callable(runs_alone) and runs_alone() and faults is not None
            and not faults.plan.injects_anything)


def _halving_start(start: int | None, estimate: int, max_value: int) -> int:
    """Where the halving retry starts: ``start``, else the power of two nearest the estimate (at most
    ``max_value``)."""
    return start if start is not None else min(max_value, 1 << max(0, (2 * max(estimate, 1) - 1).bit_length() - 1))


# Note [Gallop skipped]
#     The searches of ``simulated`` and ``binary_search`` (:func:`_largest`) gallop up 1, 2, 4, ... to the first
#     power of two that does not fit, then bisect between it and the last that did. Each answer was a replay
#     of the whole ``generate()``, and the small sizes at the start of the gallop are a large share of a
#     search's time (7B, prompt 2048, 1,000 new tokens: batches 1 to 16 were 5 of 16 replays, 17 s of 64 s).
#     Now the largest power of two ``P`` that fits is found first, replaying downwards from the largest whose
#     live bytes fit the limit (above it nothing can fit; ``FitTry`` rule ``"..., power of two"``), and the
#     powers of two below ``P`` are answered "fits" without a replay (rule ``"..., assumed"``), for the gallop
#     and the halving retry; every other size the search asks is replayed (or shared: Note [Probes share
#     replays]). Under the usable memory ``P`` of the margin's limit fits too, so that search starts from it.
#     The largest power whose live bytes fit is reached by doubling from 1 (a workload built per size, no
#     replay): the estimate's own gallop builds those sizes (its limit, the usable memory, is at least the
#     margin's), so no workload is built that the search without the skip does not build. Halving down from
#     ``max_value`` built sizes far past any device, which the builder refuses (``--max 2**40``: "371
#     allocations add up to more than 2**63 - 1 bytes") where the plain search answered.
#     The search then asks what it asked before, in the same order, and gets the same answers, hence the same
#     result, whenever one assumption holds: *every power of two below a power of two that fits fits too*.
#     That is the bisection's own assumption (the probe is monotone in the size), made only at half the
#     largest power that fits and below; near the answer every size is replayed as before and keeps whatever
#     the replay answers there.
#
#     A search that assumed the probe monotone everywhere (a model's guess of the answer, checked at the guess
#     and one past it) replays fewer sizes but does not keep the answer: the replay is not monotone near the
#     answer (``ModelShape(512, 1376, 4, 8000, 8, 8)`` on ``sim:gtx-1050-2gb``, prompt 64, 300 new tokens:
#     batch 419 ran out of memory under the margin's limit where 446 fit, on the device of before 2026-11-29), and the bisection lands on another
#     edge. ``find_max_batch(..., skip_gallop=False)`` keeps the search that replays every size it asks, the
#     reference of ``tests/estimate/test_fit_search.py``.
def _search(probes: _Probes, limit: int, usable: int, max_value: int, start: int | None,
            skip_gallop: bool) -> tuple[int, int, int, int, int]:
    """The four rules' searches: doubling and bisection from 1 under the margin's limit, the estimate, the
    halving retry, doubling and bisection under the usable memory; with ``skip_gallop``, the gallop's sizes
    below the largest power of two that fits are not replayed (Note [Gallop skipped]). Returns (simulated,
    estimate, start, halving, binary_search)."""
    if skip_gallop:
        probes.skip_gallop(limit, max_value, "simulated")
    simulated = _largest(lambda v: probes.fits(v, limit, "simulated"), 1, max_value)
    estimate = _largest(lambda v: probes.estimate_fits(v, usable), 1, max_value)
    first = _halving_start(start, estimate, max_value)
    if skip_gallop:
        # what fits under the margin's limit fits within the usable memory (Note [Probes share replays])
        probes.skip_gallop(usable, max_value, "binary_search", probes.assumed_below.get(limit, 0))
    halving = first
    while halving >= 1 and not probes.fits(halving, usable, "halving"):
        halving //= 2
    binary = _largest(lambda v: probes.fits(v, usable, "binary_search"), 1, max_value)
    return simulated, estimate, first, halving, binary


def find_max_batch(shape: ModelShape, dtype_bytes: int, *, device: "str | Device" = "sim:h200-141gb",
                   prompt_len: int = DEFAULT_PROMPT_LEN, new_tokens: int = DEFAULT_NEW_TOKENS, batch_size: int = 1,
                   search: str = "batch", training: bool = False, policy: str = "pytorch",
                   margin: float | None = None, max_value: int = 4096, start: int | None = None,
                   progress: bool | None = False, weight_format: WeightFormat | None = None,
                   gradient_checkpointing: bool = False, optimizer_8bit: bool = False,
                   mixed_precision: str | None = None, full_replay: bool = False,
                   skip_gallop: bool = True, lora: LoraConfig | None = None, jobs: int = 1) -> FitResult:
    """The largest batch (``search="batch"``) or prompt/sequence length (``search="seq_len"``, at
    ``batch_size``) that runs on ``device`` without out-of-memory, by replaying the workload's allocations
    under ``policy`` with ``margin`` of the memory beyond the weights held back (default
    :data:`DEFAULT_MARGINS`, Note [Fragmentation margin]), within the device's usable memory as a
    ``GpuMemoryManager`` sees it (:func:`usable_memory`).

    ``training=True`` fits training steps of ``prompt_len`` tokens (``new_tokens`` is ignored). Returns a
    :class:`FitResult`; its ``simulated`` is 0 when not even 1 fits. ``max_value`` bounds the search.
    ``weight_format``: the projections' format (:mod:`.formats`; generate() only), with its dequantization
    workspace on ``device`` for the ternary ones. ``gradient_checkpointing``, ``optimizer_8bit`` and
    ``mixed_precision`` (the autocast dtype on fp32 master weights, ``dtype_bytes`` 4): training
    options (:func:`~gpumem.estimate.workload.training_trace`); ``lora``: LoRA adapters on the frozen base
    (training only; its ``base_format`` is QLoRA's quantized base, which then counts as the weights the margin
    leaves out). ``progress``: a bar of the replays (None: on a terminal). Raises :class:`InjectedFaultError` when a
    replay fails on a fault the device spec injects. ``full_replay=True``: every probe replayed in full, none
    shared (the reference of Note [Probes share replays] and of :func:`replay_inference`'s fast path).
    ``skip_gallop=False``: every size the search asks is replayed, the small ones of its gallop included (the
    reference of Note [Gallop skipped]; the same result wherever that Note's assumption holds, the tries aside).
    ``jobs``: processes (at most the CPUs) to replay ``generate()`` probes on, with the sizes the search may ask
    next replayed ahead, from the first replay of a long decode or once a replay took
    :data:`~gpumem.estimate.probe_pool.POOL_AFTER_S` (Note [Probes replayed ahead] in :mod:`.probe_pool`: the same
    result and tries as ``jobs=1``, sooner).

    Note [Probes share replays]
        The searches probe the same sizes under two limits: the margin's (``simulated``) and the usable memory
        (``halving``, ``binary_search``). A replay that fitted under one limit with a peak reserve ``P`` and made
        no out-of-memory retry is the replay under any limit of at least ``P``: no growth it made passed ``P`` or
        was refused, so none is refused there either, and the allocator makes the same decisions op for op. Such
        a probe is answered "fits" without a replay; any other is replayed. A replay that fitted only through
        retries is not shared: under a higher limit those retries do not happen, the cached memory they gave back
        stays, and the replay can run out of memory later where the lower limit's did not (a GQA model on
        ``sim:rtx-3060-12gb``, batch 1152: fit under the margin's limit, out of memory under the usable memory;
        shared, ``binary_search`` answered 1212 where every size replayed answered 1144, until 2026-11-29).
    """
    if not isinstance(full_replay, bool):
        raise InvalidArgumentError(f"full_replay must be True or False, got {full_replay!r}")
    if not isinstance(skip_gallop, bool):
        raise InvalidArgumentError(f"skip_gallop must be True or False, got {skip_gallop!r}")
    if search not in ("batch", "seq_len"):
        raise InvalidArgumentError(f"search must be 'batch' or 'seq_len', got {search!r}")
    jobs = check_jobs(jobs)
    cpus = usable_cpus()
    if jobs > cpus:  # more processes than CPUs only wait on each other (and each holds a replay)
        log.info("find_max_batch: jobs=%d, but %d CPUs usable here: %d processes", jobs, cpus, cpus)
        jobs = cpus
    if isinstance(max_value, bool) or not isinstance(max_value, int) or max_value < 1:
        raise InvalidArgumentError(f"max_value must be a positive whole number, got {max_value!r}")
    if margin is None:
        margin = DEFAULT_MARGINS.get(policy, 0.20)
    if not (isinstance(margin, (int, float)) and 0.0 <= margin <= 10.0):
        raise InvalidArgumentError(f"margin must be a number in [0, 10], got {margin!r}")
    if lora is not None and not isinstance(lora, LoraConfig):
        raise InvalidArgumentError(f"lora must be a LoraConfig or None, got {type(lora).__name__}")
    if (gradient_checkpointing or optimizer_8bit or mixed_precision is not None or lora is not None) and not training:
        raise InvalidArgumentError("find_max_batch: gradient_checkpointing, optimizer_8bit, mixed_precision and lora "
                                   "are for training=True")
    if mixed_precision is not None:
        check_mixed_precision(mixed_precision, dtype_bytes, lora=lora is not None, optimizer_8bit=optimizer_8bit)
    if weight_format is not None and training:
        raise InvalidArgumentError("find_max_batch: a weight format with training is not modelled (full training "
                                   "updates 16-bit weights); QLoRA's frozen base is lora=LoraConfig(rank, "
                                   "base_format=...) (`gpumem fit --training --lora-rank R --weight-format F`)")
    own = not isinstance(device, Device)
    dev = open_device(device) if own else device
    bar = progress_bar(None, f"fit {search}", " replays", enabled=progress)  # no total: tqdm writes "{n}{unit}"
    try:
        usable = max(0, usable_memory(dev))
        workspace = dequant_workspace_nbytes(shape, weight_format, dev)
        weights_total = weights_nbytes(shape, dtype_bytes, weight_format if lora is None else lora.base_format)
        weights = min(usable, weights_total)
        limit = int(weights + (usable - weights) / (1.0 + margin))
        tries: list[FitTry] = []

        extra_tokens = 0 if training else new_tokens
        bound = ""
        if search == "batch":
            shape.check_tokens(prompt_len + extra_tokens)
        elif shape.sliding_window:  # Note [Sliding window]: the search stays within the window
            shape.check_tokens(1 + extra_tokens)
            room = shape.sliding_window - extra_tokens
            if room < 1:
                raise InvalidArgumentError(
                    f"find_max_batch: {extra_tokens} new tokens >= the sliding window of {shape.sliding_window} "
                    f"tokens: no prompt length keeps the sequence within the window, where the seq_len search "
                    f"stays (give fewer new tokens, or search the batch)")
            if room < max_value:
                seq = f"the sequence (prompt + {extra_tokens} new tokens)" if extra_tokens else "the sequence"
                bound = (f"{'sequence' if training else 'prompt'} lengths searched up to {room}, not {max_value}: "
                         f"{seq} stays within the sliding window of {shape.sliding_window} tokens")
                max_value = room

        def sizes(v: int) -> tuple[int, int]:
            return (v, prompt_len) if search == "batch" else (batch_size, v)

        def workload(v: int) -> WorkloadTrace:
            b, p = sizes(v)
            if training:
                return training_trace(shape, dtype_bytes, batch_size=b, seq_len=p,
                                      gradient_checkpointing=gradient_checkpointing, optimizer_8bit=optimizer_8bit,
                                      mixed_precision=mixed_precision, lora=lora)
            return inference_trace(shape, dtype_bytes, batch_size=b, prompt_len=p, new_tokens=new_tokens,
                                   weight_format=weight_format, workspace_nbytes=workspace)

        # Note [Each probe on a device of its own]: a device spec opened here that runs alone (no tenants, no
        # faults) is opened anew for each generate() replay, as gpumem estimate does, so that a virtual-memory
        # engine makes its page moves in C++ (Note [An idle device's bookkeeping calls made here]); a device
        # shared by the probes kept them in Python (gpumem fit --policy gpumem of a 7B model: each probe 5x
        # slower than gpumem estimate's replay of the same size: new user 27). The probes' figures are the same:
        # each probe's allocator is closed and gives everything back before the next, and a fresh device places
        # what an emptied one places. A Device given, or one with faults or tenants, is shared as before (a
        # fault plan runs on across the probes).
        probe_dev: "str | Device" = device if own and _alone_without_faults(dev) else dev

        def replay(w: WorkloadTrace, v: int, room: int) -> ReservedEstimate:
            if training:
                return _replay(w, dev, policy, room)
            b, p = sizes(v)
            # a replay of many new tokens takes seconds: a bar of its steps under the bar of the replays
            steps = progress_bar(max(new_tokens, 1), f"{search} {v}", " steps", enabled=progress)
            try:
                return replay_inference(shape, dtype_bytes, (policy,), probe_dev, batch_size=b, prompt_len=p,
                                        new_tokens=new_tokens, limit=room, peak_nbytes=w.peak_nbytes,
                                        weight_format=weight_format, workspace_nbytes=workspace,
                                        full_replay=full_replay, bar=steps)[0]
            finally:
                steps.close()

        def fault(v: int, r: ReservedEstimate) -> InjectedFaultError:
            return InjectedFaultError(
                f"an injected fault (the device spec's fault options) failed the replay of {search} "
                f"{v} on {dev.spec}; nothing was out of memory, and no size can be judged on a "
                f"device that injects faults (give the spec without them): {r.oom_message}")

        policy_rules = _policy_rules(policy)

        if jobs > 1 and not training and isinstance(probe_dev, str):  # a pool may start: never in a worker's start
            check_not_bootstrapping()

        def job(v: int, room: int) -> ProbeJob | None:
            if training or not isinstance(probe_dev, str):  # Note [Probes replayed ahead]: these stay here
                return None
            b, p = sizes(v)
            return ProbeJob(shape, dtype_bytes, policy, probe_dev, b, p, new_tokens, room, probes.peak(v),
                            weight_format, workspace, full_replay, policy_rules, getattr(dev, "profile", None))

        def explore(p: _Probes) -> object:
            return _search(p, limit, usable, max_value, start, skip_gallop)

        eager = not training and new_tokens * shape.n_layers >= EAGER_STEP_LAYERS
        probes = _Probes(workload, replay, fault, usable, full_replay, bar, tries, jobs, job, explore, eager=eager)
        try:
            simulated, estimate, first, halving, binary = explore(probes)
        finally:
            probes.close()
        reason = ""
        if simulated < 1:
            what = "batch 1" if search == "batch" else f"a prompt of 1 token at batch {batch_size}"
            if weights_total > usable:
                reason = (f"the weights alone ({format_bytes(weights_total)}) exceed the usable "
                          f"memory of {dev.spec} ({format_bytes(usable)})")
            else:
                reason = (f"not even {what} fits: its replay under {policy} needs more than "
                          f"{format_bytes(limit)} (the usable {format_bytes(usable)} less the margin)")
        # Note [An answer at the search's upper bound]: the search never tries past max_value, so an answer
        # equal to it says only "at least this much"; `gpumem fit --search seq_len` answered 4096 (--max's
        # default) on an H200 where 5046 fits, with no word. A window's bound is a real one (``bound``).
        return FitResult(search, policy, dev.spec, usable, limit, margin, simulated, estimate, halving, binary, first,
                         tries, weights_total, reason, prompt_len=prompt_len,
                         new_tokens=0 if training else new_tokens, batch_size=batch_size, training=training,
                         bound=bound, max_value=max_value, lora_rank=None if lora is None else lora.rank,
                         at_max=not bound and simulated == max_value)
    except OutOfMemoryError as exc:  # the device itself could not be opened with room: report as no fit
        raise InvalidArgumentError(f"find_max_batch: {exc}") from exc
    finally:
        bar.close()
        if own:
            dev.close()
