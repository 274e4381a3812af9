"""Replays on the recording's GPU clock (``gpu_timing="gpu-clock"``; Note [A replay on the recorded GPU clock] in
gpumem/sim/gpu_work.py) and the pieces that read the clock (``gpumem.torch.gpu_clock_of_ops``, ``gpumem replay
--gpu-clock``, the probes' ``--gpu-clock``). Recording the clock on a GPU: tests/pytorch/torch_child.py
``trace_gpu_clock``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem.allocator import CachingAllocator
from gpumem.errors import InvalidArgumentError, TraceFormatError
from gpumem.replay import program_gpu, replay, replay_trace
from gpumem.sim import SimDevice, get_profile
from gpumem.sim.gpu_work import ProgramGpu
from gpumem.trace import Trace, load_trace

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "data" / "traces"
GPT2 = TRACES / "gpt2_fp32_train_h200.snapshot.pickle.gz"


@pytest.fixture(scope="module")
def gpt2() -> Trace:
    return load_trace(GPT2)


def test_a_gpu_never_behind_replays_as_an_idle_one(gpt2):
    """A clock equal to the CPU's: the work queued after each op ends when the CPU reaches the next, so every
    fence is complete when the allocator looks: the figures of ``idle``, to the byte and the call."""
    idle = replay_trace(gpt2, "sim:h200-141gb", "gpumem", progress=False, gpu_timing="idle")
    clock = replay_trace(gpt2, "sim:h200-141gb", "gpumem", progress=False, gpu_clock_us=gpt2.times_us.copy())
    assert clock.extra["gpu_timing"] == "gpu-clock"
    assert (clock.peak_reserved_bytes, clock.stats.device_calls) == (idle.peak_reserved_bytes, idle.stats.device_calls)


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_gpu_behind_keeps_fences_pending_and_the_sanitizer_sees_no_hazard(gpt2, engine):
    """The clock 20 ms behind the CPU at every op: the work is queued (touching the blocks it made), fences are
    pending when the allocator looks, and no unmap meets queued work (the sanitizer raises if one does)."""
    lagging = gpt2.times_us + 20_000.0
    with SimDevice(get_profile("h200-141gb"), sanitizer="raise") as dev:
        alloc = CachingAllocator(dev, "gpumem", engine=engine)
        try:
            r = replay(gpt2, alloc, progress=False, gpu_clock_us=lagging)
        finally:
            alloc.close()
    idle = replay_trace(gpt2, "sim:h200-141gb", "gpumem", progress=False, gpu_timing="idle", engine=engine)
    assert r.completed_ops == gpt2.n_ops and r.extra["gpu_launches"] > 1000
    # the fences are pending where the idle GPU's were complete: the busy_slack rule grows rather than steal
    assert r.peak_reserved_bytes > idle.peak_reserved_bytes and r.stats.device_calls < idle.stats.device_calls


def _one_stream(gaps_us: list[float]) -> Trace:
    ops, t = [], 0.0
    for i, gap in enumerate(gaps_us):
        ops.append((0, i, 4 << 20, 0, t, 0))
        t += gap
        ops.append((1, i, 4 << 20, 0, t, 0))
        t += gap
    return Trace.from_ops("tiny", "gpumem", ops)


@settings(max_examples=30, deadline=None)
@given(gaps=st.lists(st.floats(min_value=10.0, max_value=500.0), min_size=2, max_size=12),
       lags=st.lists(st.floats(min_value=0.0, max_value=5_000.0), min_size=24, max_size=24))
def test_the_gpu_runs_as_far_behind_as_the_recording_says(gaps, lags):
    """At each op the work queued before it is done as long after the CPU gets there as the recording says (the
    lag of its clock): an event recorded there completes then. A stream's clock never runs backwards (made so
    here), so every such lag can be reached."""
    trace = _one_stream(gaps)
    n = trace.n_ops
    times = trace.times_us
    clock = np.maximum.accumulate(times + np.asarray(lags[:n]))
    with SimDevice(get_profile("h200-141gb")) as dev:
        gpu = ProgramGpu(trace, dev, "gpu-clock", gpu_clock_us=clock)
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
    trace = _one_stream([50.0, 120.0, 80.0])
    with SimDevice(get_profile("h200-141gb")) as dev:
        gpu = ProgramGpu(trace, dev, "gpu-clock", gpu_clock_us=trace.times_us + 30.0)
        arrivals = []
        for i in range(trace.n_ops):
            gpu.before(i)
            arrivals.append(dev.now_s)
            gpu.after(i, 0)
        gpu.finish()
    np.testing.assert_allclose(np.diff(arrivals), np.diff(trace.times_us) * 1e-6, atol=1e-9)


def test_bad_clocks_are_refused_and_nothing_changes(gpt2):
    trace = _one_stream([10.0, 10.0])
    good = trace.times_us.copy()
    with SimDevice(get_profile("h200-141gb")) as dev:
        before = dev.now_s
        for bad, match in ((good[:-1], "3 values for a trace of 4"), (np.array([0.0, np.nan, 1.0, 2.0]), "no time for 1"),
                           (np.ones((2, 2)), "values for a trace of 4")):
            with pytest.raises(InvalidArgumentError, match=match):
                replay_trace(trace, dev, progress=False, gpu_clock_us=bad)
        with pytest.raises(InvalidArgumentError, match="needs the recording's GPU clock"):
            ProgramGpu(trace, dev, "gpu-clock")
        with pytest.raises(InvalidArgumentError, match="for that timing only"):
            replay_trace(trace, dev, progress=False, gpu_timing="trace", gpu_clock_us=good)
        with pytest.raises(InvalidArgumentError, match="not 'idle'|other than 'idle'"):
            program_gpu(trace, dev, "idle", gpu_clock_us=good)
        flat = Trace.from_ops("flat", "gpumem", [(0, 0, 64, 0, 5.0, 0), (1, 0, 64, 0, 5.0, 0)])
        with pytest.raises(InvalidArgumentError, match="the trace's own clock"):
            replay_trace(flat, dev, progress=False, gpu_clock_us=np.array([5.0, 5.0]))
        two = Trace.from_ops("two", "gpumem", [(0, 0, 64, 0, 1.0, 0), (0, 1, 64, 7, 2.0, 0), (1, 0, 64, 0, 3.0, 0)])
        with pytest.raises(InvalidArgumentError, match="uses 2 streams"):
            replay_trace(two, dev, progress=False, gpu_clock_us=np.array([1.0, 2.0, 3.0]))
        with pytest.raises(InvalidArgumentError, match="not both"):
            alloc = CachingAllocator(dev, "gpumem")
            try:
                replay(trace, alloc, gpu=ProgramGpu(trace, dev, "trace"), gpu_clock_us=good)
            finally:
                alloc.close()
        assert dev.now_s == before and dev.streams.n_busy_streams == 0


def test_gpu_clock_of_ops_follows_the_ops_the_trace_keeps():
    """The native buffer holds stream uses, waits, plan events and frees of blocks allocated before tracing
    began; only the events that become ops get a clock, in op order."""
    from gpumem.torch import gpu_clock_of_ops, trace_from_words
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
    assert trace.n_ops == 4 and clock.shape == (4,)
    np.testing.assert_array_equal(clock[[0, 1, 3]], [2.0, 3.0, 5.0])
    assert np.isnan(clock[2])   # -1: no stamp
    with pytest.raises(TraceFormatError, match="7 GPU clock values for 8 events"):
        gpu_clock_of_ops(flat, ns[:-1])


def test_cli_replays_on_a_clock_file(tmp_path, capsys, gpt2):
    from gpumem.cli import main
    from gpumem.trace import save_trace
    from gpumem.trace.gpu_clock import gpu_clock_path, load_gpu_clock, save_gpu_clock

    path = tmp_path / "run.gmt.gz"
    save_trace(gpt2, path)
    clock = save_gpu_clock(gpt2.times_us + 1_000.0, gpu_clock_path(path))
    assert clock.name == "run.gmt.gz.gpu-clock.npy.gz"
    np.testing.assert_array_equal(load_gpu_clock(clock), gpt2.times_us + 1_000.0)
    assert main(["replay", str(path), "--gpu-clock", str(clock), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpu_timing"] == "gpu-clock" and out["gpu_launches"] > 0
    save_gpu_clock(gpt2.times_us[:10], tmp_path / "short.npy")
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    np.save(tmp_path / "ints.npy", np.arange(gpt2.n_ops))
    np.save(tmp_path / "objects.npy", np.array([1.0, None], dtype=object), allow_pickle=True)
    np.save(tmp_path / "square.npy", np.ones((3, 3)))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "short.npy").read_bytes()[:-8])
    for bad, match in (("short.npy", "10 values for a trace of"), ("junk.npy", "not a NumPy .npy file"),
                       ("ints.npy", "one float per op"), ("missing.npy", "no GPU clock file"),
                       ("objects.npy", "one float per op"), ("square.npy", "one float per op"),
                       ("cut.npy", "the file ends after 72 of 80 bytes")):
        assert main(["replay", str(path), "--gpu-clock", str(tmp_path / bad)]) != 0, bad
        assert match in capsys.readouterr().err, bad
    assert main(["replay", str(path), "--gpu-clock", str(clock), "--gpu-timing", "trace"]) != 0
    assert "for that timing only" in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError, match="one float per op"):
        save_gpu_clock(np.arange(3), tmp_path / "x.npy")


def test_probes_refuse_a_clock_without_a_trace(capsys):
    from hil.probes import decode_progress, workloads

    assert decode_progress.main(["--allocator", "gpumem", "--gpu-clock"]) == 2
    assert "--gpu-clock needs --record" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        workloads.main(["live", "--workloads", "gpt2_train", "--gpumem-gpu-clock", "--no-record", "--out", "x"])
    assert "--gpumem-gpu-clock needs the trace" in capsys.readouterr().err
