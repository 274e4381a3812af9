"""Simulator fidelity: does the simulated card behave like the real one?

::

    python -m hil.fidelity --device cuda:0 [--sim sim:h200-141gb] [--traces DIR] [--json OUT.json]

Four checks, each against the real device given and its simulated twin:

1. **Peak reserved** - the allocator (default policy and engine) replays every trace on both; its peak
   reserved bytes must be identical. The number of device calls it made on each is reported beside.
2. **mem_info** - the device's free bytes after the same calls (after the allocator is made, at the
   trace's peak of live bytes, at the end, after ``empty_cache()``) must differ by no more than the
   context overhead (what the real device showed as used before the replay began).
3. **Latency** - each device call's simulated cost (:class:`gpumem.sim.latency.LatencyModel`) must be
   within 2x of the cost measured now by ``python -m sim.calibrate``, compared on the
   footing Note [Latency calibration] gives: driver calls less the binding's own cost (``null_call``).
4. **Hazards** - a kernel reads a block while the block is freed and its memory goes back to the
   device (its pages stolen by the next allocation; ``empty_cache()``), once with the allocator as it
   is and once with its stream fences switched off (the allocator made to misbehave on purpose). On the
   real GPU each run is a fresh process of ``python -m hil.probes.inflight`` under
   ``compute-sanitizer --tool memcheck``; on the simulator the same steps run with the simulator's
   sanitizer counting hazards. Both must flag the misbehaving runs and neither the real ones.
4. **Live against predicted** (with ``--live-record``, issue 18) - real PyTorch workloads run live under
   PyTorch's allocator and ``gpumem.torch``, each recording its own trace
   (``python -m hil.probes.workloads live``); each run replayed on ``--sim`` with its allocator's
   model (``--gpu-timing`` for the replay's GPU timing): every gpumem row's predicted overhead must be
   within 1 percentage point of the live one.

Every difference is listed; the status is ``passed`` only when every check holds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

log = logging.getLogger("hil.fidelity")

#: The largest ratio, either way, between simulated and measured call latency.
LATENCY_FACTOR = 2.0
_MiB = 1 << 20


class FidelityInputError(Exception):
    """Bad input: one clear line, exit status 2."""


# -- 1 and 2: replays with mem_info checkpoints -----------------------------------------------------------------
@dataclasses.dataclass
class ReplaySide:
    """One trace replayed on one device."""

    device: str
    peak_reserved_nbytes: int
    device_calls: int
    free_nbytes: dict[str, int]
    context_nbytes: int


CHECKPOINTS = ("allocator made", "peak live", "end", "after empty_cache")


def replay_with_checkpoints(spec: str, trace: Any) -> ReplaySide:
    """Replay ``trace`` through a default ``CachingAllocator`` on ``spec``, reading ``mem_info()`` at
    :data:`CHECKPOINTS`."""
    from gpumem.allocator import CachingAllocator
    from gpumem.specs import open_device

    kinds, ids, sizes, streams = trace.as_lists()
    peak_at = int(trace.live_nbytes().argmax()) if kinds else -1
    dev = open_device(spec)
    try:
        info = dev.mem_info()
        context_nbytes = info.total_nbytes - info.free_nbytes
        alloc = CachingAllocator(dev)
        free: dict[str, int] = {"allocator made": dev.mem_info().free_nbytes}
        ptrs: dict[int, int] = {}
        try:
            for i, (k, a, n) in enumerate(zip(kinds, ids, sizes)):
                if k == 0:
                    if n:
                        ptrs[a] = alloc.allocate(n)
                else:
                    p = ptrs.pop(a, None)
                    if p is not None:
                        alloc.free(p)
                if i == peak_at:
                    free["peak live"] = dev.mem_info().free_nbytes
            free["end"] = dev.mem_info().free_nbytes
            for p in ptrs.values():
                alloc.free(p)
            ptrs.clear()
            alloc.empty_cache()
            free["after empty_cache"] = dev.mem_info().free_nbytes
            stats = alloc.snapshot_stats()
            return ReplaySide(spec, int(stats.peak_reserved_nbytes), int(stats.device_calls), free, context_nbytes)
        finally:
            for p in ptrs.values():
                alloc.free(p)
            alloc.close()
    finally:
        dev.close()


@dataclasses.dataclass
class TraceFidelity:
    trace: str
    real: ReplaySide
    sim: ReplaySide
    peak_reserved_equal: bool
    free_diff_nbytes: dict[str, int]
    mem_info_within: bool


def compare_trace(name: str, real: ReplaySide, sim: ReplaySide) -> TraceFidelity:
    """Compare two replays of one trace: peak reserved identical; each free figure within the real
    device's context overhead."""
    diffs = {c: real.free_nbytes[c] - sim.free_nbytes[c] for c in CHECKPOINTS
             if c in real.free_nbytes and c in sim.free_nbytes}
    within = all(abs(d) <= real.context_nbytes for d in diffs.values()) and len(diffs) == len(CHECKPOINTS)
    return TraceFidelity(name, real, sim, real.peak_reserved_nbytes == sim.peak_reserved_nbytes, diffs, within)


