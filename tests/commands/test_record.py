"""`gpumem record`, gpumem.record() and snapshot_on_oom, without a GPU: a fake torch (fake_torch/torch) stands in.

The command's tests run it end to end in a child process with the fake torch on PYTHONPATH; the library's
tests load the fake into sys.modules for the test only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpumem
from gpumem.cli import EXIT_USAGE, main
from gpumem.commands.record import child_command
from gpumem.cli import _UsageError
from gpumem.errors import BackendUnavailableError, InvalidArgumentError
from gpumem.trace import load_trace

ROOT = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).resolve().parent / "fake_torch"

PROGRAM = """\
import sys, torch
keep = [torch.cuda.fake_alloc(1000 * (i + 1)) for i in range(5)]
torch.cuda.fake_free(keep.pop(0))
open("ran.marker", "w").write("ran")
what = sys.argv[1] if len(sys.argv) > 1 else ""
if what == "oom":
    torch.cuda.fake_alloc(10 << 20)
elif what == "raise":
    raise ValueError("the program failed")
elif what == "exit3":
    sys.exit(3)
elif what == "sleep":
    print("ready", flush=True)
    import time; time.sleep(60)
"""


def _env(fake: bool = True, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUMEM_", "FAKE_TORCH"))}
    env["PYTHONPATH"] = os.pathsep.join(([str(FAKE)] if fake else []) + [str(ROOT)])
    env.update(extra)
    return env


def _record(tmp_path: Path, *args: str, fake: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "prog.py").write_text(PROGRAM)
    return subprocess.run([sys.executable, "-m", "gpumem", "record", *args], cwd=tmp_path, env=_env(fake, **env),
                          capture_output=True, text=True, timeout=120)


# -- parsing -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command, expected", [
    (["--", "python", "t.py", "a"], ["python", "-m", "gpumem.record_child", "t.py", "a"]),
    (["python", "-u", "-X", "dev", "t.py"], ["python", "-u", "-X", "dev", "-m", "gpumem.record_child", "t.py"]),
    (["python", "-m", "pkg.train", "--lr", "1"], ["python", "-m", "gpumem.record_child", "-m", "pkg.train", "--lr", "1"]),
    (["python", "-c", "print(1)"], ["python", "-m", "gpumem.record_child", "-c", "print(1)"]),
])
def test_child_command_rewrites_the_interpreter_line(command: list[str], expected: list[str]) -> None:
    assert child_command(command) == expected


@pytest.mark.parametrize("command, words", [
    ([], "no program given"),
    (["--"], "no program given"),
    (["ls", "-l"], "must be started by a Python interpreter"),
    (["python"], "no program given after the interpreter"),
    (["python", "-"], "standard input"),
    (["python", "-I", "t.py"], "'-I' is not supported"),
    (["python", "-m"], "-m needs an argument"),
    (["python7.99", "t.py"], "no such Python interpreter"),
])
def test_child_command_refuses_what_it_cannot_record(command: list[str], words: str) -> None:
    with pytest.raises(_UsageError, match=words.replace("(", r"\(")):
        child_command(command)


def test_help_explains_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["record", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for words in ("snapshot.pickle", "--allocator", "--report", "record.json", "runs nothing", "exit status"):
        assert words in out
    # the output folder is --out DIR throughout: no other name for it (the epilog once said OUT/oom)
    assert "OUT/" not in out and "DIR/oom" in out


def test_bad_options_run_nothing(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    r = _record(tmp_path, "--out", "full", "--", "python", "prog.py")
    assert r.returncode == EXIT_USAGE and "is not empty" in r.stderr
    assert not (tmp_path / "ran.marker").exists() and os.listdir(tmp_path / "full") == ["keep.txt"]
    r = _record(tmp_path, "--max-entries", "0", "--", "python", "prog.py")
    assert r.returncode == EXIT_USAGE and "--max-entries" in r.stderr and not (tmp_path / "ran.marker").exists()
    r = _record(tmp_path, "--out", "no/such/dir", "--", "python", "prog.py")
    assert r.returncode == EXIT_USAGE and "no such folder" in r.stderr


# -- the one-line refusal ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fake, env, reason", [
    (True, {"FAKE_TORCH_CUDA": "0"}, "PyTorch sees no CUDA device"),
    (False, {}, "PyTorch is not installed"),
])
def test_no_cuda_or_no_torch_is_one_line_and_runs_nothing(tmp_path: Path, fake: bool, env: dict[str, str],
                                                          reason: str) -> None:
    if not fake and importlib.util.find_spec("torch") is not None:
        pytest.skip("PyTorch is installed here")
    r = _record(tmp_path, "--out", "run", "--", "python", "prog.py", fake=fake, **env)
    assert r.returncode == EXIT_USAGE
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("gpumem record: cannot record: " + reason) and "not run" in lines[0]
    assert not (tmp_path / "ran.marker").exists()
    assert not (tmp_path / "run").exists()  # the folder it made is removed again


# -- end to end with the fake torch ----------------------------------------------------------------------------
def _status(out: Path) -> dict:
    return json.loads((out / "record.json").read_text())


def test_record_writes_a_snapshot_gpumem_reads_and_a_report(tmp_path: Path) -> None:
    r = _record(tmp_path, "--out", "run", "--report", "--", "python", "prog.py")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "run"
    trace = load_trace(out / "snapshot.pickle")
    assert trace.n_allocs == 5 and trace.n_ops == 6
    st = _status(out)
    assert st["status"] == "done" and st["exit_status"] == 0 and st["allocator"] == "pytorch"
    assert (out / "report" / "index.html").is_file()
    assert "snapshot written to run/snapshot.pickle" in r.stderr and "report written to" in r.stdout


@pytest.mark.parametrize("what, code, ended_by", [("exit3", 3, "SystemExit"), ("raise", 1, "ValueError")])
def test_exit_status_is_the_programs_and_the_snapshot_is_written(tmp_path: Path, what: str, code: int,
                                                                 ended_by: str) -> None:
    r = _record(tmp_path, "--out", "run", "--", "python", "prog.py", what)
    assert r.returncode == code, r.stderr
    assert _status(tmp_path / "run")["ended_by"] == ended_by
    assert load_trace(tmp_path / "run" / "snapshot.pickle").n_allocs == 5
    if what == "raise":  # the traceback is the program's, as python prog.py would print it
        assert "ValueError: the program failed" in r.stderr and 'File "prog.py", line 9' in r.stderr
        assert "record_child" not in r.stderr and "runpy" not in r.stderr


def test_oom_writes_the_snapshot_and_report_before_the_error(tmp_path: Path) -> None:
    r = _record(tmp_path, "--out", "run", "--", "python", "prog.py", "oom")
    assert r.returncode == 1 and "torch.OutOfMemoryError" in r.stderr
    oom = _status(tmp_path / "run")["oom_snapshots"]
    assert len(oom) == 1 and oom[0]["requested_nbytes"] == 10 << 20
    text = Path(tmp_path / oom[0]["report"]).read_text()
    assert "tried to allocate 10.00 MiB" in text and "prog.py:2 in <listcomp>" in text and "4 buffer(s)" in text
    # PyTorch's observer gets (device, requested, the device's total, free): the H200 record read the total
    # as the bytes allocated ("PyTorch: 139.80 GiB allocated")
    assert "free of 1.00 MiB total" in text and "PyTorch on cuda:0: 13.67 KiB allocated, 13.67 KiB reserved" in text
    assert load_trace(tmp_path / oom[0]["snapshot"]).n_allocs == 5
    # the written before the error reached the program: the observer's log line comes before the traceback
    assert r.stderr.index("out of memory on cuda:0 (10.00 MiB requested)") < r.stderr.index("Traceback")


def test_oom_dir_from_the_environment(tmp_path: Path) -> None:
    r = _record(tmp_path, "--out", "run", "--", "python", "prog.py", "oom", GPUMEM_OOM_SNAPSHOT_DIR="elsewhere")
    assert r.returncode == 1
    assert len(list((tmp_path / "elsewhere").glob("oom-*.txt"))) == 1 and not (tmp_path / "run" / "oom").exists()


@pytest.mark.parametrize("sig, ended_by", [(signal.SIGTERM, "Terminated"), (signal.SIGINT, "KeyboardInterrupt")])
def test_a_signal_writes_the_snapshot_and_ends_by_the_signal(tmp_path: Path, sig: int, ended_by: str) -> None:
    """SIGTERM to gpumem record goes on to the program; SIGINT goes to the whole process group, as Ctrl-C in a
    terminal does (gpumem record itself waits for the program to write its snapshot).

    SIGINT starts at its default in the command, as in a terminal: a test run started with SIGINT ignored (a
    background job of a shell without job control) passes the ignoring on, and a program that ignores SIGINT
    ignores it under gpumem record too, as Python itself would (found failing a README check by sleeping 60 s)."""
    (tmp_path / "prog.py").write_text(PROGRAM)
    proc = subprocess.Popen([sys.executable, "-m", "gpumem", "record", "--out", "run", "--", "python", "prog.py",
                             "sleep"], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + sig, err
    assert _status(tmp_path / "run")["ended_by"] == ended_by
    assert load_trace(tmp_path / "run" / "snapshot.pickle").n_allocs == 5


# -- the library, with the fake torch in sys.modules -------------------------------------------------------------
@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch):
    from gpumem import recording

    for name in ("torch", "torch.cuda", "torch.cuda.memory", "torch._C"):
        monkeypatch.setitem(sys.modules, name, None)  # restored (removed) after the test
    spec = importlib.util.spec_from_file_location("torch", FAKE / "torch" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["torch"] = module
    spec.loader.exec_module(module)
    monkeypatch.delenv("GPUMEM_OOM_SNAPSHOT_DIR", raising=False)
    recording._oom_hook.cache_clear()
    yield module
    recording._oom_hook.cache_clear()


def test_context_manager_writes_the_snapshot(fake_torch, tmp_path: Path) -> None:
    with gpumem.record(out=tmp_path / "r1") as rec:
        a = fake_torch.cuda.fake_alloc(4096)
        fake_torch.cuda.fake_alloc(8192)
        fake_torch.cuda.fake_free(a)
    assert rec.result is not None and rec.result.snapshot_path == tmp_path / "r1" / "snapshot.pickle"
    assert load_trace(rec.result.snapshot_path).n_allocs == 2
    calls = fake_torch.cuda.fake_state.history_calls
    assert calls[0]["enabled"] == "all" and calls[0]["context"] == "all" and calls[-1]["enabled"] is None


def test_context_manager_writes_the_snapshot_when_the_block_raises(fake_torch, tmp_path: Path) -> None:
    with pytest.raises(fake_torch.OutOfMemoryError):
        with gpumem.record(out=tmp_path / "r2", oom_dir=tmp_path / "oom") as rec:
            fake_torch.cuda.fake_alloc(4096)
            fake_torch.cuda.fake_alloc(2 << 20)
    assert load_trace(rec.result.snapshot_path).n_allocs == 1
    assert len(list((tmp_path / "oom").glob("oom-cuda-0-*.pickle"))) == 1


def test_context_manager_bad_input(fake_torch, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="allocator must be one of"):
        gpumem.record(out=tmp_path, allocator="tensorflow")
    with pytest.raises(InvalidArgumentError, match="max_entries"):
        gpumem.record(out=tmp_path, max_entries=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgumentError, match="not a folder"):
        gpumem.record(out=tmp_path / "file").start()
    assert fake_torch.cuda.fake_state.history_calls == []  # nothing was turned on


def test_context_manager_without_cuda(fake_torch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_TORCH_CUDA", "0")
    with pytest.raises(BackendUnavailableError, match="no CUDA device"):
        with gpumem.record(out=tmp_path / "r"):
            pass
    assert not (tmp_path / "r").exists()


def test_snapshot_on_oom_opt_in_and_off(fake_torch, tmp_path: Path) -> None:
    import gpumem.torch

    fake_torch.cuda.fake_alloc(1000)
    with pytest.raises(fake_torch.OutOfMemoryError):
        fake_torch.cuda.fake_alloc(2 << 20)
    assert not list(tmp_path.iterdir())  # not opted in: nothing
    gpumem.snapshot_on_oom(tmp_path / "oom")
    fake_torch.cuda.fake_alloc(3000)
    with pytest.raises(fake_torch.OutOfMemoryError):
        fake_torch.cuda.fake_alloc(2 << 20)
    reports = list((tmp_path / "oom").glob("*.txt"))
    assert len(reports) == 1 and "test_record.py" in reports[0].read_text()
    gpumem.snapshot_on_oom(None)
    with pytest.raises(fake_torch.OutOfMemoryError):
        fake_torch.cuda.fake_alloc(2 << 20)
    assert len(list((tmp_path / "oom").glob("*.txt"))) == 1
    with pytest.raises(InvalidArgumentError):
        gpumem.snapshot_on_oom(tmp_path, max_entries=-1)


def test_a_failing_oom_write_never_hides_the_error(fake_torch, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    gpumem.snapshot_on_oom(tmp_path / "file" / "oom")  # cannot be created
    with pytest.raises(fake_torch.OutOfMemoryError):
        fake_torch.cuda.fake_alloc(2 << 20)


# -- gpumem's native history ----------------------------------------------------------------------------------
def test_snapshot_from_native_events_per_device(tmp_path: Path) -> None:
    from gpumem.recording import snapshot_from_events
    from gpumem.trace import save_pytorch_snapshot

    events = [
        (1, 0, 0x9000, 64, 0, 0.5),         # a free of memory allocated before the history: skipped
        (0, 0, 0x1000, 512, 0, 1.0),
        (0, 1, 0x2000, 1024, 7, 2.0),
        (1, 0, 0x1000, 512, 0, 3.0),
        (0, 0, 0x1000, 256, 0, 4.0),        # the address again, after its free
        (2, 0, 0, 1 << 30, 0, 5.0),
    ]
    snap = snapshot_from_events(events, free_nbytes={0: 123})
    path = save_pytorch_snapshot(snap, tmp_path / "s.pickle")
    t0 = load_trace(path, device=0)
    t1 = load_trace(path, device=1)
    assert (t0.n_allocs, t1.n_allocs) == (2, 1)
    ooms = [e for e in snap["device_traces"][0] if e["action"] == "oom"]
    assert ooms == [{"action": "oom", "addr": 0, "size": 1 << 30, "stream": 0, "time_us": 5.0, "frames": [],
                     "device_free": 123}]


def test_gpumem_oom_observer_writes_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumem import recording
    import gpumem.torch as gtorch

    hook = recording._OomHook(directory=tmp_path)
    monkeypatch.setattr(recording, "_native_events", lambda: ([(0, 0, 0x1000, 4096, 0, 1.0)], 0))
    monkeypatch.setattr(gtorch, "memory_summary", lambda device=None: "gpumem memory summary, cuda:0 (fake)")
    hook.on_gpumem_oom(0, 1 << 20, 100, 1 << 30)
    assert len(hook.records) == 1
    text = hook.records[0].report_path.read_text()
    assert "gpumem memory summary, cuda:0 (fake)" in text and "tracked live buffers: 1, 4.00 KiB" in text
    assert load_trace(hook.records[0].snapshot_path).n_allocs == 1


def test_native_history_without_a_gpu() -> None:
    from gpumem import recording
    from gpumem.native import engine

    if engine() != "native":
        pytest.skip("no native engine")
    lib = recording._native()
    assert lib.gpumem_torch_record_history(10) == 0
    events, dropped = recording._native_events()
    assert (events, dropped) == ([], 0)
    assert lib.gpumem_torch_record_history(0) == 0


def test_a_pytorch_oom_entry_without_addr_is_read(tmp_path: Path) -> None:
    """PyTorch writes an ``oom`` trace entry with ``device_free`` and no ``addr``; the H200 record's
    ``gpumem report`` of an out-of-memory run failed on it ("entry 63: 'addr' is missing")."""
    import pickle

    from gpumem.trace import save_pytorch_snapshot, to_pytorch_snapshot
    from gpumem.trace.model import Trace

    trace = Trace.from_ops("t", "test", [(0, 0, 4096, 0, 1, 0x1000), (0, 1, 8192, 0, 2, 0x3000)])
    snap = to_pytorch_snapshot(trace)
    snap["device_traces"][0].append({"action": "oom", "size": 1 << 30, "stream": 0, "time_us": 3,
                                     "device_free": 1 << 20, "frames": []})
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(snap))
    t = load_trace(path)
    assert t.n_allocs == 2 and t.n_failed_allocs == 1
    bad = tmp_path / "bad.pickle"  # an alloc without addr is still refused, naming the entry
    snap["device_traces"][0][0].pop("addr")
    save_pytorch_snapshot(snap, bad)
    with pytest.raises(gpumem.TraceFormatError, match="entry 0: 'addr' is missing"):
        load_trace(bad)


@st.composite
def _histories(draw):
    """Native histories: allocations at fresh addresses and frees of live ones, on devices 0 and 1."""
    events, live, next_addr = [], {0: [], 1: []}, 0x10000
    for t in range(draw(st.integers(0, 60))):
        dev = draw(st.integers(0, 1))
        if live[dev] and draw(st.booleans()):
            addr = live[dev].pop(draw(st.integers(0, len(live[dev]) - 1)))
            events.append((1, dev, addr, 0, 0, float(t)))
        else:
            nbytes = draw(st.integers(1, 1 << 20))
            events.append((0, dev, next_addr, nbytes, 0, float(t)))
            live[dev].append(next_addr)
            next_addr += 1 << 21
    return events, {d: len(v) for d, v in live.items()}


@settings(max_examples=40, deadline=None)
@given(_histories())
def test_snapshot_from_events_keeps_every_allocation(tmp_path_factory: pytest.TempPathFactory, history) -> None:
    """Property: per device, the snapshot read back holds every recorded allocation and the same live set."""
    from gpumem.recording import snapshot_from_events
    from gpumem.trace import save_pytorch_snapshot

    events, live = history
    path = save_pytorch_snapshot(snapshot_from_events(events), tmp_path_factory.mktemp("h") / "s.pickle")
    for dev in (0, 1):
        n = sum(1 for e in events if e[0] == 0 and e[1] == dev)
        if n == 0:
            continue
        t = load_trace(path, device=dev)
        assert t.n_allocs == n and t.n_live_at_end == live[dev]


# -- review findings (each failed before its fix) ------------------------------------------------------------------
def test_a_program_that_changes_folder_still_gets_its_snapshot(tmp_path: Path) -> None:
    """A relative --out went to the child as is: a program that chdir'd wrote nowhere (the snapshot and the
    status file failed), the child ended with a traceback and status 1, and gpumem record said "the recorder
    did not start" and removed the folder."""
    (tmp_path / "sub").mkdir()
    r = _record(tmp_path, "--out", "run", "--", "python", "-c",
                "import os, torch; os.chdir('sub'); torch.cuda.fake_alloc(4096); torch.cuda.fake_alloc(2 << 20)",
                GPUMEM_OOM_SNAPSHOT_DIR="oomdir")
    assert r.returncode == 1 and "Traceback" in r.stderr and "record_child" not in r.stderr, r.stderr
    assert load_trace(tmp_path / "run" / "snapshot.pickle").n_allocs == 1
    assert len(list((tmp_path / "oomdir").glob("oom-*.txt"))) == 1  # relative to where gpumem record ran
    assert not any((tmp_path / "sub").iterdir())
    assert "snapshot written to run/snapshot.pickle" in r.stderr


