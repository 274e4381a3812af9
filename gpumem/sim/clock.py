"""The simulated device's clock over a SimPy environment, through SimPy's public API only.

Note [A lazy clock over SimPy]
------------------------------
Every simulated call moves time, and ``env.run(until=...)`` schedules and processes an event of
its own, which costs more than most calls do. When nothing is due before the new time
(``env.peek() > until_s``) nothing can happen meanwhile, so the clock only notes the new time
(``now_s``) and SimPy stays behind; it hands the time over (:meth:`SimClock.sync`) when an event
is due or before anything is scheduled into SimPy (:meth:`SimClock.process`), since a timeout or
process made relative to ``env.now`` must see the device's time. Outside SimPy's own processes only
the clock schedules into a lazy clock's environment, so it knows when the next event is due. While SimPy lags, no event lies between ``env.now`` and
``now_s``, so processing is as if SimPy had moved at every call (the test in
``tests/sim/test_clock.py`` checks this against an eager clock).

The hand-over lands exactly: ``run(until=t)`` stops at ``now + (t - now)``, which in floating point
is ``t`` only when the subtraction is exact (Sterbenz: ``now >= t / 2``) or ``now == 0``; otherwise
the clock first hops to ``2 * now`` (exact) until it is. So every time is what moving SimPy at every
call (the old code did that by writing SimPy's private ``_now``) gives, to the last bit.

An environment handed in by the caller may be shared (other devices, the caller's processes), so
that clock is eager: it reads ``env.now`` first and hands every move over at once. Code given
this device's own environment through :attr:`gpumem.sim.SimDevice.env` turns the clock eager too.
"""

from __future__ import annotations

from typing import Any, Generator

import simpy


class SimClock:
    """The simulated time of the devices on one SimPy environment (Note [A lazy clock over SimPy]).

    ``now_s`` is the device's time; ``env.now`` may lag behind it (``lazy``) while no event is due.
    """

    __slots__ = ("env", "now_s", "next_s", "lazy")

    def __init__(self, env: simpy.Environment, *, lazy: bool) -> None:
        self.env = env
        self.now_s: float = env.now
        self.next_s: float = env.peek()
        """``env.peek()`` when SimPy last ran or was scheduled into through the clock (lazy clocks
        only: SimPy's ``peek`` raises and catches an exception when nothing is scheduled)."""
        self.lazy = lazy
        """False: hand every move to SimPy at once and read its time first (a shared environment)."""

    @property
    def now(self) -> float:
        """The current simulated time: ``now_s``, or SimPy's while it processes events past it."""
        env_now = self.env.now
        return env_now if env_now > self.now_s else self.now_s

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` on, running every SimPy event due before then (the new time
        is ``now + seconds`` in floating point; a move too small to change it does nothing)."""
        if not self.lazy:
            self.now_s = self.env.now  # others may have moved a shared environment
        now = self.now_s
        until_s = now + seconds
        if until_s <= now:
            return
        if (self.next_s if self.lazy else self.env.peek()) > until_s:
            self.now_s = until_s
            if not self.lazy:
                self.sync()
        else:
            self.run(until_s)

    def sync(self) -> simpy.Environment:
        """Hand the clock's time to SimPy (no event is due before it: nothing runs) and return the
        environment, ready for timeouts and processes made relative to ``env.now``."""
        env = self.env
        now, until_s = env.now, self.now_s
        if now < until_s:
            while now + (until_s - now) != until_s:  # run(until=) would stop beside it: hop first
                now = now + now if now > 0 else now / 2
                env.run(until=now)
            env.run(until=until_s)
        return env

    def process(self, generator: Generator[simpy.Event, Any, Any]) -> simpy.Process:
        """Start a SimPy process now (at the device's time)."""
        process = self.sync().process(generator)
        self.next_s = self.env.peek()
        return process

    def run(self, until: float | simpy.Event) -> Any:
        """``env.run(until=until)`` from the clock's time (a time after it, or an event), then take
        SimPy's time (also when a process raised)."""
        env = self.sync()
        try:
            return env.run(until=until)
        finally:
            if env.now > self.now_s:
                self.now_s = env.now
            self.next_s = env.peek()