# -- 3: latency -------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class LatencyRow:
    call: str
    measured_us: float
    simulated_us: float
    ratio: float
    within: bool


def _model_costs(model: Any) -> dict[str, float]:
    """The simulated cost of each call the calibration probe times, by the probe's key."""
    two, big = 2 * _MiB, 64 * _MiB
    costs = {
        "malloc_free_512": model.malloc_free_us(512), "malloc_free_1048576": model.malloc_free_us(_MiB),
        "malloc_free_67108864": model.malloc_free_us(big), "malloc_free_1073741824": model.malloc_free_us(1 << 30),
        "memGetInfo": model.mem_get_info_us, "cuMemGetInfo": model.mem_get_info_us,
        "getDeviceProperties": model.get_properties_us,
        "cuMemMap_1page": model.mem_map_us, "cuMemMap_64MiB_1map": model.mem_map_us,
        "cuMemSetAccess_1page": model.mem_set_access_cost_us(1, two),
        "cuMemSetAccess_32maps": model.mem_set_access_cost_us(32, 32 * two),
        "cuMemSetAccess_64MiB_1map": model.mem_set_access_cost_us(1, big),
        "cuMemUnmap_1page": model.mem_unmap_cost_us(1, two),
        "cuMemUnmap_32maps": model.mem_unmap_cost_us(32, 32 * two),
        "cuMemUnmap_64MiB_1map": model.mem_unmap_cost_us(1, big),
        "cuMemAddressReserve_1GiB": model.address_reserve_us, "cuMemAddressReserve_1TiB": model.address_reserve_us,
        "cuMemAddressFree_1GiB": model.address_free_cost_us(1 << 30),
        "cuMemAddressFree_1TiB": model.address_free_cost_us(1 << 40),
        "cuEventQuery": model.event_query_us, "cuEventDestroy": model.event_destroy_us,
        "cuStreamWaitEvent": model.stream_wait_event_us, "cuStreamSynchronize_idle": model.synchronize_us,
        "cuEventSynchronize_idle": model.synchronize_us, "cuCtxSynchronize_idle": model.device_synchronize_us,
        "cuStreamCreate": model.stream_create_us, "cuStreamDestroy": model.stream_destroy_us,
    }
    for label, nbytes in (("2MiB", two), ("32MiB", 32 * _MiB), ("256MiB", 256 * _MiB), ("1GiB", 1 << 30)):
        costs[f"cuMemCreate_{label}"] = model.mem_create_cost_us(nbytes)
        costs[f"cuMemRelease_{label}"] = model.mem_release_cost_us(nbytes)
    return costs