def test_os_exit_is_not_called_a_failed_start(tmp_path: Path) -> None:
    """A program ending by os._exit(3) was reported as "the recorder did not start ... can python import gpumem
    and torch?" and its output folder removed."""
    r = _record(tmp_path, "--out", "run", "--", "python", "-c", "import os, torch; torch.cuda.fake_alloc(8); os._exit(3)")
    assert r.returncode == 3
    assert "did not start" not in r.stderr and "os._exit" in r.stderr, r.stderr
    st = _status(tmp_path / "run")
    assert st["status"] == "ended without snapshot" and st["exit_status"] == 3


def test_two_recordings_never_share_a_folder(tmp_path: Path) -> None:
    """`gpumem record -- python -m gpumem record -- python prog.py` (or two runs started in the same second
    without --out) wrote both recordings into one default folder: the outer snapshot replaced the inner one."""
    r = _record(tmp_path, "--", "python", "-m", "gpumem", "record", "--", "python", "prog.py")
    assert r.returncode == 0, r.stderr
    folders = sorted(p for p in tmp_path.iterdir() if p.name.startswith("gpumem-record-"))
    assert len(folders) == 2, folders
    assert sorted(_status(f)["n_events"] > 0 for f in folders) == [False, True]
    # an explicit empty folder that another recording has claimed is refused, and left as it is
    (tmp_path / "claimed").mkdir()
    (tmp_path / "claimed" / "record.json").write_text('{"status": "running"}')
    r = _record(tmp_path, "--out", "claimed", "--", "python", "prog.py")
    assert r.returncode == EXIT_USAGE and "not empty" in r.stderr
    assert (tmp_path / "claimed" / "record.json").read_text() == '{"status": "running"}'


