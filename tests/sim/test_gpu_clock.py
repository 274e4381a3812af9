"""Replays on the recording's GPU clock (``gpu_timing="gpu-clock"``; Note [A replay on the recorded GPU clock] in
gpumem/sim/gpu_work.py), the clock in a trace (``Trace.gpu_times_us``, ``.gmt`` version 5) and the pieces that
read it (``gpumem.torch.trace_from_words``, ``gpumem replay``, the probes' ``--gpu-clock``). Recording the clock
on a GPU: tests/pytorch/torch_child.py ``trace_gpu_clock``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem.allocator import CachingAllocator
from gpumem.errors import InvalidArgumentError, TraceFormatError
from gpumem.replay import GpuClockUnusedWarning, default_gpu_timing, program_gpu, replay, replay_trace
from gpumem.sim import SimDevice, get_profile
from gpumem.sim.gpu_work import ProgramGpu
from gpumem.trace import Trace, load_trace, save_trace
from test_gpu_timing import _tiny_trace   # one stream: an allocation and its free per gap

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "data" / "traces"
GPT2 = TRACES / "gpt2_fp32_train_h200.snapshot.pickle.gz"


@pytest.fixture(scope="module")
def gpt2() -> Trace:
    # without the step marks read off its optimizer steps: a step plan serves the steps from its arena, where
    # the GPU's lag changes nothing these tests look at
    return load_trace(GPT2, step_marks=False)


def _clocked(trace: Trace, clock) -> Trace:
    return dataclasses.replace(trace, gpu_times_us=np.asarray(clock, dtype=np.float64))


def test_a_gpu_never_behind_replays_as_an_idle_one(gpt2):
    """A clock equal to the CPU's: the work queued after each op ends when the CPU reaches the next, so every
    fence is complete when the allocator looks: the figures of ``idle``, to the byte and the call."""
    idle = replay_trace(gpt2, "sim:h200-141gb", "gpumem", progress=False, gpu_timing="idle")
    clock = replay_trace(_clocked(gpt2, gpt2.times_us), "sim:h200-141gb", "gpumem", progress=False)
    assert clock.extra["gpu_timing"] == "gpu-clock"
    assert (clock.peak_reserved_bytes, clock.stats.device_calls) == (idle.peak_reserved_bytes, idle.stats.device_calls)


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_gpu_behind_keeps_fences_pending_and_the_sanitizer_sees_no_hazard(gpt2, engine):
    """The clock 20 ms behind the CPU at every op: the work is queued (touching the blocks it made), fences are
    pending when the allocator looks, and no unmap meets queued work (the sanitizer raises if one does)."""
    lagging = _clocked(gpt2, gpt2.times_us + 20_000.0)
    with SimDevice(get_profile("h200-141gb"), sanitizer="raise") as dev:
        alloc = CachingAllocator(dev, "gpumem", engine=engine)
        try:
            r = replay(lagging, alloc, progress=False)
        finally:
            alloc.close()
    idle = replay_trace(gpt2, "sim:h200-141gb", "gpumem", progress=False, gpu_timing="idle", engine=engine)
    assert r.completed_ops == gpt2.n_ops and r.extra["gpu_launches"] > 1000
    # the fences are pending where the idle GPU's were complete: the busy_slack rule grows rather than steal
    assert r.peak_reserved_bytes > idle.peak_reserved_bytes and r.stats.device_calls < idle.stats.device_calls


@settings(max_examples=30, deadline=None)
@given(gaps=st.lists(st.floats(min_value=10.0, max_value=500.0), min_size=2, max_size=12),
       lags=st.lists(st.floats(min_value=0.0, max_value=5_000.0), min_size=24, max_size=24))
def test_the_gpu_runs_as_far_behind_as_the_recording_says(gaps, lags):
    """At each op the work queued before it is done as long after the CPU gets there as the recording says (the
    lag of its clock): an event recorded there completes then. A stream's clock never runs backwards (made so
    here), so every such lag can be reached."""
    trace = _tiny_trace(gaps)
    n = trace.n_ops
    times = trace.times_us
    clock = np.maximum.accumulate(times + np.asarray(lags[:n]))
    trace = _clocked(trace, clock)
    with SimDevice(get_profile("h200-141gb")) as dev:
        gpu = ProgramGpu(trace, dev, "gpu-clock")
        for i in range(n):
            gpu.before(i)
            arrived = dev.now_s
            if i:   # op 0: nothing queued yet
                dev.event_synchronize(dev.event_record(0))
                lag_s = (clock[i] - times[i]) * 1e-6
                assert dev.now_s == pytest.approx(max(arrived + lag_s, arrived), abs=3e-6), (i, lag_s)
            gpu.after(i, 0)
        gpu.finish()
        assert dev.streams.n_busy_streams == 0


def test_the_cpu_keeps_the_recorded_pace():
    """Between two ops the replay's CPU spends the recorded time (the simulated launch in it, not on top)."""
    trace = _tiny_trace([50.0, 120.0, 80.0])
    trace = _clocked(trace, trace.times_us + 30.0)
    with SimDevice(get_profile("h200-141gb")) as dev:
        gpu = ProgramGpu(trace, dev, "gpu-clock")
        arrivals = []
        for i in range(trace.n_ops):
            gpu.before(i)
            arrivals.append(dev.now_s)
            gpu.after(i, 0)
        gpu.finish()
    np.testing.assert_allclose(np.diff(arrivals), np.diff(trace.times_us) * 1e-6, atol=1e-9)


