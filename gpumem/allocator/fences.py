"""Stream fences: device events that say when queued GPU work on a stream is done.

Note [Stream-ordered frees]
---------------------------
A block freed on its stream may go to the next request on that stream at once: the stream runs its
work in order, so the new owner's kernels start after the old owner's finish. Giving the *memory* back
to the device is different: ``cuMemUnmap`` and ``cudaFree`` take effect when the host calls them, not
in stream order, and a kernel still reading the memory then faults (the context is dead). So, as
PyTorch's caching allocator does:

* a free that leaves a page (virtual backing) or a segment (malloc backing) with no live block notes
  the streams of the blocks that used it since it was last fenced; before the page or segment goes
  back to the device (a steal, a release), the allocator records an event on each of those streams (a
  *fence*: complete once the work queued there up to now is done) and gives the memory back only once
  the fences completed: it queries first, takes memory whose work is done first, and waits
  (``event_synchronize``) only when it needs that memory now (a steal with no idle page left,
  ``empty_cache``, the out-of-memory retry);
* a block used on other streams too (``record_stream``) records an event on each of them when freed
  and stays out of the free lists until they complete (looked at when an allocation misses the cache,
  waited for before an out-of-memory error).

Why a page's fence is recorded when the page goes back, not at the free: a free is the hot path, and
most frees empty a page (an event per free doubled the device calls of a replay). Recording later
covers more work than needed, which can only make the allocator wait longer, never too little.
Events on one stream complete in the order they were recorded, so a fence is just ``(stream,
number)``: :class:`StreamFences` keeps, per stream, the events not yet known complete (queried oldest
first, destroyed once complete) and the highest number known complete.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from ..device import Device

log = logging.getLogger(__name__)


class StreamFences:
    """Events recorded on streams, known complete in recording order (see the Note)."""

    __slots__ = ("device", "_queues", "_done", "_next", "n_records", "n_queries", "n_waits", "n_destroys", "n_stream_waits")

    def __init__(self, device: Device) -> None:
        self.device = device
        self._queues: dict[int, deque[tuple[int, Any]]] = {}
        """stream -> ``(number, event)`` of the events not yet known complete, oldest first."""
        self._done: dict[int, int] = {}
        """stream -> the highest fence number known complete."""
        self._next = 1
        self.n_records = 0
        self.n_queries = 0
        self.n_waits = 0
        self.n_destroys = 0
        self.n_stream_waits = 0

    @property
    def device_calls(self) -> int:
        """Event calls made so far (record, query, synchronize, destroy, stream wait)."""
        return self.n_records + self.n_queries + self.n_waits + self.n_destroys + self.n_stream_waits

    @property
    def outstanding(self) -> int:
        """Events recorded and not yet destroyed."""
        return sum(len(q) for q in self._queues.values())

    def record(self, stream: int) -> int:
        """Record an event on ``stream`` and return its fence number. On failure nothing changes."""
        event = self.device.event_record(stream)
        self.n_records += 1
        number = self._next
        self._next = number + 1
        q = self._queues.get(stream)
        if q is None:
            q = self._queues[stream] = deque()
        q.append((number, event))
        if len(q) > 1:
            self._retire_front(stream, q)  # keep the queue short: one query when the GPU is behind
        return number

    def _retire_front(self, stream: int, q: deque[tuple[int, Any]]) -> None:
        """Retire the completed events at the front of ``q`` except the newest (queries, never waits)."""
        while len(q) > 1:
            self.n_queries += 1
            if not self.device.event_query(q[0][1]):
                return
            self._retire(stream, q)

    def done(self, stream: int, number: int) -> bool:
        """Whether the fence has completed (queries the device, never waits)."""
        if number <= self._done.get(stream, 0):
            return True
        q = self._queues.get(stream)
        while q:
            n, event = q[0]
            if n > number:
                break
            self.n_queries += 1
            if not self.device.event_query(event):
                return False
            self._retire(stream, q)
        return number <= self._done.get(stream, 0) or not q or q[0][0] > number

    def _event_of(self, stream: int, number: int) -> Any:
        """The newest event of ``stream`` recorded at or before fence ``number`` and not known complete, or None
        (the fence is done)."""
        if number <= self._done.get(stream, 0):
            return None
        target = None
        for n, event in self._queues.get(stream, ()):
            if n > number:
                break
            target = event
        return target

    def wait(self, stream: int, number: int) -> None:
        """Block until the fence has completed (``event_synchronize`` on it, if not known complete)."""
        target = self._event_of(stream, number)
        if target is not None:
            self.device.event_synchronize(target)
            self.n_waits += 1
            q = self._queues[stream]
            while q and q[0][0] <= number:
                self._retire(stream, q)

    def order_after(self, waiting: int, stream: int, number: int) -> None:
        """Make ``waiting`` run its later work after the fence (``stream_wait_event`` on it, if not known complete):
        the GPU waits, not the host (Note [Wait on the GPU, not the host] in :mod:`.backing`)."""
        target = self._event_of(stream, number)
        if target is not None:
            self.device.stream_wait_event(waiting, target)
            self.n_stream_waits += 1

    def all_done(self, fences: dict[int, int] | None) -> bool:
        """Whether every ``{stream: number}`` fence has completed (queries, never waits)."""
        if not fences:
            return True
        for stream, number in fences.items():
            if not self.done(stream, number):
                return False
        return True

    def wait_all(self, fences: dict[int, int] | None) -> None:
        """Wait for every ``{stream: number}`` fence."""
        if fences:
            for stream, number in fences.items():
                self.wait(stream, number)

    def _retire(self, stream: int, q: deque[tuple[int, Any]]) -> None:
        n, event = q.popleft()
        self._done[stream] = n
        if not q:
            del self._queues[stream]
        try:
            self.device.event_destroy(event)
            self.n_destroys += 1
        except Exception as exc:  # noqa: BLE001 - a lost event handle holds no memory
            log.debug("could not destroy an event on stream %d: %s", stream, exc)

    def forget_idle(self) -> None:
        """Forget the streams whose newest event has completed: destroy their events and drop their
        entries (host memory per stream goes back on ``empty_cache``). Safe for any fence still held
        elsewhere: a stream with no queued event answers every fence as complete. Best effort: a
        failing query stops it (a lost device is raised)."""
        from ..errors import DeviceLostError

        try:
            for stream, q in list(self._queues.items()):
                self.n_queries += 1
                if self.device.event_query(q[-1][1]):
                    while q:
                        self._retire(stream, q)
        except DeviceLostError:
            raise
        except Exception as exc:  # noqa: BLE001 - the events stay queued, nothing is lost
            log.debug("could not query an event while forgetting idle streams: %s", exc)
        queues = self._queues
        self._done = {s: n for s, n in self._done.items() if s in queues}

    def streams(self) -> set[int]:
        """The streams with events not yet known complete."""
        return set(self._queues)

    def close(self) -> None:
        """Destroy every outstanding event (best effort)."""
        for stream, q in list(self._queues.items()):
            for _, event in q:
                try:
                    self.device.event_destroy(event)
                except Exception as exc:  # noqa: BLE001
                    log.debug("could not destroy an event on stream %d: %s", stream, exc)
        self._queues.clear()


def merge_fences(into: dict[int, int] | None, stream: int, number: int) -> dict[int, int]:
    """``into`` with ``stream``'s fence raised to ``number`` (a later fence on a stream covers earlier ones)."""
    if into is None:
        return {stream: number}
    if into.get(stream, 0) < number:
        into[stream] = number
    return into
