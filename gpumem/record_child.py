"""The program side of ``gpumem record``: ``python -m gpumem.record_child (SCRIPT | -m MODULE | -c CODE) [ARGS]``.

``gpumem record -- python train.py ARGS`` runs ``python -m gpumem.record_child train.py ARGS`` instead
(:mod:`gpumem.commands.record`). This module turns the recording on (:class:`gpumem.recording.Recording`)
before the program's first line, runs the program as ``__main__`` (``sys.argv``, ``sys.path[0]`` as Python
sets them), and writes the snapshot when the program ends: normally, by ``sys.exit``, by an uncaught
exception (the traceback is printed as usual) or by SIGTERM/SIGINT. Its exit status is the program's; after
SIGTERM it ends by SIGTERM again. What it wrote goes into a status file (JSON) that ``gpumem record`` reads.
Where PyTorch or a CUDA device is missing it runs nothing and writes the reason there (exit status 2);
once recording, before the program's first line, it writes ``"status": "running"`` there.

Configuration (set by ``gpumem record``): ``GPUMEM_RECORD_OUT`` the output folder, ``GPUMEM_RECORD_STATUS``
the status file (default ``OUT/record.json``), ``GPUMEM_RECORD_ALLOCATOR`` pytorch|gpumem,
``GPUMEM_RECORD_MAX_ENTRIES``, and ``GPUMEM_OOM_SNAPSHOT_DIR`` (:data:`gpumem.recording.OOM_SNAPSHOT_ENV`).

A program that ends by ``os._exit`` or SIGKILL writes no snapshot.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

OUT_ENV = "GPUMEM_RECORD_OUT"
STATUS_ENV = "GPUMEM_RECORD_STATUS"
ALLOCATOR_ENV = "GPUMEM_RECORD_ALLOCATOR"
MAX_ENTRIES_ENV = "GPUMEM_RECORD_MAX_ENTRIES"
STATUS_NAME = "record.json"
EXIT_UNAVAILABLE = 2  # gpumem.cli.EXIT_USAGE (not imported: the child stays light until it records)

log = logging.getLogger("gpumem.record")


class Terminated(BaseException):
    """SIGTERM arrived: unwinds the program like Ctrl-C so that the snapshot is written."""


@dataclass(frozen=True)
class Target:
    """What to run: ``kind`` is ``"script"``, ``"module"`` or ``"code"``."""

    kind: str
    value: str
    args: tuple[str, ...]


def parse_target(argv: Sequence[str]) -> Target:
    """``SCRIPT ARGS``, ``-m MODULE ARGS`` or ``-c CODE ARGS``; ValueError otherwise."""
    if not argv:
        raise ValueError("no program given: expected SCRIPT, -m MODULE or -c CODE")
    first = argv[0]
    if first in ("-m", "-c"):
        if len(argv) < 2 or not argv[1]:
            raise ValueError(f"{first} needs an argument")
        return Target("module" if first == "-m" else "code", argv[1], tuple(argv[2:]))
    if first.startswith("-") and first != "-":
        raise ValueError(f"unsupported option {first!r} before the program (put interpreter options before -m "
                         "gpumem.record_child)")
    return Target("script", first, tuple(argv[1:]))


def _write_status(path: Path, data: dict[str, Any]) -> bool:
    """Replace the status file; False (and one line on stderr) where it cannot be written (the program removed
    or replaced the output folder): the program's own ending still decides the exit status."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        print(f"gpumem record: could not write {path}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False
    return True


