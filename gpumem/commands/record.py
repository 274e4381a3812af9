"""``gpumem record [--out DIR] [--report] [--allocator pytorch|gpumem] -- python PROGRAM ARGS``: run a PyTorch
program with its GPU memory history on and write its snapshot (and, with ``--report``, its fragmentation
report) when it ends, however it ends."""

from __future__ import annotations

from ._args import MANY, refuse_repeated_options

import argparse
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from ._common import (EXIT_OK, EXIT_USAGE, _DEFAULT_DEVICE, _UsageError, _add_verbose, _exit_codes_text,
                      _shorten_path, run_command)

_DESCRIPTION = """\
Run a PyTorch program with its GPU memory history on and write its snapshot when it ends (normally, by
sys.exit, by an uncaught exception such as torch.OutOfMemoryError, or by Ctrl-C or SIGTERM):
  DIR/snapshot.pickle  a PyTorch memory snapshot: `gpumem report DIR/snapshot.pickle --out R`, `gpumem replay`,
                       or drag it onto https://pytorch.org/memory_viz;
  DIR/oom/             on an out-of-memory error, before the program sees it: the snapshot at that moment
                       (oom-*.pickle) and a text report of who holds what (oom-*.txt);
  DIR/report/          with --report: the fragmentation report of the snapshot (index.html);
  DIR/record.json      what was written and how the program ended.
The program runs in its own process: `python SCRIPT`, `python -m MODULE` or `python -c CODE` (interpreter
options such as -u may come before), started as `python -m gpumem.record_child ...`, which turns the
recording on before the program's first line. Its exit status is gpumem record's. Where PyTorch or a CUDA
device is missing, it says so in one line and runs nothing (status 2).

--allocator gpumem runs the program on gpumem's native engine (gpumem.torch.install() before its first
line; PyTorch records no history for a pluggable allocator, so gpumem's own history is written, without
stacks). A program that ends by os._exit or SIGKILL leaves no snapshot."""

_PYTHON = re.compile(r"^python[0-9.]*(\.exe)?$")
# interpreter options kept before `-m gpumem.record_child` (the rest are refused: -I and -E would drop the
# PYTHONPATH that finds gpumem, and -m/-c/SCRIPT belong to the program)
_PY_FLAGS = frozenset({"-u", "-O", "-OO", "-B", "-s", "-S", "-q", "-b", "-bb", "-d", "-v", "-R"})
_PY_FLAGS_WITH_VALUE = frozenset({"-X", "-W"})
_STATUS_MAX_NBYTES = 64 << 20  # record.json lists the out-of-memory files: far below this


def child_command(command: Sequence[str]) -> list[str]:
    """``python [OPTS] PROGRAM...`` rewritten as ``python [OPTS] -m gpumem.record_child PROGRAM...``;
    :class:`_UsageError` for anything else."""
    words = list(command)
    if words and words[0] == "--":
        words = words[1:]
    if not words:
        raise _UsageError("no program given: gpumem record [OPTIONS] -- python PROGRAM.py ARGS")
    exe = words[0]
    if not _PYTHON.match(os.path.basename(exe)):
        raise _UsageError(f"the program must be started by a Python interpreter (python, python3, a path to one), "
                          f"got {exe[:80]!r}: gpumem record -- python PROGRAM.py ARGS")
    if shutil.which(exe) is None:
        raise _UsageError(f"no such Python interpreter: {exe[:80]!r}")
    i = 1
    opts: list[str] = []
    while i < len(words) and words[i].startswith("-") and words[i] not in ("-m", "-c", "-"):
        w = words[i]
        if w in _PY_FLAGS:
            opts.append(w)
            i += 1
        elif w in _PY_FLAGS_WITH_VALUE and i + 1 < len(words):
            opts += [w, words[i + 1]]
            i += 2
        else:
            raise _UsageError(f"interpreter option {w[:40]!r} is not supported by gpumem record "
                              "(supported: " + " ".join(sorted(_PY_FLAGS | _PY_FLAGS_WITH_VALUE)) + ")")
    rest = words[i:]
    if not rest or rest[0] == "-":
        raise _UsageError("no program given after the interpreter: give PROGRAM.py, -m MODULE or -c CODE "
                          "(a program on standard input cannot be recorded)")
    if rest[0] in ("-m", "-c") and len(rest) < 2:
        raise _UsageError(f"{rest[0]} needs an argument")
    return [exe, *opts, "-m", "gpumem.record_child", *rest]


