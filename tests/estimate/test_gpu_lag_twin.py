"""Note [A twin that runs the program's GPU work] (gpumem/_native/pybackend.cpp): the native engine's twin keeps the
``model`` GPU timing's clock in C++; it must give what the simulator gives (:class:`~gpumem.sim.gpu_work.ModelGpu`,
``replay_trace(..., gpu_timing="model")``) to the bit: the same peak, the same engine stats, the same clock."""

import contextlib

import pytest
from hypothesis import given, settings, strategies as st

from gpumem.allocator import make_allocator
from gpumem.errors import InvalidArgumentError, OutOfMemoryError, UnsupportedOperationError
from gpumem.estimate import ModelShape, inference_trace
from gpumem.estimate.fit import replay_inference
from gpumem.native import load_engine
from gpumem.replay import replay_trace
from gpumem.sim import get_profile
from gpumem.sim.gpu_work import GpuWorkModel, ModelGpu
from gpumem.sim.latency import LatencyModel
from gpumem.specs import open_device

pytestmark = pytest.mark.skipif(load_engine() is None, reason="the native engine is not built")

DEVICE = "sim:h200-141gb"
# a decode whose kernels outrun the CPU (batch 8): with the GPU's lag gpumem holds 1,421,869,056 bytes at its peak
# where the idle replay holds 1,390,411,776, and makes other calls (1,432 device and 173 event calls, 1,496 and 357)
WIDE = ModelShape(2048, 5504, 4, 32000, 16, 16)
WIDE_KW = dict(batch_size=8, prompt_len=1024, new_tokens=300)


def _run(trace, twin: bool, model: GpuWorkModel | None = None, every: int = 13, policy="gpumem"):
    """Every op of ``trace`` under ``policy`` on the native engine, the GPU's work run by the twin or by ModelGpu."""
    dev = open_device(DEVICE)
    a = make_allocator(dev, policy, engine="native")
    try:
        if twin:
            eng = a._engine
            eng.use_idle_twin(model or GpuWorkModel())
            before, after, clock = eng.lag_before, eng.lag_after, lambda: eng.lag_stats()["now_s"]
        else:
            g = ModelGpu(dev, model)
            before, after, clock = g.before, g.after, lambda: dev.now_s
        kinds, ids, sizes, streams = trace.as_lists()
        ptrs: dict[int, int] = {}
        times = []
        for j, (k, i, n, s) in enumerate(zip(kinds, ids, sizes, streams)):
            before()
            if k == 0:
                p = ptrs[i] = a.allocate(n, s) if n else 0
                if n:
                    after(s, p, n)
            else:
                p = ptrs.pop(i, 0)
                if p:
                    a.free(p)
            if j % every == 0:
                times.append(clock())
        return a.snapshot_stats(), times
    finally:
        a.close()
        dev.close()


@pytest.mark.parametrize("model", [None, GpuWorkModel(cpu_op_us=1.0, queue_depth=8, touch_factor=40.0)])
def test_the_twin_keeps_the_simulators_clock_to_the_bit(model):
    trace = inference_trace(WIDE, 2, full_decode=True, **WIDE_KW).trace
    (st_py, t_py), (st_twin, t_twin) = _run(trace, False, model), _run(trace, True, model)
    assert st_twin == st_py
    assert t_twin == t_py and t_py[-1] > 0
    idle = replay_trace(trace, DEVICE, "gpumem", gpu_timing="idle").stats
    assert (st_twin.peak_reserved_nbytes, st_twin.event_calls) != (idle.peak_reserved_nbytes, idle.event_calls)


def test_the_twin_runs_the_gpus_waits_to_the_bit():
    """Note [Wait on the GPU, not the host]: a stream that waits on another's fence starts its later work when that
    work ends, in the twin as in the simulator (a zero-length marker on the stream)."""
    import dataclasses
    from pathlib import Path

    from gpumem.allocator.policy import get_policy
    from gpumem.trace import load_trace

    trace = load_trace(Path(__file__).resolve().parents[2] / "data" / "traces" / "multistream_infer_h200.snapshot.pickle.gz")
    policy = dataclasses.replace(get_policy("gpumem"), wait_on_gpu=True, busy_slack=0.0)
    (st_py, t_py), (st_twin, t_twin) = (_run(trace, twin, policy=policy, every=5) for twin in (False, True))
    assert st_twin == st_py and t_twin == t_py
    host = _run(trace, False, policy=dataclasses.replace(policy, wait_on_gpu=False), every=5)[0]
    assert st_py.event_calls != host.event_calls   # the GPU's waits were made


