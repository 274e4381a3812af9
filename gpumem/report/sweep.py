"""What-if sweeps: every trace x device x policy x limit, replayed in parallel, as one tidy table.

>>> from gpumem.report.sweep import run_sweep, write_sweep
>>> result = run_sweep(["data/traces/resnet_train.snapshot.pickle.gz"], ["sim:t4-16gb", "sim:rtx-2060-6gb"],
...                    ["gpumem", "pytorch"], jobs=2)
>>> write_sweep(result, "out/sweep")   # sweep.csv, sweep.json and the summary figures (PNG)

Each combination is one *case* (:class:`SweepCase`: a trace path, a device spec, a policy name and a limit,
all small strings) run by :func:`run_case`, a top-level function, so that any
``concurrent.futures``-style executor can run it: local processes by default
(:class:`~concurrent.futures.ProcessPoolExecutor`), or a Dask cluster
(``distributed.Client(address).get_executor()``), through the same code path (Note [One code path for every
executor]). Each case becomes one :class:`SweepRow`; a case that fails (a bad trace, a device that cannot be
opened) becomes a row with ``status="error"`` and the error's text instead of stopping the sweep.

Reproducibility: rows come in the order of the arguments (traces, then devices, then policies, then limits;
:attr:`SweepRow.index`), whatever order the executor finishes them in, and every column except the
wall-clock timing columns (:data:`TIMING_COLUMNS`: ``wall_s``, ``ns_per_op``) is identical from run to run and
from executor to executor (:meth:`SweepResult.comparable_rows`).
"""

from __future__ import annotations

import concurrent.futures as cf
from concurrent.futures.process import BrokenProcessPool
import csv
import dataclasses
import enum
import functools
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..outputs import csv_row, replace_atomically, resolve_output
from ..errors import BackendUnavailableError, GpumemError, InvalidArgumentError

log = logging.getLogger(__name__)

__all__ = [
    "COLUMNS",
    "SWEEP_FILES",
    "TIMING_COLUMNS",
    "SweepCase",
    "SweepError",
    "SweepResult",
    "SweepRow",
    "SweepStatus",
    "check_out_dir",
    "make_cases",
    "plot_sweep",
    "require_matplotlib",
    "run_case",
    "run_sweep",
    "trace_labels",
    "write_sweep",
]

#: Columns measured with the wall clock: they differ from run to run and are left out of
#: :meth:`SweepResult.comparable_rows`.
TIMING_COLUMNS: tuple[str, ...] = ("wall_s", "ns_per_op")

#: The files :func:`write_sweep` writes into its folder (the figures are listed in ``sweep.json``).
SWEEP_FILES: tuple[str, ...] = ("sweep.csv", "sweep.json")

_TRACE_CACHE_SIZE = 4


class SweepError(InvalidArgumentError):
    """A sweep that cannot be started or written: bad arguments, an output folder in the way."""


class SweepStatus(str, enum.Enum):
    """The values of :attr:`SweepRow.status` (rows hold the plain text, ``SweepStatus.OK.value``; a str
    compares equal to its member: ``row.status == SweepStatus.OK``)."""

    OK = "ok"
    """The whole trace was replayed without an out-of-memory error."""
    OOM = "oom"
    """An allocation did not fit (the device or the limit): the replay stopped there."""
    ERROR = "error"
    """The case could not run (a bad trace file, a device that cannot be opened, ...): see ``error``."""


@dataclass(frozen=True)
class SweepCase:
    """One combination to replay: small, picklable, the same on every worker.

    ``trace_path`` is the path a worker opens (absolute, so that workers started elsewhere find it; on a
    cluster every worker must see it at that path); ``trace`` is the path as the user gave it (what the
    table shows).
    """

    index: int
    trace: str
    trace_path: str
    device: str
    policy: str
    limit: str | None = None
    gpu_timing: str | None = None
    """How the program's GPU work runs beside the replay (None: the default of :func:`gpumem.replay.replay`)."""
    step_marks: bool = True
    """Read the trace's step marks (False: ``load_trace(..., step_marks=False)``, a run without step plans)."""

    def __post_init__(self) -> None:
        if not isinstance(self.step_marks, bool):
            raise SweepError(f"step_marks must be True or False, got {self.step_marks!r}")