def compare_latency(measured: dict[str, Any], model: Any | None = None) -> list[LatencyRow]:
    """Each call of a calibration record (``costs_us``) against the simulator's model."""
    from gpumem.sim.latency import LatencyModel

    model = model or LatencyModel()
    costs = measured.get("costs_us", {})
    null_us = float(costs.get("null_call", {}).get("median_us", 0.0))
    rows = []
    for key, sim_us in _model_costs(model).items():
        m = costs.get(key)
        if not isinstance(m, dict) or "median_us" not in m:
            continue
        us = float(m["median_us"])
        if key.startswith("cu"):
            us = max(us - null_us, 0.05)  # the binding's own cost is not the driver's (Note [Latency calibration])
        ratio = sim_us / us if us > 0 else float("inf")
        rows.append(LatencyRow(key, round(us, 3), round(sim_us, 3), round(ratio, 3),
                               1 / LATENCY_FACTOR <= ratio <= LATENCY_FACTOR))
    if "cuEventCreate" in costs and "cuEventRecord" in costs:  # event_record stands for create + record
        us = max(float(costs["cuEventCreate"]["median_us"]) + float(costs["cuEventRecord"]["median_us"])
                 - 2 * null_us, 0.05)
        ratio = model.event_record_us / us
        rows.append(LatencyRow("cuEventCreate+cuEventRecord", round(us, 3), model.event_record_us, round(ratio, 3),
                               1 / LATENCY_FACTOR <= ratio <= LATENCY_FACTOR))
    return rows


# -- 4: hazards ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class HazardRow:
    scenario: str
    allocator: str  # "as it is" or "fences off"
    sim_hazards: int
    real_errors: int | None
    real_note: str
    agree: bool


@contextlib.contextmanager
def fences_off() -> Iterator[None]:
    """Switch the allocator's stream fences off (as before issue 6): memory goes back while kernels read it."""
    from gpumem.allocator.fences import StreamFences

    done, wait = StreamFences.done, StreamFences.wait
    StreamFences.done = lambda self, stream, number: True  # type: ignore[method-assign]
    StreamFences.wait = lambda self, stream, number: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        StreamFences.done, StreamFences.wait = done, wait  # type: ignore[method-assign]


def simulated_inflight(path: str, old: bool, sim: str) -> int:
    """The simulated twin of ``python -m hil.probes.inflight --path PATH [--old]``: hazards counted."""
    from gpumem.allocator import CachingAllocator
    from hil.probes.inflight import BLOCK_NBYTES, PAGE_STEALS
    from gpumem.specs import open_device
    from gpumem.units import MiB

    with fences_off() if old else contextlib.nullcontext():
        dev = open_device(sim, sanitizer="count")
        try:
            alloc = CachingAllocator(dev, PAGE_STEALS if path == "steal" else "gpumem",
                                     limit=12 * MiB if path == "steal" else None, engine="python")
            stream = dev.stream_create()
            block = alloc.allocate(BLOCK_NBYTES, stream)
            out = alloc.allocate(8, stream)
            dev.launch(stream, 0.05, [(block, BLOCK_NBYTES), (out, 8)], name="slow_sum")  # about 50 ms, as the probe
            if path == "steal":
                alloc.allocate(2 * MiB, stream)
                alloc.free(block)
                alloc.allocate(8 * MiB, stream)
            else:
                alloc.free(block)
                alloc.empty_cache()
            dev.synchronize()
            return len(dev.hazards)
        finally:
            dev.close()


def real_inflight(path: str, old: bool, device: str, sanitizer: str, work_dir: Path) -> tuple[int | None, str]:
    """One run of the in-flight probe under memcheck in a fresh process: (errors, note)."""
    from hil.sanitizer import SanitizerTool, parse_sanitizer_log, sanitizer_prefix

    log_file = work_dir / f"inflight-{path}-{'old' if old else 'fenced'}.log"
    cmd = [*sanitizer_prefix(sanitizer, SanitizerTool.MEMCHECK, log_file), sys.executable, "-m",
           "hil.probes.inflight", "--path", path, "--device", device] + (["--old"] if old else [])
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None, "timed out after 300 s"
    note = ""
    for line in res.stdout.splitlines():
        try:
            out = json.loads(line)
        except ValueError:
            continue
        note = ("context healthy, sum right" if out.get("sum_right") else
                f"context {'healthy' if out.get('context_healthy') else 'dead'}: {str(out.get('error', ''))[:80]}")
    try:
        findings = parse_sanitizer_log(log_file.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError) as exc:
        return None, f"{exc}; {note}"
    return findings.errors, note


