"""What every ``gpumem`` command shares: exit statuses, the usage error, argument types and checks.

Note [One command-line module layout]: each subcommand is a module of :mod:`gpumem.commands` with a
``register(sub, formatter_class)``; what they share lives here, and none of them imports
:mod:`gpumem.cli`, which only builds the parser from the modules and runs the command
(:func:`gpumem.cli.main`). The old names stay importable from :mod:`gpumem.cli`.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import stat
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping

from ..errors import DeviceLostError, GpumemError, InvalidArgumentError
from ..validate import parse_limit

log = logging.getLogger("gpumem")


EXIT_OK = 0


EXIT_OOM = 1


EXIT_USAGE = 2


EXIT_DEVICE_LOST = 3


EXIT_DEVICE_ERROR = 4


EXIT_INTERRUPTED = 130


EXIT_BROKEN_PIPE = 141


#: Exit status -> meaning, as ``--help`` and docs/replay.md list them (read-only).
EXIT_CODES: Mapping[int, str] = MappingProxyType({
    EXIT_OK: "done",
    EXIT_OOM: "out of memory: the trace does not fit the device (or --limit)",
    EXIT_USAGE: "bad input: a bad option, device spec, trace file or output path",
    EXIT_DEVICE_LOST: "the device was lost during the replay",
    EXIT_DEVICE_ERROR: "another device error during the replay (a failed device call, a memory hazard\n"
                       "      the simulator caught, an internal consistency error)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
    EXIT_BROKEN_PIPE: "standard output was closed: the output pipe closed early (e.g. `| head`; nothing\n"
                      "      else went wrong), or it was closed from the start (`>&-`; nothing was run)",
})


_DEFAULT_DEVICE = "sim:h200-141gb"


OVERHEAD_MEANING = ("peak reserved / peak live - 1: memory the allocator held from the device, at its worst, "
                    "beyond what the program had allocated")


FRAGMENTATION_MEANING = ("1 - largest free cached block / all free cached bytes, at the end: 0% when the memory "
                         "the allocator keeps but does not use is one piece")


class _UsageError(Exception):
    """A bad input found by a command: printed as ``gpumem COMMAND: message``, exit 2."""


#: Exit status -> meaning in words that hold for every command (``gpumem --help``); a command with more
#: specific words passes them to :func:`_exit_codes_text` (replay: :data:`EXIT_CODES`).
GENERAL_EXIT_CODES: Mapping[int, str] = MappingProxyType({
    EXIT_OK: "done",
    EXIT_OOM: "out of memory: what the command needs does not fit the device (or its limit)",
    EXIT_USAGE: "bad input: a bad option, device spec, input file or output path",
    EXIT_DEVICE_LOST: "the device was lost",
    EXIT_DEVICE_ERROR: "another device error (a failed device call, a memory hazard the simulator caught,\n"
                       "      an internal consistency error)",
    EXIT_INTERRUPTED: EXIT_CODES[EXIT_INTERRUPTED],
    EXIT_BROKEN_PIPE: EXIT_CODES[EXIT_BROKEN_PIPE],
})


def _exit_codes_text(meanings: Mapping[int, str] | None = None) -> str:
    """The ``exit status:`` block of a ``--help``: :data:`GENERAL_EXIT_CODES`, with a command's own
    ``meanings`` (status -> text) in their place; a status whose text is empty is left out."""
    merged = {**GENERAL_EXIT_CODES, **(meanings or {})}
    return "exit status:\n" + "\n".join(f"  {code:<4}{text}" for code, text in sorted(merged.items()) if text)


def _cli_names(message: str) -> str:
    """Python keyword names in a library message, as the options a command-line user passes instead."""
    # the library may already name the option in parentheses: "pass format= (the command line's --format)"
    aside = r"(?:\s*\(the command line's [^)]*\))?"
    message = re.sub(r"\bpass device=" + aside, "pass --device-index N", message)
    return re.sub(r"\bpass format=" + aside, "pass --format NAME", message)


_FILE_KINDS = ((stat.S_ISDIR, "a folder; give a file name"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _shorten_path(path: str, limit: int = 120) -> str:
    return path if len(path) <= limit else path[: limit // 2] + "..." + path[-(limit // 2):]


class OutputFile:
    """An output file checked and opened for writing before a long run (:func:`check_output_path`).

    ``created`` says whether the check created it (empty); :meth:`discard` removes it again then, so that
    a run that fails leaves nothing behind.
    """

    def __init__(self, path: Path, created: bool) -> None:
        self.path = path
        self.created = created

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def discard(self) -> None:
        """Remove the file if the check created it (a failed run); keeps a file that was there before."""
        if self.created:
            try:
                os.unlink(self.path)
            except OSError as exc:  # pragma: no cover - removed meanwhile
                log.debug("could not remove %s: %s", self.path, exc)
            self.created = False


def check_output_path(path: str, option: str) -> OutputFile:
    """Check that a file can be written at ``path`` by opening it for writing (creating it if missing),
    before the long run starts; :class:`_UsageError` saying why not.

    The target, if it exists, must be a regular file (or a link to one): folders, FIFOs, devices, sockets
    and dangling links are refused, since writing them would fail (or block, for a FIFO without a
    reader) only after the whole replay. The file is opened with ``O_WRONLY | O_CREAT | O_NONBLOCK`` and
    without truncation, so an existing file keeps its content until the results are written; every
    ``OSError`` (a missing folder, permission denied, a name too long) is a usage error.
    """
    if not path:
        raise _UsageError(f"{option}: the file name is empty")
    shown = _shorten_path(path)
    p = Path(path)  # note: Path drops a trailing "/", so the checks below use the text as given
    try:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if os.path.lexists(path):
                raise _UsageError(f"{option}: {shown} is a link to a missing file ({os.readlink(path)[:120]}); "
                                  "give a file name") from None
            if path.endswith(("/", os.sep)):
                raise _UsageError(f"{option}: {shown} names a folder (it ends with {path[-1]!r}); give a file name")
            existed = False
        else:
            existed = True
            for is_kind, what in _FILE_KINDS:
                if is_kind(st.st_mode):
                    raise _UsageError(f"{option}: {shown} is {what}")
        parent = p.parent
        if not existed and not parent.is_dir():
            raise _UsageError(f"{option}: no such folder {_shorten_path(str(parent))} (create it first)")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        out = OutputFile(p, created=not existed)
        if not stat.S_ISREG(st.st_mode):  # changed between the checks
            raise _UsageError(f"{option}: {shown} is not a regular file")
        return out
    except OSError as exc:
        raise _UsageError(f"{option}: cannot write {shown}: {exc.strerror or exc}") from None


def _folder_message(path: str) -> str:
    shown = _shorten_path(path)
    return (f"{shown} is a folder, not a trace file; give one trace file, or replay every trace in the folder "
            f"with: python benchmarks/replay_bench.py --traces {shown}")


def _check_trace_path(path: str) -> None:
    """A usage error for a trace path that is a folder or not a regular file (a FIFO, a device)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return  # the reader says "no such trace file"
    except OSError as exc:  # a name too long, a loop of links, a file where a folder should be
        raise _UsageError(f"cannot read the trace {_shorten_path(path)}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise _UsageError(_folder_message(path))
    if not stat.S_ISREG(st.st_mode):
        what = next((w for is_kind, w in _FILE_KINDS if is_kind(st.st_mode)), "not a regular file")
        raise _UsageError(f"{_shorten_path(path)} is {what}, not a trace file (traces are read from regular files)")


def _limit_syntax(text: str) -> str:
    """argparse check of ``--limit``'s form (the bytes are computed once the device is open)."""
    try:
        parse_limit(text, 2**64)
    except InvalidArgumentError as exc:
        if "less than one byte" not in str(exc):
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def whole_number_at_least(minimum: int, what: str) -> "Callable[[str], int]":
    """An argparse type: a whole number (base 10) of at least ``minimum``; ``what`` names it in the error."""
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text[:40]!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {'0 or more' if minimum == 0 else f'at least {minimum}'}, "
                                             f"got {value}")
        return value
    return parse