@dataclass(frozen=True)
class SweepRow:
    """One row of the tidy table: what one case measured (or why it could not run)."""

    index: int
    """Position of the case in the sweep (traces, then devices, policies, limits, in argument order)."""
    trace: str
    device: str
    policy: str
    limit: str | None
    status: str
    """:class:`SweepStatus`: ``ok``, ``oom`` or ``error``."""
    ran: bool
    """Whether the whole trace ran without an out-of-memory error (``status == "ok"``)."""
    trace_name: str | None = None
    limit_nbytes: int | None = None
    n_ops: int | None = None
    completed_ops: int | None = None
    peak_live_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    overhead: float | None = None
    """``peak_reserved_bytes / peak_live_bytes - 1`` over the replayed part."""
    oom_count: int | None = None
    oom_op: int | None = None
    trace_peak_live_bytes: int | None = None
    external_fragmentation_at_end: float | None = None
    device_calls: int | None = None
    cache_hits: int | None = None
    cache_misses: int | None = None
    sim_time_s: float | None = None
    engine: str | None = None
    gpu_timing: str | None = None
    """How the program's GPU work ran beside the replay (the default differs per trace: ``gpu-clock`` for one
    that carries its GPU clock)."""
    step_marks: bool = True
    """Whether the trace's step marks were read (``gpumem sweep --no-step-marks``: not)."""
    error: str | None = None
    """``ErrorType: message`` for ``status == "error"``; the out-of-memory message for ``oom``."""
    wall_s: float | None = None
    """Wall-clock seconds of the replay (a timing column: not reproducible)."""
    ns_per_op: float | None = None
    """Wall-clock nanoseconds per replayed operation (a timing column: not reproducible)."""

    def as_dict(self) -> dict[str, Any]:
        """The row as a plain dict, in column order."""
        return dataclasses.asdict(self)


COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SweepRow))
"""The table's columns, in order."""
_EARLIER_COLUMNS: tuple[tuple[str, ...], ...] = (tuple(c for c in COLUMNS if c != "step_marks"),)
"""The columns of sweeps written by earlier versions, whose folders a sweep may replace (before 2026-12-01: no
``step_marks``)."""


@dataclass(frozen=True)
class SweepResult:
    """The rows of a sweep (in :attr:`SweepRow.index` order) and the arguments that made them."""

    rows: tuple[SweepRow, ...]
    traces: tuple[str, ...]
    devices: tuple[str, ...]
    policies: tuple[str, ...]
    limits: tuple[str | None, ...]
    executor: str = ""
    """What ran the cases (``ProcessPoolExecutor(jobs=2)``, the executor's class name, ...)."""

    def comparable_rows(self) -> list[dict[str, Any]]:
        """The rows without the timing columns (:data:`TIMING_COLUMNS`): equal for equal sweeps, whatever
        executor ran them."""
        return [{k: v for k, v in r.as_dict().items() if k not in TIMING_COLUMNS} for r in self.rows]

    @property
    def n_errors(self) -> int:
        """Rows that could not run."""
        return sum(r.status == SweepStatus.ERROR.value for r in self.rows)

    def as_json(self) -> dict[str, Any]:
        """The ``sweep.json`` object (without the figure list, which :func:`write_sweep` adds)."""
        return {
            "traces": list(self.traces), "devices": list(self.devices), "policies": list(self.policies),
            "limits": list(self.limits), "executor": self.executor, "columns": list(COLUMNS),
            "timing_columns": list(TIMING_COLUMNS), "rows": [r.as_dict() for r in self.rows],
        }


# -- cases ---------------------------------------------------------------------------------------------
def _distinct(values: Iterable[Any], what: str) -> tuple[Any, ...]:
    out = tuple(values)
    if not out:
        raise SweepError(f"a sweep needs at least one {what}")
    seen: set[Any] = set()
    for v in out:
        if v in seen:
            raise SweepError(f"{what} {v!r} is given twice")
        seen.add(v)
    return out


def _check_device(spec: Any) -> str:
    from ..specs import DeviceKind, parse_spec

    if not isinstance(spec, str):
        raise SweepError(f"a device must be a spec string such as 'sim:t4-16gb', got {type(spec).__name__}")
    try:
        parsed = parse_spec(spec)
        if parsed.kind is DeviceKind.SIM:
            from ..specs import open_device

            open_device(spec).close()  # checks the profile and the options here, not in every worker
    except GpumemError as exc:
        raise SweepError(f"device {spec}: {exc}") from None
    return spec


