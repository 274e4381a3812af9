"""gpumem sweep: the table on every executor (inline, local processes, a local Dask cluster), error rows,
bad arguments, the output folder, and the command line end to end."""

from __future__ import annotations

import concurrent.futures as cf
import csv
import itertools
import json
import os
import random
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumem.allocator.policy import POLICIES as POLICIES_ALL
from gpumem.cli import EXIT_OK, EXIT_USAGE, main
from gpumem.replay import replay_trace
from gpumem.report.sweep import (
    COLUMNS,
    TIMING_COLUMNS,
    SweepError,
    SWEEP_FILES,
    SweepStatus,
    make_cases,
    run_sweep,
    write_sweep,
)
from gpumem.trace import Trace, save_trace
from gpumem.units import MiB

DEVICES = ["sim:gtx-1650-4gb", "sim:t4-16gb"]
POLICIES = ["gpumem", "pytorch"]
LIMITS = [None, "64MiB"]


def _trace(name: str, seed: int, n: int = 120) -> Trace:
    """A small trace: allocations of 1 KiB .. 24 MiB, about half freed as it goes, the rest at the end."""
    rng = random.Random(seed)
    ops, live, next_id = [], [], 0
    for _ in range(n):
        if live and rng.random() < 0.45:
            aid, nbytes = live.pop(rng.randrange(len(live)))
            ops.append((1, aid, nbytes, 0, 0.0, 0))
        else:
            nbytes = rng.choice([1024, 4096, 300_000, 2 * MiB + 7, 9 * MiB, 24 * MiB])
            ops.append((0, next_id, nbytes, 0, 0.0, 0))
            live.append((next_id, nbytes))
            next_id += 1
    for aid, nbytes in live:
        ops.append((1, aid, nbytes, 0, 0.0, 0))
    return Trace.from_ops(name, "test", ops)


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> list[str]:
    d = tmp_path_factory.mktemp("traces")
    return [str(save_trace(_trace("small_a", 1), d / "small_a.gmt")),
            str(save_trace(_trace("small_b", 2), d / "small_b.gmt.gz"))]


@pytest.fixture(scope="module")
def inline_result(traces):
    return run_sweep(traces, DEVICES, POLICIES, LIMITS, jobs=1, progress=False)


# -- the table -----------------------------------------------------------------------------------------
def test_one_row_per_combination_in_argument_order(traces, inline_result):
    rows = inline_result.rows
    expected = list(itertools.product(traces, DEVICES, POLICIES, LIMITS))
    assert [(r.trace, r.device, r.policy, r.limit) for r in rows] == expected
    assert [r.index for r in rows] == list(range(len(expected)))
    assert all(r.status == (SweepStatus.OK if r.limit is None else SweepStatus.OOM) for r in rows)
    assert all(r.ran == (r.status == SweepStatus.OK) for r in rows)
    assert all(r.limit_nbytes == (None if r.limit is None else 64 * MiB) for r in rows)


def test_numbers_equal_a_plain_replay(traces, inline_result):
    for row in inline_result.rows[:4]:
        plain = replay_trace(row.trace, row.device, row.policy, limit=row.limit, progress=False)
        assert row.peak_live_bytes == plain.peak_live_bytes
        assert row.peak_reserved_bytes == plain.peak_reserved_bytes
        assert row.overhead == plain.overhead
        assert row.oom_count == plain.ooms
        assert row.oom_op == plain.oom_op
        assert row.completed_ops == plain.completed_ops
        assert row.device_calls == plain.stats.device_calls


