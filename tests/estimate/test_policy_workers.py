"""Note [Policies replayed apart]: replay_inference with ``jobs > 1`` replays a long decode's policies in groups on
worker processes and gives the figures of one process; whatever goes wrong with a worker leaves its group here."""

import dataclasses
import json
import logging
import multiprocessing
import os
import time

import pytest

from gpumem.cli import main
from gpumem.errors import InvalidArgumentError
from gpumem.estimate import ModelShape
from gpumem.estimate import fit as fit_module
from gpumem.estimate.fit import PolicyGroupJob, replay_inference
from gpumem.estimate.policy_workers import PolicyWorkers, split_policies

TINY = ModelShape(512, 1376, 4, 8000, 8, 8)
POLICIES = ("pytorch", "expandable", "gpumem")
KW = dict(prompt_len=128, new_tokens=24)


class CountingBar:
    def __init__(self) -> None:
        self.n = 0

    def update(self, n=1) -> None:
        self.n += n

    def close(self) -> None:
        pass


@pytest.fixture
def apart(monkeypatch):
    """Every decode long enough to replay apart, and the groups counted as they are made."""
    monkeypatch.setattr(fit_module, "APART_STEP_LAYERS", 0)
    monkeypatch.setattr(fit_module, "usable_cpus", lambda: 8)
    made = []
    real = fit_module.PolicyWorkers

    def workers(jobs, bar):
        made.append([j.policies for j in jobs])
        return real(jobs, bar)

    monkeypatch.setattr(fit_module, "PolicyWorkers", workers)
    return made


@pytest.mark.parametrize("policies, jobs, groups", [
    (POLICIES, 2, [(2,), (0, 1)]),
    (POLICIES, 3, [(2,), (0,), (1,)]),
    (POLICIES, 8, [(2,), (0,), (1,)]),
    (POLICIES, 1, [(2, 0, 1)]),
    (("pytorch", "expandable"), 2, [(0,), (1,)]),
    (("gpumem", "pytorch"), 4, [(0,), (1,)]),
])
def test_split_keeps_gpumem_here_and_deals_the_others(policies, jobs, groups):
    assert split_policies(policies, jobs) == groups


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True, "2"])
def test_jobs_that_are_not_a_count_of_processes_are_refused(jobs):
    with pytest.raises(InvalidArgumentError, match="jobs must be a whole number"):
        replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", jobs=jobs, **KW)


@pytest.mark.parametrize("jobs", [2, 3])
def test_policies_apart_give_the_figures_of_one_process(jobs, apart):
    one_bar, many_bar = CountingBar(), CountingBar()
    one = replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", bar=one_bar, **KW)
    many = replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", bar=many_bar, jobs=jobs, **KW)
    assert many == one
    assert [r.policy for r in many] == list(POLICIES)
    assert many_bar.n == one_bar.n   # the workers' steps moved the bar, each once
    assert apart == [[("pytorch", "expandable")]] if jobs == 2 else [[("pytorch",), ("expandable",)]]


def test_an_out_of_memory_replay_apart_stops_as_in_one_process(apart):
    """A limit the decode outgrows: each policy stops where it stops in one process (one of them on the full path)."""
    one = replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", limit=60 << 20, **KW)
    many = replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", limit=60 << 20, jobs=2, **KW)
    assert many == one and not all(r.fits for r in one)


@pytest.mark.parametrize("spec", ["sim:h200-141gb,faults=mem_create:0.5", "sim:h200-141gb,tenants=1"])
def test_a_device_with_faults_or_tenants_stays_in_one_process(spec, apart):
    try:
        one = replay_inference(TINY, 2, POLICIES, spec, **KW)
    except Exception as exc:  # noqa: BLE001 - the spec's own refusal: the same with jobs
        with pytest.raises(type(exc)):
            replay_inference(TINY, 2, POLICIES, spec, jobs=2, **KW)
    else:
        assert replay_inference(TINY, 2, POLICIES, spec, jobs=2, **KW) == one
    assert apart == []


