"""Issue 22 point 5: the fast replay of generate() (one stream for every policy, decode steps made from a
template, the small pool skipped at a fixed point) gives the full replay's figures to the byte."""

import contextlib

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from gpumem.allocator import make_allocator
from gpumem.errors import InternalError, InvalidArgumentError
from gpumem.estimate import ModelShape, inference_trace
from gpumem.estimate.fastreplay import (AllStopped, NativeSkippingSink, PlainSink, SinkGroup, SkippingSink, StepJumper,
                                        build_template, can_skip_small_pool, make_sink)
from gpumem.estimate.fit import _replay, replay_inference
from gpumem.estimate.workload import stream_inference
from gpumem.specs import open_device

POLICIES = ("pytorch", "expandable", "gpumem", "bestfit", "cupy")
DEVICE = "sim:h200-141gb"


@contextlib.contextmanager
def fast_path_on(engine: str):
    """The fast path on the native engine (its default where built: Note [The fast path on the native engine]) or
    on the Python engine, where the small pool is skipped (Notes [Small pool skipped at a fixed point],
    [Expandable's small pool skipped])."""
    from gpumem.allocator import caching
    from gpumem.estimate import fit

    with pytest.MonkeyPatch.context() as mp:
        if engine == "python":
            mp.setattr(fit, "load_engine", lambda *a, **k: None)
            mp.setattr(caching, "NATIVE_BY_DEFAULT", False)
        yield


@st.composite
def shapes(draw):
    heads = draw(st.sampled_from([2, 4, 8]))
    head_dim = draw(st.sampled_from([16, 64, 128]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0]))
    window = draw(st.sampled_from([0, 0, 0, 40]))
    return ModelShape(heads * head_dim, draw(st.sampled_from([96, 344, 1024])), draw(st.integers(1, 3)),
                      draw(st.sampled_from([500, 1000, 32000])), heads, kv_heads, sliding_window=window)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes(), st.integers(1, 6), st.integers(1, 900), st.integers(0, 260), st.sampled_from([1, 2, 4]),
       st.lists(st.sampled_from(POLICIES), min_size=1, max_size=3, unique=True), st.sampled_from([None, 0.6, 0.9, 1.0]))
def test_fast_replay_gives_the_full_replays_figures_to_the_byte(shape, batch, prompt, new, dtype_bytes, policies,
                                                                 limit_share):
    peak = inference_trace(shape, dtype_bytes, batch_size=batch, prompt_len=prompt, new_tokens=new).peak_nbytes
    # a limit near the peak makes some replays run out of memory, in the prefill or in a decode step
    limit = None if limit_share is None else int(peak / limit_share) + 3 * 2**20
    kw = dict(batch_size=batch, prompt_len=prompt, new_tokens=new, limit=limit)
    fast = replay_inference(shape, dtype_bytes, policies, DEVICE, **kw)
    full = replay_inference(shape, dtype_bytes, policies, DEVICE, full_replay=True, **kw)
    assert_same_figures(fast, full)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 2), st.integers(500, 1500), st.integers(66, 200),
       st.lists(st.sampled_from(["pytorch", "expandable", "bestfit"]), min_size=1, max_size=3, unique=True),
       st.sampled_from([None, 0.8, 0.95, 1.0]), st.sampled_from([8, 4]), st.sampled_from(["python", "native"]))
def test_fast_replay_that_skips_gives_the_full_replays_figures_to_the_byte(batch, prompt, new, policies, limit_share,
                                                                          kv_heads, engine):
    """Shapes whose KV cache is in the large pool, so that the small pool is skipped (Notes [Small pool skipped at a
    fixed point], [Expandable's small pool skipped]) over more than one period of 64 steps, near the limit too."""
    shape = ModelShape(1024, 2048, 1, 1000, 8, kv_heads)
    peak = inference_trace(shape, 2, batch_size=batch, prompt_len=prompt, new_tokens=new).peak_nbytes
    limit = None if limit_share is None else int(peak / limit_share) + 3 * 2**20
    kw = dict(batch_size=batch, prompt_len=prompt, new_tokens=new, limit=limit)
    with fast_path_on(engine):
        fast = replay_inference(shape, 2, policies, DEVICE, **kw)
    full = replay_inference(shape, 2, policies, DEVICE, full_replay=True, **kw)
    assert_same_figures(fast, full)