def run_target(target: Target) -> None:
    """Run the program as ``__main__``, as ``python SCRIPT`` / ``-m`` / ``-c`` would."""
    if target.kind == "script":
        sys.argv = [target.value, *target.args]
        sys.path[0] = os.path.dirname(os.path.abspath(target.value))
        runpy.run_path(target.value, run_name="__main__")
    elif target.kind == "module":
        sys.argv = [target.value, *target.args]  # run_module puts the module's file in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(target.value, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *target.args]
        sys.path[0] = ""
        code = compile(target.value, "<string>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102 - the user's own -c code


def _exit_code(exc: BaseException | None) -> int:
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        code = exc.code
        return 0 if code is None else code if isinstance(code, int) else 1
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, Terminated):
        return 128 + signal.SIGTERM
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Record the program named by ``argv``; returns (or ends with) its exit status."""
    from .recording import OOM_SNAPSHOT_ENV, Recording

    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="gpumem record: %(message)s")
    out = os.environ.get(OUT_ENV)
    if not out:
        print(f"gpumem.record_child: {OUT_ENV} is not set (run it through `gpumem record`)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    status_path = Path(os.environ.get(STATUS_ENV) or Path(out) / STATUS_NAME)
    try:
        target = parse_target(argv)
        max_entries = int(os.environ.get(MAX_ENTRIES_ENV) or 0) or None
    except ValueError as exc:
        print(f"gpumem.record_child: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    kwargs: dict[str, Any] = {"allocator": os.environ.get(ALLOCATOR_ENV) or "pytorch"}
    if max_entries:
        kwargs["max_entries"] = max_entries
    from .errors import GpumemError

    try:
        rec = Recording(out, **kwargs).start()
    except GpumemError as exc:  # no torch, no CUDA, no native engine, too late for gpumem.torch
        try:
            Path(out).mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # _write_status says so
        _write_status(status_path, {"status": "unavailable", "reason": str(exc), "error": type(exc).__name__})
        return EXIT_UNAVAILABLE

    def on_sigterm(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the snapshot is being written
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    # "running": gpumem record tells a program that ended before the snapshot (os._exit, a signal) from a
    # recorder that never started ("starting", its own claim on the folder)
    _write_status(status_path, {"status": "running", "allocator": rec.allocator.value, "pid": os.getpid()})
    print(f"gpumem record: recording {rec.allocator.value}'s allocations into {out}", file=sys.stderr, flush=True)
    outcome: BaseException | None = None
    try:
        run_target(target)
    except BaseException as exc:  # noqa: BLE001 - every ending writes the snapshot, then goes on as it would
        outcome = exc
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the snapshot short
    status: dict[str, Any] = {"status": "done", "exit_status": _exit_code(outcome),
                              "ended_by": type(outcome).__name__ if outcome is not None else "return",
                              "allocator": rec.allocator.value}
    try:
        result = rec.stop()
        status.update({k: (str(v) if isinstance(v, Path) else getattr(v, "value", v)) for k, v in
                       asdict(result).items()})
    except Exception as exc:  # noqa: BLE001 - the program's own ending decides the exit status
        status.update({"snapshot_error": f"{type(exc).__name__}: {exc}"})
        print(f"gpumem record: could not write the snapshot: {type(exc).__name__}: {exc}", file=sys.stderr)
    from .recording import _oom_hook

    status["oom_snapshots"] = [{"snapshot": str(r.snapshot_path), "report": str(r.report_path), "device": r.device,
                                "requested_nbytes": r.requested_nbytes} for r in _oom_hook().records]
    status["oom_skipped"] = _oom_hook().skipped
    status["oom_dir"] = os.environ.get(OOM_SNAPSHOT_ENV) or None
    _write_status(status_path, status)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, previous)
    if isinstance(outcome, Terminated):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # end as the signal would have ended the program
    if outcome is not None and not isinstance(outcome, (SystemExit, KeyboardInterrupt, Terminated)):
        # as Python ends on an uncaught exception (sys.excepthook, status 1), without this module's frames
        tb = _program_frames(outcome.__traceback__)
        sys.excepthook(type(outcome), outcome.with_traceback(tb), tb)
        return 1
    if outcome is not None:
        raise outcome  # Python ends as it would have: SystemExit's code or message, Ctrl-C
    return 0


def _program_frames(tb: Any) -> Any:
    """The traceback from the program's first frame on (this module's and runpy's frames dropped)."""
    here = os.path.abspath(__file__)
    while tb is not None and tb.tb_next is not None and (
            os.path.abspath(tb.tb_frame.f_code.co_filename) == here or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


if __name__ == "__main__":  # pragma: no cover - run by gpumem record
    sys.exit(main())