def test_a_failed_status_write_keeps_the_programs_exit_status(tmp_path: Path) -> None:
    """A program that removes the output folder: the child ended with a traceback (status 1, not the
    program's 0) and gpumem record said the recorder did not start."""
    r = _record(tmp_path, "--out", "run", "--", "python", "-c",
                "import os, shutil, torch; torch.cuda.fake_alloc(8); shutil.rmtree(os.environ['GPUMEM_RECORD_OUT']);"
                "open(os.environ['GPUMEM_RECORD_OUT'], 'w').write('mine')")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "did not start" not in r.stderr
    assert "could not write the snapshot" in r.stderr and (tmp_path / "run").read_text() == "mine"


def test_max_entries_past_64_bits_is_refused(tmp_path: Path) -> None:
    """ctypes passed --max-entries 2**64 to gpumem's history as 0, which turns the history off: a recording of
    nothing; 2**64 + 5 kept 5 events."""
    r = _record(tmp_path, "--out", "run", "--max-entries", str(2 ** 64), "--", "python", "prog.py")
    assert r.returncode == EXIT_USAGE and "--max-entries" in r.stderr and not (tmp_path / "run").exists()
    with pytest.raises(InvalidArgumentError, match="max_entries"):
        gpumem.record(out=tmp_path / "r", max_entries=2 ** 64 + 5)
    with pytest.raises(InvalidArgumentError, match="max_entries"):
        gpumem.snapshot_on_oom(tmp_path, max_entries=2 ** 64)