def test_local_processes_and_dask_give_identical_numbers(traces, inline_result):
    distributed = pytest.importorskip("distributed")
    local = run_sweep(traces, DEVICES, POLICIES, LIMITS, jobs=2, progress=False)
    assert local.executor == "ProcessPoolExecutor(jobs=2)"
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  worker_dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        on_dask = run_sweep(traces, DEVICES, POLICIES, LIMITS, executor=client.get_executor(), progress=False)
        # a Client passed as the executor itself (its submit returns Dask futures) takes the same path
        on_client = run_sweep(traces[:1], DEVICES[:1], POLICIES, executor=client, progress=False)
        address = client.scheduler.address
    # the record names the cluster, not only the executor's class
    assert address.startswith("tcp://")
    assert on_dask.executor == f"ClientExecutor(scheduler={address})"
    assert on_client.executor == f"Client(scheduler={address})"
    assert local.comparable_rows() == inline_result.comparable_rows()
    assert on_dask.comparable_rows() == inline_result.comparable_rows()
    first = [r for r in inline_result.comparable_rows() if r["trace"] == traces[0] and r["device"] == DEVICES[0]
             and r["limit"] is None]
    assert [{k: v for k, v in r.items() if k != "index"} for r in on_client.comparable_rows()] == \
           [{k: v for k, v in r.items() if k != "index"} for r in first]
    assert all(set(r) == set(COLUMNS) - set(TIMING_COLUMNS) for r in on_dask.comparable_rows())


class _ShuffledExecutor(cf.Executor):
    """Runs the tasks only when a first result is asked for, in a shuffled order."""

    def __init__(self, seed: int) -> None:
        self.pending: list[tuple[cf.Future, object, tuple]] = []
        self.rng = random.Random(seed)

    def submit(self, fn, /, *args, **kwargs):
        fut = _LazyFuture(self)
        self.pending.append((fut, fn, args))
        return fut

    def run_all(self) -> None:
        order = self.pending[:]
        self.pending.clear()
        self.rng.shuffle(order)
        for fut, fn, args in order:
            fut.set_result(fn(*args))


class _LazyFuture(cf.Future):
    def __init__(self, owner: _ShuffledExecutor) -> None:
        super().__init__()
        self.owner = owner

    def result(self, timeout=None):
        if not self.done():
            self.owner.run_all()
        return super().result(timeout)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_row_order_does_not_depend_on_completion_order(traces, inline_result, seed):
    result = run_sweep(traces, DEVICES, POLICIES, LIMITS, executor=_ShuffledExecutor(seed), progress=False)
    assert result.comparable_rows() == inline_result.comparable_rows()


@settings(max_examples=40, deadline=None)
@given(devices=st.lists(st.sampled_from(DEVICES), min_size=1, max_size=2, unique=True),
       policies=st.lists(st.sampled_from(["gpumem", "pytorch", "cupy", "bestfit"]), min_size=1, unique=True),
       limits=st.lists(st.sampled_from([None, "1GiB", "90%", "0.5", 123456789, 1]), min_size=1, unique=True))
def test_cases_are_the_product_in_order(devices, policies, limits):
    cases = make_cases(["a.gmt", "b/c.gmt"], devices, policies, limits)
    assert [(c.trace, c.device, c.policy, c.limit) for c in cases] == list(
        itertools.product(["a.gmt", "b/c.gmt"], devices, policies, [None if x is None else f"{x}B" if isinstance(x, int) else x for x in limits]))
    assert [c.index for c in cases] == list(range(len(cases)))
    assert all(os.path.isabs(c.trace_path) for c in cases)


def test_each_worker_reads_a_trace_once_and_again_when_it_changes(tmp_path):
    import gpumem.report.sweep as sweep_module

    path = tmp_path / "t.gmt"
    save_trace(_trace("t", 5), path)
    cases = make_cases([str(path)], DEVICES[:1], POLICIES)
    before = sweep_module._cached_trace.cache_info()
    first = [sweep_module.run_case(c) for c in cases]
    after = sweep_module._cached_trace.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    save_trace(_trace("t", 6, n=60), path)
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse clocks
    second = sweep_module.run_case(cases[0])
    assert sweep_module._cached_trace.cache_info().misses - after.misses == 1
    assert second.n_ops != first[0].n_ops