def test_the_full_replay_is_the_full_traces_replay():
    s = ModelShape(128, 344, 2, 1000, 4, 2)
    w = inference_trace(s, 2, batch_size=2, prompt_len=40, new_tokens=150, full_decode=True)
    fast = replay_inference(s, 2, POLICIES, DEVICE, batch_size=2, prompt_len=40, new_tokens=150)
    for r in fast:
        ref = _replay(w, DEVICE, r.policy)
        assert (r.peak_reserved_bytes, r.fits, r.peak_allocated_bytes) == (ref.peak_reserved_bytes, ref.fits,
                                                                           w.peak_nbytes), r.policy


class _Recorder(PlainSink):
    """Records every op it is given, one by one (no allocator)."""

    def __init__(self):
        self.ops, self.error, self.ptrs = [], None, {}

    def alloc(self, op_id, nbytes):
        self.ops.append((0, op_id, nbytes))

    def free(self, op_id):
        self.ops.append((1, op_id))

    def end_step(self, step):
        pass

    def run_step(self, t, tpl):
        for k, i, n in zip(tpl.kinds.tolist(), tpl.op_ids(t).tolist(), tpl.sizes(t).tolist()):
            self.alloc(i, n) if k == 0 else self.free(i)


@pytest.mark.parametrize("shape", [ModelShape(128, 344, 2, 1000, 4, 4), ModelShape(256, 688, 3, 3000, 8, 2),
                                   ModelShape(256, 512, 2, 1000, 4, 2, n_experts=4, experts_per_token=2)])
def test_the_template_makes_the_emitters_ops(shape):
    made, ref = _Recorder(), _Recorder()
    jumper = StepJumper(SinkGroup([made]), lambda step: None, 99)
    stream_inference(shape, 2, (jumper,), batch_size=3, prompt_len=50, new_tokens=100, on_step=jumper.end_step,
                     jump=jumper.jump)
    stream_inference(shape, 2, (ref,), batch_size=3, prompt_len=50, new_tokens=100)
    assert jumper.template is not None
    assert made.ops == ref.ops


def test_no_template_from_steps_that_differ():
    assert build_template({}) is None
    records = {s: [(0, 10 * s, 100), (0, 10 * s + 1, 8 * s), (1, 10 * s - 10, 0)] for s in range(1, 5)}
    assert build_template(records) is not None
    records[4] = [(0, 40, 100), (1, 30, 0), (0, 41, 32)]  # another order
    assert build_template(records) is None
    records[4] = [(0, 40, 100), (0, 41, 40), (1, 30, 0)]  # not affine in the step (8, 16, 24, 40)
    assert build_template(records) is None


def assert_same_figures(fast, full):
    """The fast path's figures are the full path's, to the byte; its peak of blocks is the full path's or a bound
    above it by at most a step's small blocks (Note [The peak of blocks on the fast path]: up to 6.4 MiB seen)."""
    assert fast == full
    for f, g in zip(fast, full):
        assert g.peak_block_allocated_bytes is not None and f.peak_block_allocated_bytes is not None
        assert g.peak_block_allocated_bytes <= f.peak_block_allocated_bytes <= g.peak_block_allocated_bytes + 8 * 2**20


def _native_or_skip():
    from gpumem.native import load_engine

    if load_engine() is None:  # pragma: no cover - the engine is optional
        pytest.skip("the native engine (gpumem._engine) is not built")


