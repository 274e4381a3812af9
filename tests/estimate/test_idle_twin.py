"""The idle device twin (Note [An idle device's bookkeeping calls made here] in gpumem/_native/pybackend.cpp): the
native engine makes an idle simulated device's map, access, unmap and event calls in C++, with the same results
as the device's own methods, call for call."""

import contextlib
import dataclasses

import pytest

from gpumem.allocator import make_allocator
from gpumem.allocator.policy import get_policy
from gpumem.errors import DeviceClosedError, InvalidArgumentError, UnsupportedOperationError
from gpumem.estimate import ModelShape
from gpumem.estimate.fit import _replay_allocator, replay_inference
from gpumem.native import load_engine
from gpumem.sim import FaultPlan, SimDevice
from gpumem.sim.pressure import Step
from gpumem.specs import open_device

pytestmark = pytest.mark.skipif(load_engine() is None, reason="the native engine is not built")

DEVICE = "sim:h200-141gb"
#: Llama-7B's shape, whose long decode moves pages every step under the gpumem policy from about step 3,300 after a
#: 2,048-token prompt (reports/estimate-speed.md).
LLAMA_7B = ModelShape(4096, 11008, 32, 32000, 32, 32)
#: A small one, for the errors.
SMALL = ModelShape(1024, 2816, 8, 32000, 16, 16)
#: The gpumem policy with no page slack: the ring below moves pages every step from about step 400
#: (``python -m sim.decode_calls --ring 8 --weights-mib 256 ...``), thousands of map, unmap and event calls.
TIGHT = dataclasses.replace(get_policy("gpumem"), page_slack=0.0, page_slack_min_nbytes=0)


def _ring(allocator, steps: int = 600, blocks: int = 8, prompt: int = 512, token_nbytes: int = 4096) -> list[str]:
    """The KV cache's pattern (sim.decode_calls.ring_run): blocks grown by torch.cat every step beside 256 MiB of
    weights; the device's books checked against the engine's now and then. Returns the problems found."""
    problems: list[str] = []
    allocator.allocate(256 << 20, 0)
    cache = [allocator.allocate(prompt * token_nbytes, 0) for _ in range(blocks)]
    for t in range(1, steps + 1):
        for i in range(blocks):
            x = allocator.allocate(4096, 0)
            new = allocator.allocate((prompt + t) * token_nbytes, 0)
            allocator.free(cache[i])
            cache[i] = new
            allocator.free(x)
        if t % 97 == 0:
            problems += allocator._engine.consistency_problems()
    return problems + allocator._engine.consistency_problems()


def _run(policy, twin: bool):
    dev = open_device(DEVICE)
    a = make_allocator(dev, policy, engine="native")
    try:
        if twin:
            a._engine.use_idle_twin()
        problems = _ring(a)
        return dataclasses.asdict(a.snapshot_stats()), problems, dict(dev.stats.calls)
    finally:
        a.close()
        dev.close()


@pytest.mark.parametrize("policy", [TIGHT, "gpumem", "expandable"], ids=["tight", "gpumem", "expandable"])
def test_same_decisions_and_calls_as_the_device(policy):
    on, problems_on, dev_calls_on = _run(policy, twin=True)
    off, problems_off, dev_calls_off = _run(policy, twin=False)
    assert problems_on == [] and problems_off == []
    assert on == off  # every counter: device and event calls, steals, peaks
    if policy is TIGHT:  # pages moved every step: the twin made those calls itself, the device saw none
        assert dev_calls_off.get("mem_map", 0) > 1000 and dev_calls_off.get("event_record", 0) > 1000
    for call in ("mem_map", "mem_unmap", "mem_set_access", "event_record", "event_query", "event_destroy"):
        assert dev_calls_on.get(call, 0) == 0
    for call in ("mem_create", "mem_release", "address_reserve"):
        assert dev_calls_on.get(call, 0) == dev_calls_off.get(call, 0)


def test_estimate_the_same_with_and_without_the_twin(monkeypatch):
    # pytorch and expandable on the idle twin; gpumem on the twin with the GPU's lag, which without the twin runs in
    # SimPy (ModelGpu: Note [The GPU's lag in the decode replay]), so its decode is shorter here
    runs = [(("pytorch", "expandable"), dict(prompt_len=2048, new_tokens=4000)),
            (("gpumem",), dict(prompt_len=2048, new_tokens=400, batch_size=4))]
    with_twin = [replay_inference(LLAMA_7B, 2, pols, DEVICE, **kw) for pols, kw in runs]
    monkeypatch.setattr(SimDevice, "runs_alone", lambda self: False)
    without = [replay_inference(LLAMA_7B, 2, pols, DEVICE, **kw) for pols, kw in runs]
    assert with_twin == without


def test_out_of_memory_is_the_same(monkeypatch):
    # a limit the decode outgrows: the estimate stops at the same error, with the same message
    def estimate():
        return replay_inference(SMALL, 2, ("gpumem", "expandable"), DEVICE, prompt_len=1024, new_tokens=300,
                                limit=400 * 2**20)
    on = estimate()
    monkeypatch.setattr(SimDevice, "runs_alone", lambda self: False)
    off = estimate()
    assert on == off and not any(r.fits for r in on) and on[0].oom_message