def _check_limit(limit: Any) -> str | None:
    from ..validate import parse_limit

    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (str, int, float)):
        raise SweepError(f"a limit must be None, bytes (int), a fraction (float) or text such as '8GiB', "
                         f"got {type(limit).__name__}")
    # the table and the workers carry the limit as text: bytes get their unit ("1" alone is ambiguous)
    text = f"{limit}B" if isinstance(limit, int) else str(limit)
    try:
        parse_limit(text, 2**64)
    except InvalidArgumentError as exc:
        if "less than one byte" not in str(exc):
            raise SweepError(f"limit {limit!r}: {exc}") from None
    return text


def make_cases(traces: Sequence[Any], devices: Sequence[str], policies: Sequence[str],
               limits: Sequence[Any] = (None,), gpu_timing: str | None = None,
               step_marks: bool = True) -> list[SweepCase]:
    """Check the arguments and return every combination as a :class:`SweepCase`, in table order.

    Raises :class:`SweepError` for an empty or repeated argument, a trace that is not a path, a malformed
    device spec or limit, an unknown simulated profile or policy. A trace file that is missing or
    unreadable is *not* an argument error: its cases become error rows.
    """
    from ..allocator.bucket import is_bucket_policy
    from ..allocator.policy import get_policy

    for t in traces if isinstance(traces, (list, tuple)) else ():
        if not isinstance(t, (str, os.PathLike)):
            raise SweepError(f"traces are given as file paths (each worker reads its own copy), "
                             f"got {type(t).__name__}")
    if isinstance(traces, (str, os.PathLike)) or not isinstance(traces, (list, tuple)):
        raise SweepError("traces must be a list of file paths")
    trace_list = _distinct((os.fspath(t) for t in traces), "trace")
    same: dict[str, str] = {}
    for t in trace_list:  # ./t.gz and t.gz, or a link to it, are one trace
        real = os.path.realpath(t)
        if real in same:
            raise SweepError(f"trace {t!r} is the same file as {same[real]!r}; give it once")
        same[real] = t
    device_list = _distinct((_check_device(d) for d in devices), "device")
    policy_list = _distinct(policies, "policy")
    for p in policy_list:
        if not isinstance(p, str):
            raise SweepError(f"a policy is given by its name, got {type(p).__name__}")
        if is_bucket_policy(p):  # the size-bucket pool, as gpumem replay and gpumem fit take it
            continue
        try:
            get_policy(p)
        except InvalidArgumentError as exc:
            raise SweepError(str(exc)) from None
    limit_list = _distinct((_check_limit(x) for x in limits), "limit")
    if gpu_timing is not None:
        from ..sim.gpu_work import gpu_timing as _check_timing

        try:
            gpu_timing = _check_timing(gpu_timing).value
        except InvalidArgumentError as exc:
            raise SweepError(str(exc)) from None
    if not isinstance(step_marks, bool):
        raise SweepError(f"step_marks must be True or False, got {step_marks!r}")
    cases = []
    for i, (t, d, p, lim) in enumerate(itertools.product(trace_list, device_list, policy_list, limit_list)):
        cases.append(SweepCase(i, t, os.path.abspath(t), d, p, lim, gpu_timing, step_marks))
    return cases


# -- one case, in a worker -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=_TRACE_CACHE_SIZE)
def _cached_trace(path: str, mtime_ns: int, size: int, step_marks: bool = True) -> Any:
    # Note [Per-worker trace cache]: a worker runs many cases of the same trace (a sweep is sorted by trace
    # first), and reading a snapshot costs more than replaying it; so each worker process keeps its last few
    # traces. The key holds the file's mtime and size, so an edited file is read again. This cache is the
    # one piece of process-wide state: it only memoises a pure function of the file's content, and is
    # bounded (_TRACE_CACHE_SIZE traces); lru_cache guards it with its own lock.
    from ..trace import load_trace

    return load_trace(path, step_marks=step_marks)


def _load_trace(path: str, step_marks: bool = True) -> Any:
    st = os.stat(path)
    return _cached_trace(path, st.st_mtime_ns, st.st_size, step_marks)