def _stream(sinks, shape, last_step, **kw):
    """Stream ``generate()``'s ops to ``sinks`` with the decode steps from the template (as the fast path does)."""
    jumper = StepJumper(SinkGroup(sinks), lambda step: None, last_step)
    stream_inference(shape, 2, (jumper,), new_tokens=last_step + 1, on_step=jumper.end_step, jump=jumper.jump, **kw)
    for s in sinks:
        if hasattr(s, "finish"):
            s.finish()
    return jumper


@pytest.mark.parametrize("engine,policy", [("python", "pytorch"), ("python", "expandable"), ("native", "pytorch"),
                                           ("native", "expandable"), ("native", "bestfit")])
def test_the_small_pool_is_skipped_and_the_figures_stay(engine, policy):
    """Notes [Small pool skipped at a fixed point], [Expandable's small pool skipped] and [The small pool skipped on
    the native engine]: the sink skips on either engine; the allocator that takes every op runs on the Python
    engine."""
    if engine == "native":
        _native_or_skip()
    shape = ModelShape(1024, 2048, 1, 1000, 8, 8)  # KV cache tensors of over 1 MiB: in the large pool
    devs = [open_device(DEVICE), open_device(DEVICE)]
    try:
        skipping, every = make_allocator(devs[0], policy, engine=engine), make_allocator(devs[1], policy,
                                                                                       engine="python")
        assert can_skip_small_pool(skipping) and not can_skip_small_pool(make_allocator(devs[0], "gpumem"))
        sinks = [make_sink(skipping), PlainSink(every)]
        assert type(sinks[0]) is (NativeSkippingSink if engine == "native" else SkippingSink)
        _stream(sinks, shape, 299, prompt_len=600)
        assert sinks[0].skipped_ops > 10_000 and sinks[1].skipped_ops == 0
        # from the first period on, steps are skipped whole, not op by op; at batch 1 the ids and mask round to a
        # new 512 B every 64 steps: the skip ends there and starts again
        assert sinks[0].skipped_steps > 250
        if engine == "native":
            assert sinks[0].skips_started >= 4 and sinks[0].limit_stops == 0
        assert not any(s.voided or s.needs_prefix_trace or s.error for s in sinks)
        # the same peak, and the same blocks left (the weights...) at the same addresses: nothing skipped stays
        assert skipping.snapshot_stats().peak_reserved_nbytes == every.snapshot_stats().peak_reserved_nbytes
        assert sorted(skipping.live_blocks()) == sorted(every.live_blocks())
        assert skipping.stats.allocated_nbytes == every.stats.allocated_nbytes
        # Note [The peak of blocks on the fast path]: the skipping sink's peak of blocks is a bound at or above the
        # one of the sink that sent every op, and that one is exact
        exact = every.snapshot_stats().peak_allocated_nbytes
        assert sinks[1].small_skip_bound_nbytes == 0 and sinks[1].peak_block_allocated_nbytes() == exact
        assert 0 < sinks[0].small_skip_bound_nbytes < 2**20
        assert exact <= sinks[0].peak_block_allocated_nbytes() <= exact + sinks[0].small_skip_bound_nbytes
    finally:
        for d in devs:
            d.close()


@pytest.mark.parametrize("policy,layers,batch,new,margin_mib,stops", [
    ("pytorch", 2, 1, 1500, -12, True), ("pytorch", 2, 1, 1500, -1, True), ("pytorch", 1, 1, 1500, 40, False),
    ("bestfit", 1, 2, 1200, -3, False), ("expandable", 1, 2, 1200, 20, True), ("expandable", 1, 1, 1500, 5, True)])