def test_the_estimate_gives_the_model_replays_figure():
    kw = WIDE_KW
    full = inference_trace(WIDE, 2, full_decode=True, **kw)
    fast, ref = (replay_inference(WIDE, 2, ("pytorch", "gpumem"), DEVICE, full_replay=f, **kw) for f in (False, True))
    assert fast == ref
    assert fast[1].peak_reserved_bytes == replay_trace(full.trace, DEVICE, "gpumem", gpu_timing="model").peak_reserved_bytes
    assert fast[0].peak_reserved_bytes == replay_trace(full.trace, DEVICE, "pytorch", gpu_timing="idle").peak_reserved_bytes
    # a Device given: the Python ModelGpu on it, the same figure
    dev = open_device(DEVICE)
    try:
        (given,) = replay_inference(WIDE, 2, ("gpumem",), dev, **kw)
    finally:
        dev.close()
    assert given.peak_reserved_bytes == fast[1].peak_reserved_bytes


def test_refusals_change_nothing():
    profile = get_profile("h200-141gb")
    busy = profile.__class__(**{**profile.__dict__, "latency": LatencyModel.as_measured()})
    dev = open_device(DEVICE, profile=busy)
    a = make_allocator(dev, "gpumem", engine="native")
    try:
        with pytest.raises(UnsupportedOperationError, match="prices a busy device higher"):
            a._engine.use_idle_twin(GpuWorkModel())
        assert a._engine.lag_stats() is None
        with pytest.raises(InvalidArgumentError, match="GpuWorkModel"):
            a._engine.use_idle_twin("model")  # type: ignore[arg-type]
        a._engine.lag_before()   # no lag: nothing happens
        a._engine.lag_after(0, 0, 1 << 20)
        assert dev.now_s == 0.0
    finally:
        a.close()
        dev.close()
    dev = open_device(DEVICE)
    a = make_allocator(dev, "gpumem", engine="native")
    try:
        eng = a._engine
        eng.use_idle_twin(GpuWorkModel())
        with pytest.raises(UnsupportedOperationError, match="other twin"):
            eng.use_idle_twin(GpuWorkModel())
        with pytest.raises(InvalidArgumentError, match="stop_at_slow"):
            from gpumem.native import native_module
            import numpy as np
            eng.run_ops(np.zeros(1, np.int8), np.zeros(1, np.int64), np.ones(1, np.int64) << 20,
                        native_module().PtrTable(), stop_at_slow=True)
        assert eng.lag_stats()["launches"] == 0
    finally:
        a.close()
        dev.close()


def test_memory_under_queued_work_is_unmapped_only_after_it_and_a_launch_on_unmapped_memory_is_refused():
    dev = open_device(DEVICE)
    a = make_allocator(dev, "gpumem", engine="native")
    try:
        eng = a._engine
        eng.use_idle_twin(GpuWorkModel())
        nbytes = 1 << 30
        p = a.allocate(nbytes, 0)
        eng.lag_after(0, p, nbytes)   # a kernel reads the block for a while (about 0.6 ms on the H200)
        queued_at_s = eng.lag_stats()["now_s"]
        a.free(p)
        assert eng.lag_stats()["pending"] == 1
        # empty_cache unmaps the block's pages only once the kernel has run: the twin's clock waited for it
        a.empty_cache()
        assert a.reserved_nbytes == 0
        st = eng.lag_stats()
        kernel_s = 4e-6 + 2 * nbytes / (dev.profile.memory_bandwidth_gbps * 1e9 * 0.7)
        assert st["pending"] == 0 and st["now_s"] >= queued_at_s + kernel_s
        assert dev.now_s <= st["now_s"]   # the device is set to the twin's time at its own calls only
        from gpumem.errors import GpumemError
        with pytest.raises(GpumemError, match="not mapped with access"):
            eng.lag_after(0, p, 4096)
        assert eng.lag_stats()["launches"] == 1
    finally:
        a.close()
        dev.close()


