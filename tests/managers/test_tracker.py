"""AllocationTracker: ids, metadata, totals and peaks (overall, per region), leaks, the exit report."""

from __future__ import annotations

import atexit
import logging
import threading

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from gpumem.errors import InvalidArgumentError
from gpumem.managers.regions import region
from gpumem.managers.tracker import AllocationTracker, Location, UnknownBufferError


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_ids_are_unique_and_metadata_kept():
    t = AllocationTracker(capture_stacks=True)
    a = t.register(100, n_elements=25, tag="w", ptr=4096, device="sim:x")
    b = t.register(50, location=Location.CPU)
    assert a != b
    info = t.get(a)
    assert (info.nbytes, info.n_elements, info.tag, info.ptr, info.device, info.location) == \
        (100, 25, "w", 4096, "sim:x", Location.GPU)
    assert info.stack[-1].name == "test_ids_are_unique_and_metadata_kept"
    assert info.wall_time_s > 0
    assert t.nbytes_at(Location.CPU) == 50 and t.nbytes_at(Location.GPU) == 100
    t.unregister(a)
    c = t.register(1)
    assert c not in (a, b)                       # never reused


@pytest.mark.parametrize("kwargs,match", [
    (dict(nbytes=-1), "nbytes"), (dict(nbytes=1.0), "nbytes"), (dict(nbytes=1, location="gpu"), "location"),
    (dict(nbytes=1, n_elements=-2), "n_elements"), (dict(nbytes=1, tag=3), "tag"), (dict(nbytes=1, ptr=0), "ptr"),
])
def test_bad_register_changes_nothing(kwargs, match):
    t = AllocationTracker()
    t.register(10)
    before = t.stats()
    with pytest.raises(InvalidArgumentError, match=match):
        t.register(**kwargs)
    assert t.stats() == before


def test_unknown_ids():
    t = AllocationTracker()
    a = t.register(10)
    t.unregister(a)
    before = t.stats()
    for call in (t.unregister, t.get, lambda i: t.annotate(i, tag="x"), lambda i: t.relocate(i, Location.CPU)):
        with pytest.raises(UnknownBufferError):
            call(a)
    assert t.stats() == before


def test_relocate_and_annotate():
    t = AllocationTracker()
    a = t.register(64, ptr=512)
    t.relocate(a, Location.CPU)
    assert t.nbytes_at(Location.CPU) == 64 and t.nbytes_at(Location.GPU) == 0 and t.get(a).ptr is None
    t.annotate(a, tag="kv", n_elements=16)
    assert (t.get(a).tag, t.get(a).n_elements) == ("kv", 16)
    t.unregister(a)
    assert t.nbytes_at(Location.CPU) == 0


def test_peaks_reset_overall_and_per_region():
    t = AllocationTracker()
    with region("step"):
        with region("fwd"):
            a = t.register(100)
        b = t.register(50)
    t.unregister(a)
    assert t.peak_nbytes == 150
    assert t.region_stats("step").peak_nbytes == 150
    assert t.region_stats("step/fwd").peak_nbytes == 100
    t.reset_peak(region="step")
    assert t.region_stats("step").peak_nbytes == 50 and t.region_stats("step/fwd").peak_nbytes == 100
    assert t.peak_nbytes == 150
    t.reset_peak()
    assert t.peak_nbytes == 50 and t.region_stats("step/fwd").peak_nbytes == 0
    assert t.region_stats("never").live_nbytes == 0
    t.unregister(b)
    with pytest.raises(InvalidArgumentError):
        t.reset_peak(region="")


def test_find_old_allocations_and_leak_report():
    clock = FakeClock()
    t = AllocationTracker(clock=clock)
    with region("load"):
        old = t.register(1000, tag="weights")
    clock.now += 60
    t.register(10, tag="tmp")
    assert [i.buffer_id for i in t.find_old_allocations(30)] == [old]
    assert len(t.find_old_allocations(0)) == 2
    rep = t.leak_report(min_age_s=30)
    assert rep.total_nbytes == 1000 and rep.by_region == (("load", 1000, 1),) and rep.by_tag == (("weights", 1000, 1),)
    assert "load" in rep.format() and "weights" in rep.format()
    for bad in (-1, float("nan"), float("inf"), "1", True):
        with pytest.raises(InvalidArgumentError, match="age_s"):
            t.find_old_allocations(bad)