def test_a_native_skip_near_the_limit_ends_before_an_allocation_that_could_grow_past_it(policy, layers, batch, new,
                                                                                         margin_mib, stops):
    """Note [The small pool skipped on the native engine]: a skipped step's large ops go in one call that stops
    before each allocation the cache does not serve; one that could grow past the limit ends the skip there, the
    rest of the step sent whole (``stops``). Here the KV cache, in the large pool, brings the reserved bytes near
    the limit during the decode, after the skip ran; the figures are the full replay's, also where the limit is
    under the peak without it (an out-of-memory retry, and then an error or not)."""
    _native_or_skip()
    shape = ModelShape(1024, 2048, layers, 1000, 8, 8)
    kw = dict(batch_size=batch, prompt_len=50, new_tokens=new)
    peak = replay_inference(shape, 2, (policy,), DEVICE, **kw)[0].peak_reserved_bytes
    limit = peak + margin_mib * 2**20
    devs = [open_device(DEVICE), open_device(DEVICE)]
    try:
        skipping = make_allocator(devs[0], policy, engine="native", limit=limit)
        every = make_allocator(devs[1], policy, engine="python", limit=limit)
        sinks = [make_sink(skipping), PlainSink(every)]
        assert isinstance(sinks[0], NativeSkippingSink)
        with contextlib.suppress(AllStopped):
            _stream(sinks, shape, new - 1, batch_size=batch, prompt_len=50)
        assert sinks[0].skipped_steps > 100
        assert (sinks[0].limit_stops > 0) == stops and not sinks[0].voided
        assert str(sinks[0].error) == str(sinks[1].error) and sinks[0].error_step == sinks[1].error_step
        assert skipping.snapshot_stats().peak_reserved_nbytes == every.snapshot_stats().peak_reserved_nbytes
    finally:
        for d in devs:
            d.close()
    assert replay_inference(shape, 2, (policy,), DEVICE, limit=limit, **kw) == \
        replay_inference(shape, 2, (policy,), DEVICE, limit=limit, full_replay=True, **kw)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([(1024, 8, 8), (1024, 8, 4), (2048, 16, 8), (2048, 16, 16)]), st.integers(1, 3),
       st.integers(1, 3), st.integers(300, 1500), st.integers(66, 400), st.sampled_from(["pytorch", "expandable",
                                                                                      "bestfit"]),
       st.sampled_from([None, None, 0.8, 1.0, 1.05, 1.1]))
def test_the_native_skip_leaves_the_figures_of_every_op_sent(dims, layers, batch, prompt, new, policy, limit_share):
    """Note [The small pool skipped on the native engine] on random shapes whose KV cache reaches the large pool,
    batches 1 to 3 (the small requests change every 64, 32 or 21 steps; a KV cache may pass from the small pool to
    the large one on the way), lengths and limits near the peak: the
    skipping sink ends with the peak, the error (and its step), the live blocks and the allocated bytes of an
    allocator on the Python engine that took every op."""
    _native_or_skip()
    hidden, heads, kv_heads = dims
    shape = ModelShape(hidden, 2 * hidden, layers, 1000, heads, kv_heads)
    peak = inference_trace(shape, 2, batch_size=batch, prompt_len=prompt, new_tokens=new).peak_nbytes
    limit = None if limit_share is None else int(peak / limit_share) + 3 * 2**20
    devs = [open_device(DEVICE), open_device(DEVICE)]
    try:
        skipping = make_allocator(devs[0], policy, engine="native", limit=limit)
        every = make_allocator(devs[1], policy, engine="python", limit=limit)
        sinks = [make_sink(skipping), PlainSink(every)]
        with contextlib.suppress(AllStopped):
            _stream(sinks, shape, new - 1, batch_size=batch, prompt_len=prompt)
        s = sinks[0]
        event("skipped" if s.skipped_steps else "not skipped")
        event("ended or kept off by the limit" if s.limit_stops else "limit never in the way")
        assert not s.voided
        assert str(s.error) == str(sinks[1].error) and s.error_step == sinks[1].error_step
        assert skipping.snapshot_stats().peak_reserved_nbytes == every.snapshot_stats().peak_reserved_nbytes
        if s.error is None:
            assert sorted(skipping.live_blocks()) == sorted(every.live_blocks())
            assert skipping.stats.allocated_nbytes == every.stats.allocated_nbytes
    finally:
        for d in devs:
            d.close()