def test_the_twin_only_on_devices_the_estimate_opened():
    dev = open_device(DEVICE)
    try:
        a = _replay_allocator(dev, "gpumem", None, fast=True, own=False)
        try:
            assert a._engine._ext.twin_mapping_ranges() is None
        finally:
            a.close()
        a = _replay_allocator(dev, "gpumem", None, fast=True, own=True)
        try:
            assert a._engine._ext.twin_mapping_ranges() == []
            p = a.allocate(64 << 20, 0)
            maps = a._engine._ext.twin_mapping_ranges()
            assert any(va <= p < va + n for va, n, _ in maps)
            assert dev.mapping_ranges() == []  # the device keeps none of them: the twin does
            a.free(p)
            a.check_consistency()
        finally:
            a.close()
    finally:
        dev.close()


def _device(**kw) -> SimDevice:
    return open_device(DEVICE, **kw)


@contextlib.contextmanager
def _allocator(policy="gpumem", dev=None):
    """A native-engine allocator on ``dev`` (a fresh device when None); both closed at the end."""
    own = dev is None
    dev = _device() if own else dev
    a = make_allocator(dev, policy, engine="native")
    try:
        yield dev, a
    finally:
        a.close()
        if own:
            dev.close()


@pytest.mark.parametrize("make, why", [
    (lambda: _device(pressure=Step(1 << 30)), "a tenant"),
    (lambda: _device(faults=FaultPlan(fail_calls={"event_destroy": frozenset({10**6})})), "faults per call"),
    (lambda: _device(faults=FaultPlan(device_lost_at_s=10.0)), "a planned loss"),
])
def test_refused_where_something_else_can_happen(make, why):
    with _allocator(dev=make()) as (dev, a):
        assert not dev.runs_alone(), why
        with pytest.raises(UnsupportedOperationError, match="idle device twin"):
            a._engine.use_idle_twin()
        assert a._engine._ext.twin_mapping_ranges() is None  # nothing changed
        a.free(a.allocate(8 << 20, 0))
        a.check_consistency()
    dev.close()


def test_runs_alone_follows_the_device():
    dev = _device()
    assert dev.runs_alone()
    dev.env  # handed out: code may now schedule on the device's clock
    assert not dev.runs_alone()
    dev.close()
    assert not dev.runs_alone()
    dev = _device()
    dev.launch(0, 1.0)
    assert not dev.runs_alone()  # work queued
    dev.synchronize()
    assert dev.runs_alone()
    dev.close()


def test_refused_once_the_engine_holds_memory():
    with _allocator() as (dev, a):
        p = a.allocate(8 << 20, 0)
        with pytest.raises(InvalidArgumentError, match="holds no chunk"):
            a._engine.use_idle_twin()
        assert dev.runs_alone()  # nothing attached
        assert a._engine._ext.twin_mapping_ranges() is None
        a.free(p)
        a.check_consistency()


def test_refused_on_segment_mode():
    with _allocator("pytorch") as (_, a):
        with pytest.raises(UnsupportedOperationError):
            a._engine.use_idle_twin()


def test_the_device_refuses_what_needs_its_books_while_a_twin_keeps_them():
    dev = _device()
    a = make_allocator(dev, "gpumem", engine="native")
    a._engine.use_idle_twin()
    p = a.allocate(8 << 20, 0)
    assert not dev.runs_alone()
    with _allocator(dev=dev) as (_, second), pytest.raises(UnsupportedOperationError, match="idle device twin"):
        second._engine.use_idle_twin()  # a second twin, too
    for call in (lambda: dev.write(p, b"x"), lambda: dev.read(p, 1), lambda: dev.launch(0, 1e-3, [(p, 4096)]),
                 lambda: dev.add_tenant(Step(1 << 20)), lambda: dev.env):
        with pytest.raises(UnsupportedOperationError, match="idle device twin keeps"):
            call()
    a.free(p)
    a.close()
    assert dev.runs_alone()  # detached at close: the device is whole again
    q = dev.malloc(4096)
    dev.write(q, b"x")
    dev.close()


@pytest.mark.parametrize("twin", [True, False])
def test_a_closed_device_refuses_as_without_the_twin(twin):
    # the attack's finding: with the twin on, a free that needs an event succeeded on a closed device
    dev = _device()
    a = make_allocator(dev, "gpumem", engine="native")
    if twin:
        a._engine.use_idle_twin()
    p = a.allocate(8 << 20, 0)
    q = a.allocate(8 << 20, 0)
    a.record_stream(p, 1)
    a.free(q)  # cached: its pages hold a fence for later
    before = a.snapshot_stats()
    dev.close()
    with pytest.raises(DeviceClosedError, match="is closed"):
        a.free(p)
    with pytest.raises(DeviceClosedError):
        a.allocate(64 << 20, 0)
    assert a.snapshot_stats().allocated_nbytes == before.allocated_nbytes
    a.close()


def test_use_idle_twin_twice_and_after_close():
    dev = _device()
    a = make_allocator(dev, "gpumem", engine="native")
    a._engine.use_idle_twin()
    with pytest.raises(InvalidArgumentError, match="on already"):
        a._engine._ext.use_idle_twin()
    with pytest.raises(TypeError):
        a._engine._ext.use_idle_twin(4096)  # the granularity is the device's, read by the twin itself
    a.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        a._engine.use_idle_twin()
    dev.close()
