"""Note [Probes replayed ahead]: find_max_batch with ``jobs > 1`` replays the sizes its search may ask next on other
processes, and answers exactly as with one process: the same result, the same tries in the same order."""

import dataclasses
import logging
import os
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings, strategies as st

from gpumem.errors import InvalidArgumentError
from gpumem.estimate import ModelShape, find_max_batch
from gpumem.estimate import fit as fit_module
from gpumem.estimate.fit import FitTry, ProbeJob, ReservedEstimate, _Probes, _search
from gpumem.estimate.probe_pool import PoolBroken, ProbePool, ahead, check_jobs, default_jobs
from gpumem.progress import NoProgress

from test_fit_search import MATRIX, TINY, WIDE, FakeReplays, fake_searches, fake_tables


class InlinePool:
    """A ProbePool that makes each replay in this process when it is taken, and notes what was asked ahead.
    ``broken_after``: the take after that many raises PoolBroken, as a pool whose worker died."""

    def __init__(self, run, broken_after: int | None = None, ended: bool = False) -> None:
        self.run = run
        self.broken_after = broken_after
        self.ended = ended  # replays asked ahead have ended by the next take (answers() has them), else run
        self.submitted: list = []
        self.taken: list = []
        self._pending: dict = {}
        self.closed = False

    def pending(self, key) -> bool:
        return key in self._pending

    def in_flight(self) -> int:
        return 0 if self.ended else len(self._pending)

    def answers(self) -> dict:
        return {k: self.run(job).fits for k, job in self._pending.items()} if self.ended else {}

    def submit(self, key, job) -> None:
        assert not self.closed
        if key not in self._pending:
            self._pending[key] = job
            self.submitted.append(key)

    def take(self, key, job):
        if self.broken_after is not None and len(self.taken) >= self.broken_after:
            raise PoolBroken
        self.submit(key, job)
        del self._pending[key]
        self.taken.append(key)
        return self.run(job)

    def close(self) -> None:
        self.closed = True


def _pooled(fake: FakeReplays, usable: int, tries: list, jobs: int, limit: int, max_value: int, start, skip: bool,
            broken_after: int | None = None, ended: bool = True):
    """FakeReplays' probes with an InlinePool from the first replay on."""
    plain = fake.probes(usable, tries)
    pools: list[InlinePool] = []

    def factory(n: int) -> InlinePool:
        assert n == jobs
        pools.append(InlinePool(lambda job: plain._replay(plain._workload(job[0]), job[0], job[1]), broken_after,
                                ended))
        return pools[-1]

    probes = _Probes(plain._workload, plain._replay, plain._fault, usable, False, NoProgress(), tries, jobs,
                     lambda v, room: (v, room), lambda p: _search(p, limit, usable, max_value, start, skip),
                     pool_factory=factory, pool_after_s=0.0)
    return probes, pools


@settings(max_examples=150)
@given(fake_searches(), st.sampled_from([2, 3, 8]), st.booleans(), st.booleans())
def test_replaying_ahead_keeps_every_answer_and_try(case, jobs, skip, ended):
    max_value, limit, usable, per, fit_l, fit_u, start = case
    tables = fake_tables(max_value, limit, usable, fit_l, fit_u)
    one, many = FakeReplays(tables, per), FakeReplays(tables, per)
    one_tries: list[FitTry] = []
    many_tries: list[FitTry] = []
    want = _search(one.probes(usable, one_tries), limit, usable, max_value, start, skip)
    probes, pools = _pooled(many, usable, many_tries, jobs, limit, max_value, start, skip, ended=ended)
    try:
        got = _search(probes, limit, usable, max_value, start, skip)
    finally:
        probes.close()
    assert got == want
    assert many_tries == one_tries  # the same sizes asked, in the same order, with the same answers
    # every replay the search waited for was one it makes in one process; the first made here, the rest taken
    # from the pool, which was asked for each before or when it was needed
    assert set(one.replayed) <= set(many.replayed)   # FakeReplays notes every replay, asked ahead or not
    if pools:
        pool = pools[0]
        assert pool.closed
        assert [(v, lim or usable) for v, lim in pool.taken] == one.replayed[1:]
        assert set(pool.taken) <= set(pool.submitted)


