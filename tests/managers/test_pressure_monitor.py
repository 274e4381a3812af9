"""MemoryPressure levels and the PressureMonitor: on every simulated pressure preset, over NVML (fake
CUDA libraries), its thread, its callbacks and releasers, and bad input."""

from __future__ import annotations

import logging
import math
import os
import sys
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpumem
from gpumem import sim
from gpumem.allocator import CachingAllocator
from gpumem.errors import InvalidArgumentError
from gpumem.events import MemoryEventKind
from gpumem.managers.pressure import MemoryPressure, PressureMonitor, SampleSource
from gpumem.sim.pressure import PRESET_NAMES
from gpumem.sim.pressure import preset as preset_scenario

GiB = gpumem.GiB
MiB = gpumem.MiB
PROFILE = "sim:rtx-3060-12gb"  # 11.76 GiB: small enough for quick tests, big enough for every preset


def _monitor_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("gpumem-pressure")]


# -- levels ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction, level", [
    (0.0, MemoryPressure.LOW), (0.5999, MemoryPressure.LOW), (0.60, MemoryPressure.MEDIUM),
    (0.7999, MemoryPressure.MEDIUM), (0.80, MemoryPressure.HIGH), (0.95, MemoryPressure.HIGH),
    (0.9501, MemoryPressure.CRITICAL), (1.0, MemoryPressure.CRITICAL)])
def test_levels_at_their_bounds(fraction, level):
    assert MemoryPressure.from_used_fraction(fraction) is level


@pytest.mark.parametrize("bad", [-0.01, 1.01, math.nan, math.inf, "0.5", None, True])
def test_bad_fraction_is_refused(bad):
    with pytest.raises(InvalidArgumentError, match="used fraction"):
        MemoryPressure.from_used_fraction(bad)


@given(st.floats(0, 1), st.floats(0, 1))
def test_levels_are_monotonic_in_the_fraction(a, b):
    lo, hi = sorted((a, b))
    assert MemoryPressure.from_used_fraction(lo) <= MemoryPressure.from_used_fraction(hi)


# -- hysteresis and callbacks, through observe() ----------------------------------------------------------
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=40), st.sampled_from([0.0, 0.02, 0.05]))
def test_hysteresis_rises_at_once_falls_late_and_reports_every_change_once(permille, hysteresis):
    with gpumem.open_device(PROFILE) as dev:
        changes = []
        mon = PressureMonitor(dev, interval_s=1.0, hysteresis=hysteresis, callbacks=[changes.append])
        level = None
        for i, p in enumerate(permille):
            sample = mon.observe(p, 1000)
            raw = MemoryPressure.from_used_fraction(p / 1000)
            assert sample.level >= raw  # rises at once
            if i == 0 or hysteresis == 0:
                assert sample.level is raw
            else:  # falls only once the fraction is hysteresis below the level's bound
                assert sample.level <= MemoryPressure.from_used_fraction(min(1.0, p / 1000 + hysteresis + 1e-9))
            if level is not None and sample.level != level:
                assert changes[-1].old is level and changes[-1].new is sample.level
            level = sample.level
        assert [c.sequence for c in changes] == list(range(1, len(changes) + 1))
        assert all(c.old != c.new for c in changes)
        assert mon.level is level and mon.stats().level_changes == len(changes)


def test_a_callback_that_raises_is_logged_and_the_others_still_run(caplog):
    with gpumem.open_device(PROFILE) as dev:
        seen = []

        def bad(change):
            raise RuntimeError("boom")

        mon = PressureMonitor(dev, interval_s=1.0, hysteresis=0.0, callbacks=[bad, seen.append])
        with caplog.at_level(logging.ERROR, logger="gpumem.managers.pressure"):
            mon.observe(700, 1000)
            mon.observe(100, 1000)
        assert [c.new for c in seen] == [MemoryPressure.MEDIUM, MemoryPressure.LOW]
        assert mon.stats().callback_errors == 2
        assert "boom" in caplog.text