@pytest.mark.parametrize("policy", ["pytorch", "expandable"])
def test_a_wrong_template_address_is_caught_when_the_skipped_ops_are_sent(policy):
    """The check that makes a wrong skip loud: the small ops skipped are sent when the skip ends, each where the
    period's step put it; a period whose addresses were wrong raises InternalError there."""
    _native_or_skip()

    class Wrong(NativeSkippingSink):
        def _try_template(self):
            super()._try_template()
            if self._skipping:  # a period whose last small allocation is said to have landed elsewhere
                for x in self._period:
                    x.addrs = x.addrs.copy()
                    x.addrs[-1] += 512

    shape = ModelShape(1024, 2048, 1, 1000, 8, 8)
    dev = open_device(DEVICE)
    try:
        sink = Wrong(make_allocator(dev, policy, engine="native"))
        with pytest.raises(InternalError, match="template"):
            _stream([sink], shape, 299, prompt_len=600)
        assert sink.skipped_steps > 0
    finally:
        dev.close()


@pytest.mark.parametrize("policy", ["pytorch", "expandable", "bestfit"])
def test_the_native_small_pool_state_changes_with_small_ops_only(policy):
    """``small_pool_state`` (Note [The small pool's state as bytes] in ``gpumem/_native/engine.cpp``): large ops
    leave it as it was, a small allocation changes it, and the same small allocation and free made again from the
    state they left leave it as they found it (a fixed point: the block at the same address)."""
    _native_or_skip()
    dev = open_device(DEVICE)
    try:
        a = make_allocator(dev, policy, engine="native")
        state = a._engine._ext.small_pool_state
        keep = [a.allocate(n, 0) for n in (512, 4096, 1000)]
        s0 = state()
        big = a.allocate(50 * 2**20, 0)
        assert state() == s0
        p = a.allocate(3000, 0)
        s1 = state()
        assert s1 != s0
        a.free(big)
        assert state() == s1
        a.free(p)
        s2 = state()
        q = a.allocate(3000, 0)
        assert state() == s1 and q == p
        a.free(q)
        assert state() == s2
        assert len(keep) == 3
    finally:
        dev.close()


@pytest.mark.parametrize("batch,prompt,new,limit_mib", [(1, 600, 300, None), (1, 900, 200, 160), (2, 700, 150, 300)])
def test_expandable_on_the_native_engine_gives_the_python_engines_figures(monkeypatch, batch, prompt, new, limit_mib):
    """``expandable`` runs natively by default (every op sent); on the Python engine its small pool is skipped
    (Note [Expandable's small pool skipped]): the same estimate to the byte, also under a limit."""
    from gpumem.allocator import caching

    shape = ModelShape(1024, 2048, 1, 1000, 8, 8)
    kw = dict(batch_size=batch, prompt_len=prompt, new_tokens=new, limit=limit_mib and limit_mib * 2**20)
    native = replay_inference(shape, 2, ("expandable",), DEVICE, **kw)
    monkeypatch.setattr(caching, "NATIVE_BY_DEFAULT", False)
    assert replay_inference(shape, 2, ("expandable",), DEVICE, **kw) == native


def test_full_replay_must_be_a_bool():
    with pytest.raises(InvalidArgumentError, match="full_replay"):
        replay_inference(ModelShape(128, 344, 1, 1000, 4, 4), 2, ("pytorch",), DEVICE, prompt_len=8,
                         full_replay="yes")


@pytest.mark.parametrize("batch,prompt,new,limit_mib", [(1, 600, 300, None), (1, 600, 300, 200), (1, 900, 200, 160),
                                                        (2, 700, 150, None), (1, 2000, 260, 300)])
@pytest.mark.parametrize("engine", ["python", "native"])
def test_fast_replay_that_skips_matches_the_full_one(batch, prompt, new, limit_mib, engine):
    shape = ModelShape(1024, 2048, 1, 1000, 8, 8)  # the small pool is skipped here on the Python engine (test above)
    kw = dict(batch_size=batch, prompt_len=prompt, new_tokens=new, limit=limit_mib and limit_mib * 2**20)
    with fast_path_on(engine):
        fast = replay_inference(shape, 2, POLICIES, DEVICE, **kw)
    full = replay_inference(shape, 2, POLICIES, DEVICE, full_replay=True, **kw)
    assert_same_figures(fast, full)