def hazard_rows(device: str, sim: str, sanitizer: str | None, work_dir: Path) -> list[HazardRow]:
    rows = []
    for path in ("steal", "release"):
        for old in (False, True):
            sim_n = simulated_inflight(path, old, sim)
            if sanitizer is None:
                real_n, note = None, "compute-sanitizer not run"
            else:
                real_n, note = real_inflight(path, old, device, sanitizer, work_dir)
            agree = real_n is not None and (sim_n > 0) == (real_n > 0) and (sim_n > 0) == old
            rows.append(HazardRow("pages stolen under a kernel" if path == "steal" else "empty_cache under a kernel",
                                  "fences off" if old else "as it is", sim_n, real_n, note, agree))
    return rows


# -- the whole check ----------------------------------------------------------------------------------------------
def _fmt_mib(n: int) -> str:
    return f"{n / _MiB:+.1f} MiB" if n else "0"


def render_markdown(traces: list[TraceFidelity], latency: list[LatencyRow], hazards: list[HazardRow], sim: str,
                    latency_note: str) -> str:
    lines = [f"### Peak reserved and mem_info: the real device against `{sim}`", "",
             "| trace | peak reserved (real) | peak reserved (sim) | identical | device calls real / sim "
             "| free bytes real − sim at: " + ", ".join(CHECKPOINTS) + " | within context overhead |",
             "|---|---|---|---|---|---|---|"]
    for t in traces:
        lines.append(f"| {t.trace} | {t.real.peak_reserved_nbytes:,} | {t.sim.peak_reserved_nbytes:,} "
                     f"| {'yes' if t.peak_reserved_equal else '**no**'} | {t.real.device_calls:,} / {t.sim.device_calls:,} "
                     f"| {', '.join(_fmt_mib(t.free_diff_nbytes.get(c, 0)) for c in CHECKPOINTS)} "
                     f"| {'yes' if t.mem_info_within else '**no**'} (±{t.real.context_nbytes / _MiB:.0f} MiB) |")
    lines += ["", f"### Device-call latency: simulated against measured (within {LATENCY_FACTOR:g}×)", ""]
    if latency:
        lines += ["| call | measured µs | simulated µs | sim / measured | within |", "|---|---|---|---|---|"]
        lines += [f"| {r.call} | {r.measured_us:.2f} | {r.simulated_us:.2f} | {r.ratio:.2f} "
                  f"| {'yes' if r.within else '**no**'} |" for r in latency]
    else:
        lines.append(f"not measured: {latency_note}")
    lines += ["", "### Hazards: a kernel reads memory while it goes back to the device", "",
              "| scenario | allocator | simulator's sanitizer (hazards) | compute-sanitizer memcheck (errors) "
              "| real run | agree |", "|---|---|---|---|---|---|"]
    lines += [f"| {h.scenario} | {h.allocator} | {h.sim_hazards} | {h.real_errors if h.real_errors is not None else '—'} "
              f"| {h.real_note} | {'yes' if h.agree else '**no**'} |" for h in hazards]
    return "\n".join(lines) + "\n"