def test_exit_report_registered_and_unregistered(monkeypatch, caplog):
    registered = []
    monkeypatch.setattr(atexit, "register", lambda f: registered.append(f))
    monkeypatch.setattr(atexit, "unregister", lambda f: registered.remove(f))
    t = AllocationTracker(report_leaks_at_exit=True, name="unit")
    assert t.reports_at_exit and len(registered) == 1
    t.register(123, tag="leaky")
    with caplog.at_level(logging.WARNING, logger="gpumem.managers.tracker"):
        registered[0]()                           # what the interpreter would run at exit
    assert "leak report (unit)" in caplog.text and "leaky" in caplog.text
    t.close()
    assert registered == [] and not t.reports_at_exit
    t.report_leaks_at_exit(True)                  # closed: not registered again
    assert registered == []


def test_thread_safety():
    t = AllocationTracker()

    def work():
        for _ in range(500):
            t.unregister(t.register(8))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    s = t.stats()
    assert s.live_nbytes == 0 and s.total_allocs == s.total_frees == 2000


class TrackerMachine(RuleBasedStateMachine):
    """The tracker against a plain model: live set, totals, peaks (overall and per region)."""

    ids = Bundle("ids")

    def __init__(self):
        super().__init__()
        self.t = AllocationTracker()
        self.model: dict = {}
        self.peak = 0
        self.region_peak: dict[str, int] = {}

    def _region_live(self, r):
        return sum(n for n, reg in self.model.values() if reg and (reg == r or reg.startswith(r + "/")))

    @rule(target=ids, nbytes=st.integers(0, 1 << 30), where=st.sampled_from([None, "a", "b", "a/x"]),
          loc=st.sampled_from(list(Location)))
    def register(self, nbytes, where, loc):
        if where is None:
            bid = self.t.register(nbytes, location=loc)
        else:
            parts = where.split("/")
            with region(parts[0]):
                if len(parts) > 1:
                    with region(parts[1]):
                        bid = self.t.register(nbytes, location=loc)
                else:
                    bid = self.t.register(nbytes, location=loc)
        assert bid not in self.model
        self.model[bid] = (nbytes, where)
        self.peak = max(self.peak, sum(n for n, _ in self.model.values()))
        for r in ("a", "b", "a/x"):
            self.region_peak[r] = max(self.region_peak.get(r, 0), self._region_live(r))
        return bid

    @rule(bid=consumes(ids))
    def unregister(self, bid):
        info = self.t.unregister(bid)
        assert info.nbytes == self.model.pop(bid)[0]

    @rule(bid=ids)
    def unregister_twice_or_live(self, bid):
        if bid in self.model:
            assert bid in self.t
        else:
            before = self.t.stats()
            with pytest.raises(UnknownBufferError):
                self.t.unregister(bid)
            assert self.t.stats() == before

    @rule()
    def reset_all(self):
        self.t.reset_peak()
        self.peak = sum(n for n, _ in self.model.values())
        self.region_peak = {r: self._region_live(r) for r in self.region_peak}

    @precondition(lambda self: self.region_peak)
    @rule(r=st.sampled_from(["a", "b", "a/x"]))
    def reset_region(self, r):
        self.t.reset_peak(region=r)
        if r in self.region_peak:
            self.region_peak[r] = self._region_live(r)

    @invariant()
    def totals(self):
        s = self.t.stats()
        assert s.live_nbytes == sum(n for n, _ in self.model.values())
        assert s.live_count == len(self.model)
        assert s.peak_nbytes == self.peak
        assert s.gpu_nbytes + s.cpu_nbytes == s.live_nbytes
        for r, p in self.region_peak.items():
            rs = self.t.region_stats(r)
            assert rs.live_nbytes == self._region_live(r)
            assert rs.peak_nbytes == p


TestTrackerMachine = TrackerMachine.TestCase