@pytest.mark.parametrize("kw", [dict(policy="pytorch", new_tokens=120, prompt_len=600),
                                dict(policy="gpumem", new_tokens=40, prompt_len=300),
                                dict(policy="bestfit", new_tokens=30, prompt_len=200),
                                dict(policy="pytorch", search="seq_len", batch_size=3, new_tokens=50),
                                dict(policy="pytorch", training=True, prompt_len=64)])
def test_fit_with_shared_probes_and_fast_replays_answers_as_the_full_one(kw):
    from gpumem.estimate import find_max_batch
    shape = ModelShape(1024, 2048, 1, 1000, 8, 8)
    args = dict(device="sim:t4-16gb", max_value=512, **kw)
    assert find_max_batch(shape, 2, **args) == find_max_batch(shape, 2, full_replay=True, **args)


@pytest.mark.parametrize("shape,batch,prompt", [(ModelShape(128, 344, 2, 1000, 4, 2), 2, 40),
                                                (ModelShape(256, 512, 2, 1000, 4, 2, n_experts=4, experts_per_token=2),
                                                 1, 7),
                                                (ModelShape(256, 512, 2, 1000, 4, 2, sliding_window=5), 3, 9)])
def test_the_prefix_trace_makes_the_streams_ops_up_to_the_step_before_prefix_step(shape, batch, prompt):
    """Note [Stopped where the prefix trace stops too]: the ops the trace and the stream share."""
    from gpumem.estimate.fastreplay import PREFIX_STEP

    class Ops(PlainSink):
        def __init__(self):
            self.ops, self.order, self.ends = [], {}, {}

        def alloc(self, op_id, nbytes):
            self.order[op_id] = len(self.order)
            self.ops.append((0, nbytes))

        def free(self, op_id):
            self.ops.append((1, self.order[op_id]))

        def end_step(self, step):
            self.ends[step] = len(self.ops)

    got = Ops()
    stream_inference(shape, 2, (got,), batch_size=batch, prompt_len=prompt, new_tokens=40, on_step=got.end_step)
    tr = inference_trace(shape, 2, batch_size=batch, prompt_len=prompt, new_tokens=PREFIX_STEP).trace
    order, ops = {}, []
    for k, n, a in zip(tr.kinds.tolist(), tr.nbytes.tolist(), tr.alloc_ids.tolist()):
        if k == 0:
            order[a] = len(order)
            ops.append((0, n))
        else:
            ops.append((1, order[a]))
    end = got.ends[PREFIX_STEP - 1]
    assert ops[:end] == got.ops[:end]


def test_a_stream_stopped_in_the_prefill_is_kept_and_matches_the_full_path():
    from gpumem.estimate.fit import _stream_policies
    from gpumem.progress import NoProgress
    shape = ModelShape(1024, 2048, 1, 1000, 8, 8)
    kw = dict(batch_size=4, prompt_len=2000, new_tokens=50, weight_format=None, workspace_nbytes=0)
    peak = inference_trace(shape, 2, batch_size=4, prompt_len=2000, new_tokens=50).peak_nbytes
    limit = peak // 2  # the prefill alone needs more
    got = _stream_policies(shape, 2, list(POLICIES), DEVICE, limit, peak, NoProgress(), False, kw)
    assert all(r is not None and not r.fits for r in got)  # none voided
    full = replay_inference(shape, 2, POLICIES, DEVICE, full_replay=True, limit=limit,
                            **{k: kw[k] for k in ("batch_size", "prompt_len", "new_tokens")})
    assert got == full