def run_fidelity(device: str, sim: str, traces: list[Path], sanitizer: str | None, calibrate_repeat: int) -> dict:
    from gpumem.errors import TraceFormatError
    from gpumem.trace import load_trace

    started = time.monotonic()
    started_utc = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    results: list[TraceFidelity] = []
    problems: list[str] = []
    for path in traces:
        log.info("replaying %s on %s and %s ...", path.name, device, sim)
        try:
            trace = load_trace(path)
        except (OSError, TraceFormatError) as exc:  # one bad file costs its own row, not the part
            problems.append(f"{path.name}: cannot be read as a trace ({str(exc)[:200]})")
            continue
        real = replay_with_checkpoints(device, trace)
        simulated = replay_with_checkpoints(sim, trace)
        t = compare_trace(path.name, real, simulated)
        results.append(t)
        if not t.peak_reserved_equal:
            problems.append(f"{path.name}: peak reserved {real.peak_reserved_nbytes:,} on {device}, "
                            f"{simulated.peak_reserved_nbytes:,} on {sim}")
        if not t.mem_info_within:
            problems.append(f"{path.name}: free bytes differ beyond the context overhead: {t.free_diff_nbytes}")
        if real.device_calls != simulated.device_calls:
            log.info("%s: %d device calls on %s, %d on %s", path.name, real.device_calls, device,
                     simulated.device_calls, sim)
    latency: list[LatencyRow] = []
    latency_note = ""
    calibration: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpumem-fidelity-") as tmp:
        out = Path(tmp) / "calibrate.json"
        log.info("measuring device-call latency (python -m sim.calibrate) ...")
        res = subprocess.run([sys.executable, "-m", "sim.calibrate", "--out", str(out),
                              "--repeat", str(calibrate_repeat)], capture_output=True, text=True, timeout=900)
        if res.returncode == 0 and out.exists():
            measured = json.loads(out.read_text(encoding="utf-8"))
            latency = compare_latency(measured)
            calibration = {k: measured[k] for k in ("driver_version", "repeat", "costs_us") if k in measured}
        else:
            tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-1:]
            latency_note = f"the calibration probe exited with status {res.returncode}" + (f": {tail[0]}" if tail else "")
            problems.append(latency_note)
        problems += [f"latency of {r.call}: simulated {r.simulated_us:.2f} µs, measured {r.measured_us:.2f} µs "
                     f"({r.ratio:.2f}×)" for r in latency if not r.within]
        log.info("hazard scenarios ...")
        hazards = hazard_rows(device, sim, sanitizer, Path(tmp))
    problems += [f"hazard '{h.scenario}', allocator {h.allocator}: simulator {h.sim_hazards}, memcheck "
                 f"{h.real_errors}" for h in hazards if not h.agree]
    n_lat = sum(r.within for r in latency)
    summary = (f"{sum(t.peak_reserved_equal for t in results)}/{len(results)} traces with identical peak reserved, "
               f"{sum(t.mem_info_within for t in results)}/{len(results)} mem_info within the context overhead, "
               f"{n_lat}/{len(latency)} calls within {LATENCY_FACTOR:g}×, "
               f"{sum(h.agree for h in hazards)}/{len(hazards)} hazard scenarios agree")
    status = "passed" if not problems else "failed"
    if sanitizer is None and not problems:
        status, problems = "skipped", ["compute-sanitizer not found: the hazard scenarios were not checked on the GPU"]
    return {
        "status": status, "reason": "; ".join(problems), "summary": summary,
        "markdown": render_markdown(results, latency, hazards, sim, latency_note),
        "device": device, "sim": sim, "traces": [dataclasses.asdict(t) for t in results],
        "latency": [dataclasses.asdict(r) for r in latency], "calibration": calibration, "hazards": [dataclasses.asdict(h) for h in hazards],
        "differences": problems, "started_utc": started_utc, "duration_s": round(time.monotonic() - started, 1),
    }