def test_bad_clocks_are_refused_and_nothing_changes():
    trace = _tiny_trace([10.0, 10.0])
    good = trace.times_us.copy()
    for bad, match in ((good[:-1], r"one float64 per op \(4"), (np.ones((2, 2)), r"one float64 per op"),
                       (good.astype(np.float32), "float32"), ("1234", "one float64 per op"),
                       (np.array([0.0, np.inf, 1.0, 2.0]), "op 1 has an infinite time"), (True, "one float64 per op")):
        with pytest.raises(InvalidArgumentError, match=match):
            dataclasses.replace(trace, gpu_times_us=bad)
    with SimDevice(get_profile("h200-141gb")) as dev:
        before = dev.now_s
        partial = _clocked(trace, [0.0, np.nan, 20.0, 30.0])
        with pytest.raises(InvalidArgumentError, match="no time for 1 of its 4 operations"):
            replay_trace(partial, dev, progress=False, gpu_timing="gpu-clock")
        with pytest.raises(InvalidArgumentError, match="has no GPU clock"):
            ProgramGpu(trace, dev, "gpu-clock")
        flat = Trace.from_ops("flat", "gpumem", [(0, 0, 64, 0, 5.0, 0), (1, 0, 64, 0, 5.0, 0)])
        with pytest.raises(InvalidArgumentError, match="no clock of its own"):
            replay_trace(_clocked(flat, [5.0, 5.0]), dev, progress=False, gpu_timing="gpu-clock")
        two = Trace.from_ops("two", "gpumem", [(0, 0, 64, 0, 1.0, 0), (0, 1, 64, 7, 2.0, 0), (1, 0, 64, 0, 3.0, 0)])
        two = _clocked(two, [1.0, 2.0, 3.0])
        with pytest.raises(InvalidArgumentError, match="uses 2 streams"):
            replay_trace(two, dev, progress=False, gpu_timing="gpu-clock")
        huge = Trace.from_ops("huge", "gpumem", [(0, 0, 64, 0, -1.7e308, 0), (0, 1, 64, 0, 1.7e308, 0),
                                                  (1, 0, 64, 0, 1.7e308, 0), (1, 1, 64, 0, 1.7e308, 0)])
        with pytest.raises(InvalidArgumentError, match="too far apart for a float"):   # attacker 32, F2
            replay_trace(_clocked(huge, [0.0] * 4), dev, progress=False, gpu_timing="gpu-clock")
        assert dev.now_s == before and dev.streams.n_busy_streams == 0
        # by default such traces replay under 'trace', and say why (a warning, shown once per message)
        for t in (partial, two):
            with pytest.warns(GpuClockUnusedWarning, match="replaying under 'trace' timing"):
                assert default_gpu_timing(t).value == "trace"
        assert default_gpu_timing(trace).value == "trace" and default_gpu_timing(_clocked(trace, good)).value == "gpu-clock"
        assert program_gpu(_clocked(trace, good), dev, "idle") is None   # the clock can be left unused


def test_the_native_clock_follows_the_ops_the_trace_keeps():
    """The native buffer holds stream uses, waits, plan events and frees of blocks allocated before tracing
    began; only the events that become ops get a clock, in op order."""
    from gpumem.torch import trace_from_words

    def gpu_clock_of_ops(words, ns):
        return trace_from_words(words, gpu_ns=ns).gpu_times_us
    from gpumem.trace.builder import PLAN_CODE, USE_CODE, WAIT_CODE

    a, b = 0x1000, 0x2000
    words = [[1, 0x9000, 64, 0, 10],       # a free of a block from before the trace: skipped
             [0, a, 64, 0, 20],
             [USE_CODE, a, 0, 5, 25],      # record_stream: a StreamUse, not an op
             [0, b, 32, 0, 30],
             [WAIT_CODE, 5, 0, 0, 35],     # a wait
             [PLAN_CODE, 0, 0, 0, 36],     # a step mark
             [1, a, 64, 0, 40],
             [1, b, 32, 0, 50]]
    flat = np.asarray(words, dtype=np.uint64).ravel()
    ns = np.asarray([1, 2_000, 2_500, 3_000, 3_500, 3_600, -1, 5_000], dtype=np.int64)
    trace = trace_from_words(flat)
    clock = gpu_clock_of_ops(flat, ns)
    assert trace.gpu_times_us is None   # no clock given: none in the trace
    assert trace.n_ops == 4 and clock.shape == (4,)
    np.testing.assert_array_equal(clock[[0, 1, 3]], [2.0, 3.0, 5.0])
    assert np.isnan(clock[2])   # -1: no stamp
    for bad_words, bad_ns, match in ((flat, ns[:-1], "expected 8 int64 GPU clock values"),
                                     (flat, ns.astype(float), "expected 8 int64"),
                                     (flat[:-1], ns, "not a whole number of 5-word events"),
                                     (np.asarray([[0, a, 8, 0, 1], [0, a, 8, 0, 2]], dtype=np.uint64).ravel(),
                                      np.asarray([1, 2]), "alloc at")):
        with pytest.raises(TraceFormatError, match=match):
            gpu_clock_of_ops(bad_words, bad_ns)


