"""Streams of the simulated GPU: queued work running in simulated time.

A stream is a FIFO of :class:`Work`. Each stream that has work gets a SimPy
process that runs its queue in order: a work item starts when the one before it
has finished (and, for a ``stream_wait_event`` marker, when the awaited work has
finished), then occupies the stream for its ``duration_s``. Time moves only
through device calls and ``SimDevice.advance()``, so a 10 ms kernel stays in
flight across thousands of allocator calls, as on a real GPU.

Note [Events are a pointer to the stream's tail]
------------------------------------------------
Work on a stream completes in order, so "all work queued before this event" has
completed exactly when the *last* item queued before it has. An event therefore
records nothing but that item (or ``None`` on an idle stream: complete at once):
``event_record`` is O(1) and allocates one small object, which matters because
an allocator records an event on every free. ``stream_wait_event`` of an event
that has not completed queues a zero-length marker that waits for the event's
item, so later work on the waiting stream starts after it.

Note [What the sanitizer looks at]
----------------------------------
Work that is queued or running *touches* its ranges (reads and writes them)
until it ends. :meth:`StreamEngine.touching` finds in-flight work overlapping a
range; the device asks it before it frees or unmaps memory.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator, Sequence

import simpy

from .clock import SimClock

QUEUED = 0
RUNNING = 1
DONE = 2
_STATE_NAMES = ("queued", "running", "done")


class Work:
    """Work queued on a stream by ``SimDevice.launch`` (a kernel, a copy): it runs for
    ``duration_s`` of simulated time and reads and writes ``touches`` while queued or running."""

    __slots__ = ("name", "stream", "duration_s", "touches", "wait_for", "state", "start_s", "end_s", "done_event")

    def __init__(self, env: simpy.Environment, name: str, stream: int, duration_s: float,
                 touches: tuple[tuple[int, int], ...], wait_for: "Work | None" = None) -> None:
        self.name = name
        self.stream = stream
        self.duration_s = duration_s
        self.touches = touches
        """``(ptr, nbytes)`` ranges the work reads and writes."""
        self.wait_for = wait_for
        self.state = QUEUED
        self.start_s: float | None = None
        self.end_s: float | None = None
        self.done_event = simpy.Event(env)

    @property
    def done(self) -> bool:
        """Whether the work has finished."""
        return self.state == DONE

    @property
    def state_name(self) -> str:
        """``"queued"``, ``"running"`` or ``"done"``."""
        return _STATE_NAMES[self.state]

    def __repr__(self) -> str:
        return f"<Work {self.name!r} stream={self.stream} {self.state_name}>"


class _Stream:
    __slots__ = ("id", "queue", "process", "tail")

    def __init__(self, stream_id: int) -> None:
        self.id = stream_id
        self.queue: deque[Work] = deque()
        self.process: simpy.Process | None = None
        self.tail: Work | None = None


class StreamEngine:
    """The streams of one simulated device and the work in flight on them."""

    def __init__(self, clock: SimClock) -> None:
        self._clock = clock
        self.env = clock.env
        self._streams: dict[int, _Stream] = {}
        self._inflight: dict[Work, None] = {}  # insertion-ordered set
        self._n_pending = 0
        self.pending_s = 0.0
        """The summed durations of unfinished work (an upper bound on how long it can still run:
        Note [The clock stays finite] in :mod:`gpumem.sim.device`)."""

    def known(self, stream: int) -> bool:
        """Whether ``stream`` has unfinished work."""
        return stream in self._streams

    def tail(self, stream: int) -> Work | None:
        """The last unfinished work queued on ``stream``, or ``None`` when it is idle."""
        st = self._streams.get(stream)
        if st is None:
            return None
        tail = st.tail
        return tail if tail is not None and tail.state != DONE else None

    def tails(self) -> list[Work]:
        """The last unfinished work of every busy stream."""
        return [st.tail for st in self._streams.values() if st.tail is not None and st.tail.state != DONE]

    def launch(self, stream: int, name: str, duration_s: float, touches: Sequence[tuple[int, int]] = (),
               wait_for: Work | None = None) -> Work:
        """Queue work on ``stream`` (made lazily) and start the stream's process if it is idle."""
        st = self._streams.get(stream)
        if st is None:
            st = self._streams[stream] = _Stream(stream)
        work = Work(self.env, name, stream, duration_s, tuple(touches), wait_for)
        st.queue.append(work)
        st.tail = work
        self._n_pending += 1
        self.pending_s += duration_s
        if work.touches:
            self._inflight[work] = None
        if st.process is None:  # the process starts at env.now: hand SimPy the device's time first
            st.process = self._clock.process(self._run(st))
        return work

    @property
    def n_busy_streams(self) -> int:
        """Streams with unfinished work (idle streams are forgotten)."""
        return len(self._streams)

    def _run(self, st: _Stream) -> Iterator[simpy.Event]:
        env = self.env
        queue = st.queue
        while queue:
            work = queue[0]
            waited = work.wait_for
            if waited is not None and waited.state != DONE:
                yield waited.done_event
            work.state = RUNNING
            work.start_s = env.now
            if work.duration_s > 0:
                yield env.timeout(work.duration_s)
            work.state = DONE
            work.end_s = env.now
            queue.popleft()
            self._inflight.pop(work, None)
            self._n_pending -= 1
            # reset when idle, so rounding in the running sum never accumulates
            self.pending_s = self.pending_s - work.duration_s if self._n_pending else 0.0
            work.done_event.succeed()
        st.process = None
        # an idle stream keeps nothing: foreign code may use thousands of stream ids once each
        if self._streams.get(st.id) is st:
            del self._streams[st.id]

    def touching(self, va: int, nbytes: int) -> tuple[Work, int, int] | None:
        """In-flight work that touches ``[va, va + nbytes)``, with the overlapping touch, or ``None``."""
        end = va + nbytes
        for work in self._inflight:
            for ptr, n in work.touches:
                if ptr < end and va < ptr + n:
                    return work, ptr, n
        return None

    @property
    def inflight(self) -> list[Work]:
        """Queued or running work that touches memory, oldest first."""
        return list(self._inflight)