@contextlib.contextmanager
def _lagged(model: "GpuWorkModel | None | bool" = None, profile=None, **open_kw):
    """A device and a gpumem allocator on the native engine, the twin's lag on (``model`` False: off), closed after."""
    dev = open_device(DEVICE, **({"profile": profile} if profile is not None else {}), **open_kw)
    a = make_allocator(dev, "gpumem", engine="native")
    try:
        if model is not False:
            a._engine.use_idle_twin(model or GpuWorkModel())
        yield dev, a
    finally:
        a.close()
        dev.close()


@pytest.mark.parametrize("model, profile_change, error", [
    (GpuWorkModel(queue_depth=2**63), {}, InvalidArgumentError),
    (GpuWorkModel(), {"memory_bandwidth_gbps": 0.0}, InvalidArgumentError),
])
def test_a_refused_lag_leaves_the_twin_off(model, profile_change, error):
    """Attacker 29: the twin was left on, the device detached, when the lag's constants were refused."""
    import dataclasses

    profile = dataclasses.replace(get_profile("h200-141gb"), **profile_change)
    with _lagged(False, profile=profile) as (dev, a):
        with pytest.raises(error):
            a._engine.use_idle_twin(model)
        assert a._engine._ext.twin_mapping_ranges() is None and a._engine.lag_stats() is None
        a.allocate(64 << 20, 0)
        assert dev.n_mappings > 0   # the device's own books: no twin


def test_the_device_clock_never_goes_back():
    """Attacker 29: time the device's clock gained outside the twin (advance()) was lost at the next device call."""
    with _lagged() as (dev, a):
        dev.advance(1.0)
        a.allocate(64 << 20, 0)   # grows: device calls, at the later of the two clocks
        assert dev.now_s > 1.0 and a._engine.lag_stats()["now_s"] >= dev.now_s


def test_bad_lag_calls_change_nothing():
    with _lagged(GpuWorkModel(touch_factor=1.7e308)) as (dev, a):
        eng = a._engine
        p = a.allocate(64 << 20, 0)
        before = eng.lag_stats()
        from gpumem.errors import GpumemError
        with pytest.raises(GpumemError, match="finite"):
            eng.lag_after(0, p, 64 << 20)   # a kernel past the largest finite time
        with pytest.raises(OverflowError):
            eng.lag_after(-1, p, 4096)
        with pytest.raises(GpumemError, match="address space"):
            eng.lag_after(0, 2**64 - 4096, 8192)
        eng.lag_after(0, p, 0)   # a zero-byte allocation queues nothing
        assert eng.lag_stats() == before
    for call in (eng.lag_before, lambda: eng.lag_after(0, 1, 1), eng.lag_stats):
        with pytest.raises(InvalidArgumentError, match="closed"):
            call()


def test_a_device_whose_sanitizer_does_not_raise_is_refused():
    with _lagged(False, sanitizer="count") as (dev, a):
        with pytest.raises(UnsupportedOperationError, match="sanitizer"):
            a._engine.use_idle_twin(GpuWorkModel())
        assert a._engine._ext.twin_mapping_ranges() is None


def test_a_kernel_at_pointer_0_touches_nothing():
    """Re-check 29: the twin recorded work at ptr 0 as touching [0, n) and refused a later unmap there."""
    with _lagged() as (dev, a):
        p = a.allocate(40 << 20, 0)
        a.free(p)
        a._engine.lag_after(0, 0, 1 << 30)   # ModelGpu.after: no touches where ptr is 0
        assert a.empty_cache() == 40 << 20