def test_the_clock_travels_in_gmt_version_5(tmp_path, gpt2):
    from gpumem.trace.gmt import read_gmt_trace

    clocked = _clocked(gpt2, gpt2.times_us + np.where(np.arange(gpt2.n_ops) % 7 == 0, np.nan, 1234.5))
    path = tmp_path / "run.gmt.gz"
    save_trace(clocked, path)
    back = read_gmt_trace(path)
    assert back == clocked and back.gpu_times_us is not None
    assert back != gpt2   # the clock is part of a trace's equality
    np.testing.assert_array_equal(back.slice(10, 20).gpu_times_us, clocked.gpu_times_us[10:20])
    assert back.renamed("x").gpu_times_us is back.gpu_times_us
    plain = tmp_path / "plain.gmt"
    save_trace(gpt2, plain)
    assert json.loads(plain.read_text().splitlines()[0])["version"] == 1   # no clock: the old version, as before
    text = tmp_path / "v5.gmt"
    save_trace(_clocked(gpt2.head(4), gpt2.head(4).times_us + 1.0), text)
    lines = text.read_text().splitlines()
    assert json.loads(lines[0])["version"] == 5 and json.loads(lines[0])["gpu_clock"] is True
    for k, (mutate, match) in enumerate((
            (lambda ls: [ls[0].replace('"gpu_clock": true', '"gpu_clock": false')] + ls[1:], "must say \"gpu_clock\": true"),
            (lambda ls: [ls[0]] + [" ".join(ls[1].split()[:-1])] + ls[2:], "a version 5 file"),
            (lambda ls: [ls[0]] + [" ".join(ls[1].split()[:-1]) + " inf"] + ls[2:], "is infinite"),
            (lambda ls: [ls[0]] + [ls[1] + " 7"] + ls[2:], "a version 5 file"),
            (lambda ls: [ls[0]] + [" ".join(ls[1].split()[:-1]) + " 0x5"] + ls[2:], "gpu_time_us '0x5' is not"),
            (lambda ls: [ls[0].replace('"version": 5', '"version": 4')] + [" ".join(x.split()[:-1]) for x in ls[1:]],
             "a version 5 field, in a version 4 header"),
            (lambda ls: [ls[0].replace('"version": 5', '"version": 4').replace(', "gpu_clock": true', '')] + ls[1:],
             "version 3 file|expected"))):
        bad = tmp_path / f"bad{k}.gmt"
        bad.write_text("\n".join(mutate(list(lines))) + "\n")
        with pytest.raises(TraceFormatError, match=match):
            read_gmt_trace(bad)


def test_cli_replays_a_trace_on_its_clock(tmp_path, capsys, gpt2):
    from gpumem.cli import main

    path = tmp_path / "run.gmt.gz"
    save_trace(_clocked(gpt2, gpt2.times_us + 1_000.0), path)
    assert main(["replay", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpu_timing"] == "gpu-clock" and out["gpu_launches"] > 0
    assert main(["replay", str(path), "--json", "--gpu-timing", "trace"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu_timing"] == "trace"
    assert main(["replay", str(GPT2), "--gpu-timing", "gpu-clock"]) != 0
    assert "has no GPU clock" in capsys.readouterr().err
    out_dir = tmp_path / "sweep"
    assert main(["sweep", str(path), str(GPT2), "--device", "sim:h200-141gb", "--policy", "gpumem", "--out",
                 str(out_dir), "--no-plots", "--jobs", "1"]) == 0
    rows = json.loads((out_dir / "sweep.json").read_text())["rows"]
    assert sorted(r["gpu_timing"] for r in rows) == ["gpu-clock", "trace"]   # each row says which ran


def test_one_op_on_its_clock_says_gpu_clock():
    one = _clocked(Trace.from_ops("one", "gpumem", [(0, 0, 64, 0, 5.0, 0)]), [5.0])
    r = replay_trace(one, "sim:h200-141gb", "gpumem", progress=False)
    assert r.extra["gpu_timing"] == "gpu-clock"


def test_probes_refuse_a_clock_without_a_trace(capsys):
    from hil.probes import decode_progress, workloads

    assert decode_progress.main(["--allocator", "gpumem", "--gpu-clock"]) == 2
    assert "--gpu-clock needs --record" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        workloads.main(["live", "--workloads", "gpt2_train", "--gpumem-gpu-clock", "--no-record", "--out", "x"])
    assert "--gpumem-gpu-clock needs the trace" in capsys.readouterr().err