def test_replaying_ahead_asks_the_next_sizes_of_both_answers():
    # under 100: sizes up to 5 fit; under 200: up to 9 (as test_fit_search's hand-made case)
    tables = {100: [v <= 5 for v in range(40)], 200: [v <= 9 for v in range(40)]}
    one, many = FakeReplays(tables, 10), FakeReplays(tables, 10)
    assert _search(one.probes(200, []), 100, 200, 16, None, True) == (5, 16, 16, 8, 9)
    probes, pools = _pooled(many, 200, [], 3, 100, 16, None, True)
    assert _search(probes, 100, 200, 16, None, True) == (5, 16, 16, 8, 9)
    pool = pools[0]
    # the first replay (8 under 100) is made here; at the second (4 under 100, the next power of two down) the
    # pool is asked for it and for what the search asks after it either way
    assert one.replayed[0] == (8, 100) and pool.taken[0] == (4, 100)
    assert pool.submitted[:3] == [(4, 100), (6, 100), (2, 100)]
    assert len(pool.submitted) > len(pool.taken)   # some asked ahead were not needed, and were dropped


def test_a_pool_whose_worker_died_leaves_the_search_to_this_process():
    tables = {100: [v <= 5 for v in range(40)], 200: [v <= 9 for v in range(40)]}
    one, many = FakeReplays(tables, 10), FakeReplays(tables, 10)
    one_tries: list[FitTry] = []
    many_tries: list[FitTry] = []
    want = _search(one.probes(200, one_tries), 100, 200, 16, None, True)
    probes, pools = _pooled(many, 200, many_tries, 2, 100, 16, None, True, broken_after=1)
    assert _search(probes, 100, 200, 16, None, True) == want
    assert many_tries == one_tries
    assert len(pools) == 1 and pools[0].closed and len(pools[0].taken) == 1   # no new pool after it broke


def test_ahead_counts_only_keys_not_asked_yet():
    # a search asking 1, then 2 if 1 fits else 3, then 4 ...: a binary tree of keys
    def first_unknown(assumed):
        k = 1
        while k in assumed:
            k = 2 * k if assumed[k] else 2 * k + 1
        return k if k < 64 else None

    assert ahead(1, first_unknown, 7, lambda k: False) == [1, 2, 3, 4, 5, 6, 7]
    assert ahead(1, first_unknown, 3, lambda k: k in (1, 2)) == [3, 4, 5]
    assert ahead(1, first_unknown, 1, lambda k: False) == [1]
    assert ahead(1, lambda assumed: None, 4, lambda k: False) == [1]
    # an answer known (a replay ended) is taken as given: only its branch is explored
    assert ahead(1, first_unknown, 3, lambda k: k in (1,), known={1: False}) == [3, 6, 7]
    assert ahead(2, first_unknown, 2, lambda k: False, known={1: True, 3: True}) == [2, 4]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_jobs_must_be_a_whole_number_of_processes(bad):
    with pytest.raises(InvalidArgumentError, match="jobs must be a whole number of processes >= 1"):
        check_jobs(bad)
    with pytest.raises(InvalidArgumentError, match="jobs must be a whole number"):
        find_max_batch(TINY, 2, device="sim:gtx-1050-2gb", prompt_len=64, new_tokens=2, max_value=4, jobs=bad)


def test_default_jobs_is_within_the_cpus():
    assert 1 <= default_jobs() <= 8


@pytest.mark.parametrize("shape, kw", [MATRIX[0], MATRIX[3], MATRIX[6]])
def test_find_max_batch_on_worker_processes_answers_as_one_process(shape, kw, monkeypatch):
    """Real worker processes, started at once (no replay is long here): the same answers and tries as one
    process; training steps stay in this process."""
    monkeypatch.setattr(fit_module, "POOL_AFTER_S", 0.0)
    started = []
    real_pool = fit_module.ProbePool

    def pool(jobs):
        started.append(jobs)
        return real_pool(jobs)

    monkeypatch.setattr(fit_module, "ProbePool", pool)
    one = find_max_batch(shape, 2, **kw)
    many = find_max_batch(shape, 2, jobs=2, **kw)
    assert dataclasses.replace(many, tries=[]) == dataclasses.replace(one, tries=[])
    assert many.tries == one.tries
    assert started == ([] if kw.get("training") else [2])


@dataclasses.dataclass(frozen=True)
class _SleepingJob(ProbeJob):
    """A replay that takes a minute."""

    def run(self):
        time.sleep(60)


def test_a_probe_pool_ends_its_workers_without_waiting_for_replays_asked_ahead():
    pool = ProbePool(2)
    job = ProbeJob(WIDE, 2, "pytorch", "sim:gtx-1050-2gb", 8, 600, 120, 2 << 30, 1 << 30, None, 0, False)
    try:
        r = pool.take("a", job)
        assert isinstance(r, ReservedEstimate) and r.policy == "pytorch" and r.fits
        assert r == job.run()   # as this process replays it
        pool.submit("slow", _SleepingJob(*dataclasses.astuple(job)))
        assert pool.pending("slow") and not pool.pending("a")
    finally:
        t0 = time.perf_counter()
        pool.close()
    assert time.perf_counter() - t0 < 30   # the minute's replay was ended, not awaited
    assert not pool.pending("slow")