def _error_row(case: SweepCase, exc: BaseException | str) -> SweepRow:
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    # the worker's absolute path says where this machine keeps the file: the table shows the path as given
    text = text.replace(case.trace_path, case.trace)
    return SweepRow(case.index, case.trace, case.device, case.policy, case.limit, SweepStatus.ERROR.value, False,
                    step_marks=case.step_marks, error=text[:2000])


def run_case(case: SweepCase) -> SweepRow:
    """Replay one case and return its row; never raises for a failing case (its row says why).

    A top-level function of small, picklable arguments, so that process pools and Dask workers can run it.
    """
    from ..replay import replay_trace
    from ..specs import open_device
    from ..validate import parse_limit

    limit_nbytes = None
    try:
        trace = _load_trace(case.trace_path, case.step_marks)
        if trace.n_ops == 0:
            return _error_row(case, "InvalidArgumentError: the trace has no allocations or frees")
        device = open_device(case.device)
        try:
            if case.limit is not None:
                limit_nbytes = parse_limit(case.limit, device.properties().total_nbytes)
            result = replay_trace(trace, device, case.policy, progress=False, limit=limit_nbytes,
                                  gpu_timing=case.gpu_timing)
        finally:
            device.close()
    except Exception as exc:  # noqa: BLE001 - a failing case is a row (Note [Errors are rows])
        # Note [Errors are rows]: one bad trace or device must not throw away the other cases' work, so
        # every exception of a case (gpumem's own, OSError, and bugs alike) becomes its row's error text;
        # the traceback goes to the debug log.
        log.debug("sweep case %s failed", case, exc_info=True)
        return _error_row(case, exc)
    status = (SweepStatus.OK if result.oom_error is None else SweepStatus.OOM).value
    return SweepRow(
        index=case.index, trace=case.trace, device=case.device, policy=case.policy, limit=case.limit,
        status=status, ran=status == SweepStatus.OK, trace_name=result.trace, limit_nbytes=limit_nbytes,
        n_ops=result.n_ops, completed_ops=result.completed_ops, peak_live_bytes=result.peak_live_bytes,
        peak_reserved_bytes=result.peak_reserved_bytes, overhead=result.overhead, oom_count=result.ooms,
        oom_op=result.oom_op, trace_peak_live_bytes=result.trace_peak_live_bytes,
        external_fragmentation_at_end=result.stats.external_fragmentation,
        device_calls=result.stats.device_calls, cache_hits=result.stats.cache_hits,
        cache_misses=result.stats.cache_misses, sim_time_s=result.sim_time_s,
        engine=str(result.extra.get("engine", "")), gpu_timing=result.extra.get("gpu_timing"),
        step_marks=case.step_marks, error=result.oom_message, wall_s=result.wall_s, ns_per_op=result.ns_per_op,
    )