# -- failing cases and bad arguments ---------------------------------------------------------------------
def test_a_bad_trace_is_an_error_row_and_the_others_run(traces, tmp_path):
    bad = tmp_path / "bad.gmt"
    bad.write_bytes(b"this is not a trace\n")
    missing = str(tmp_path / "missing.pickle.gz")
    result = run_sweep([traces[0], str(bad), missing], DEVICES[:1], POLICIES[:1], jobs=1, progress=False)
    ok, corrupt, absent = result.rows
    assert ok.status == SweepStatus.OK and ok.error is None
    assert corrupt.status == SweepStatus.ERROR and not corrupt.ran
    assert corrupt.error.startswith("TraceFormatError")
    assert absent.status == SweepStatus.ERROR and absent.error.startswith("FileNotFoundError")
    assert corrupt.peak_reserved_bytes is None and absent.n_ops is None
    assert result.n_errors == 2


def test_an_executor_failure_is_an_error_row(traces):
    class Broken(cf.Executor):
        def submit(self, fn, /, *args, **kwargs):
            fut = cf.Future()
            fut.set_exception(cf.process.BrokenProcessPool("a worker died"))
            return fut

    result = run_sweep(traces[:1], DEVICES[:1], POLICIES, executor=Broken(), progress=False)
    assert [r.status for r in result.rows] == [SweepStatus.ERROR] * 2
    assert all(r.error.startswith("BrokenProcessPool: a worker died (the executor could not run the case")
               for r in result.rows)
    pool = cf.ThreadPoolExecutor(1)
    pool.shutdown()
    result = run_sweep(traces[:1], DEVICES[:1], POLICIES, executor=pool, progress=False)
    assert all(r.error.startswith("RuntimeError: cannot schedule new futures after shutdown") for r in result.rows)


@pytest.mark.parametrize("kwargs, message", [
    (dict(traces=[]), "at least one trace"),
    (dict(traces="a.gmt"), "list of file paths"),
    (dict(traces=[Trace.from_ops("t", "test", [])]), "file paths"),
    (dict(traces=["a.gmt", "a.gmt"]), "trace 'a.gmt' is given twice"),
    (dict(devices=[]), "at least one device"),
    (dict(devices=["sim:t4-16gb", "sim:t4-16gb"]), "given twice"),
    (dict(devices=["gpu0"]), "must look like 'sim:<profile>'"),
    (dict(devices=["sim:no-such-card"]), "unknown simulated profile"),
    (dict(devices=[3]), "spec string"),
    (dict(policies=["tlsf"]), "unknown allocator policy 'tlsf'"),
    (dict(limits=["2.5"]), "limit '2.5'"),
    (dict(limits=[]), "at least one limit"),
    (dict(limits=[True]), "a limit must be"),
    (dict(limits=[2.5]), "limit 2.5"),
    (dict(limits=[0]), "limit 0"),
    (dict(jobs=0), "jobs must be"),
    (dict(jobs=2, executor=cf.ThreadPoolExecutor(1)), "not both"),
    (dict(executor=object()), "submit"),
])
def test_bad_arguments_are_clear_errors_and_run_nothing(tmp_path, kwargs, message):
    args = dict(traces=["a.gmt"], devices=["sim:t4-16gb"], policies=["gpumem"], limits=[None])
    args.update(kwargs)
    calls = []

    class Recording(cf.Executor):
        def submit(self, fn, /, *a, **k):
            calls.append(a)
            raise AssertionError("nothing should run")

    executor = args.pop("executor", None)
    jobs = args.pop("jobs", None)
    with pytest.raises(SweepError, match=message):
        run_sweep(args["traces"], args["devices"], args["policies"], args["limits"],
                  executor=executor if executor is not None or jobs is not None else Recording(), jobs=jobs,
                  progress=False)
    assert calls == []
    assert list(tmp_path.iterdir()) == []


