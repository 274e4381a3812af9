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

Note [Physical aliasing]
------------------------
A virtual range can be unmapped only after its work ends, but the physical chunk behind it can be
mapped again elsewhere at once: an allocator that hands a chunk on before its old work ran (a
stream-ordered steal) must make sure that every new user of the chunk is ordered after that work.
The checks above see virtual addresses only, so such a bug passed them (the attacker review of
2026-12-03 found one: a block of a third stream on a shared page of a taken chunk). So work also
carries its *physical* pieces (``phys``: chunk, offset, length, and the address it reached them
through), and when work is launched, unfinished work of another stream that reaches the same bytes of
a chunk through another address, and that the new work is not ordered after, is an alias: on a card the
two may run side by side on one piece of memory, whatever the simulated clock happens to do (a first
version compared running times only, and missed a user queued behind other work: attacker review of
2026-12-04). The order is kept as vector clocks: every work has a place in the device's launch order
(``seq``) and knows, by stream, the newest work it must follow (``vc``), inherited from its stream and
merged from the work a stream waits for (``stream_wait_event``, ``order_streams``). Work the host saw
finish is finished, so host synchronizations need no clock. The same address on two streams is the
program's own sharing (a block used on two streams), not the allocator's; work on one stream never
overlaps itself. ``on_alias`` tells the device, which records the hazard (``raise`` mode: the next call
of any kind raises it, once).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator, NamedTuple, Sequence

import simpy

from .clock import SimClock

QUEUED = 0
RUNNING = 1
DONE = 2
_STATE_NAMES = ("queued", "running", "done")


class Work:
    """Work queued on a stream by ``SimDevice.launch`` (a kernel, a copy): it runs for
    ``duration_s`` of simulated time and reads and writes ``touches`` while queued or running."""

    __slots__ = ("name", "stream", "duration_s", "touches", "wait_for", "state", "start_s", "end_s", "done_event",
                 "phys", "seq", "vc")

    def __init__(self, env: simpy.Environment, name: str, stream: int, duration_s: float,
                 touches: tuple[tuple[int, int], ...], wait_for: "Work | None" = None,
                 phys: "tuple[PhysicalPiece, ...]" = (), seq: int = 0, vc: "dict[int, int] | None" = None) -> None:
        self.name = name
        self.stream = stream
        self.duration_s = duration_s
        self.touches = touches
        """``(ptr, nbytes)`` ranges the work reads and writes."""
        self.phys = phys
        """The physical pieces of ``touches`` that lie in mapped chunks (Note [Physical aliasing])."""
        self.wait_for = wait_for
        self.state = QUEUED
        self.start_s: float | None = None
        self.end_s: float | None = None
        self.done_event = simpy.Event(env)
        self.seq = seq
        """Its place in the order of all work launched on the device (Note [Physical aliasing])."""
        self.vc: dict[int, int] = {} if vc is None else vc
        """What it is ordered after, by stream: the :attr:`seq` of the newest work of each other stream that must
        finish before it starts (its own stream's earlier work always must). Shared, never changed."""

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


class PhysicalPiece(NamedTuple):
    """``nbytes`` of a physical chunk from ``offset``, reached through virtual address ``va``."""

    chunk: object
    offset: int
    nbytes: int
    va: int


#: Told of an alias when ``work`` is launched: ``(work, unfinished work of another stream it is not ordered after,
#: that work's piece, work's piece)``.
AliasObserver = Callable[["Work", "Work", PhysicalPiece, PhysicalPiece], None]


def find_alias(a: Sequence[PhysicalPiece], b: Sequence[PhysicalPiece]) -> tuple[PhysicalPiece, PhysicalPiece] | None:
    """A piece of ``b`` and one of ``a`` on the same bytes of one chunk reached through different addresses, or
    None (Note [Physical aliasing])."""
    by_chunk: dict[int, list[PhysicalPiece]] = {}
    for p in b:
        by_chunk.setdefault(id(p.chunk), []).append(p)
    for p in a:
        for q in by_chunk.get(id(p.chunk), ()):
            lo = max(p.offset, q.offset)
            if lo < min(p.offset + p.nbytes, q.offset + q.nbytes) and p.va - p.offset != q.va - q.offset:
                return q, p
    return None


class _Stream:
    __slots__ = ("id", "queue", "process", "tail", "vc")

    def __init__(self, stream_id: int) -> None:
        self.id = stream_id
        self.queue: deque[Work] = deque()
        self.process: simpy.Process | None = None
        self.tail: Work | None = None
        self.vc: dict[int, int] = {}   # what work launched here from now on is ordered after (Work.vc)


class StreamEngine:
    """The streams of one simulated device and the work in flight on them."""

    def __init__(self, clock: SimClock) -> None:
        self._clock = clock
        self.env = clock.env
        self._streams: dict[int, _Stream] = {}
        self._inflight: dict[Work, None] = {}  # insertion-ordered set
        self._seq = 0
        self._phys_unfinished: dict[int, dict[Work, None]] = {}
        """Unfinished work with physical pieces, by stream, oldest first (Note [Physical aliasing])."""
        self.on_alias: AliasObserver | None = None
        """Called when work is launched that may run beside unfinished work of another stream on the same physical
        bytes (nothing orders it after that work)."""
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
               wait_for: Work | None = None, phys: Sequence[PhysicalPiece] = ()) -> Work:
        """Queue work on ``stream`` (made lazily) and start the stream's process if it is idle; ``phys``: the
        physical pieces of ``touches`` (Note [Physical aliasing])."""
        st = self._streams.get(stream)
        if st is None:
            st = self._streams[stream] = _Stream(stream)
        if wait_for is not None and wait_for.state != DONE:   # what the waited work is ordered after, and it
            vc = dict(st.vc)
            for s, n in wait_for.vc.items():
                if vc.get(s, 0) < n:
                    vc[s] = n
            if vc.get(wait_for.stream, 0) < wait_for.seq:
                vc[wait_for.stream] = wait_for.seq
            st.vc = vc
        self._seq += 1
        work = Work(self.env, name, stream, duration_s, tuple(touches), wait_for, tuple(phys), self._seq, st.vc)
        if work.phys:
            if self._phys_unfinished:
                self._check_alias(work)
            self._phys_unfinished.setdefault(stream, {})[work] = None
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
            if work.phys:
                works = self._phys_unfinished[work.stream]
                del works[work]
                if not works:
                    del self._phys_unfinished[work.stream]
            self._n_pending -= 1
            # reset when idle, so rounding in the running sum never accumulates
            self.pending_s = self.pending_s - work.duration_s if self._n_pending else 0.0
            work.done_event.succeed()
        st.process = None
        # an idle stream keeps nothing: foreign code may use thousands of stream ids once each
        if self._streams.get(st.id) is st:
            del self._streams[st.id]

    def _check_alias(self, work: Work) -> None:
        """Tell ``on_alias`` of unfinished work of another stream on ``work``'s physical bytes through another
        address that ``work`` is not ordered after (Note [Physical aliasing]); work that ends at this instant is
        finished."""
        now = self.env.now
        for stream, works in self._phys_unfinished.items():
            if stream == work.stream:
                continue
            known = work.vc.get(stream, 0)
            for other in reversed(works):   # newest first: the older ones are ordered before once one is
                if other.seq <= known:
                    break
                if other.state == RUNNING and other.start_s + other.duration_s <= now:   # type: ignore[operator]
                    continue
                hit = find_alias(work.phys, other.phys)
                if hit is not None and self.on_alias is not None:
                    self.on_alias(work, other, *hit)

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
