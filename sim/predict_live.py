"""Which replay setting predicts live gpumem.torch runs best: every live row with its own trace, one table.

Issue 18 point 1: the default GPU timing of a replay is the one that predicts live runs best. This takes
every live H200 run of gpumem.torch whose allocation trace gpumem recorded (``reports/hil/live-h200-2026-11-25*``,
runs 1-3; :data:`RECORDS`), replays each trace on ``sim:h200-141gb`` with the policy the live run had, under
every candidate setting (:func:`candidates`):

* GPU timing ``idle``, ``model``, ``trace`` (Note [The GPU runs behind the CPU] in :mod:`gpumem.sim.gpu_work`);
* under ``trace``, the sync threshold ``GpuWorkModel.sync_gap_us`` (a gap of the trace's clock at least this
  long is a synchronisation; the gaps include gpumem's own allocation time, ``live-vs-predicted-...-run3.md``);
* the latency model: every call priced idle (``LatencyModel()``) or priced as measured on a busy device
  (``LatencyModel.as_measured()``, Note [A busy device prices VMM calls higher] in :mod:`gpumem.sim.latency`);

and compares the predicted overhead (peak reserved / peak live - 1) with the live one (peak reserved / peak
allocated - 1), in percentage points. The rows are split once, by workload, as the trace corpus is
(:mod:`gpumem.trace.corpus`; ``hil.probes.workloads.corpus_part_of``): the setting is chosen by mean absolute
error on the tuning rows only (:func:`choose`), and replaces today's default only where it beats it beyond
the rows' noise (:func:`adopt`); the check rows are reported beside it and decide nothing.

    python -m sim.predict_live [--jobs 2] [--json build/predict-live.json]
    python -m sim.predict_live --from-json build/predict-live.json      # the tables again, no replay
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from gpumem.allocator.policy import POLICIES, AllocatorPolicy
from gpumem.errors import GpumemError, InvalidArgumentError
from gpumem.progress import progress
from gpumem.replay import replay_trace
from gpumem.sim import get_profile
from gpumem.sim.gpu_work import DEFAULT_GPU_TIMING, GpuTiming, GpuWorkModel
from gpumem.sim.latency import LatencyModel
from gpumem.specs import open_device
from gpumem.trace import load_trace
from gpumem.trace.stream_log import unknown_stream_uses
from sim.cli_checks import json_target_problem

PROFILE = "h200-141gb"
HIL = Path("reports/hil")

#: Today's default with the knobs added since the live runs (2026-11-25) set as those runs behaved: the ordered
#: steal before a warm-up (``steal_before_warmup``, on by default since 2026-12-04) did not exist, and with it on the
#: run-1 rows, which have no step marks, replay another engine than the one measured (vit_train 5.31 -> 2.27 %).
_AT_THE_RUNS = dataclasses.replace(POLICIES["gpumem"], steal_before_warmup=False)

#: The engine policies the live runs had (``policy: null`` in a record is the default of its day).
LIVE_POLICIES: dict[str, AllocatorPolicy] = {
    # run 1: main before busy_slack (the rule before issue 18): chunks capped at 1/256, no ordered steal
    "busy_slack=inf": dataclasses.replace(_AT_THE_RUNS, name="busy_slack=inf", busy_slack=math.inf),
    # run 2, probe train A: the ordered steal on, chunks at 1/256
    "A": dataclasses.replace(_AT_THE_RUNS, name="A", stream_ordered_steal=True),
    # run 2 B, run 3 default: the default policy of the runs' day
    "default": dataclasses.replace(_AT_THE_RUNS, name="default"),
    # run 2 C and its workloads, run 3 memfirst: the memory-first setting
    "C": dataclasses.replace(_AT_THE_RUNS, name="C", chunk_max_fraction=1 / 1024, stream_ordered_steal=True),
}
#: what a record's ``policy`` field says, where it names one, for each setting above
POLICY_SPECS = {"C": "gpumem:chunk_max_fraction=0.0009765625,stream_ordered_steal=true"}

#: The latency models compared.
LATENCIES: dict[str, LatencyModel] = {"idle-priced": LatencyModel(), "as-measured": LatencyModel.as_measured()}
DEFAULT_LATENCY = "idle-priced"
#: Sync thresholds tried under ``trace`` timing, ms; ``inf``: no gap is a synchronisation.
SYNC_GAPS_MS: tuple[float, ...] = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 20.0, math.inf)
#: ``GpuWorkModel.sync_gap_us`` must be finite: "no sync" is a gap longer than any trace (31,700 years).
NO_SYNC_US = 1e18


@dataclass(frozen=True)
class Record:
    """One live record: the run, its JSON, the policy its gpumem runs had, where their traces are."""

    run: str
    path: Path
    policy: str
    """A key of :data:`LIVE_POLICIES`."""
    kind: str
    """``workloads``: ``hil.probes.workloads live`` (``workload``, ``trace_file``); ``train``: ``hil.probes.train``."""
    traces: tuple[tuple[str, str], ...] = ()
    """``train``: model -> trace file (in the record's folder)."""
    own_trace: bool = True
    """False: the runs recorded no trace; the trace of the same program under another policy is replayed."""
    stream_uses_recorded: bool = True
    """False: the traces were recorded before gpumem's traces carried ``record_stream`` (``.gmt`` version 2,
    run 3): a trace of several streams cannot say which blocks were used across them, so its row is shown
    and not scored (:func:`gpumem.trace.stream_log.unknown_stream_uses`)."""


#: Every live record of gpumem.torch with a trace (runs 1-3). Run 4 (``live-h200-2026-11-25-run4``, 40 steps)
#: recorded no trace; run 2's traces are of 80-step runs, another program length, so run 4 has no row.
RECORDS: tuple[Record, ...] = (
    Record("run 1", HIL / "live-h200-2026-11-25/workloads.json", "busy_slack=inf", "workloads",
           stream_uses_recorded=False),
    Record("run 2 A", HIL / "live-h200-2026-11-25-run2/A-gpt2.json", "A", "train", (("gpt2", "gpt2.gmt.gz"),),
           stream_uses_recorded=False),
    Record("run 2 A", HIL / "live-h200-2026-11-25-run2/A-resnet50.json", "A", "train",
           (("resnet50", "resnet50.gmt.gz"),), stream_uses_recorded=False),
    Record("run 2 B", HIL / "live-h200-2026-11-25-run2/B.json", "default", "train",
           (("gpt2", "gpt2.gmt.gz"), ("resnet50", "resnet50.gmt.gz")), own_trace=False, stream_uses_recorded=False),
    Record("run 2 C", HIL / "live-h200-2026-11-25-run2/C.json", "C", "train",
           (("gpt2", "gpt2.gmt.gz"), ("resnet50", "resnet50.gmt.gz")), own_trace=False, stream_uses_recorded=False),
    Record("run 2", HIL / "live-h200-2026-11-25-run2/workloads/workloads.json", "C", "workloads",
           stream_uses_recorded=False),
    Record("run 3", HIL / "live-h200-2026-11-25-run3/default/workloads.json", "default", "workloads"),
    Record("run 3", HIL / "live-h200-2026-11-25-run3/memfirst/workloads-memfirst.json", "C", "workloads"),
)
#: ``hil.probes.train`` model -> the workload it is (for the corpus part)
TRAIN_WORKLOADS = {"gpt2": "gpt2_train", "resnet50": "resnet50_train"}


@dataclass(frozen=True)
class Row:
    """One live run of gpumem.torch and the trace that predicts it."""

    run: str
    workload: str
    policy: str
    trace: str
    """Path of the trace, relative to the checkout."""
    own_trace: bool
    part: str
    """``tuning`` or ``check``."""
    live: float
    """Live peak reserved / peak allocated - 1."""
    not_scored: str | None = None
    """Why the row is shown and not scored: its trace of several streams was recorded without the program's
    ``record_stream`` calls (:attr:`Record.stream_uses_recorded`); None for a scored row."""

    @property
    def scored(self) -> bool:
        return self.not_scored is None

    @property
    def key(self) -> str:
        return f"{self.run} {self.workload} {self.policy}"


@dataclass(frozen=True)
class Candidate:
    """One replay setting."""

    timing: str
    latency: str
    sync_gap_ms: float | None = None
    """``trace`` timing's threshold (``inf``: none); None for ``idle`` and ``model``."""
    sync_drains: bool = True
    """``trace``: whether a synchronisation's gap is GPU work (``GpuWorkModel.sync_gap_is_gpu_work``)."""

    @property
    def label(self) -> str:
        if self.timing == "trace":
            gap = "none" if math.isinf(self.sync_gap_ms) else f"{self.sync_gap_ms:g} ms"   # type: ignore[arg-type]
            return f"trace, sync {gap}, {self.latency}" + ("" if self.sync_drains else ", CPU gaps only")
        return f"{self.timing}, {self.latency}"

    def gpu_model(self) -> GpuWorkModel | None:
        if self.timing != "trace":
            return None
        gap_ms = self.sync_gap_ms if self.sync_gap_ms is not None else 2.0
        return GpuWorkModel(sync_gap_us=NO_SYNC_US if math.isinf(gap_ms) else gap_ms * 1e3,
                            sync_gap_is_gpu_work=self.sync_drains)


def default_candidate() -> Candidate:
    """Today's default: the default timing, its threshold and latency model."""
    timing = DEFAULT_GPU_TIMING.value
    gap = GpuWorkModel().sync_gap_us / 1e3 if timing == "trace" else None
    latency = next(k for k, v in LATENCIES.items() if v == get_profile(PROFILE).latency)
    return Candidate(timing, latency, gap, GpuWorkModel().sync_gap_is_gpu_work)


def candidates() -> list[Candidate]:
    """``idle`` (one: it never sees a busy device, so the latency model cannot matter; checked in
    :func:`replay_row`), ``model`` under each latency model, ``trace`` under each threshold and latency model,
    and ``trace`` at 2 ms with the synchronisations' gaps not GPU work (the model before 2026-12-01) under each."""
    out = [Candidate("idle", DEFAULT_LATENCY)]
    out += [Candidate("model", lat) for lat in LATENCIES]
    out += [Candidate("trace", lat, gap) for lat in LATENCIES for gap in SYNC_GAPS_MS]
    out += [Candidate("trace", lat, 2.0, sync_drains=False) for lat in LATENCIES]
    return out


def _part(workload: str) -> str:
    from hil.probes.workloads import corpus_part_of

    part = corpus_part_of(workload)
    if part not in ("tuning", "check"):
        raise InvalidArgumentError(f"workload {workload!r} has no corpus part (hil.probes.workloads.CORPUS_NAMES)")
    return part


def live_rows(records: Iterable[Record] = RECORDS) -> list[Row]:
    """Every gpumem.torch run of ``records`` with a live peak, as a :class:`Row` (each trace is read to
    see whether the row can be scored: :attr:`Row.not_scored`).

    Raises:
        InvalidArgumentError: a record names a policy other than the one :data:`RECORDS` says it ran, or a
            trace file is missing.
    """
    rows = []
    why: dict[str, str | None] = {}   # trace -> why its rows are not scored
    for rec in records:
        data = json.loads(rec.path.read_text())
        folder = rec.path.parent
        for r in data["runs"]:
            if r.get("allocator") != "gpumem" or not r.get("peak_reserved_bytes"):
                continue
            named = r.get("policy") or data.get("gpumem_policy")
            if named is not None and named != POLICY_SPECS.get(rec.policy):
                raise InvalidArgumentError(f"{rec.path}: gpumem ran {named!r}, not {rec.policy!r}")
            if rec.kind == "workloads":
                workload, trace = r["workload"], folder / r["trace_file"]
            else:
                workload, trace = TRAIN_WORKLOADS[r["model"]], folder / dict(rec.traces)[r["model"]]
            if not trace.is_file():
                raise InvalidArgumentError(f"{rec.path}: trace {trace} is missing")
            key = trace.as_posix()
            if key not in why:
                why[key] = unknown_stream_uses(load_trace(trace, progress=False), rec.stream_uses_recorded)
            rows.append(Row(rec.run, workload, rec.policy, trace.as_posix(), rec.own_trace, _part(workload),
                            r["peak_reserved_bytes"] / r["peak_allocated_bytes"] - 1, why[key]))
    return rows


def _replay(trace, policy: AllocatorPolicy, cand: Candidate) -> float:
    profile = dataclasses.replace(get_profile(PROFILE), latency=LATENCIES[cand.latency])
    dev = open_device(f"sim:{PROFILE}", profile=profile)
    try:
        return replay_trace(trace, dev, policy, progress=False, gpu_timing=cand.timing,
                            gpu_model=cand.gpu_model()).overhead
    finally:
        dev.close()


def replay_row(row: Row, cands: Sequence[Candidate]) -> dict[str, float]:
    """``candidate label -> predicted overhead`` for ``row``.

    Raises:
        RuntimeError: ``idle`` timing gave other figures under the two latency models (it never sees a busy
            device, Note [A busy device prices VMM calls higher]; a difference would be a simulator bug).
    """
    trace = load_trace(row.trace)
    policy = LIVE_POLICIES[row.policy]
    out = {c.label: _replay(trace, policy, c) for c in cands}
    for lat in LATENCIES:
        if lat != DEFAULT_LATENCY:
            other = _replay(trace, policy, Candidate("idle", lat))
            if other != out[Candidate("idle", DEFAULT_LATENCY).label]:
                raise RuntimeError(f"{row.key}: idle timing gives {other} under {lat}, "
                                   f"{out[Candidate('idle', DEFAULT_LATENCY).label]} idle-priced")
    return out


def _job(args: tuple[Row, list[Candidate]]) -> dict[str, float]:
    return replay_row(*args)


def measure(rows: list[Row], cands: list[Candidate], jobs: int = 1) -> list[dict[str, float]]:
    """Every row under every candidate (``jobs`` processes)."""
    out: list[dict[str, float]] = []
    with progress(len(rows), "live rows", "row") as bar:
        if jobs <= 1:
            for row in rows:
                out.append(replay_row(row, cands))
                bar.update(1)
        else:
            with ProcessPoolExecutor(jobs) as pool:
                for pred in pool.map(_job, [(row, cands) for row in rows]):
                    out.append(pred)
                    bar.update(1)
    return out


@dataclass(frozen=True)
class Errors:
    """A candidate's errors over a set of rows, percentage points."""

    mean_abs_pp: float
    worst_abs_pp: float
    worst_row: str
    mean_pp: float
    """Mean signed error (predicted - live)."""
    within_1pp: int
    n: int


def errors(rows: Sequence[Row], preds: Sequence[dict[str, float]], label: str) -> Errors:
    """The errors of candidate ``label`` over ``rows`` (and their predictions ``preds``)."""
    if not rows:
        raise InvalidArgumentError("errors: no rows")
    diffs = [(p[label] - r.live) * 100 for r, p in zip(rows, preds)]
    worst = max(range(len(diffs)), key=lambda i: abs(diffs[i]))
    return Errors(sum(map(abs, diffs)) / len(diffs), abs(diffs[worst]), rows[worst].key, sum(diffs) / len(diffs),
                  sum(abs(d) <= 1.0 for d in diffs), len(diffs))


#: two mean errors closer than this (pp) are a tie (replays are deterministic; this only absorbs float noise)
TIE_PP = 1e-9


def choose(cands: Sequence[Candidate], tuning: dict[str, Errors], default: Candidate) -> Candidate:
    """The candidate of least mean absolute error on the tuning rows. Ties (within :data:`TIE_PP`): today's
    default if it is among them; else those with today's latency model and timing if any; then, for ``trace``
    thresholds, the middle one of those tied (the lower middle of an even count): the farthest from both ends
    of the range that predicts equally well."""
    best = min(tuning[c.label].mean_abs_pp for c in cands)
    tied = [c for c in cands if tuning[c.label].mean_abs_pp <= best + TIE_PP]
    if default in tied:
        return default
    for narrow in (lambda c: c.latency == default.latency, lambda c: c.timing == default.timing):
        if any(narrow(c) for c in tied):
            tied = [c for c in tied if narrow(c)]
    tied.sort(key=lambda c: (c.timing, c.latency, c.sync_gap_ms if c.sync_gap_ms is not None else 0.0,
                             not c.sync_drains))
    return tied[(len(tied) - 1) // 2]


@dataclass(frozen=True)
class Paired:
    """A candidate against today's default on the same rows: ``|error| - |default's error|`` per row, pp."""

    better: int
    """Rows it predicts closer (by more than 1e-6 pp)."""
    worse: int
    mean_diff_pp: float
    """Its mean absolute error less the default's (negative: better)."""
    low_pp: float
    """The 2.5th percentile of the mean difference over rows resampled with replacement (:data:`RESAMPLES`)."""
    high_pp: float
    """The 97.5th percentile."""


#: resamples of the paired bootstrap (fixed seed: the table is the same on every run)
RESAMPLES = 10_000


def paired(rows: Sequence[Row], preds: Sequence[dict[str, float]], label: str, base: str, seed: int = 0) -> Paired:
    """Candidate ``label`` against ``base`` on ``rows``: rows better and worse, the mean difference of the
    absolute errors and its 95 % interval over the rows resampled with replacement."""
    if not rows:
        raise InvalidArgumentError("paired: no rows")
    diff = [(abs(p[label] - r.live) - abs(p[base] - r.live)) * 100 for r, p in zip(rows, preds)]
    rnd = random.Random(seed)
    n = len(diff)
    means = sorted(sum(diff[rnd.randrange(n)] for _ in range(n)) / n for _ in range(RESAMPLES))
    return Paired(sum(d < -1e-6 for d in diff), sum(d > 1e-6 for d in diff), sum(diff) / n,
                  means[int(0.025 * RESAMPLES)], means[int(0.975 * RESAMPLES) - 1])


#: The least mean gain (pp) on the tuning rows for which another setting replaces today's default: a row's
#: replay moves by about a tenth of a point from one sync threshold to the next (microsecond races), so
#: hundredths are not a difference (``reports/sim-sync-drain.md``).
ADOPT_MARGIN_PP = 0.05


def adopt(chosen: Candidate, default: Candidate, vs_default: Paired) -> Candidate:
    """The default after this table: ``chosen`` (least mean absolute error on the tuning rows) where it beats
    today's default beyond the rows' noise - on more rows than it loses, with the whole 95 % interval of the
    paired difference below zero, and by at least :data:`ADOPT_MARGIN_PP` on average - else today's default.
    Why a margin: the tuning rows are GPU-bound training, which every timing but ``idle`` predicts within
    0.8 pp; the settings' mean errors there differ by hundredths of a point, carried by a few rows, and a
    bootstrap over rows that mostly tie is narrow without meaning more (``reports/sim-predict-live.md``)."""
    if chosen == default:
        return default
    if _beats_beyond_noise(vs_default) and vs_default.mean_diff_pp <= -ADOPT_MARGIN_PP:
        return chosen
    return default


def _beats_beyond_noise(v: Paired) -> bool:
    """Better on more rows than worse, with the whole 95 % interval of the paired difference below zero."""
    return v.better > v.worse and v.high_pp < 0.0


def _pct(x: float) -> str:
    return f"{x:.2%}"


def row_table(rows: Sequence[Row], preds: Sequence[dict[str, float]], cands: Sequence[Candidate],
              latency: str) -> str:
    """One line per row: live, then every candidate's prediction under ``latency`` (idle timing included)."""
    cols = [c for c in cands if c.latency == latency or c.timing == "idle"]
    heads = [c.label.replace(f", {latency}", "").replace(f", {DEFAULT_LATENCY}", "").replace("trace, sync ", "trace ")
             for c in cols]
    lines = ["| run | workload | policy | part | live | " + " | ".join(heads) + " |",
             "|---|---|---|---|---|" + "---|" * len(cols)]
    for r, p in zip(rows, preds):
        own = "" if r.own_trace else " (run 2 A's trace)"
        part = r.part if r.scored else f"{r.part}, **not scored**"
        lines.append(f"| {r.run} | {r.workload} | {r.policy}{own} | {part} | {_pct(r.live)} | "
                     + " | ".join(_pct(p[c.label]) for c in cols) + " |")
    return "\n".join(lines)


def error_table(cands: Sequence[Candidate], errs: dict[str, dict[str, Errors]], marks: dict[str, str],
                vs_default: dict[str, Paired] | None = None) -> str:
    """Per candidate, per part: mean |error|, worst |error| (its row), mean signed error, rows within 1 pp;
    with ``vs_default``, the first part's paired comparison with today's default."""
    parts = list(errs)
    head = "| candidate | " + " | ".join(f"{p}: mean abs pp | {p}: worst abs pp (row) | {p}: mean pp | "
                                          f"{p}: within 1 pp" for p in parts)
    if vs_default is not None:
        head += f" | {parts[0]}: vs today's default, rows better / worse, mean abs pp difference [95 % interval]"
    lines = [head + " |", "|---|" + "---|---|---|---|" * len(parts) + ("---|" if vs_default is not None else "")]
    for c in cands:
        cells = []
        for p in parts:
            e = errs[p][c.label]
            cells += [f"{e.mean_abs_pp:.3f}", f"{e.worst_abs_pp:.2f} ({e.worst_row})", f"{e.mean_pp:+.3f}",
                      f"{e.within_1pp}/{e.n}"]
        if vs_default is not None:
            v = vs_default[c.label]
            cells.append(f"{v.better} / {v.worse}, {v.mean_diff_pp:+.3f} [{v.low_pp:+.3f}, {v.high_pp:+.3f}]")
        lines.append(f"| {c.label}{marks.get(c.label, '')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(rows: list[Row], preds: list[dict[str, float]], cands: list[Candidate]) -> tuple[str, dict]:
    """The Markdown tables and the decision, and the same as a JSON-able dict."""
    default = default_candidate()
    sets = {   # rows not scored (Row.not_scored) are in the row tables only
        "tuning": [i for i, r in enumerate(rows) if r.part == "tuning" and r.scored],
        "check": [i for i, r in enumerate(rows) if r.part == "check" and r.scored],
        "tuning, own traces": [i for i, r in enumerate(rows) if r.part == "tuning" and r.own_trace and r.scored],
    }
    errs = {name: {c.label: errors([rows[i] for i in idx], [preds[i] for i in idx], c.label) for c in cands}
            for name, idx in sets.items()}
    tuning_rows = [rows[i] for i in sets["tuning"]]
    tuning_preds = [preds[i] for i in sets["tuning"]]
    vs_default = {c.label: paired(tuning_rows, tuning_preds, c.label, default.label) for c in cands}
    chosen = choose(cands, errs["tuning"], default)
    adopted = adopt(chosen, default, vs_default[chosen.label])
    marks = {default.label: " (today's default)"}
    marks[chosen.label] = marks.get(chosen.label, "") + " (least tuning error)"
    marks[adopted.label] = marks.get(adopted.label, "") + " **(default after this table)**"
    unscored = [r for r in rows if not r.scored]
    out = [f"{len(rows)} live rows ({len(sets['tuning'])} tuning, {len(sets['check'])} check scored, "
           f"{len(unscored)} not scored); device sim:{PROFILE}", ""]
    if unscored:
        out += ["Not scored (shown in the row tables, left out of every error and of the choice):", ""]
        out += [f"* {r.key}: {r.not_scored.removeprefix('not scored: ')}" for r in unscored] + [""]  # type: ignore[union-attr]
    for lat in LATENCIES:
        out += [f"### Rows, latency {lat}", "", row_table(rows, preds, cands, lat), ""]
    out += ["### Errors per candidate (predicted - live, percentage points)", "",
            error_table(cands, {k: errs[k] for k in ("tuning", "check")}, marks, vs_default), "",
            "### Tuning rows with their own trace only (run 2 B and C left out)", "",
            error_table(cands, {"tuning, own traces": errs["tuning, own traces"]}, marks), ""]
    dt, ct, v = errs["tuning"][default.label], errs["tuning"][chosen.label], vs_default[chosen.label]
    out.append(f"Least mean absolute error on the tuning rows: {chosen.label} (mean {ct.mean_abs_pp:.3f} pp, worst "
               f"{ct.worst_abs_pp:.2f} pp); today's default {default.label}: mean {dt.mean_abs_pp:.3f} pp, worst "
               f"{dt.worst_abs_pp:.2f} pp; against it {v.better} rows better, {v.worse} worse, difference "
               f"{v.mean_diff_pp:+.3f} pp [{v.low_pp:+.3f}, {v.high_pp:+.3f}]"
               + (f", a gain under the {ADOPT_MARGIN_PP:g} pp margin" if adopted != chosen and _beats_beyond_noise(v)
                  else "")
               + f". Default after this table: **{adopted.label}**.")
    data = {"rows": [dict(dataclasses.asdict(r), predicted=p) for r, p in zip(rows, preds)],
            "default": default.label, "chosen": chosen.label, "adopted": adopted.label,
            "vs_default": {lab: dataclasses.asdict(x) for lab, x in vs_default.items()},
            "errors": {k: {lab: dataclasses.asdict(e) for lab, e in v.items()} for k, v in errs.items()}}
    return "\n".join(out), data


_ROW_TYPES = {"run": str, "workload": str, "policy": str, "trace": str, "own_trace": bool, "part": str,
              "live": float, "not_scored": (str, type(None))}


def _number(value: object) -> bool:
    """A JSON number (an int within 64 bits or a float; not a bool)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, float) or (isinstance(value, int) and -2**63 <= value < 2**63)


def load_record(path: Path, cands: Sequence[Candidate]) -> tuple[list[Row], list[dict[str, float]]]:
    """The rows and predictions of a record written by ``--json``, every field checked (a prediction for every
    candidate of ``cands``). Raises ValueError naming the bad field (nesting too deep for the JSON decoder
    included) or OSError."""
    try:
        data = json.loads(path.read_text())
    except RecursionError:
        raise ValueError("nested too deep for a record of this study") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError("a JSON object with a list 'rows' expected")
    labels = [c.label for c in cands]
    rows: list[Row] = []
    preds: list[dict[str, float]] = []
    for i, r in enumerate(data["rows"]):
        at = f"rows[{i}]"
        if not isinstance(r, dict):
            raise ValueError(f"{at}: a JSON object expected, got {type(r).__name__}")
        unknown = [str(k)[:40] for k in r if k not in _ROW_TYPES and k != "predicted"]
        missing = [k for k in (*_ROW_TYPES, "predicted") if k not in r and k != "not_scored"]
        if unknown or missing:
            raise ValueError(f"{at}: " + "; ".join(([f"missing {', '.join(missing)}"] if missing else [])
                                                   + ([f"unknown {', '.join(unknown)[:80]}"] if unknown else [])))
        for k, kind in _ROW_TYPES.items():
            if k in r and not (_number(r[k]) if kind is float else isinstance(r[k], kind)):
                raise ValueError(f"{at}.{k}: {getattr(kind, '__name__', 'str or null')} expected, got "
                                 f"{type(r[k]).__name__}")
        if r["part"] not in ("tuning", "check"):
            raise ValueError(f"{at}.part: 'tuning' or 'check' expected, got {r['part']!r:.40}")
        pred = r["predicted"]
        if not isinstance(pred, dict) or any(not _number(pred.get(lab)) for lab in labels):
            bad = next((lab for lab in labels if not isinstance(pred, dict) or not _number(pred.get(lab))), "")
            raise ValueError(f"{at}.predicted: an object with a number for every candidate expected ({bad} "
                             "missing or not a number)")
        rows.append(Row(**{k: (float(v) if _ROW_TYPES[k] is float else v) for k, v in r.items() if k != "predicted"}))
        preds.append({lab: float(pred[lab]) for lab in labels})
    if not any(r.part == "tuning" for r in rows):
        raise ValueError("no tuning row: nothing to choose a setting by")
    if any("not_scored" not in r for r in data["rows"]):   # written before rows could be left unscored
        why = {r.key: r.not_scored for r in live_rows()}
        rows = [dataclasses.replace(r, not_scored=why.get(r.key)) for r in rows]
    return rows, preds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.predict_live", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=1, help="processes replaying rows side by side (default 1)")
    p.add_argument("--json", type=Path, help="also write the rows, predictions and errors here")
    p.add_argument("--from-json", type=Path, help="print the tables of a --json file again instead of replaying")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, not {args.jobs}")
    if args.json is not None and (why := json_target_problem(args.json)):
        p.error(f"--json: {why}")   # before the study, not after every row was replayed
    cands = candidates()
    if args.from_json:
        try:
            rows, preds = load_record(args.from_json, cands)
        except (OSError, ValueError, GpumemError) as exc:
            p.error(f"--from-json: cannot read {args.from_json} as a record of this study: "
                    f"{getattr(exc, 'strerror', None) or exc}")
    else:
        rows = live_rows()
        preds = measure(rows, cands, args.jobs)
    text, data = report(rows, preds, cands)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1, default=lambda x: None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