def test_releasers_run_at_high_and_critical_only_and_one_that_raises_does_not_stop_the_others(caplog):
    class Counting:
        def __init__(self, fail=False):
            self.calls = 0
            self.fail = fail

        def empty_cache(self):
            self.calls += 1
            if self.fail:
                raise RuntimeError("cannot release")
            return 0

    with gpumem.open_device(PROFILE) as dev:
        good, bad = Counting(), Counting(fail=True)
        mon = PressureMonitor(dev, interval_s=1.0, hysteresis=0.0, releasers=[bad, good])
        with caplog.at_level(logging.ERROR, logger="gpumem.managers.pressure"):
            for p in (100, 700, 850, 990, 850, 500):
                mon.observe(p, 1000)
        assert good.calls == 3 and bad.calls == 3  # 850, 990, 850
        st_ = mon.stats()
        assert st_.releases == 3 and st_.release_errors == 3 and st_.peak_level is MemoryPressure.CRITICAL


def test_registration_and_bad_input_change_nothing():
    with gpumem.open_device(PROFILE) as dev:
        mon = PressureMonitor(dev, interval_s=1.0)
        before = mon.stats()
        for bad in (object(), 3, "x"):
            with pytest.raises(InvalidArgumentError, match="empty_cache"):
                mon.add_releaser(bad)
        with pytest.raises(InvalidArgumentError, match="callable"):
            mon.add_callback(42)
        with pytest.raises(InvalidArgumentError, match="not a registered"):
            mon.remove_callback(print)
        with pytest.raises(InvalidArgumentError, match="not a registered"):
            mon.remove_releaser(dev)
        for used, total in ((-1, 10), (11, 10), (1, 0), (1.5, 10), (True, 10)):
            with pytest.raises(InvalidArgumentError):
                mon.observe(used, total)
        assert mon.stats() == before and mon.level is MemoryPressure.LOW
        seen = []
        mon.add_callback(seen.append)
        mon.remove_callback(seen.append)
        mon.observe(900, 1000)
        assert seen == []


@pytest.mark.parametrize("kwargs, match", [
    ({"interval_s": 0}, "interval_s"), ({"interval_s": -1}, "interval_s"), ({"interval_s": math.nan}, "interval_s"),
    ({"interval_s": True}, "interval_s"), ({"hysteresis": 0.7}, "hysteresis"), ({"hysteresis": -0.1}, "hysteresis"),
    ({"releasers": [object()]}, "empty_cache"), ({"callbacks": [1]}, "callable"),
    ({"sim_advance_s": -1.0}, "sim_advance_s")])
def test_bad_constructor_arguments(kwargs, match):
    with gpumem.open_device(PROFILE) as dev:
        with pytest.raises(InvalidArgumentError, match=match):
            PressureMonitor(dev, **kwargs)


def test_a_device_is_required():
    with pytest.raises(InvalidArgumentError, match="gpumem.Device"):
        PressureMonitor("sim:t4-16gb", interval_s=1.0)