def test_jobs_past_the_cpus_start_no_more_processes_than_cpus(monkeypatch):
    from gpumem.estimate.probe_pool import usable_cpus

    monkeypatch.setattr(fit_module, "POOL_AFTER_S", 0.0)
    started = []

    class Recorder(InlinePool):
        def __init__(self, jobs):
            started.append(jobs)
            super().__init__(lambda job: job.run())

    monkeypatch.setattr(fit_module, "ProbePool", Recorder)
    kw = dict(device="sim:gtx-1050-2gb", prompt_len=256, new_tokens=2, max_value=64)
    assert find_max_batch(TINY, 2, jobs=10_000, **kw) == find_max_batch(TINY, 2, **kw)
    assert started == ([usable_cpus()] if usable_cpus() > 1 else [])


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


_KILLED_SEARCH = """
import sys, time
sys.path.insert(0, {here!r})
from test_probe_pool import _SleepingJob
from test_fit_search import WIDE
from gpumem.estimate.probe_pool import ProbePool
if __name__ == "__main__":
    pool = ProbePool(2)
    for key in ("a", "b"):
        pool.submit(key, _SleepingJob(WIDE, 2, "pytorch", "sim:gtx-1050-2gb", 8, 600, 120, 2 << 30, 1 << 30, None, 0,
                                      False))
    while len(pool._executor._processes or {{}}) < 2:
        time.sleep(0.05)
    print(" ".join(str(p) for p in pool._executor._processes), flush=True)
    time.sleep(120)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_workers_end_when_the_search_is_killed():
    """New user 2026-12-03: a `gpumem fit` killed by SIGTERM or SIGKILL left its workers (and the forkserver)
    running with no parent; each worker now ends once the search's process is gone, before its parent has reaped
    it too (a zombie's pid still answers os.kill: review 2026-12-03)."""
    script = _KILLED_SEARCH.format(here=os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_running(p) for p in pids)
        proc.kill()   # not reaped until the end: a zombie meanwhile
        deadline = time.monotonic() + 20
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_running(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()


def _fast_pool(monkeypatch):
    """Worker processes from the first replay on."""
    monkeypatch.setattr(fit_module, "POOL_AFTER_S", 0.0)


@pytest.mark.parametrize("how", ["added", "changed"])
def test_a_policy_added_or_changed_at_run_time_is_replayed_here(how, monkeypatch):
    """Attacker 2026-12-03: a policy added to POLICIES at run time was unknown in the workers (jobs=2 raised where
    jobs=1 answered); a built-in one changed would have been replayed there unchanged. The workers refuse a policy
    other than the search's, and the search replays it itself."""
    from gpumem.allocator.policy import POLICIES

    name = "mine" if how == "added" else "pytorch"
    monkeypatch.setitem(POLICIES, name, dataclasses.replace(POLICIES["pytorch"], name=name,
                                                            round_nbytes=4 * POLICIES["pytorch"].round_nbytes))
    _fast_pool(monkeypatch)
    kw = dict(device="sim:gtx-1050-2gb", prompt_len=256, new_tokens=20, max_value=512, policy=name)
    assert find_max_batch(TINY, 2, jobs=2, **kw) == find_max_batch(TINY, 2, **kw)


def test_a_pool_that_cannot_start_leaves_the_search_to_this_process(monkeypatch, caplog):
    """Attacker 2026-12-03: with no semaphores (no /dev/shm) the pool's start raised out of gpumem fit."""
    def no_pool(jobs):
        raise OSError(38, "Function not implemented")

    _fast_pool(monkeypatch)
    monkeypatch.setattr(fit_module, "ProbePool", no_pool)
    kw = dict(device="sim:gtx-1050-2gb", prompt_len=256, new_tokens=20, max_value=512)
    assert find_max_batch(TINY, 2, jobs=2, **kw) == find_max_batch(TINY, 2, **kw)
    assert "worker processes could not start (OSError" in caplog.text


def test_a_pool_broken_between_two_takes_leaves_the_search_to_this_process():
    """Attacker 2026-12-03: a worker dying between two takes made the next submit raise BrokenProcessPool out of
    the search."""
    class BrokenSubmit(InlinePool):
        def submit(self, key, job):
            if self.taken:
                raise PoolBroken
            super().submit(key, job)

    tables = {100: [v <= 5 for v in range(40)], 200: [v <= 9 for v in range(40)]}
    one, many = FakeReplays(tables, 10), FakeReplays(tables, 10)
    one_tries: list[FitTry] = []
    many_tries: list[FitTry] = []
    want = _search(one.probes(200, one_tries), 100, 200, 16, None, True)
    plain = many.probes(200, many_tries)
    pools = []

    def factory(n):
        pools.append(BrokenSubmit(lambda job: plain._replay(plain._workload(job[0]), job[0], job[1])))
        return pools[-1]

    probes = _Probes(plain._workload, plain._replay, plain._fault, 200, False, NoProgress(), many_tries, 2,
                     lambda v, room: (v, room), lambda p: _search(p, 100, 200, 16, None, True),
                     pool_factory=factory, pool_after_s=0.0)
    assert _search(probes, 100, 200, 16, None, True) == want
    assert many_tries == one_tries and len(pools) == 1 and pools[0].closed


def test_a_shape_that_does_not_pickle_is_replayed_here(monkeypatch):
    """Attacker 2026-12-03: a ModelShape subclass defined in a function could not be sent to a worker."""
    @dataclasses.dataclass(frozen=True)
    class LocalShape(ModelShape):
        pass

    shape = LocalShape(*dataclasses.astuple(TINY))
    _fast_pool(monkeypatch)
    started = []
    monkeypatch.setattr(fit_module, "ProbePool", lambda jobs: started.append(jobs))
    kw = dict(device="sim:gtx-1050-2gb", prompt_len=256, new_tokens=20, max_value=512)
    assert find_max_batch(shape, 2, jobs=2, **kw) == find_max_batch(shape, 2, **kw)
    assert started == []


def test_no_pool_in_a_daemon_process(monkeypatch):
    """Attacker 2026-12-03: inside a daemonic process (a multiprocessing.Pool's worker) jobs=2 raised "daemonic
    processes are not allowed to have children"."""
    import multiprocessing

    from gpumem.estimate.probe_pool import pool_refused

    monkeypatch.setattr(multiprocessing.current_process(), "daemon", True, raising=False)
    job = ProbeJob(WIDE, 2, "pytorch", "sim:gtx-1050-2gb", 8, 600, 120, 2 << 30, 1 << 30, None, 0, False)
    assert "daemon" in pool_refused(job)


def test_the_forkserver_preload_list_of_the_program_is_kept():
    """Attacker 2026-12-03: starting a pool replaced the program's forkserver preload list."""
    import multiprocessing
    import multiprocessing.forkserver

    from gpumem.estimate import probe_pool

    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("no forkserver here")
    server = multiprocessing.forkserver._forkserver
    before = list(server._preload_modules)
    try:
        multiprocessing.set_forkserver_preload(["json"])
        probe_pool._context()
        assert server._preload_modules[0] == "json" and "gpumem.estimate.fit" in server._preload_modules
    finally:
        multiprocessing.set_forkserver_preload(before)


@pytest.mark.parametrize("text, cap", [("200000 100000\n", 2), ("150000 100000\n", 2), ("max 100000\n", None),
                                       ("garbage", None), ("50000 100000", 1)])
def test_usable_cpus_keeps_within_a_cgroup_quota(text, cap, tmp_path):
    from gpumem.estimate.probe_pool import usable_cpus

    path = tmp_path / "cpu.max"
    path.write_text(text)
    free = usable_cpus(str(tmp_path / "none"))
    assert usable_cpus(str(path)) == (free if cap is None else min(free, cap))


def test_a_device_profile_changed_at_run_time_is_replayed_here(monkeypatch, caplog):
    """As replay_inference's workers (test_policy_workers): a fit's workers opened the profile as imported, and their
    answers were another device's."""
    from gpumem.sim import profiles

    monkeypatch.setattr(profiles, "BUILTIN_PROFILES", tuple(
        dataclasses.replace(p, total_nbytes=p.total_nbytes // 2) if p.name == "gtx-1050-2gb" else p
        for p in profiles.BUILTIN_PROFILES))
    _fast_pool(monkeypatch)
    caplog.set_level(logging.INFO)
    kw = dict(device="sim:gtx-1050-2gb", prompt_len=256, new_tokens=20, max_value=512)
    assert find_max_batch(TINY, 2, jobs=2, **kw) == find_max_batch(TINY, 2, **kw)
    assert "profile was changed at run time" in caplog.text