def test_short_decodes_and_one_policy_stay_in_one_process(monkeypatch):
    made = []
    monkeypatch.setattr(fit_module, "PolicyWorkers", lambda jobs, bar: made.append(jobs))
    replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", jobs=2, **KW)   # 24 x 4 block-steps: short
    monkeypatch.setattr(fit_module, "APART_STEP_LAYERS", 0)
    replay_inference(TINY, 2, ("gpumem",), "sim:h200-141gb", jobs=2, **KW)
    replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", jobs=2, full_replay=True, **KW)
    assert made == []


@dataclasses.dataclass(frozen=True)
class _DiesInWorker(PolicyGroupJob):
    """A group whose worker process dies (killed, out of host memory) mid-way; in the estimate's process it
    replays."""

    def run(self, bar=None):
        if multiprocessing.parent_process() is not None:
            if bar is not None:
                bar.update(5)
            os._exit(3)
        return super().run(bar)


@dataclasses.dataclass(frozen=True)
class _FailsInWorker(PolicyGroupJob):
    def run(self, bar=None):
        if multiprocessing.parent_process() is not None:
            raise MemoryError("no host memory in the worker")
        return super().run(bar)


@pytest.mark.parametrize("job_class, why", [(_DiesInWorker, "ended before its replay did"),
                                            (_FailsInWorker, "MemoryError: no host memory in the worker")])
def test_a_worker_that_fails_leaves_its_group_here(job_class, why, apart, monkeypatch, caplog):
    monkeypatch.setattr(fit_module, "PolicyGroupJob", job_class)
    one_bar, many_bar = CountingBar(), CountingBar()
    one = replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", bar=one_bar, **KW)
    with caplog.at_level(logging.WARNING):
        many = replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", bar=many_bar, jobs=2, **KW)
    assert many == one
    assert why in caplog.text and "replayed in this process instead" in caplog.text
    assert many_bar.n == one_bar.n   # the dead worker's steps are not counted twice


def test_a_policy_changed_at_run_time_is_replayed_here(apart, monkeypatch, caplog):
    """A worker starts with the policies as the program imports them: one changed at run time in the estimate's
    process is refused there and replayed here."""
    from gpumem.allocator.policy import POLICIES as REGISTRY

    monkeypatch.setitem(REGISTRY, "pytorch", dataclasses.replace(REGISTRY["pytorch"],
                                                                 round_nbytes=4 * REGISTRY["pytorch"].round_nbytes))
    one = replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", **KW)
    many = replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", jobs=2, **KW)
    assert many == one
    assert "not the caller's here" in caplog.text


