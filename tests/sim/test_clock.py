"""The lazy device clock (Note [A lazy clock over SimPy] in gpumem.sim.clock) gives the same event
order and times as moving SimPy at every call, to the last bit."""

from __future__ import annotations

import pytest
import simpy
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpumem.sim import SimDevice, get_profile
from gpumem.sim.clock import SimClock
from gpumem.sim.pressure import PeriodicSpikes, RandomArrivals, Scenario, Step


class _OldClock:
    """The oracle: what the simulated device did before the lazy clock, writing SimPy's private clock
    on quiet stretches (so SimPy is at the device's time after every call)."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env

    @property
    def now(self) -> float:
        return self.env.now

    def advance(self, seconds: float) -> None:
        env = self.env
        until_s = env.now + seconds
        if until_s <= env.now:
            return
        if env.peek() > until_s:
            env._now = until_s  # noqa: SLF001 - the old code under comparison did exactly this
        else:
            env.run(until=until_s)

    def process(self, generator):
        return self.env.process(generator)

    def wait(self, event):
        self.env.run(until=event)


_DURATIONS = st.one_of(
    st.floats(min_value=0.0, max_value=10.0, allow_nan=False),
    st.sampled_from([0.0, 1e-6, 3.2e-6, 2.0 ** -53, 2.0 ** -52, 0.1, 0.3, 0.5, 1.0]),
)
_OPS = st.lists(st.one_of(
    st.tuples(st.just("advance"), _DURATIONS),
    st.tuples(st.just("spawn"), st.lists(_DURATIONS, min_size=1, max_size=4)),
    st.tuples(st.just("wait"), st.integers(min_value=0, max_value=7)),
), max_size=40)
_STARTS = st.sampled_from([0, 0.0, 0.25, 2.0 ** -53, 1e-9, 3.0, -1.0])


def _play(make_clock, start, ops) -> list[tuple]:
    """Run ``ops`` on a fresh environment through the clock ``make_clock(env)`` returns; the log holds
    every process wake-up (process, step, time) and the clock's time after every operation."""
    env = simpy.Environment(initial_time=start)
    clock = make_clock(env)
    log: list[tuple] = []
    procs: list[simpy.Process] = []

    def proc(pid: int, delays: list[float]):
        log.append(("start", pid, env.now))
        for step, delay in enumerate(delays):
            yield env.timeout(delay)
            log.append(("wake", pid, step, env.now))
            if step == 1:  # a process that schedules another one while SimPy runs
                env.process(proc(1000 + pid, [delay]))

    for op, arg in ops:
        if op == "advance":
            clock.advance(arg)
        elif op == "spawn":
            procs.append(clock.process(proc(len(procs), arg)))
        elif procs:
            target = procs[arg % len(procs)]
            if not target.processed:
                clock.wait(target)
        log.append(("now", op, clock.now))
    return log


def _lazy(env):
    return SimClock(env, lazy=True)


def _eager(env):
    return SimClock(env, lazy=False)


@settings(max_examples=300, deadline=None)
@given(_STARTS, _OPS)
@example(2.0 ** -53, [("advance", 1.0 + 2.0 ** -52 - 2.0 ** -53), ("spawn", [1.0])])
@example(0.0, [("advance", 0.1), ("spawn", [0.2]), ("advance", 0.3), ("advance", 0.1)])
def test_lazy_and_eager_clocks_give_the_old_event_order_and_times(start, ops):
    old = _play(_OldClock, start, ops)
    assert _play(_lazy, start, ops) == old
    assert _play(_eager, start, ops) == old


def test_the_hand_over_lands_exactly_where_run_until_would_not():
    start, now_s = 2.0 ** -53, 1.0 + 2.0 ** -52
    assert start + (now_s - start) != now_s  # SimPy's run(until=now_s) from start stops beside it
    env = simpy.Environment(initial_time=start)
    clock = SimClock(env, lazy=True)
    clock.now_s = now_s  # the device's time after a quiet stretch, SimPy still at its start
    assert clock.sync() is env and env.now == now_s


def test_a_lazy_clock_runs_simpy_only_when_an_event_is_due():
    env = simpy.Environment()
    clock = SimClock(env, lazy=True)
    woke: list[float] = []

    def sleeper():
        yield env.timeout(1.0)
        woke.append(env.now)

    clock.advance(0.25)
    assert (env.now, clock.now) == (0, 0.25)  # nothing scheduled: SimPy stays behind
    clock.process(sleeper())  # hands the time over first: the process starts at 0.25
    assert (env.now, woke) == (0.25, [])
    clock.advance(0.5)  # the start is due: SimPy steps it, and the sleeper waits for 1.25
    assert (env.now, clock.now, woke) == (0.25, 0.75, [])
    clock.advance(0.75)
    assert (env.now, clock.now, woke) == (1.25, 1.5, [1.25])
    clock.advance(1.0)
    assert (env.now, clock.now) == (1.25, 2.5)