def test_a_plain_sink_over_the_native_engine_sends_template_steps_in_one_call_with_the_loops_figures():
    """Note [A step's ops in one call] (``gpumem/_native/op_table.h``): a :class:`PlainSink` over the native engine
    sends each step made from the template through ``run_ops``; the same sink with its Python loop ends with the
    same stats, live blocks, pointers and error, also when it runs out of memory in the middle of a step."""
    from gpumem.estimate.fastreplay import AllStopped, native_run_ops
    from gpumem.native import load_engine

    if load_engine() is None:  # pragma: no cover - the engine is optional
        pytest.skip("the native engine (gpumem._engine) is not built")
    shape = ModelShape(256, 344, 2, 500, 4, 4)  # batch 8, a 10-token prompt: the decode steps make the peak

    def run(limit):
        devs = [open_device(DEVICE), open_device(DEVICE)]
        allocs = [make_allocator(d, "gpumem", limit=limit) for d in devs]
        batched, looped = PlainSink(allocs[0]), PlainSink(allocs[1])
        assert native_run_ops(allocs[0]) is not None and batched._run_ops_native is not None
        looped._run_ops_native, looped.ptrs = None, {}  # the Python loop
        jumper = StepJumper(SinkGroup([batched, looped]), lambda step: None, 299)
        try:
            stream_inference(shape, 2, (jumper,), batch_size=8, prompt_len=10, new_tokens=300,
                             on_step=jumper.end_step, jump=jumper.jump)
        except AllStopped:
            pass
        assert jumper.template is not None or 0 <= batched.error_step <= 4
        assert type(batched.error) is type(looped.error) and str(batched.error) == str(looped.error)
        assert (batched.error_step, batched.early_trouble, batched.needs_prefix_trace) == \
            (looped.error_step, looped.early_trouble, looped.needs_prefix_trace)
        assert allocs[0].snapshot_stats() == allocs[1].snapshot_stats()
        assert sorted(allocs[0].live_blocks()) == sorted(allocs[1].live_blocks())
        assert sorted(batched.ptrs.items()) == sorted(looped.ptrs.items())
        for d in devs:
            d.close()
        return batched, allocs[0].snapshot_stats().peak_reserved_nbytes

    full, peak = run(None)
    assert full.error is None
    steps = [run(int(peak * share))[0].error_step for share in (0.8, 0.9, 0.5)]
    assert any(s > 4 for s in steps), steps  # one ran out of memory in a step made from the template
    assert all(s != -1 for s in steps[::2])
    assert isinstance(full.ptrs, load_engine().PtrTable)


def test_the_fast_path_runs_caching_policies_on_the_native_engine_and_the_python_one_without_it(monkeypatch):
    """Note [The fast path on the native engine]: ``engine="native"`` for every caching policy where the engine is
    built, the default engine where it is not; the small pool skipped on either (Notes [Small pool skipped at a
    fixed point], [The small pool skipped on the native engine]), but under ``gpumem``."""
    from gpumem.estimate import fit
    from gpumem.native import load_engine

    if load_engine() is None:
        pytest.skip("the native engine is not built")
    made = []
    real = fit._replay_allocator
    monkeypatch.setattr(fit, "_replay_allocator", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    shape = ModelShape(1024, 2048, 1, 1000, 8, 8)
    replay_inference(shape, 2, ("pytorch", "expandable", "gpumem", "bucket"), DEVICE, prompt_len=300, new_tokens=20)
    # made in one stream; gpumem's sink sends every op (Note [The GPU's lag in the decode replay])
    by = {"bucket" if type(a).__name__ == "BucketAllocator" else a.policy.name: a for a in made}
    assert sorted(by) == ["bucket", "expandable", "gpumem", "pytorch"] and len(made) == 4
    caching = [by[p] for p in ("pytorch", "expandable", "gpumem")]
    assert [a.engine for a in caching] == ["native", "native", "native"]
    assert [can_skip_small_pool(a) for a in caching] == [True, True, False]
    made.clear()
    with fast_path_on("python"):
        replay_inference(shape, 2, ("pytorch", "expandable"), DEVICE, prompt_len=300, new_tokens=20)
    assert [a.engine for a in made] == ["python", "python"] and all(can_skip_small_pool(a) for a in made)