def test_no_worker_from_a_daemon_process(apart, monkeypatch, caplog):
    """Refused by design: said once, at INFO, not a warning per group on every call (attacker 2026-12-03)."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(multiprocessing.current_process(), "daemon", True, raising=False)
    one = replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", **KW)
    assert replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", jobs=3, **KW) == one
    said = [r for r in caplog.records if "daemon" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO


def test_numpy_integers_are_a_count_of_processes(apart):
    np = pytest.importorskip("numpy")
    assert replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", jobs=np.int64(2), **KW) == \
        replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", **KW)


def test_a_policy_the_device_refuses_is_refused_before_any_worker_starts(apart):
    """Attacker 2026-12-03: expandable on a device without virtual memory raised only after this process's own
    replay (and a warning that the figures would be the same)."""
    import time as _time

    from gpumem.errors import UnsupportedOperationError

    with pytest.raises(UnsupportedOperationError) as one:
        replay_inference(TINY, 2, POLICIES, "sim:jetson-nano-4gb", **KW)
    with pytest.raises(UnsupportedOperationError) as many:
        replay_inference(TINY, 2, POLICIES, "sim:jetson-nano-4gb", jobs=2, **KW)
    assert str(many.value) == str(one.value)
    assert apart == []


def test_a_device_profile_changed_at_run_time_is_replayed_here(apart, monkeypatch, caplog):
    """Attacker 2026-12-03: a worker opened the profile as imported: figures of another device, without a word."""
    from gpumem.sim import profiles

    monkeypatch.setattr(profiles, "BUILTIN_PROFILES", tuple(
        dataclasses.replace(p, total_nbytes=p.context_nbytes + (80 << 20)) if p.name == "h200-141gb" else p
        for p in profiles.BUILTIN_PROFILES))
    one = replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", **KW)
    many = replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", jobs=3, **KW)
    assert many == one and not all(r.fits for r in one)
    assert "profile was changed at run time" in caplog.text


def test_workers_that_cannot_start_leave_the_groups_here(apart, monkeypatch, caplog):
    """No semaphores or pipes (no /dev/shm): the estimate goes on in one process."""
    from gpumem.estimate import policy_workers

    def no_context():
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(policy_workers, "_context", no_context)
    one = replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", **KW)
    assert replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", jobs=3, **KW) == one
    assert "OSError" in caplog.text


@dataclasses.dataclass(frozen=True)
class _Sleeps:
    def run(self, bar=None):
        time.sleep(60)


@dataclasses.dataclass(frozen=True)
class _IgnoresSigterm:
    def run(self, bar=None):
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        bar.update(1)
        time.sleep(60)


def test_close_kills_a_worker_that_ignores_sigterm():
    """Attacker 2026-12-03: a program whose top level sets a SIGTERM handler hands it to its workers."""
    bar = CountingBar()
    workers = PolicyWorkers([_IgnoresSigterm()], bar)
    deadline = time.perf_counter() + 30
    while workers.progress() == 0 and time.perf_counter() < deadline:
        time.sleep(0.05)
    t0 = time.perf_counter()
    workers.close()
    assert time.perf_counter() - t0 < 5
    assert workers._workers[0].process.exitcode == -9


def test_a_starter_thread_that_cannot_start_leaves_the_group_here(monkeypatch, caplog):
    """Attacker 2026-12-03: "can't start new thread" (a pids limit) escaped, leaving the workers started."""
    import threading

    from gpumem.estimate import policy_workers

    real = threading.Thread.start
    calls = []

    def start(self):
        calls.append(self.name)
        if self.name == "gpumem-estimate-start" and calls.count(self.name) == 2:
            raise RuntimeError("can't start new thread")
        return real(self)

    monkeypatch.setattr(policy_workers.threading.Thread, "start", start)
    bar = CountingBar()
    workers = PolicyWorkers([_Counts(2), _Counts(3)], bar)
    try:
        assert workers.result(0) == ["done"]
        assert workers.result(1) is None
    finally:
        workers.close()
    assert "can't start new thread" in caplog.text


@dataclasses.dataclass(frozen=True)
class _Killed:
    def run(self, bar=None):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_by_a_signal_is_said_so(caplog):
    workers = PolicyWorkers([_Killed()], CountingBar())
    try:
        assert workers.result(0) is None
    finally:
        workers.close()
    assert "killed by signal 9" in caplog.text and "__main__" not in caplog.text


def test_close_ends_a_worker_without_waiting_for_it():
    workers = PolicyWorkers([_Sleeps()], CountingBar())
    t0 = time.perf_counter()
    workers.close()
    assert time.perf_counter() - t0 < 10
    assert not workers._workers[0].process.is_alive()


@dataclasses.dataclass(frozen=True)
class _Counts:
    steps: int

    def run(self, bar=None):
        for _ in range(self.steps):
            bar.update(1)
        return ["done"]


def test_a_worker_moves_the_bar_by_its_steps():
    bar = CountingBar()
    workers = PolicyWorkers([_Counts(7), _Counts(3)], bar)
    try:
        assert workers.result(0) == ["done"] and workers.result(1) == ["done"]
    finally:
        workers.close()
    assert bar.n == 10


SHAPE = ["--hidden-size", "512", "--intermediate-size", "1376", "--layers", "4", "--vocab-size", "8000", "--heads",
         "8", "--prompt-len", "128", "--new-tokens", "24"]


@pytest.mark.parametrize("value", ["0", "-1"])
def test_estimate_jobs_below_one_is_refused_by_its_option_name(value, capsys):
    assert main(["estimate", *SHAPE, "--jobs", value]) == 2
    assert f"gpumem estimate: --jobs {value}: the processes to replay on must be 1 or more" in capsys.readouterr().err


def test_estimate_prints_the_same_on_one_process_and_several(apart, capsys):
    outs = []
    for jobs in ("1", "2"):
        assert main(["estimate", *SHAPE, "--json", "--jobs", jobs]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1]
    assert apart == [[("pytorch", "expandable")]]


def test_a_folder_named_gpumem_in_the_working_directory_is_not_this_package(tmp_path):
    from gpumem.estimate.probe_pool import _shadowed

    assert not _shadowed(str(tmp_path))
    (tmp_path / "gpumem").mkdir()
    assert _shadowed(str(tmp_path))
    assert not _shadowed(os.path.dirname(os.path.dirname(os.path.dirname(fit_module.__file__))))
    other = tmp_path / "other"
    other.mkdir()
    (other / "gpumem.py").write_text("print('the program s own gpumem.py')\n")
    assert _shadowed(str(other))   # attacker 2026-12-03: the forkserver ran it, its print in --json's output
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "gpumem").write_text("")   # a file without .py: not importable, not a shadow
    assert not _shadowed(str(tmp_path / "file"))


def test_workers_start_from_a_folder_that_holds_a_clone(tmp_path):
    """New user 2026-12-03: run from the folder holding a clone (a folder named gpumem there), every worker imported
    that folder as the package and failed, with a traceback, even with --json."""
    import shutil
    import subprocess
    import sys

    exe = shutil.which("gpumem", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("no gpumem command beside this Python")
    (tmp_path / "gpumem").mkdir()
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "gpumem.py").write_text("print('SHADOW')\n")
    args = [exe, "estimate", "--hidden-size", "4096", "--intermediate-size", "11008", "--layers", "32",
            "--vocab-size", "32000", "--heads", "32", "--prompt-len", "2048", "--new-tokens", "3000", "--json", "-v"]
    done = subprocess.run([*args, "--jobs", "2"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "replayed on 2 processes" in done.stderr
    assert "Traceback" not in done.stderr and "instead" not in done.stderr
    done = subprocess.run([*args, "--jobs", "2"], cwd=tmp_path / "mod", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "SHADOW" not in done.stdout, done.stderr[-2000:]
    json.loads(done.stdout)
    assert "Traceback" not in done.stderr and "instead" not in done.stderr


def test_a_removed_working_directory_shadows_nothing(tmp_path, monkeypatch):
    from gpumem.estimate.probe_pool import _shadowed

    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert not _shadowed()


def test_a_worker_with_another_copy_of_gpumem_refuses_and_the_group_is_replayed_here(apart, monkeypatch, caplog):
    """Attacker 2026-12-03: a script in a clone, gpumem installed too: the forkserver imported the installed copy,
    and the workers' figures were another copy's, without a word."""
    monkeypatch.setattr(fit_module, "PACKAGE_DIR", "/another/copy")
    one = replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", **KW)
    assert replay_inference(TINY, 2, POLICIES, "sim:h200-141gb", jobs=2, **KW) == one
    assert "from /another/copy by the caller" in caplog.text


def test_the_forkserver_preloads_nothing_where_its_path_finds_another_copy(tmp_path, monkeypatch):
    from gpumem.estimate import probe_pool

    (tmp_path / "gpumem").mkdir()
    (tmp_path / "gpumem" / "__init__.py").write_text("")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the working directory comes first on the forkserver's path
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert probe_pool._other_copy_first()
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.dirname(fit_module.__file__))))
    assert not probe_pool._other_copy_first()