def live_vs_predicted_part(record_path: Path, sim: str, gpu_timing: str | None = None) -> dict[str, Any]:
    """The live-vs-predicted table (issue 18) of a workloads record (``python -m hil.probes.workloads
    live``), its traces beside it: each live run replayed on ``sim`` with its allocator's model. Returns the
    rows, their Markdown and the gpumem rows off by more than 1 percentage point (``differences``).

    Raises:
        FidelityInputError: the record cannot be read.
    """
    from hil.probes import workloads

    try:
        rows = workloads.live_vs_predicted(workloads._load_record(record_path), record_path.parent, sim, gpu_timing)
    except workloads.WorkloadInputError as exc:
        raise FidelityInputError(f"--live-record: {exc}") from None
    problems = [f"live vs predicted, {r.workload} on gpumem: " + (r.error or f"{r.diff_pp:+.2f} pp")
                for r in rows if r.allocator == "gpumem" and (r.diff_pp is None or abs(r.diff_pp) > 1.0)]
    return {"rows": [dataclasses.asdict(r) | {"diff_pp": r.diff_pp} for r in rows], "differences": problems,
            "markdown": f"### Live against predicted peak reserved ({record_path.name})\n\n"
                        + workloads.render_table(rows, sim)}


def main(argv: Sequence[str] | None = None) -> int:
    from hil.peers import default_traces_dir, find_traces, PeersInputError
    from hil.sanitizer import find_compute_sanitizer

    parser = argparse.ArgumentParser(prog="python -m hil.fidelity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0", help="the real GPU (cuda:N); a sim: spec records the part as "
                                                            "skipped")
    parser.add_argument("--sim", default="sim:h200-141gb", help="the simulated twin (default sim:h200-141gb)")
    parser.add_argument("--traces", type=Path, default=None, help="folder of traces (default: data/traces)")
    parser.add_argument("--no-sanitizer", action="store_true", help="do not run compute-sanitizer (hazards skipped)")
    parser.add_argument("--calibrate-repeat", type=int, default=30, help="samples per call for the latency probe")
    parser.add_argument("--json", type=Path, default=None, help="write the JSON here (default: stdout)")
    parser.add_argument("--live-record", type=Path, default=None,
                        help="a workloads record (python -m hil.probes.workloads live), its traces beside it: "
                             "add the live-vs-predicted table")
    parser.add_argument("--gpu-timing", default=None, help="the replays' GPU timing mode for --live-record")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    try:
        if not args.sim.startswith("sim:"):
            raise FidelityInputError(f"--sim: {args.sim!r} is not a simulated device (sim:PROFILE)")
        if not (args.device.startswith("cuda:") or args.device.startswith("sim:")):
            raise FidelityInputError(f"--device: {args.device!r} is not cuda:N or sim:PROFILE")
        if not 3 <= args.calibrate_repeat <= 1000:
            raise FidelityInputError(f"--calibrate-repeat must be from 3 to 1000, got {args.calibrate_repeat}")
        from gpumem.specs import open_device

        open_device(args.sim).close()
        traces = find_traces(args.traces or default_traces_dir())
    except (FidelityInputError, PeersInputError) as exc:
        print(f"python -m hil.fidelity: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - an unknown profile: one line
        print(f"python -m hil.fidelity: --sim {args.sim}: {exc}", file=sys.stderr)
        return 2
    if args.device.startswith("sim:"):
        data: dict[str, Any] = {"status": "skipped", "reason": f"needs a real GPU ({args.device} is simulated)",
                                "summary": "", "markdown": "", "started_utc": now, "duration_s": 0.0}
    else:
        sanitizer = None if args.no_sanitizer else find_compute_sanitizer()
        data = run_fidelity(args.device, args.sim, traces, sanitizer, args.calibrate_repeat)
    if args.live_record is not None:
        try:
            part = live_vs_predicted_part(args.live_record, args.sim, args.gpu_timing)
        except FidelityInputError as exc:
            print(f"python -m hil.fidelity: {exc}", file=sys.stderr)
            return 2
        data["live_vs_predicted"] = part
        data["markdown"] = data["markdown"] + ("\n" if data["markdown"] else "") + part["markdown"]
        if part["differences"] and data["status"] != "skipped":
            data["differences"] = data.get("differences", []) + part["differences"]
            data["status"], data["reason"] = "failed", "; ".join(data["differences"])
    text = json.dumps(data, indent=1, default=str) + "\n"
    if args.json is None:
        sys.stdout.write(text)
    else:
        args.json.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