def test_an_empty_oom_dir_variable_does_not_turn_the_oom_files_off(tmp_path: Path) -> None:
    """GPUMEM_OOM_SNAPSHOT_DIR= (empty) was passed on as is: no out-of-memory files at all, although the help
    says OUT/oom."""
    r = _record(tmp_path, "--out", "run", "--", "python", "prog.py", "oom", GPUMEM_OOM_SNAPSHOT_DIR="")
    assert r.returncode == 1
    assert len(list((tmp_path / "run" / "oom").glob("oom-*.txt"))) == 1


def test_a_recording_gives_back_the_oom_folder_it_found(fake_torch, tmp_path: Path) -> None:
    """snapshot_on_oom(A), then a recording with its own oom_dir: at its end the hook was turned off, so later
    out-of-memory errors wrote nothing to A."""
    gpumem.snapshot_on_oom(tmp_path / "a")
    with gpumem.record(out=tmp_path / "r", oom_dir=tmp_path / "b"):
        with pytest.raises(fake_torch.OutOfMemoryError):
            fake_torch.cuda.fake_alloc(2 << 20)
    with pytest.raises(fake_torch.OutOfMemoryError):
        fake_torch.cuda.fake_alloc(2 << 20)
    assert len(list((tmp_path / "b").glob("*.txt"))) == 1 and len(list((tmp_path / "a").glob("*.txt"))) == 1