# -- the sweep -----------------------------------------------------------------------------------------
class _DeferredFuture(cf.Future):
    """A future that runs its task in the calling thread when its result is first asked for."""

    def __init__(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self._call: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = (fn, args, kwargs)

    def result(self, timeout: float | None = None) -> Any:
        call, self._call = self._call, None
        if call is not None:
            fn, args, kwargs = call
            try:
                self.set_result(fn(*args, **kwargs))
            except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
                self.set_exception(exc)
        return super().result(timeout)


class _InlineExecutor(cf.Executor):
    """Runs each task in the calling process (``jobs=1``) when its result is asked for: no pool to start,
    and the progress bar moves as the cases finish."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> cf.Future:  # type: ignore[override]
        return _DeferredFuture(fn, args, kwargs)


def _submit(executor: Any, case: SweepCase) -> Any:
    """``executor.submit(run_case, case)``, or a failed future when submitting itself fails (a task the
    executor cannot serialise, an executor already shut down)."""
    try:
        return executor.submit(run_case, case)
    except Exception as exc:  # noqa: BLE001 - becomes the case's error row
        fut: cf.Future = cf.Future()
        fut.set_exception(exc)
        return fut


def _process_pool(jobs: int) -> cf.Executor:
    # Note [Spawned workers]: the sweep may run in a process that has threads (a Dask client, a test
    # runner's), where fork can copy a held lock into the child; spawn starts clean interpreters.
    return cf.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))


_GUARD_HINT = ("a script that calls run_sweep with a process pool (jobs > 1, the default) must do so under "
               "'if __name__ == \"__main__\":': the pool starts its workers with spawn, and each worker imports "
               "the script again (see docs/sweeps.md, From Python); or pass jobs=1, or an executor")


def _check_spawnable() -> None:
    """Raise :class:`SweepError` where a spawned process pool cannot work: in a worker that is importing an
    unguarded script (it would run the whole sweep again), or when the main program has no file a worker
    could import (a script fed through stdin)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # set while a spawned child prepares
        raise SweepError("run_sweep was called while a pool worker was starting: " + _GUARD_HINT)
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if isinstance(path, str) and not os.path.isfile(path):
        raise SweepError(f"run_sweep cannot start a process pool from a program without a file ({path}: a "
                         f"script read from stdin, say), since each worker must import it: save it as a file "
                         f"with its sweep under 'if __name__ == \"__main__\":', or pass jobs=1")


def describe_executor(executor: Any) -> str:
    """How the sweep records an executor: its class, with the scheduler's address for a Dask client or its
    executor (``ClientExecutor(scheduler=tcp://10.0.0.5:8786)``)."""
    name = type(executor).__name__
    client = executor if hasattr(executor, "scheduler") else getattr(executor, "_client", None)
    try:
        address = getattr(getattr(client, "scheduler", None), "address", None)
    except Exception:  # noqa: BLE001 - a description must not fail the sweep
        address = None
    return f"{name}(scheduler={address})" if isinstance(address, str) and address else name


def run_sweep(traces: Sequence[Any], devices: Sequence[str], policies: Sequence[str],
              limits: Sequence[Any] = (None,), *, executor: Any = None, jobs: int | None = None,
              progress: bool | None = True, gpu_timing: str | None = None,
              step_marks: bool = True) -> SweepResult:
    """Replay every trace x device x policy x limit and return the tidy table (:class:`SweepResult`).

    ``traces`` are file paths (any format :func:`gpumem.trace.load_trace` reads); each worker loads them
    itself. ``devices`` are specs (``sim:t4-16gb``, ``cuda:0``), ``policies`` names
    (:data:`gpumem.allocator.policy.POLICIES`), ``limits`` caps on reserved memory as ``gpumem replay
    --limit`` takes them (None: no cap).

    ``executor``: any ``concurrent.futures``-style executor (an object with ``submit(fn, *args)``
    returning futures with ``result()``), e.g. a Dask client's ``get_executor()``; it is used, not shut
    down. Without one, a process pool of ``jobs`` workers (default: the CPU count, capped by the number of
    cases) runs the cases and is shut down afterwards; ``jobs=1`` runs them in this process.
    ``progress``: a bar of finished cases, shown only when stderr is a terminal (False: never).
    ``gpu_timing``: how the program's GPU work runs beside each replay (``trace``, ``model``, ``idle``;
    None: the default of :func:`gpumem.replay.replay`). ``step_marks=False``: the traces are read without
    their step marks (:func:`gpumem.trace.load_trace`), so the ``gpumem`` policy replays a run without step plans.

    Raises :class:`SweepError` for bad arguments (nothing is run then); a case that fails is a row with
    ``status="error"`` (Note [Errors are rows]).
    """
    from ..progress import progress as progress_bar

    if executor is not None and jobs is not None:
        raise SweepError("give either an executor or jobs, not both (jobs sizes the local process pool)")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise SweepError(f"jobs must be a whole number of at least 1, got {jobs!r}")
    if executor is not None and not callable(getattr(executor, "submit", None)):
        raise SweepError(f"executor must have a submit(fn, *args) method (a concurrent.futures-style executor), "
                         f"got {type(executor).__name__}")
    cases = make_cases(traces, devices, policies, limits, gpu_timing, step_marks)
    own = executor is None
    if own:
        n = min(jobs or os.cpu_count() or 1, len(cases))
        if n > 1:
            _check_spawnable()
        executor = _InlineExecutor() if n == 1 else _process_pool(n)
        described = f"ProcessPoolExecutor(jobs={n})" if n > 1 else "in-process (jobs=1)"
    else:
        described = describe_executor(executor)
    log.info("sweep: %d cases on %s", len(cases), described)
    rows: list[SweepRow | None] = [None] * len(cases)
    bar = progress_bar(len(cases), "sweep", "case", enabled=None if progress else False)
    try:
        # Note [One code path for every executor]: submit every case, then take the results; nothing here
        # depends on the executor's kind. Results are taken in submission order (futures of any library
        # have result(); not all work with concurrent.futures.as_completed), and each row lands at its
        # case's index, so the table's order never depends on which worker finished first.
        futures = [(case, _submit(executor, case)) for case in cases]
        for case, fut in futures:
            try:
                row = fut.result()
            except Exception as exc:  # noqa: BLE001 - the worker itself died or could not unpickle the task
                if own and isinstance(exc, BrokenProcessPool):  # our workers died: most often, while starting,
                    # from an unguarded script (a worker that imports it raises SweepError, _check_spawnable)
                    raise SweepError(f"the sweep's worker processes died ({exc}); {_GUARD_HINT}") from None
                log.debug("sweep case %s: executor error", case, exc_info=True)
                row = _error_row(case, exc)
                if not own:
                    row = dataclasses.replace(row, error=(row.error or "") + " (the executor could not run the "
                                              "case: is this version of gpumem installed where it runs the "
                                              "tasks, on a Dask cluster the scheduler and every worker?)")
            rows[case.index] = row
            bar.update(1)
    finally:
        bar.close()
        if own:
            executor.shutdown(wait=True, cancel_futures=True)
    return SweepResult(tuple(r for r in rows if r is not None), tuple(dict.fromkeys(c.trace for c in cases)),
                       tuple(dict.fromkeys(c.device for c in cases)), tuple(dict.fromkeys(c.policy for c in cases)),
                       tuple(dict.fromkeys(c.limit for c in cases)), described)


# -- output --------------------------------------------------------------------------------------------
def _write_csv(result: SweepResult, path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(COLUMNS), lineterminator="\n")
        w.writeheader()
        for r in result.rows:
            w.writerow(csv_row({k: ("" if v is None else v) for k, v in r.as_dict().items()}))


def _is_sweep_folder(out: Path) -> bool:
    """True when ``out`` holds an earlier gpumem sweep and nothing else: a ``sweep.json`` that is a sweep's
    (its table's columns and rows, the figure list), and only plain files named in it or :data:`SWEEP_FILES`."""
    try:
        entries = list(out.iterdir())
        data = json.loads((out / "sweep.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict) or data.get("columns") not in [list(c) for c in (COLUMNS, *_EARLIER_COLUMNS)] \
            or not isinstance(data.get("rows"), list) or not isinstance(data.get("figures"), list) \
            or not {"traces", "devices", "policies", "limits", "executor"} <= set(data):
        return False
    figures = {f for f in data["figures"] if isinstance(f, str) and f.endswith(".png") and "/" not in f
               and os.sep not in f and not f.startswith(".")}
    return all(not e.is_symlink() and e.is_file() and (e.name in SWEEP_FILES or e.name in figures)
               for e in entries)


def check_out_dir(out: "str | os.PathLike[str]", traces: Sequence[Any] = ()) -> None:
    """Raise :class:`SweepError` unless ``out`` can take a sweep: new, empty, or an earlier gpumem sweep's
    folder holding nothing else (the only kind that is replaced), and holding none of ``traces``
    (checked by :func:`write_sweep`; call it before a long sweep to fail early)."""
    out = Path(out)
    if out.name in ("", ".", "..") or os.path.realpath(out) == os.path.realpath(os.sep):
        raise SweepError(f"--out {out}: give the sweep a folder of its own (a new name)")
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise SweepError(f"--out {out}: exists and is not a folder")
        real = os.path.realpath(out).rstrip(os.sep) + os.sep
        for t in traces:
            if isinstance(t, (str, os.PathLike)) and os.path.realpath(t).startswith(real):
                raise SweepError(f"--out {out}: holds the trace {t}; give a new or empty folder")
        entries = list(out.iterdir())
        if entries and not _is_sweep_folder(out):
            raise SweepError(f"--out {out}: the folder is not empty and is not an earlier gpumem sweep (only "
                             "sweep.csv, sweep.json and its figures); give a new or empty folder")
    if not out.parent.is_dir():
        raise SweepError(f"--out {out}: no such folder {out.parent} (create it first)")


def require_matplotlib() -> None:
    """Raise :class:`~gpumem.errors.BackendUnavailableError` saying what to install when matplotlib, which
    draws the figures, is missing (it is not one of gpumem's required dependencies)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BackendUnavailableError("the sweep's figures need matplotlib: pip install matplotlib (or "
                                      "'gpumem[dask]'), or write the table only (plots=False, --no-plots)") from None


def write_sweep(result: SweepResult, out: "str | os.PathLike[str]", *, plots: bool = True) -> list[Path]:
    """Write ``sweep.csv``, ``sweep.json`` and the summary figures into the folder ``out``; returns the
    files written (paths inside ``out``).

    ``out`` must be new, empty, or an earlier sweep's folder (which is replaced). Everything is written
    into a temporary folder beside it first and moved into place at the end, so a failure leaves no
    half-written sweep. Raises :class:`SweepError` when ``out`` is in the way.
    """
    out = Path(out)
    if out.name not in ("", ".", ".."):  # the folder resolved first (Note [An output is replaced only by a complete one])
        out = resolve_output(out)
    check_out_dir(out)
    if plots:
        require_matplotlib()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        _write_csv(result, tmp / "sweep.csv")
        figures: list[str] = []
        if plots:
            figures = [p.name for p in plot_sweep(result, tmp)]
        data = result.as_json()
        data["figures"] = figures
        (tmp / "sweep.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        names = sorted(p.name for p in tmp.iterdir())
        replace_atomically(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / n for n in names]


# -- figures -------------------------------------------------------------------------------------------
_GiB = float(1 << 30)
_STATUS_COLOURS = {SweepStatus.OK.value: "#4caf50", SweepStatus.OOM.value: "#ff9800",
                   SweepStatus.ERROR.value: "#9e9e9e"}
_STATUS_LABELS = {SweepStatus.OK.value: "runs", SweepStatus.OOM.value: "out of memory",
                  SweepStatus.ERROR.value: "error (see table)"}


def trace_labels(traces: Sequence[str]) -> dict[str, str]:
    """Short names for the traces, as the figures and the text table show them: the file name without
    ``.gz``, ``.pickle``, ``.pkl`` or ``.gmt`` (the path as given where two names clash)."""
    def short(t: str) -> str:
        name = os.path.basename(t)
        for suffix in (".gz", ".bz2", ".xz", ".zst", ".pickle", ".pkl", ".gmt"):
            if name.endswith(suffix):
                name = name[: -len(suffix)]
        return name or t

    names = {t: short(t) for t in traces}
    counts: dict[str, int] = {}
    for n in names.values():
        counts[n] = counts.get(n, 0) + 1
    return {t: (n if counts[n] == 1 else t) for t, n in names.items()}


def _target_label(device: str, limit: str | None) -> str:
    return device if limit is None else f"{device}, limit {limit}"


def _grouped_bars(result: SweepResult, path: Path, value: Any, ylabel: str, title: str, *,
                  marker: Any = None, marker_label: str = "", bar_fmt: str = "") -> Path:
    """One panel per device (and limit); in each, a group of bars per trace, one bar per policy. Cases
    without a value (out of memory, error) are marked with their status above an empty slot."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    labels = trace_labels(result.traces)
    targets = [(d, lim) for d in result.devices for lim in result.limits]
    by_key = {(r.trace, r.device, r.limit, r.policy): r for r in result.rows}
    n_bars = len(result.traces) * len(result.policies)
    ncols = 1 if n_bars > 8 else min(3, len(targets))  # wide panels one above the other
    nrows = -(-len(targets) // ncols)
    width_in = min(16.0, max(5.0, 0.45 * n_bars + 2.0))
    fig, axes = plt.subplots(nrows, ncols, figsize=(width_in * ncols, 4.2 * nrows), squeeze=False)
    cmap = plt.get_cmap("tab10")
    bar_w = 0.8 / len(result.policies)
    for k, (device, limit) in enumerate(targets):
        ax = axes[k // ncols][k % ncols]
        top = 0.0
        for j, policy in enumerate(result.policies):
            xs, ys = [], []
            for i, trace in enumerate(result.traces):
                row = by_key.get((trace, device, limit, policy))
                x = i - 0.4 + bar_w * (j + 0.5)
                v = value(row) if row is not None and row.status == SweepStatus.OK else None
                if v is None:
                    status = row.status if row is not None else SweepStatus.ERROR.value
                    ax.text(x, 0, " " + ("OOM" if status == SweepStatus.OOM else "error"), rotation=90,
                            ha="center", va="bottom", fontsize=8, color=_STATUS_COLOURS[status])
                    continue
                xs.append(x)
                ys.append(v)
                top = max(top, v)
            bars = ax.bar(xs, ys, bar_w, color=cmap(j % 10))
            if bar_fmt and n_bars <= 40:
                ax.bar_label(bars, fmt=bar_fmt, fontsize=7, padding=1)
        handles = [Patch(facecolor=cmap(j % 10), label=p) for j, p in enumerate(result.policies)]
        if marker is not None:
            handles.append(Line2D([], [], color="black", linestyle="--", label=marker_label))
            for i, trace in enumerate(result.traces):
                vals = [marker(r) for p in result.policies
                        if (r := by_key.get((trace, device, limit, p))) is not None and marker(r) is not None]
                if vals:
                    ax.hlines(max(vals), i - 0.45, i + 0.45, colors="black", linestyles="--")
                    top = max(top, max(vals))
        ax.set_xticks(range(len(result.traces)))
        ax.set_xticklabels([labels[t] for t in result.traces], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(_target_label(device, limit), fontsize=10)
        ax.set_xlim(-0.5, len(result.traces) - 0.5)
        ax.set_ylim(0, top * 1.3 if top > 0 else 1.0)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(handles=handles, title="policy", fontsize=8, title_fontsize=8, loc="best")
    for k in range(len(targets), nrows * ncols):
        axes[k // ncols][k % ncols].set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fit_matrix(result: SweepResult, path: Path) -> Path:
    """Rows: trace x policy; columns: device (x limit); colour: runs / out of memory / error; text: the
    peak reserved GiB of the cases that ran."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels = trace_labels(result.traces)
    rows = [(t, p) for t in result.traces for p in result.policies]
    cols = [(d, lim) for d in result.devices for lim in result.limits]
    by_key = {(r.trace, r.policy, r.device, r.limit): r for r in result.rows}
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(cols) + 5.0), max(2.5, 0.4 * len(rows) + 1.6)))
    for i, (t, p) in enumerate(rows):
        for j, (d, lim) in enumerate(cols):
            r = by_key.get((t, p, d, lim))
            status = r.status if r is not None else SweepStatus.ERROR.value
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=_STATUS_COLOURS[status],
                                       edgecolor="white"))
            if r is not None and status == SweepStatus.OK and r.peak_reserved_bytes is not None:
                text = f"{r.peak_reserved_bytes / _GiB:.2f} GiB"
            else:
                text = "OOM" if status == SweepStatus.OOM else "error"
            ax.text(j, i, text, ha="center", va="center", fontsize=8)
    ax.set_xlim(-0.5, len(cols) - 0.5)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([_target_label(d, lim) for d, lim in cols], rotation=20, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{labels[t]} / {p}" for t, p in rows], fontsize=8)
    ax.set_xlabel("device")
    ax.set_ylabel("trace / policy")
    ax.legend(handles=[Patch(facecolor=c, label=_STATUS_LABELS[s]) for s, c in _STATUS_COLOURS.items()],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="cell: peak reserved", title_fontsize=8)
    ax.set_title("Which combinations run (peak reserved in GiB where they do)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(result: SweepResult, folder: "str | os.PathLike[str]") -> list[Path]:
    """Draw the sweep's summary figures (PNG) into ``folder``; returns their paths.

    ``fit.png`` (which combinations run), ``peak_reserved.png`` (GiB, with the trace's peak live bytes
    dashed), ``overhead.png`` (%) and ``time_per_op.png`` (wall-clock ns per operation; not reproducible).
    """
    folder = Path(folder)
    return [
        _fit_matrix(result, folder / "fit.png"),
        _grouped_bars(result, folder / "peak_reserved.png", lambda r: r.peak_reserved_bytes / _GiB,
                      "peak reserved (GiB)", "Peak memory reserved from the device, per policy",
                      marker=lambda r: None if r.trace_peak_live_bytes is None else r.trace_peak_live_bytes / _GiB,
                      marker_label="trace's peak live", bar_fmt="%.1f"),
        _grouped_bars(result, folder / "overhead.png", lambda r: 100.0 * r.overhead,
                      "overhead (%)", "Overhead: peak reserved / peak live - 1, per policy", bar_fmt="%.1f"),
        _grouped_bars(result, folder / "time_per_op.png", lambda r: r.ns_per_op,
                      "time per operation (ns, wall clock)", "Allocator time per operation (wall clock: varies "
                      "from run to run)"),
    ]