# -- every simulated pressure preset ------------------------------------------------------------------
def _cached_setup(dev, live_nbytes, cached_nbytes):
    """An allocator with ``live_nbytes`` live (filled with a pattern) and ``cached_nbytes`` cached."""
    alloc = CachingAllocator(dev)
    live = [alloc.allocate(256 * MiB) for _ in range(live_nbytes // (256 * MiB))]
    for i, p in enumerate(live):
        dev.write(p, bytes([i % 251]) * 4096)
    tmp = [alloc.allocate(256 * MiB) for _ in range(cached_nbytes // (256 * MiB))]
    for p in tmp:
        alloc.free(p)
    return alloc, live


def _check_live(dev, live):
    for i, p in enumerate(live):
        assert dev.read(p, 4096) == bytes([i % 251]) * 4096


@pytest.mark.parametrize("mode", ["events", "polls"])
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_every_preset_sees_pressure_and_gives_cache_back_before_the_tenant_is_refused(preset, mode):
    dev = gpumem.open_device(f"{PROFILE}?seed=5")
    try:
        total = dev.mem_info().total_nbytes
        # about 60 % of the device held by this process, most of it cached
        alloc, live = _cached_setup(dev, 2 * GiB, int(0.6 * total) - 2 * GiB)
        # the preset's tenant starts now (its time line begins once our memory is in place)
        dev.add_tenant(preset_scenario(preset, total))
        changes = []
        mon = PressureMonitor(dev, interval_s=3600.0, hysteresis=0.0, releasers=[alloc], callbacks=[changes.append],
                              react_to_events=(mode == "events"))
        if mode == "events":
            with mon:  # the thread waits an hour: every evaluation here comes from the tenants' events
                for _ in range(300):  # a program computing 1 ms between device calls
                    dev.advance(0.001)
            assert mon.stats().events_seen > 0
        else:
            mon.poll_once()
            for _ in range(300):  # a poll every simulated millisecond
                dev.advance(0.001)
                mon.poll_once()
            assert mon.stats().polls >= 301
        assert not _monitor_threads()
        stats = mon.stats()
        # every change names its sample's level, in order, and the callbacks saw each one
        assert [c.sequence for c in changes] == list(range(1, len(changes) + 1))
        for c in changes:
            assert c.new is MemoryPressure.from_used_fraction(c.sample.used_fraction)
        for a, b in zip(changes, changes[1:]):
            assert b.old is a.new
        if preset != "random":  # step, ramp and spikes each take >= 20 % on top of our 60 %
            assert stats.peak_level >= MemoryPressure.HIGH
        assert stats.peak_level >= MemoryPressure.MEDIUM
        if stats.peak_level >= MemoryPressure.HIGH:
            assert stats.releases >= 1 and stats.released_nbytes > 0
            assert alloc.reserved_nbytes - alloc.allocated_nbytes < 256 * MiB  # the cache went back
            if mode == "events":  # given back at the first tenant event at HIGH: no tenant was ever refused
                denied = [e for e in dev.events.history if e.kind is MemoryEventKind.TENANT_DENIED]
                assert denied == []
        _check_live(dev, live)  # live data intact
        alloc.check_consistency()
        for p in live:
            alloc.free(p)
        alloc.close()
    finally:
        dev.close()


# -- the thread --------------------------------------------------------------------------------------------
def test_thread_polls_drives_the_simulator_and_stops_cleanly():
    dev = gpumem.open_device(PROFILE, pressure=sim.Step(nbytes=5 * GiB, at_s=0.005))
    try:
        alloc, live = _cached_setup(dev, 1 * GiB, 4 * GiB)
        reached = threading.Event()

        def on_change(change):
            if change.new >= MemoryPressure.HIGH:
                reached.set()

        mon = PressureMonitor(dev, interval_s=0.001, sim_advance_s=0.001, react_to_events=False,
                              releasers=[alloc], callbacks=[on_change])
        with mon:
            assert mon.running and len(_monitor_threads()) == 1
            assert reached.wait(30), "the monitor's thread never saw the step"
            with pytest.raises(InvalidArgumentError, match="already running"):
                mon.start()
        assert not mon.running and not _monitor_threads()
        mon.stop()  # idempotent
        assert mon.stats().releases >= 1 and mon.stats().poll_errors == 0
        _check_live(dev, live)
        mon.start()  # restartable
        mon.stop()
        assert not _monitor_threads()
        for p in live:
            alloc.free(p)
        alloc.close()
    finally:
        dev.close()


def test_thread_stops_by_itself_when_the_device_is_lost():
    dev = gpumem.open_device(PROFILE, faults=sim.FaultPlan(device_lost_at_s=0.002))
    mon = PressureMonitor(dev, interval_s=0.001, sim_advance_s=0.001)
    mon.start()
    mon._thread.join(30)
    assert not mon.running and mon.stats().poll_errors == 1
    mon.stop()
    assert not _monitor_threads()


# -- NVML on a CUDA device (fake CUDA libraries) ------------------------------------------------------------
def _fakes(**kw):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cuda_adapter"))
    try:
        from cuda_fakes import Fakes
    finally:
        sys.path.pop(0)
    return Fakes(**kw)


def test_on_cuda_the_monitor_reads_nvml_so_other_processes_count():
    fakes = _fakes()
    dev = fakes.open()
    try:
        gpu = fakes.nvml.gpus[0]
        releases = []

        class Releaser:
            def empty_cache(self):
                releases.append(gpu["used"])
                return 0

        mon = PressureMonitor(dev, interval_s=1.0, hysteresis=0.0, releasers=[Releaser()])
        s = mon.poll_once()
        assert s.source is SampleSource.NVML and s.total_nbytes == gpu["total"] and s.level is MemoryPressure.LOW
        gpu["used"] = int(gpu["total"] * 0.9)  # another process took memory
        assert mon.poll_once().level is MemoryPressure.HIGH and len(releases) == 1
        gpu["used"] = int(gpu["total"] * 0.1)  # and gave it back
        assert mon.poll_once().level is MemoryPressure.LOW and len(releases) == 1
    finally:
        dev.close()


def test_on_cuda_without_nvml_the_monitor_falls_back_to_mem_info():
    fakes = _fakes(nvml=False)
    dev = fakes.open()
    try:
        s = PressureMonitor(dev, interval_s=1.0).poll_once()
        assert s.source is SampleSource.MEM_INFO
        assert s.used_nbytes == dev.mem_info().used_nbytes
    finally:
        dev.close()


def test_on_cuda_a_failing_nvml_call_falls_back_for_that_sample():
    fakes = _fakes()
    dev = fakes.open()
    try:
        mon = PressureMonitor(dev, interval_s=1.0)
        assert mon.poll_once().source is SampleSource.NVML
        fakes.nvml.fail["nvmlDeviceGetMemoryInfo"] = 3
        assert mon.poll_once().source is SampleSource.MEM_INFO
        fakes.nvml.fail.clear()
        assert mon.poll_once().source is SampleSource.NVML
        assert mon.stats().samples_by_source == {"nvml": 2, "mem_info": 1}
    finally:
        dev.close()


def test_callbacks_and_releasers_may_call_the_monitor_and_the_allocator_back():
    """Nothing of the monitor (nor the allocator) is locked while they run: no deadlock."""
    dev = gpumem.open_device(PROFILE)
    try:
        alloc = CachingAllocator(dev)
        seen = []
        mon = PressureMonitor(dev, interval_s=3600.0, hysteresis=0.0)

        def callback(change):
            seen.append((change.new, mon.level, mon.stats().level_changes))
            p = alloc.allocate(MiB)  # the allocator is free to use
            alloc.free(p)
            mon.add_callback(lambda c: None)

        class Releaser:
            def empty_cache(self):
                mon.stats()
                return alloc.empty_cache()

        mon.add_callback(callback)
        mon.add_releaser(Releaser())
        mon.observe(900, 1000)
        assert seen[0][0] is MemoryPressure.HIGH and seen[0][1] is MemoryPressure.HIGH
        alloc.close()
    finally:
        dev.close()


# -- order of delivery (Note [One evaluation at a time]) --------------------------------------------
class _ReleaserRacedByAPoll:
    """Gives the allocator's cache back, then lets another thread poll the monitor (as its thread would,
    waking up in that moment) and waits up to ``wait_s`` for that poll. Before the fix the other poll
    ran at once, saw the release and delivered its later change ahead of this thread's."""

    def __init__(self, alloc: CachingAllocator, wait_s: float = 0.2) -> None:
        self.alloc, self.wait_s, self.monitor, self.threads = alloc, wait_s, None, []

    def empty_cache(self) -> int:
        n = self.alloc.empty_cache()
        if self.monitor is not None and not self.threads:
            t = threading.Thread(target=self.monitor.poll_once)
            self.threads.append(t)
            t.start()
            t.join(self.wait_s)  # with the fix it waits for this evaluation to end
        return n


def test_a_poll_during_a_release_waits_and_changes_arrive_in_order_exactly_once():
    dev = gpumem.open_device("sim:t4-16gb")
    alloc = CachingAllocator(dev)
    blocks = [alloc.allocate(1 * GiB) for _ in range(10)]
    for p in blocks[2:]:
        alloc.free(p)
    seen = []
    releaser = _ReleaserRacedByAPoll(alloc)
    monitor = PressureMonitor(dev, releasers=[releaser], callbacks=[seen.append])
    monitor.poll_once()
    releaser.monitor = monitor
    dev.add_tenant(sim.Step(nbytes=4 * GiB))
    dev.advance(0.001)  # the tenant takes 4 GiB
    monitor.poll_once()  # CRITICAL: releases, and another thread polls in the middle of it
    for t in releaser.threads:
        t.join()
    assert [c.sequence for c in seen] == list(range(1, len(seen) + 1))
    assert [c.old for c in seen[1:]] == [c.new for c in seen[:-1]]
    assert seen[-1].new is monitor.level is MemoryPressure.LOW
    assert [(c.old.name, c.new.name) for c in seen] == [
        ("LOW", "MEDIUM"), ("MEDIUM", "CRITICAL"), ("CRITICAL", "LOW")]


@pytest.mark.parametrize("attempt", range(3))
def test_a_fast_thread_and_a_slow_release_deliver_in_order(attempt):
    dev = gpumem.open_device("sim:t4-16gb")
    alloc = CachingAllocator(dev)
    blocks = [alloc.allocate(1 * GiB) for _ in range(10)]
    for p in blocks[2:]:
        alloc.free(p)
    seen = []

    class Slow:
        def empty_cache(self) -> int:
            import time
            n = alloc.empty_cache()
            time.sleep(0.01)
            return n

    with PressureMonitor(dev, interval_s=0.001, releasers=[Slow()], callbacks=[seen.append]) as monitor:
        dev.add_tenant(sim.Step(nbytes=4 * GiB))
        for _ in range(10):
            dev.advance(0.001)
    assert [c.sequence for c in seen] == list(range(1, len(seen) + 1))
    assert seen[-1].new is monitor.level


def test_the_guides_monitor_example_prints_what_the_guide_says(capsys):
    """docs/pressure-and-multi-gpu.md, 'The pressure monitor': run as written, many times."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).parents[2] / "docs" / "pressure-and-multi-gpu.md").read_text()
    section = text[text.index("## The pressure monitor"):]
    code, printed = re.search(r"```python\n(.*?)```\n\nprints\n\n```\n(.*?)```", section, re.S).groups()
    for _ in range(20):
        exec(compile(code, "pressure-guide", "exec"), {})  # noqa: S102 - the guide's own example
        assert capsys.readouterr().out == printed


def test_concurrent_starts_start_one_thread_and_one_subscription():
    # check and claim were separate lock sections: several start() calls passed the check, each
    # started a thread and subscribed; stop() then cancelled one subscription and left the others
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with gpumem.open_device("sim:t4-16gb") as dev:
            mon = PressureMonitor(dev, interval_s=0.01)
            real_poll = mon.poll_once

            def slow_first_sample():                     # widens the window between check and claim
                threading.Event().wait(0.05)
                return real_poll()
            mon.poll_once = slow_first_sample
            barrier = threading.Barrier(8)
            results = []

            def go():
                barrier.wait()
                try:
                    mon.start()
                    results.append("started")
                except InvalidArgumentError as e:
                    results.append(str(e))
            ts = [threading.Thread(target=go) for _ in range(8)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            n_threads = sum(t.name.startswith("gpumem-pressure") for t in threading.enumerate())
            n_subs = len(dev.events._subs)
            mon.stop(timeout_s=5)
            assert results.count("started") == 1
            assert all("already running" in r for r in results if r != "started")
            assert n_threads == 1 and n_subs == 1
            assert len(dev.events._subs) == 0 and not mon.running
    finally:
        sys.setswitchinterval(old)


def test_stop_from_the_monitor_thread_changes_nothing():
    # stop() dropped the subscription before the own-thread check raised: the monitor kept running
    # without it, and the subscription was never cancelled
    with gpumem.open_device("sim:t4-16gb") as dev:
        mon = PressureMonitor(dev, interval_s=0.01)
        errs, seen = [], []

        def cb(change):
            try:
                mon.stop()
            except InvalidArgumentError as e:
                errs.append(e)
                seen.append(mon._subscription)
        mon.add_callback(cb)
        mon.start()
        sub = mon._subscription
        assert sub is not None
        ptr = dev.malloc(int(dev.properties().total_nbytes * 0.9))     # another user: the level changes
        deadline = 100
        while not errs and deadline:
            threading.Event().wait(0.05)
            deadline -= 1
        assert errs and "own thread" in str(errs[0])
        assert seen[0] is sub and mon._subscription is sub and mon.running
        mon.stop(timeout_s=5)
        assert not mon.running and len(dev.events._subs) == 0
        dev.free(ptr)