# Any program, not only the estimate's: random allocations (small and large, on streams 0-2) and frees, a kernel
# after each allocation, and now and then empty_cache or a synchronize, under a model whose GPU runs far behind.
_OPS = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "alloc", "free", "free", "empty", "sync"]),
                          st.sampled_from([512, 4096, 1 << 20, 3 << 20, 17 << 20, 64 << 20, 300 << 20]),
                          st.integers(0, 2), st.integers(0, 10**6)), min_size=1, max_size=120)


def _program(ops, twin: bool, model: GpuWorkModel):
    dev = open_device(DEVICE)
    a = make_allocator(dev, "gpumem", engine="native", limit=1 << 30)
    out = []
    try:
        if twin:
            eng = a._engine
            eng.use_idle_twin(model)
            before, after, clock = eng.lag_before, eng.lag_after, lambda: eng.lag_stats()["now_s"]
        else:
            g = ModelGpu(dev, model)
            before, after, clock = g.before, g.after, lambda: dev.now_s
        live: list[int] = []
        for what, nbytes, stream, pick in ops:
            before()
            try:
                if what == "alloc":
                    p = a.allocate(nbytes, stream)
                    live.append(p)
                    after(stream, p, nbytes)
                elif what == "free" and live:
                    a.free(live.pop(pick % len(live)))
                elif what == "empty":
                    out.append(a.empty_cache())
                elif what == "sync":
                    a.synchronize()
            except OutOfMemoryError as exc:
                out.append(str(exc))
            out.append((clock(), a.reserved_nbytes, a.allocated_nbytes))
        return out, a.snapshot_stats()
    finally:
        a.close()
        dev.close()


@settings(max_examples=25, deadline=None)
@given(ops=_OPS)
def test_any_program_gets_the_simulators_clock_and_decisions(ops):
    model = GpuWorkModel(cpu_op_us=2.0, queue_depth=4, touch_factor=20.0)
    assert _program(ops, True, model) == _program(ops, False, model)


def test_a_range_known_mapped_is_forgotten_at_an_unmap():
    """Note [Ranges known mapped]: a launch within a range an earlier launch found mapped with access skips the walk
    over the mappings; an unmap forgets every such range, so a launch on memory unmapped since is still refused (a
    cache kept over the unmap would let it through)."""
    with _lagged() as (dev, a):
        eng = a._engine
        ptrs = [a.allocate(64 << 20, 0) for _ in range(3)]   # three blocks, each a run of pages of its own
        for p in ptrs:
            eng.lag_after(0, p, 4096)
        walks = eng.lag_stats()["mapping_walks"]
        for p in ptrs:   # all three known: no walk
            eng.lag_after(0, p + 8192, 4096)
        assert eng.lag_stats()["mapping_walks"] == walks
        a.synchronize()
        a.free(ptrs[1])
        assert a.empty_cache() > 0   # the middle block's pages unmapped
        from gpumem.errors import GpumemError
        with pytest.raises(GpumemError, match="not mapped with access"):
            eng.lag_after(0, ptrs[1], 4096)
        eng.lag_after(0, ptrs[0], 4096)   # still mapped: found again by a walk
        eng.lag_after(0, ptrs[2], 4096)
        assert eng.lag_stats()["mapping_walks"] == walks + 3   # the refused launch walked too


def test_a_long_queue_of_kernels_keeps_the_simulators_clock():
    """Note [The lag's queues a ring each]: hundreds of kernels queued at once on a stream and in the launch queue
    (the ring grown several times, pushed and popped while wrapped), the clock and decisions of ModelGpu."""
    model = GpuWorkModel(cpu_op_us=0.5, queue_depth=300, touch_factor=400.0)
    ops = [("alloc", (1 << 20) * (1 + k % 5), k % 2, k) for k in range(400)]
    ops[150:150] = [("free", 0, 0, k) for k in range(100)]
    ops[320:320] = [("sync", 0, 0, 0), ("empty", 0, 0, 0)]
    assert _program(ops, True, model) == _program(ops, False, model)
    with _lagged(model) as (dev, a):   # the queues do get long: most of 100 kernels still to run
        for k in range(100):
            a._engine.lag_after(0, a.allocate(1 << 20, 0), 1 << 20)
        assert a._engine.lag_stats()["pending"] > 64   # the ring (16 at first) grown twice at least
