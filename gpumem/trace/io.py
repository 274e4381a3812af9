"""One entry point for every trace format: :func:`load_trace` and :func:`save_trace`.

Formats (``format=`` names, aliases in brackets):

==================== ========================================= =====================================
``pytorch-snapshot`` PyTorch memory snapshot pickle            ``.pickle``, ``.pkl`` (``+ .gz``)
                     [``pytorch``, ``snapshot``]
``rmm-log``          RMM logging_resource_adaptor CSV [``rmm``] ``.csv`` (``+ .gz``)
``gpumem``           gpumem's text format [``gmt``, ``native``]  ``.gmt`` (``+ .gz``)
==================== ========================================= =====================================

Detection looks at the content first (after transparent gunzip): a pickle starts
with the ``PROTO`` opcode ``0x80``, a ``.gmt`` trace with a JSON header naming
``gpumem-trace``, an RMM log with a CSV header holding ``Action`` and ``Pointer``.
When the content says nothing (empty, truncated), the suffix decides, so the
chosen reader can explain what is wrong; when neither does,
:class:`~gpumem.errors.TraceFormatError` is raised.

Trace files are untrusted input: every reader streams its file under a
:class:`~gpumem.trace.limits.TraceLimits` (``limits=``) and every failure is a
``TraceFormatError``. A trace without a single allocation is refused too: there
is nothing to replay, and such a file is almost always the wrong one.
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

from ..errors import GpumemError, InvalidArgumentError, TraceFormatError
from ._fileio import PathLike, check_exists, peek
from .limits import TraceLimits, shorten
from .model import Trace
from .gmt import read_gmt_trace, write_gmt_trace
from .pytorch import read_pytorch_snapshot
from .rmm import read_rmm_log

__all__ = ["FORMATS", "detect_format", "load_trace", "save_trace"]

#: What a reader bug on hostile input could raise; load_trace turns it into a TraceFormatError.
_READER_FAILURES: tuple[type[BaseException], ...] = (
    ValueError, KeyError, IndexError, TypeError, AttributeError, OverflowError, RecursionError, MemoryError,
    EOFError, OSError, zlib.error, GpumemError,
)

#: Canonical format names.
FORMATS = ("pytorch-snapshot", "rmm-log", "gpumem")

_ALIASES = {
    "pytorch-snapshot": "pytorch-snapshot", "pytorch": "pytorch-snapshot", "snapshot": "pytorch-snapshot",
    "rmm-log": "rmm-log", "rmm": "rmm-log",
    "gpumem": "gpumem", "native": "gpumem", "gmt": "gpumem",
}
_SUFFIXES = {".pickle": "pytorch-snapshot", ".pkl": "pytorch-snapshot", ".csv": "rmm-log", ".gmt": "gpumem"}


def _format_from_content(head: bytes) -> str | None:
    if head[:1] == b"\x80":
        return "pytorch-snapshot"
    if head.lstrip()[:1] == b"{" and b"gpumem-trace" in head:
        return "gpumem"
    first_line = head.split(b"\n", 1)[0]
    if b"," in first_line and b"Action" in first_line and b"Pointer" in first_line:
        return "rmm-log"
    return None


def _format_from_suffix(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    return _SUFFIXES.get(suffixes[-1]) if suffixes else None


_DESCRIPTIONS = {"pytorch-snapshot": "a PyTorch snapshot", "rmm-log": "an RMM log", "gpumem": "a gpumem .gmt trace"}


def _check_forced_format(path: Path, fmt: str) -> None:
    """Refuse a forced format that the content's signature contradicts, saying what the file looks like.

    Without this, a CSV read as a pickle fails deep in the unpickler with a message about opcodes.
    """
    head = peek(path)
    if not head:
        return  # empty or unreadable: the reader explains
    seen = _format_from_content(head)
    if seen == fmt or (seen is None and fmt != "pytorch-snapshot"):
        return  # an unrecognised text file: the forced text reader says what is wrong with it
    if seen is None:
        looks = "it does not start with a pickle's PROTO opcode 0x80, as every snapshot does"
    else:
        looks = f"it starts like {_DESCRIPTIONS[seen]}"
    raise TraceFormatError(str(path), f"this file does not look like {_DESCRIPTIONS[fmt]} ({looks}); "
                                      f"drop the forced format to detect it")


def detect_format(path: PathLike) -> str:
    """The canonical format name of ``path`` (content first, then suffix); ``TraceFormatError`` if unknown."""
    p = check_exists(path)
    fmt = _format_from_content(peek(p)) or _format_from_suffix(p)
    if fmt is None:
        raise TraceFormatError(
            str(p), "unrecognised trace format (expected a PyTorch snapshot pickle, an RMM log CSV or a "
            "gpumem .gmt trace); pass format= (the command line's --format) to force one"
        )
    return fmt


def load_trace(path: PathLike, format: str | None = None, *, device: int | None = None,
               name: str | None = None, limits: TraceLimits | None = None, progress: bool | None = None,
               step_marks: bool = True) -> Trace:
    """Read a trace in any supported format.

    ``format`` forces a reader (a name or alias from the module docstring);
    ``device`` picks the device of a multi-device PyTorch snapshot (its index in
    ``device_traces``); ``name`` overrides the default name (the file name up to
    its first dot; .gmt files keep the name stored in them). ``limits`` caps what
    reading may cost (default :data:`~gpumem.trace.limits.DEFAULT_LIMITS`);
    ``progress`` shows a bar of the file's bytes read (None: only when stderr is a
    terminal). ``step_marks`` keeps the trace's step-plan events (:attr:`Trace.plan_events`): those a
    gpumem.torch trace recorded, and for a PyTorch snapshot those gpumem.torch would have made at its optimizer
    steps (Note [Step marks read off a snapshot's optimizer steps] in :mod:`gpumem.trace.optimizer_marks`);
    False leaves them out, so that a replay predicts a run without step plans (``GPUMEM_STEP_MARKS=off``).
    Raises ``InvalidArgumentError`` for a ``step_marks`` that is not a bool, ``FileNotFoundError`` for a missing
    file and
    ``TraceFormatError`` for something that is no regular file (a directory, a
    FIFO, a device, a symbolic link loop: checked with ``os.stat``, never opened),
    a forced format that the content's signature contradicts, an unknown format,
    unreadable content, an exceeded limit, or a trace with no allocations.
    """
    if not isinstance(step_marks, bool):
        raise InvalidArgumentError(f"load_trace: step_marks must be True or False, got {shorten(step_marks, 40)}")
    p = check_exists(path)
    if format is None:
        fmt = detect_format(p)
    else:
        fmt = _ALIASES.get(format.lower()) if isinstance(format, str) else None  # type: ignore[assignment]
        if fmt is None:
            raise TraceFormatError(str(p), f"unknown format {shorten(format, 40)}; expected one of {sorted(_ALIASES)}")
        _check_forced_format(p, fmt)
    if device is not None and fmt != "pytorch-snapshot":
        raise TraceFormatError(str(p), f"device={shorten(device)} applies to PyTorch snapshots only; "
                                       f"this is a {fmt} trace")
    try:
        if fmt == "pytorch-snapshot":
            trace = read_pytorch_snapshot(p, device=device, name=name, limits=limits, progress=progress,
                                          step_marks=step_marks)
        elif fmt == "rmm-log":
            trace = read_rmm_log(p, name=name, limits=limits, progress=progress)
        else:
            trace = read_gmt_trace(p, limits=limits, progress=progress)
            trace = trace if name is None else trace.renamed(name)
    except (TraceFormatError, FileNotFoundError):
        raise
    except _READER_FAILURES as e:  # a reader bug must still reach the caller as a format error
        raise TraceFormatError(str(p), f"unexpected reader failure ({type(e).__name__}: "
                                       f"{shorten(str(e), 120)[1:-1]})") from e
    if trace.n_allocs == 0:
        raise TraceFormatError(str(p), f"no allocations: the {fmt} trace holds no allocation to replay")
    if not step_marks and trace.plan_events:
        trace = dataclasses.replace(trace, plan_events=())
    return trace


def save_trace(trace: Trace, path: PathLike) -> Path:
    """Write ``trace`` in the .gmt format (gzip-compressed when ``path`` ends in ``.gz``); returns the path."""
    return write_gmt_trace(trace, path)