# -- the output folder ---------------------------------------------------------------------------------
def test_write_sweep_files_and_replacing_an_earlier_sweep(inline_result, tmp_path):
    out = tmp_path / "sweep"
    files = write_sweep(inline_result, out)
    assert sorted(f.name for f in files) == ["fit.png", "overhead.png", "peak_reserved.png", "sweep.csv",
                                            "sweep.json", "time_per_op.png"]
    assert set(SWEEP_FILES) <= {f.name for f in files}
    assert all(f.stat().st_size > 0 for f in files)
    assert all(f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in files if f.suffix == ".png")
    data = json.loads((out / "sweep.json").read_text())
    assert data["rows"] == [r.as_dict() for r in inline_result.rows]
    assert data["timing_columns"] == list(TIMING_COLUMNS)
    assert data["figures"] == ["fit.png", "peak_reserved.png", "overhead.png", "time_per_op.png"]
    with open(out / "sweep.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == list(COLUMNS)
    assert [int(r["peak_reserved_bytes"]) for r in table] == [r.peak_reserved_bytes for r in inline_result.rows]
    assert [r["limit"] for r in table] == ["" if r.limit is None else r.limit for r in inline_result.rows]
    # an earlier sweep's folder is replaced as a whole, but only when it holds nothing else
    (out / "stale.txt").write_text("old")
    with pytest.raises(SweepError, match="not an earlier gpumem sweep"):
        write_sweep(inline_result, out, plots=False)
    assert (out / "stale.txt").read_text() == "old"
    (out / "stale.txt").unlink()
    write_sweep(inline_result, out, plots=False)
    assert sorted(p.name for p in out.iterdir()) == ["sweep.csv", "sweep.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["sweep"]


def test_write_sweep_refuses_a_folder_in_use_and_changes_nothing(inline_result, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(SweepError, match="not empty"):
        write_sweep(inline_result, out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(SweepError, match="not a folder"):
        write_sweep(inline_result, tmp_path / "file")
    with pytest.raises(SweepError, match="no such folder"):
        write_sweep(inline_result, tmp_path / "a" / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine"]


def test_a_failure_while_writing_leaves_nothing(inline_result, tmp_path, monkeypatch):
    import gpumem.report.sweep as sweep_module

    def broken(result, folder):
        (Path(folder) / "fit.png").write_bytes(b"half")
        raise RuntimeError("the plotting failed")

    monkeypatch.setattr(sweep_module, "plot_sweep", broken)
    with pytest.raises(RuntimeError, match="plotting failed"):
        write_sweep(inline_result, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# -- the command line ----------------------------------------------------------------------------------
def test_cli_end_to_end(traces, inline_result, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["sweep", *traces, "--device", *DEVICES, "--policy", *POLICIES, "--limit", "none", "64MiB",
                 "--out", str(out), "--jobs", "1"])
    stdout = capsys.readouterr().out
    assert code == EXIT_OK
    assert "small_a" in stdout and "in-process (jobs=1)" in stdout
    data = json.loads((out / "sweep.json").read_text())
    assert [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in data["rows"]] == \
           inline_result.comparable_rows()
    assert len(data["figures"]) == 4


def test_cli_json_and_a_bad_trace(traces, tmp_path, capsys):
    # a file that exists but is no trace is an error row (a missing path is refused before any case runs:
    # tests/commands/test_review_cli_fixes.py)
    out = tmp_path / "out"
    (tmp_path / "nope.gmt").write_text("not a trace\n")
    code = main(["sweep", traces[0], str(tmp_path / "nope.gmt"), "--device", DEVICES[1], "--policy", "all",
                 "--out", str(out), "--jobs", "1", "--json", "--no-plots"])
    captured = capsys.readouterr()
    assert code == EXIT_USAGE
    n = len(POLICIES_ALL)
    assert f"{n} of {2 * n} cases could not run" in captured.err
    data = json.loads(captured.out)
    assert data["files"] == ["sweep.csv", "sweep.json"]
    assert [r["policy"] for r in data["rows"]] == list(POLICIES_ALL) * 2
    assert [r["status"] for r in data["rows"]] == [SweepStatus.OK] * n + [SweepStatus.ERROR] * n
    assert "nope.gmt" in data["rows"][-1]["error"] and str(tmp_path) in data["rows"][-1]["error"]


@pytest.mark.parametrize("argv, message", [
    (["--device", "sim:t4-16gb", "--policy", "nope"], "unknown allocator policy 'nope'"),
    (["--device", "sim:nope", "--policy", "gpumem"], "device sim:nope: unknown simulated profile"),
    (["--device", "sim:t4-16gb", "--policy", "all", "gpumem"], "--policy all names every policy"),
    (["--device", "sim:t4-16gb", "--policy", "gpumem", "--limit", "2.5"], "--limit"),
    (["--device", "sim:t4-16gb", "--policy", "gpumem", "--jobs", "0"], "--jobs"),
    (["--device", "sim:t4-16gb", "--policy", "gpumem", "--jobs", "2", "--scheduler", "tcp://x:1"],
     "not allowed with argument"),
])
def test_cli_bad_arguments(traces, tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) if message in ("--limit", "--jobs", "not allowed with argument") else \
            _no_exit() as caught:
        code = main(["sweep", traces[0], *argv, "--out", str(out)])
    code = caught.value.code if isinstance(caught, pytest.ExceptionInfo) else code
    assert code == EXIT_USAGE
    assert message in capsys.readouterr().err
    assert not out.exists()


class _no_exit:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_cli_without_matplotlib_says_what_to_install(traces, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(["sweep", traces[0], "--device", "sim:t4-16gb", "--policy", "gpumem", "--out", str(tmp_path / "o"),
                 "--jobs", "1"])
    assert code == EXIT_USAGE
    assert "need matplotlib: pip install matplotlib" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert main(["sweep", traces[0], "--device", "sim:t4-16gb", "--policy", "gpumem", "--out", str(tmp_path / "o"),
                 "--jobs", "1", "--no-plots"]) == EXIT_OK
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["sweep.csv", "sweep.json"]


def test_cli_scheduler_without_dask_says_what_to_install(traces, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed -> ImportError
    code = main(["sweep", traces[0], "--device", "sim:t4-16gb", "--policy", "gpumem", "--out", str(tmp_path / "o"),
                 "--scheduler", "tcp://127.0.0.1:8786"])
    assert code == EXIT_USAGE
    assert "pip install 'gpumem[dask]'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# -- on the device under test (simulated profiles by default; --gpumem-device cuda:0 on a GPU) --------------
def test_sweep_on_the_device_under_test_equals_plain_replays(traces, device_spec):
    result = run_sweep(traces[:1], [device_spec], ["gpumem", "bestfit"], jobs=1, progress=False)
    for row in result.rows:
        plain = replay_trace(row.trace, device_spec, row.policy, progress=False)
        assert row.status == (SweepStatus.OK if plain.oom_error is None else SweepStatus.OOM)
        assert (row.peak_live_bytes, row.peak_reserved_bytes, row.completed_ops) == \
               (plain.peak_live_bytes, plain.peak_reserved_bytes, plain.completed_ops)


@pytest.mark.cuda
def test_sweep_on_a_real_gpu_is_the_same_on_worker_processes(traces, device_spec):
    inline = run_sweep(traces, [device_spec], POLICIES, LIMITS, jobs=1, progress=False)
    pooled = run_sweep(traces, [device_spec], POLICIES, LIMITS, jobs=2, progress=False)
    assert all(r.status != SweepStatus.ERROR for r in inline.rows), [r.error for r in inline.rows]
    assert pooled.comparable_rows() == inline.comparable_rows()


_UNGUARDED = """
from gpumem.report.sweep import run_sweep
result = run_sweep([{trace!r}], ["sim:t4-16gb"], ["gpumem", "pytorch"], jobs=2, progress=False)
print("ROWS", [r.status.value if hasattr(r.status, "value") else r.status for r in result.rows])
"""


@pytest.mark.parametrize("how", ["script", "stdin"])
def test_an_unguarded_script_or_stdin_gets_a_clear_error_not_error_rows(traces, tmp_path, how):
    # run_sweep's pool spawns its workers, which import the main script again: an unguarded script would
    # rerun the sweep in every worker, a script read from stdin cannot be imported at all
    import subprocess

    code = _UNGUARDED.format(trace=str(traces[0]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if how == "script":
        script = tmp_path / "unguarded.py"
        script.write_text(code)
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=300)
    else:
        proc = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=300)
    assert proc.returncode != 0, proc.stdout
    assert "ROWS" not in proc.stdout
    assert "SweepError" in proc.stderr
    assert "__main__" in proc.stderr and "jobs=1" in proc.stderr, proc.stderr[-2000:]