_device_index = whole_number_at_least(0, "a device number (0, 1, ...)")


_LIMIT_HELP = (
    "cap on the memory the allocator reserves. Bytes: a whole number (536870912) or a number with a unit "
    "(8GiB, 512MiB, 1.5GiB: powers of 1024; 512MB, 8GB: powers of 1000). Or a share of the device: a "
    "percentage (90%%) or a fraction written with a decimal point, in (0, 1] (0.9; 1.0 is the whole device). "
    "A bare number with a decimal point is always a fraction, so 2.5 is refused, not read as 2 bytes; '1' "
    "alone is refused as ambiguous (1.0, 100%% or 1B); 8G is refused (GB or GiB?). Same rules as "
    "CachingAllocator(limit=...). Default: no cap."
)


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    """``-v``/``-vv`` after the command too (``gpumem replay -v T``), counted with those before it."""
    parser.add_argument("-v", "--verbose", action="count", default=0, dest="command_verbose",
                        help="more logging (-v info, -vv debug)")


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command line (``args.func``) and map gpumem's errors to one line on stderr and the
    exit status of :data:`GENERAL_EXIT_CODES`."""
    try:
        return int(args.func(args))
    except _UsageError as exc:
        print(f"gpumem {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except DeviceLostError as exc:
        print(f"gpumem {args.command}: the device was lost: {exc}", file=sys.stderr)
        return EXIT_DEVICE_LOST
    except InvalidArgumentError as exc:
        print(f"gpumem {args.command}: {_cli_names(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except GpumemError as exc:
        print(f"gpumem {args.command}: device error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_DEVICE_ERROR
