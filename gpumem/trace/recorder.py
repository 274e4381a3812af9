"""Recording a trace from a running allocator.

An allocator holds a :class:`TraceRecorder` and calls it on every operation::

    rec = TraceRecorder()
    rec.record_segment("segment_alloc", base, 2 * MiB, stream)   # memory reserved from the device
    rec.record_alloc(ptr, nbytes, stream)                         # handed to the user
    rec.record_free(ptr, stream)                                  # given back by the user
    rec.record_stream_use(ptr, other_stream)                      # record_stream (before the free)
    rec.record_stream_wait(other_stream, stream)                  # wait_stream
    trace = rec.to_trace("my_run")                                # source == "recorded"
    snapshot = to_pytorch_snapshot(trace, segments_events=rec.segment_events)

Recording costs one tuple append per call (plus a clock read when no time is
given); all the pairing of frees with allocations happens in :meth:`to_trace`.
Times default to microseconds since the recorder was created, from
``time.perf_counter_ns``.
"""

from __future__ import annotations

import time

from ..errors import TraceFormatError
from .builder import ALLOC_CODE, FREE_CODE, USE_CODE, WAIT_CODE, AddressReuseError, build_trace
from .model import Trace

__all__ = ["TraceRecorder", "SEGMENT_ACTIONS", "SegmentEvent"]

#: Segment actions understood by :meth:`TraceRecorder.record_segment` and the PyTorch export.
SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")

#: ``(action, addr, nbytes, stream, time_us)``
SegmentEvent = tuple[str, int, int, int, float]


class TraceRecorder:
    """Collects allocator events cheaply; :meth:`to_trace` turns them into a :class:`Trace`.

    ``events`` holds ``(code, addr, nbytes, stream, time_us)`` tuples (code 0 =
    alloc, 1 = free, 2 = stream use, 3 = stream wait with the awaited stream in ``addr``);
    ``segment_events`` holds :data:`SegmentEvent` tuples.
    """

    __slots__ = ("events", "segment_events", "_t0_ns")

    def __init__(self) -> None:
        self.events: list[tuple[int, int, int, int, float]] = []
        self.segment_events: list[SegmentEvent] = []
        self._t0_ns = time.perf_counter_ns()

    def now_us(self) -> float:
        """Microseconds since this recorder was created."""
        return (time.perf_counter_ns() - self._t0_ns) / 1000.0

    def record_alloc(self, addr: int, nbytes: int, stream: int = 0, time_us: float | None = None) -> None:
        """An allocation of ``nbytes`` (the requested size) at ``addr`` on ``stream``."""
        if time_us is None:
            time_us = (time.perf_counter_ns() - self._t0_ns) / 1000.0
        self.events.append((ALLOC_CODE, addr, nbytes, stream, time_us))

    def record_free(self, addr: int, stream: int = 0, time_us: float | None = None) -> None:
        """The allocation at ``addr`` was freed."""
        if time_us is None:
            time_us = (time.perf_counter_ns() - self._t0_ns) / 1000.0
        self.events.append((FREE_CODE, addr, 0, stream, time_us))

    def record_stream_use(self, addr: int, stream: int, time_us: float | None = None) -> None:
        """The live allocation at ``addr`` is also used on ``stream`` (``record_stream``): a
        :class:`~gpumem.trace.model.StreamUse` of the trace."""
        if time_us is None:
            time_us = (time.perf_counter_ns() - self._t0_ns) / 1000.0
        self.events.append((USE_CODE, addr, 0, stream, time_us))

    def record_stream_wait(self, stream: int, waited: int, time_us: float | None = None) -> None:
        """``stream`` waits for the work queued on ``waited`` so far (``wait_stream``): a
        :class:`~gpumem.trace.model.StreamWait` of the trace."""
        if time_us is None:
            time_us = (time.perf_counter_ns() - self._t0_ns) / 1000.0
        self.events.append((WAIT_CODE, waited, 0, stream, time_us))

    def record_segment(
        self, action: str, addr: int, nbytes: int, stream: int = 0, time_us: float | None = None
    ) -> None:
        """A segment event: ``action`` is one of :data:`SEGMENT_ACTIONS`."""
        if action not in SEGMENT_ACTIONS:
            raise ValueError(f"unknown segment action {action!r}; expected one of {SEGMENT_ACTIONS}")
        if time_us is None:
            time_us = (time.perf_counter_ns() - self._t0_ns) / 1000.0
        self.segment_events.append((action, addr, nbytes, stream, time_us))

    def __len__(self) -> int:
        return len(self.events)

    def clear(self) -> None:
        """Forget everything recorded so far (the clock keeps running)."""
        self.events.clear()
        self.segment_events.clear()

    def to_trace(self, name: str = "recorded") -> Trace:
        """The recorded allocs and frees as a trace with ``source == "recorded"``.

        Frees of addresses never recorded as allocated are skipped and counted; stream uses of them
        are skipped.
        An alloc at an address still live raises :class:`TraceFormatError`.
        """
        if self.events:
            codes, addrs, sizes, streams, times = zip(*self.events)
        else:
            codes = addrs = sizes = streams = times = ()
        try:
            return build_trace(name, "recorded", codes, addrs, sizes, streams, times, origin=f"<recorder {name}>",
                               use_code=USE_CODE, wait_code=WAIT_CODE)
        except AddressReuseError as e:
            raise TraceFormatError(f"<recorder {name}>", str(e), entry=e.index) from None
