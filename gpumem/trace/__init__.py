"""Allocation traces: a model, readers and writers.

A :class:`Trace` is the sequence of allocate/free operations a program made, with
allocations named by dense ids instead of addresses, so that any allocator can
replay it. Traces come from:

* PyTorch memory snapshots (:mod:`gpumem.trace.pytorch`),
* RMM logging-adaptor CSV logs (:mod:`gpumem.trace.rmm`),
* gpumem's own ``.gmt`` format (:mod:`gpumem.trace.gmt`),
* a running allocator, through a :class:`TraceRecorder` (:mod:`gpumem.trace.recorder`).

and go out as ``.gmt`` (:func:`save_trace`), RMM CSV (:func:`write_rmm_log`) or a
PyTorch snapshot that PyTorch's memory viewer opens (:func:`save_pytorch_snapshot`)::

    from gpumem.trace import load_trace
    trace = load_trace("gpt2_train.snapshot.pickle.gz")
    print(trace.summary())
    for kind, alloc_id, nbytes, stream in zip(*trace.as_lists()):
        ...

Pickles are loaded with an unpickler that cannot import or call anything
(:mod:`gpumem.trace.safe_pickle`); every reader streams its file under a
:class:`TraceLimits` (:mod:`gpumem.trace.limits`), and every unreadable input
raises :class:`~gpumem.errors.TraceFormatError` naming the file (and entry or line).
"""

from __future__ import annotations

from .builder import build_trace, replay_addresses
from .io import FORMATS, detect_format, load_trace, save_trace
from .limits import DEFAULT_LIMITS, TraceLimits
from .model import OpKind, PlanEvent, PlanEventKind, StreamUse, StreamWait, Trace, TraceOp, TraceSummary
from .gmt import read_gmt_trace, write_gmt_trace
from .pytorch import load_snapshot_dict, read_pytorch_snapshot, snapshot_to_trace
from .pytorch_export import save_pytorch_snapshot, to_pytorch_snapshot
from .recorder import SEGMENT_ACTIONS, SegmentEvent, TraceRecorder
from .rmm import read_rmm_log, write_rmm_log
from .safe_pickle import OpcodeScanner, PlainUnpickler, load_plain_pickle

__all__ = [
    "DEFAULT_LIMITS",
    "FORMATS",
    "OpKind",
    "OpcodeScanner",
    "PlainUnpickler",
    "PlanEvent",
    "PlanEventKind",
    "SEGMENT_ACTIONS",
    "SegmentEvent",
    "StreamUse",
    "StreamWait",
    "Trace",
    "TraceLimits",
    "TraceOp",
    "TraceRecorder",
    "TraceSummary",
    "build_trace",
    "detect_format",
    "load_plain_pickle",
    "load_snapshot_dict",
    "load_trace",
    "read_gmt_trace",
    "read_pytorch_snapshot",
    "read_rmm_log",
    "replay_addresses",
    "save_pytorch_snapshot",
    "save_trace",
    "snapshot_to_trace",
    "to_pytorch_snapshot",
    "write_gmt_trace",
    "write_rmm_log",
]
