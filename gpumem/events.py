"""Memory events a device publishes, and subscriptions to them.

Code under test can react to pressure the way it would on a shared GPU: poll
``mem_info()``, or subscribe::

    sub = device.subscribe(lambda ev: print(ev))
    device.watch_free_level(8 * GiB)   # simulator: FREE_BELOW / FREE_ABOVE when free memory crosses 8 GiB
    ...
    sub.cancel()

Every :class:`gpumem.Device` has an :class:`EventHub`; the simulator publishes
into it (a real GPU publishes nothing yet). Events are never delivered inside a
device call: see Note [Event delivery after the call] in :mod:`gpumem.device`.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)


class MemoryEventKind(str, enum.Enum):
    """What happened."""

    TENANT_TOOK = "tenant_took"
    """Another tenant allocated memory."""
    TENANT_RETURNED = "tenant_returned"
    """Another tenant gave memory back."""
    TENANT_DENIED = "tenant_denied"
    """Another tenant asked for more than was free and got nothing."""
    FREE_BELOW = "free_below"
    """Free memory fell below a watched level."""
    FREE_ABOVE = "free_above"
    """Free memory rose back to or above a watched level."""
    FAULT_INJECTED = "fault_injected"
    """An injected fault made a call fail."""
    DEVICE_LOST = "device_lost"
    """The device is gone; every later call fails."""


@dataclass(frozen=True)
class MemoryEvent:
    """One event: when (simulated seconds), what, how many bytes, and free bytes just after."""

    time_s: float
    kind: MemoryEventKind
    nbytes: int
    free_nbytes: int
    source: str = ""
    level_nbytes: int | None = None


EventCallback = Callable[[MemoryEvent], None]


class Subscription:
    """Handle returned by ``subscribe``; :meth:`cancel` stops the callbacks."""

    def __init__(self, hub: "EventHub", callback: EventCallback) -> None:
        self._hub = hub
        self.callback = callback

    def cancel(self) -> None:
        self._hub.unsubscribe(self)


class EventHub:
    """Fan-out of :class:`MemoryEvent` to subscribers, plus free-level watching.

    Every event is also kept in :attr:`history` (bounded) so tests can assert on it.
    """

    def __init__(self, history_limit: int = 100_000,
                 dispatch: Callable[[MemoryEvent], None] | None = None) -> None:
        self._subs: list[Subscription] = []
        self._levels: list[int] = []
        self.history: list[MemoryEvent] = []
        self._history_limit = history_limit
        self._dispatch = dispatch if dispatch is not None else self.deliver
        """Where :meth:`publish` sends an event: straight to :meth:`deliver`, or (on a device) to a
        queue that delivers it once the device call returned."""

    def subscribe(self, callback: EventCallback) -> Subscription:
        sub = Subscription(self, callback)
        self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)

    @property
    def watching_levels(self) -> bool:
        """Whether any free level is watched (a device skips looking for crossings otherwise)."""
        return bool(self._levels)

    def watch_level(self, level_nbytes: int) -> None:
        if level_nbytes not in self._levels:
            self._levels.append(level_nbytes)

    def publish(self, event: MemoryEvent) -> None:
        """Record ``event`` and hand it to the dispatcher (which may deliver it later)."""
        if len(self.history) < self._history_limit:
            self.history.append(event)
        self._dispatch(event)

    def deliver(self, event: MemoryEvent) -> None:
        """Call every subscriber with ``event`` now.

        Note [A subscriber cannot break a call]: a subscriber that raises an
        ``Exception`` is a bug in the subscriber, not a failure of the device
        call that published the event (which has already taken effect). As
        PyTorch's allocator observers and RMM's callbacks cannot break an
        allocation, the exception is logged (``log.exception``, with the
        subscriber and the event) and the other subscribers are still called;
        nothing is raised. A ``BaseException`` (``KeyboardInterrupt``,
        ``SystemExit``) propagates at once: the subscribers after it do not
        get this event.
        """
        for sub in list(self._subs):
            try:
                sub.callback(event)
            except Exception:  # noqa: BLE001 - see the Note: logged, never raised
                log.exception("memory event subscriber %r raised on %r (ignored)", sub.callback, event)

    def free_changed(self, time_s: float, old_free: int, new_free: int, source: str) -> None:
        """Publish level crossings between ``old_free`` and ``new_free``."""
        for level in self._levels:
            if old_free >= level > new_free:
                self.publish(MemoryEvent(time_s, MemoryEventKind.FREE_BELOW, old_free - new_free, new_free, source,
                                         level))
            elif old_free < level <= new_free:
                self.publish(MemoryEvent(time_s, MemoryEventKind.FREE_ABOVE, new_free - old_free, new_free, source,
                                         level))