def test_oom_folder_is_the_one_named_before_a_chdir(fake_torch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """snapshot_on_oom("oom") resolved the folder at the error: after a chdir the files went elsewhere."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    gpumem.snapshot_on_oom("oom")
    with gpumem.record(out="rec") as rec:
        monkeypatch.chdir(tmp_path / "sub")
        with pytest.raises(fake_torch.OutOfMemoryError):
            fake_torch.cuda.fake_alloc(2 << 20)
    assert len(list((tmp_path / "oom").glob("*.txt"))) == 1 and not any((tmp_path / "sub").iterdir())
    assert rec.result.snapshot_path == tmp_path / "rec" / "snapshot.pickle" and rec.result.snapshot_path.is_file()


def test_a_recording_never_overwrites_a_snapshot(fake_torch, tmp_path: Path) -> None:
    """gpumem.record(out) into a folder that holds a snapshot replaced it without a word (the command refuses
    a folder that is not empty)."""
    with gpumem.record(out=tmp_path / "r"):
        fake_torch.cuda.fake_alloc(4096)
    first = (tmp_path / "r" / "snapshot.pickle").read_bytes()
    with pytest.raises(InvalidArgumentError, match="already holds a snapshot"):
        gpumem.record(out=tmp_path / "r").start()
    assert (tmp_path / "r" / "snapshot.pickle").read_bytes() == first
    assert fake_torch.cuda.fake_state.history_calls[-1]["enabled"] is None  # the refusal turned nothing on


def test_the_guide_runs_as_written(tmp_path: Path) -> None:
    """docs/out-of-memory.md, followed literally (with the fake torch, prog.py standing in for
    examples/train_small.py): every `gpumem ...` line parses, and steps 1 and 2 run in order. Step 2's
    `gpumem report run1/snapshot.pickle --out run1/report ...` failed: step 1's --report had made run1/report."""
    import glob
    import re
    import shlex

    from gpumem.cli import build_parser

    text = (ROOT / "docs" / "out-of-memory.md").read_text()
    lines = [ln.split("  #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for ln in block.splitlines() if ln.strip().startswith("gpumem ")]
    assert len(lines) >= 6
    ran = 0
    for line in lines:
        words = shlex.split(line)
        build_parser().parse_args(words[1:])  # spelled right: an unknown option or command exits here
        if words[1] not in ("record", "report", "replay") or "--allocator" in words:
            continue  # fit/estimate need a config.json; --allocator gpumem needs PyTorch's pluggable allocator
        words = [w for ww in words for w in (sorted(glob.glob(ww, root_dir=tmp_path)) or [ww] if "*" in ww else [ww])]
        words = [{"examples/train_small.py": "prog.py", "--oom": "oom"}.get(w, w) for w in words]
        r = _record(tmp_path, *words[2:]) if words[1] == "record" else subprocess.run(
            [sys.executable, "-m", "gpumem", *words[1:]], cwd=tmp_path, env=_env(), capture_output=True, text=True,
            timeout=300)
        assert r.returncode == (1 if words[1] == "record" else 0), (line, r.stderr)
        ran += 1
    assert ran >= 3  # record, report, report of the OOM snapshot


def test_a_program_that_retries_after_oom_does_not_fill_the_disk(tmp_path: Path) -> None:
    """A program catching the error and retrying wrote one full snapshot per error (60 here; hundreds of MB each
    with a long history): at most MAX_OOM_SNAPSHOTS, the rest counted."""
    from gpumem.recording import MAX_OOM_SNAPSHOTS

    r = _record(tmp_path, "--out", "run", "--", "python", "-c",
                "import torch\nfor _ in range(60):\n    try: torch.cuda.fake_alloc(2 << 20)\n"
                "    except torch.OutOfMemoryError: pass")
    assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "run" / "oom").glob("*.pickle"))) == MAX_OOM_SNAPSHOTS
    st = _status(tmp_path / "run")
    assert len(st["oom_snapshots"]) == MAX_OOM_SNAPSHOTS and st["oom_skipped"] == 60 - MAX_OOM_SNAPSHOTS
    assert f"{60 - MAX_OOM_SNAPSHOTS} later out-of-memory errors were not written" in r.stderr
    assert r.stderr.count("later out-of-memory errors are not written") == 1  # logged once


def test_concurrent_ooms_each_get_their_own_files(fake_torch, tmp_path: Path) -> None:
    """Threads meeting the error at once: distinct files, every one readable by gpumem's own reader."""
    import threading

    from gpumem.recording import MAX_OOM_SNAPSHOTS, _oom_hook

    gpumem.snapshot_on_oom(tmp_path / "o dir ü")
    fake_torch.cuda.fake_alloc(4096)
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        with pytest.raises(fake_torch.OutOfMemoryError):
            fake_torch.cuda.fake_alloc(2 << 20)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    files = sorted((tmp_path / "o dir ü").glob("*.pickle"))
    assert len(files) == 8 == len(_oom_hook().records) and 8 <= MAX_OOM_SNAPSHOTS
    for f in files:
        assert load_trace(f).n_allocs == 1