def _device_trace(env: simpy.Environment | None) -> tuple:
    """A device with tenants, streams and waits; what it published and when."""
    dev = SimDevice(get_profile("t4-16gb"), env=env, seed=7, sanitizer="count",
                    pressure=[PeriodicSpikes(nbytes=2 ** 30, period_s=0.003, spike_s=0.001),
                              RandomArrivals(rate_per_s=500.0, mean_hold_s=0.002, min_nbytes=2 ** 20, max_nbytes=2 ** 28)])
    seen: list[tuple] = []
    dev.events.subscribe(lambda e: seen.append((e.kind, e.time_s, e.nbytes, e.free_nbytes)))
    ptrs = []
    for i in range(300):
        ptrs.append(dev.malloc((i % 7 + 1) * 2 ** 20))
        if i % 5 == 0:
            dev.launch(i % 3, 0.0007 * (i % 4), [(ptrs[-1], 1024)])
        if i % 11 == 0:
            dev.event_synchronize(dev.event_record(i % 3))
        if i % 3 == 0:
            dev.free(ptrs.pop(0))
        seen.append(("now", dev.now_s))
    dev.synchronize()
    return tuple(seen), dev.now_s, dev.stats.busy_us, len(dev.hazards)


def test_a_device_on_its_own_environment_matches_one_on_a_given_environment():
    # own environment: a lazy clock; a given one: eager (it may be shared)
    assert _device_trace(None) == _device_trace(simpy.Environment())


def test_the_environment_a_device_hands_out_is_at_the_devices_time():
    dev = SimDevice(get_profile("t4-16gb"))
    dev.advance(0.5)
    dev.malloc(2 ** 20)
    env = dev.env  # SimPy lagged behind on the quiet stretch: taking it hands the time over
    assert env.now == dev.now_s > 0.5
    woke: list[float] = []

    def sleeper():
        yield env.timeout(0.25)
        woke.append(env.now)

    start_s = dev.now_s
    env.process(sleeper())  # the caller schedules into SimPy directly: the clock is eager from now on
    dev.malloc(2 ** 20)
    dev.advance(0.3)
    assert woke == [start_s + 0.25] and env.now == dev.now_s
    env.run(until=dev.now_s + 1.0)  # and the caller may run SimPy itself: the device goes on from there
    ran_to_s = env.now
    dev.malloc(2 ** 20)
    assert dev.now_s > ran_to_s and env.now == dev.now_s


def test_a_call_made_while_another_device_runs_the_shared_clock_takes_its_time():
    # found by the soak: a subscriber reacting to device b's tenant calls b while device a's call runs the
    # shared environment; the old device's nested env.run stopped at a's stop event, cutting b's call short
    env = simpy.Environment()
    a = SimDevice(get_profile("t4-16gb"), env=env)
    b = SimDevice(get_profile("t4-16gb"), env=env, pressure=Step(nbytes=2 ** 30, at_s=0.001))
    spans: list[tuple[float, float]] = []

    def on_event(event) -> None:
        start_s = b.now_s
        b.mem_info()  # dearer than a's event_record below
        spans.append((start_s, b.now_s))

    b.subscribe(on_event)
    a.advance(0.001 - 1e-7)
    a.event_record(0)  # its 0.9 µs reach the tenant's step at 1 ms
    (start_s, end_s), = spans
    assert end_s - start_s == pytest.approx(b.latency.mem_get_info_us * 1e-6, rel=1e-9)
    assert a.now_s >= end_s and env.now >= end_s


class _CallsTheDevice(Scenario):
    """A tenant that, at 0.5 s, calls its own device from inside its SimPy process (re-entrant: the
    device's clock is running SimPy when the process wakes), then sleeps 0.2 s."""

    def __init__(self, box: list) -> None:
        self.box = box
        self.seen: list[tuple] = []

    def process(self, ctx):
        yield ctx.env.timeout(0.5)
        dev = self.box[0]
        start_s = dev.now_s
        dev.advance(0.1)
        after_advance_s = dev.now_s
        dev.mem_info()
        self.seen.append((start_s, after_advance_s, dev.now_s))
        yield ctx.env.timeout(0.2)
        self.seen.append(("woke", ctx.env.now))


@pytest.mark.parametrize("own_env", [True, False])
def test_a_call_from_a_process_the_clock_runs_takes_its_time(own_env):
    """Review rv21a: on the device's own (lazy) environment, a call made from a tenant's process while the
    clock ran SimPy started from the clock's stale time, so advance(0.1) and mem_info took no time at all
    (0.5 -> 0.5); the eager clock (a given environment) and the old device took both."""
    box: list = []
    scenario = _CallsTheDevice(box)
    dev = SimDevice(get_profile("t4-16gb"), env=None if own_env else simpy.Environment())
    box.append(dev)
    dev.add_tenant(scenario)
    dev.advance(1.0)
    (start_s, after_advance_s, end_s), (_, woke_s) = scenario.seen
    assert start_s == 0.5 and after_advance_s == 0.6
    assert end_s - after_advance_s == pytest.approx(dev.latency.mem_get_info_us * 1e-6, rel=1e-9)
    assert woke_s == end_s + 0.2
    assert dev.now_s == 1.0  # the outer advance still ends where it was asked to
    dev.advance(0.5)
    assert dev.now_s == 1.5 and dev.env.now == 1.5