def child_env(out: Path, allocator: str, max_entries: int, oom_dir: Path, base: "dict[str, str] | None" = None) -> dict[str, str]:
    """The environment of the child: the recording's settings, and gpumem on ``PYTHONPATH`` when it runs from a
    checkout (an installed gpumem is the child interpreter's own business). Paths go absolute: a program that
    changes its working folder still writes into ``out`` (and a relative ``GPUMEM_OOM_SNAPSHOT_DIR`` is taken
    from where gpumem record runs); an empty ``GPUMEM_OOM_SNAPSHOT_DIR`` counts as unset."""
    from .. import record_child
    from ..recording import OOM_SNAPSHOT_ENV

    env = dict(os.environ if base is None else base)
    root = Path(record_child.__file__).resolve().parent.parent
    if root.name not in ("site-packages", "dist-packages"):
        env["PYTHONPATH"] = os.pathsep.join([str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    out = out.absolute()
    env[record_child.OUT_ENV] = str(out)
    env[record_child.STATUS_ENV] = str(out / record_child.STATUS_NAME)
    env[record_child.ALLOCATOR_ENV] = allocator
    env[record_child.MAX_ENTRIES_ENV] = str(max_entries)
    env[OOM_SNAPSHOT_ENV] = str(Path(env.get(OOM_SNAPSHOT_ENV) or oom_dir).absolute())
    return env


# Note [gpumem record claims its folder]: the output folder must be new or empty, and the check alone is not
# enough: two recordings started in the same second without --out (or `gpumem record -- python -m gpumem
# record ...`, whose inner run found the outer's default folder still empty) both took it, and the second
# snapshot replaced the first. So the default folder is always a new one (a -2, -3... suffix when the name
# is taken), and the folder is claimed by creating record.json exclusively ("status": "starting") before the
# program runs: a second recording finds the folder not empty. The child replaces it by "running" once the
# recording is on, then by the outcome; gpumem record tells from it a recorder that never started (the
# folder is removed again) from a program that ended before the snapshot (os._exit, a signal: kept).
def _check_out(path: str | None) -> tuple[Path, bool]:
    """The output folder, claimed (Note [gpumem record claims its folder]): ``--out`` missing (created) or an
    empty folder; by default a new ``gpumem-record-<time>[-N]``. Returns it and whether it was created."""
    from ..record_child import STATUS_NAME

    if path:
        out = Path(path)
        created = False
        if out.exists() or out.is_symlink():
            if not out.is_dir():
                raise _UsageError(f"--out: {_shorten_path(str(out))} exists and is not a folder")
            if any(out.iterdir()):
                raise _UsageError(f"--out: {_shorten_path(str(out))} is not empty; give a new folder")
        else:
            if not out.parent.is_dir():
                raise _UsageError(f"--out: no such folder {_shorten_path(str(out.parent))} (create it first)")
            created = _mkdir(out)
            if not created:
                raise _UsageError(f"--out: {_shorten_path(str(out))} was created meanwhile by another program")
    else:
        base = time.strftime("gpumem-record-%Y%m%d-%H%M%S")
        for n in range(1, 1000):
            out = Path(base if n == 1 else f"{base}-{n}")
            if _mkdir(out):
                break
        else:  # pragma: no cover - a thousand recordings in one second
            raise _UsageError(f"cannot find a new folder name {base}-N: give --out")
        created = True
    try:
        fd = os.open(out / STATUS_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise _UsageError(f"--out: {_shorten_path(str(out))} is not empty; give a new folder") from None
    except OSError as exc:
        _cleanup(out, created)
        raise _UsageError(f"--out: cannot write into {_shorten_path(str(out))}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps({"status": "starting", "pid": os.getpid()}))
    return out, created


def _mkdir(out: Path) -> bool:
    """Create ``out``; False if it exists already (anything there: a folder, a file, a link)."""
    try:
        out.mkdir()
    except FileExistsError:
        return False
    except OSError as exc:
        raise _UsageError(f"--out: cannot create {_shorten_path(str(out))}: {exc.strerror or exc}") from None
    return True


def _wait(proc: "subprocess.Popen[bytes]") -> int:
    """Wait for the child; SIGTERM/SIGHUP to us go on to it as SIGTERM; Ctrl-C reaches it from the terminal
    (same process group), so we only wait for it to write its snapshot. Returns its exit status (128 + N
    for a child ended by signal N)."""
    def forward(signum: int, frame: Any) -> None:
        try:
            proc.send_signal(signal.SIGTERM)
        except OSError:  # pragma: no cover - already gone
            pass

    handlers = {signal.SIGINT: signal.SIG_IGN, signal.SIGTERM: forward, signal.SIGHUP: forward}
    previous = {}
    for sig, handler in handlers.items():
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - rc if rc < 0 else rc


def _say(text: str) -> None:
    print(f"gpumem record: {text}", file=sys.stderr, flush=True)


def _read_status(path: Path) -> "dict[str, Any] | None":
    """The status file as a dict; None where it is missing, not a regular file (a FIFO would block), larger
    than a status file can be, or not a JSON object."""
    try:
        if not stat.S_ISREG(path.lstat().st_mode):
            return None
        with open(path, "rb") as f:
            raw = f.read(_STATUS_MAX_NBYTES + 1)
        if len(raw) > _STATUS_MAX_NBYTES:
            return None
        data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _show(path: "str | Path") -> str:
    """A path the child wrote (absolute) as the user would type it: relative where it lies under the current
    folder."""
    p = Path(path)
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def cmd_record(args: argparse.Namespace) -> int:
    """Check the options, run the program under the recorder, say where the files went, report."""
    from .. import record_child
    from ..recording import MAX_ENTRIES_LIMIT

    argv = child_command(args.program)
    if not 1 <= args.max_entries <= MAX_ENTRIES_LIMIT:
        raise _UsageError(f"--max-entries must be from 1 to {MAX_ENTRIES_LIMIT}, got {args.max_entries}")
    out, created = _check_out(args.out)
    oom_dir = out / "oom"
    env = child_env(out, args.allocator, args.max_entries, oom_dir)
    status_path = out / record_child.STATUS_NAME
    try:
        proc = subprocess.Popen(argv, env=env)
    except OSError as exc:
        _cleanup(out, created)
        raise _UsageError(f"cannot start {argv[0][:80]}: {exc.strerror or exc}") from None
    code = _wait(proc)
    status = _read_status(status_path)
    state = status.get("status") if status is not None else None
    if state == "starting":
        _cleanup(out, created)
        _say(f"the recorder did not start (status {code}): can {argv[0]} import gpumem and torch? see the "
             "error above")
        return code if code != EXIT_OK else EXIT_USAGE
    if state == "unavailable":
        _cleanup(out, created)
        _say(f"cannot record: {status.get('reason')}; the program was not run")
        return EXIT_USAGE
    if state == "running":
        how = f"by signal {code - 128}" if code > 128 else "by os._exit"
        record_child._write_status(status_path, {**status, "status": "ended without snapshot", "exit_status": code})
        _say(f"the program ended (status {code}, {how}?) before its snapshot could be written: nothing recorded "
             "(the snapshot is written on a normal end, sys.exit, an exception, Ctrl-C or SIGTERM)")
        return code
    if state != "done":
        _say(f"the program ended (status {code}) and {_show(status_path)} is gone or unreadable: did the program "
             f"remove or replace {_show(out)}? see the lines above")
        return code
    for oom in status.get("oom_snapshots") or ():
        _say(f"out of memory on cuda:{oom.get('device')}: snapshot {_show(oom.get('snapshot'))}, "
             f"report {_show(oom.get('report'))}")
    if status.get("oom_skipped"):
        _say(f"{int(status['oom_skipped']):,} later out-of-memory errors were not written (at most "
             f"{len(status.get('oom_snapshots') or ())} snapshots per program)")
    snapshot = status.get("snapshot_path")
    if not snapshot:
        _say(f"the program ended (status {code}) but the snapshot could not be written: {status.get('snapshot_error')}")
        return code
    snapshot = _show(snapshot)
    dropped = int(status.get("dropped") or 0)
    _say(f"the program ended (status {code}, {status.get('ended_by')}); snapshot written to {snapshot} "
         f"({int(status.get('n_events') or 0):,} events" + (f", {dropped:,} dropped past --max-entries" if dropped
                                                              else "") + ")")
    if args.report:
        report_code = _report(snapshot, out / "report", args.report_device or [])
        if code == EXIT_OK:
            code = report_code
    else:
        _say(f"next: gpumem report {snapshot} --out {out / 'report'}")
    return code


def _report(snapshot: str, out: Path, devices: list[str]) -> int:
    """``gpumem report SNAPSHOT --out OUT`` through the report command's own code; its exit status."""
    from . import report as report_command

    argv = ["report", snapshot, "--out", str(out)]
    for d in devices:
        argv += ["--device", d]
    _say("writing the report: gpumem " + " ".join(argv))
    sys.stdout.flush()
    parser = argparse.ArgumentParser(prog="gpumem")
    report_command.register(parser.add_subparsers(dest="command", required=True),
                            argparse.RawDescriptionHelpFormatter)
    refuse_repeated_options(parser)
    return run_command(parser.parse_args(argv))


def _cleanup(out: Path, created: bool) -> None:
    """Remove the output folder again if this command made it and nothing was written there."""
    status = out / "record.json"
    try:
        if status.is_file() and not status.is_symlink():
            status.unlink()
        if created and not any(out.iterdir()):
            out.rmdir()
    except OSError:  # pragma: no cover - left as is
        pass


def register(sub: Any, formatter_class: type) -> None:
    """Add ``gpumem record`` to the subcommands."""
    from ..recording import DEFAULT_MAX_ENTRIES, OOM_SNAPSHOT_ENV

    p = sub.add_parser("record", help="run a PyTorch program and write its memory snapshot (and report)",
                       formatter_class=formatter_class, description=_DESCRIPTION,
                       usage="gpumem record [-h] [--out DIR] [--report] [--allocator {pytorch,gpumem}] "
                             "[--max-entries N] [--report-device SPEC] -- python PROGRAM.py [ARGS ...]",
                       epilog=_exit_codes_text({
                           0: "done: the program ended with status 0 (and the report, with --report, was written)",
                           1: "",
                           2: "bad input (an option, the command, --out), or no PyTorch/CUDA device: nothing was run",
                           3: "", 4: "",
                       }) + "\n  N   otherwise, the program's own exit status (128 + N: ended by signal N)\n\n"
                       f"example:\n  gpumem record --out run1 --report -- python examples/train_small.py --steps 20\n"
                       f"  {OOM_SNAPSHOT_ENV}=DIR sends the out-of-memory files to DIR instead of the output folder's oom/\n"
                       "  (a relative DIR: from where gpumem record runs).")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="the output folder: new or empty (default: gpumem-record-<date>-<time>)")
    p.add_argument("--report", action="store_true",
                   help="also write the fragmentation report of the snapshot into DIR/report (gpumem report)")
    p.add_argument("--report-device", **MANY, metavar="SPEC",
                   help=f"device of the report's replays, repeatable (default: {_DEFAULT_DEVICE})")
    p.add_argument("--allocator", choices=("pytorch", "gpumem"), default="pytorch",
                   help="pytorch: PyTorch's caching allocator (default); gpumem: gpumem.torch, installed before the "
                        "program's first line")
    p.add_argument("--max-entries", type=int, default=DEFAULT_MAX_ENTRIES, metavar="N",
                   help="allocation events kept at most (default: %(default)s)")
    _add_verbose(p)
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- python PROGRAM.py ARGS (or -m MODULE, -c CODE)")
    p.set_defaults(func=cmd_record)
