"""Memory events a simulated device publishes (re-exported from :mod:`gpumem.events`).

The event types and the hub live in :mod:`gpumem.events` since every
:class:`gpumem.Device` offers ``subscribe`` (the simulator is, for now, the only
device that publishes anything); this module keeps the ``sim.events`` names.
"""

from gpumem.events import EventCallback, EventHub, MemoryEvent, MemoryEventKind, Subscription

__all__ = ["EventCallback", "EventHub", "MemoryEvent", "MemoryEventKind", "Subscription"]
