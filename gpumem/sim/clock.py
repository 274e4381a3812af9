"""The simulated device's clock over a SimPy environment, through SimPy's public API only.

Note [A lazy clock over SimPy]
------------------------------
Every simulated call moves time, and moving SimPy costs more than most calls do. So the clock keeps
the device's time itself (``now_s``) and SimPy may stay behind: while no event is due before the
new time nothing can happen meanwhile; when one is, the clock ``step``s SimPy through the events due
*before* it (what ``env.run(until=t)`` processes: its stop event is urgent). Before anything is
scheduled into SimPy (:meth:`SimClock.process`) it hands its time over (:meth:`SimClock.sync`), as
a timeout or process made relative to ``env.now`` must see the device's time. Outside SimPy's own
processes only the clock schedules into a lazy clock's environment, so ``next_s`` (``env.peek()``
after the clock last touched SimPy) says when the next event is due, without a call per move.

The times are the old device's to the last bit (it wrote SimPy's private ``_now`` on quiet
stretches and ran ``env.run(until=t)`` otherwise, so after an event ``now + (t - now)``, which
need not be ``t``). The hand-over must land exactly: ``run(until=t)`` stops at ``now + (t - now)``,
which is ``t`` when the subtraction is exact (Sterbenz: ``now >= t / 2``) or ``now == 0``, so the
clock first hops to ``2 * now`` until it is. ``tests/sim/test_clock.py`` checks all of it against
the old code, with Hypothesis.

An environment handed in by the caller may be shared (other devices, the caller's processes), so
that clock is eager: it reads ``env.now`` first and hands every move over at once. Code given the
device's own environment through :attr:`gpumem.sim.SimDevice.env` turns the clock eager too. While
a lazy clock steps SimPy it is eager as well (``lazy`` is None then): a process SimPy wakes (a
tenant's scenario) may call the device, and that call starts at SimPy's time, not the stale ``now_s``.
"""

from __future__ import annotations

from typing import Any, Generator

import simpy

from gpumem.errors import InternalError


class SimClock:
    """The simulated time of the devices on one SimPy environment (Note [A lazy clock over SimPy]).

    ``now_s`` is the device's time; ``env.now`` may lag behind it (``lazy``) while no event is due
    before ``now_s``.
    """

    __slots__ = ("env", "now_s", "next_s", "lazy")

    def __init__(self, env: simpy.Environment, *, lazy: bool) -> None:
        self.env = env
        self.now_s: float = env.now
        self.next_s: float = env.peek()
        """``env.peek()`` when the clock last touched SimPy (read by lazy clocks only: on an empty
        schedule SimPy's ``peek`` raises and catches an exception, dear for a call per move)."""
        self.lazy: bool | None = lazy
        """False: read SimPy's time first and hand every move over at once (a shared environment); None:
        a lazy clock while it steps SimPy, eager meanwhile (a process may call the device)."""

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
        else:
            self.run_to(until_s)
        if not self.lazy:
            self.sync()

    def run_to(self, until_s: float) -> None:
        """Process the events ``env.run(until=until_s)`` would from ``now_s`` (those due before it,
        which must be later than ``now_s``) and stand where it would stop."""
        env = self.env
        now = self.now_s
        stop_s = now + (until_s - now)  # where run(until=) puts its stop event
        lazy, self.lazy = self.lazy, (None if self.lazy else self.lazy)  # eager while SimPy runs
        try:
            while env.peek() < stop_s:
                env.step()
        except BaseException:
            if env.now > self.now_s:
                self.now_s = env.now  # a process raised: the clock is where SimPy stopped
            raise
        finally:
            self._after_steps(lazy)
        # a call re-entered from a process may have moved SimPy past the stop
        self.now_s = stop_s if stop_s >= env.now else env.now

    def _after_steps(self, lazy: bool | None) -> None:
        """Back from stepping SimPy: lazy again unless the environment was handed out meanwhile."""
        if self.lazy is None:
            self.lazy = lazy
        self.next_s = self.env.peek()

    def wait(self, event: simpy.Event) -> None:
        """Process events until ``event`` has been (as ``env.run(until=event)``); the clock is then
        at its time (or stays, if it was processed already)."""
        env = self.env
        lazy, self.lazy = self.lazy, (None if self.lazy else self.lazy)  # eager while SimPy runs
        try:
            while not event.processed:
                env.step()
        except simpy.core.EmptySchedule:
            raise InternalError(f"nothing is scheduled, and {event!r} will never be processed") from None
        finally:
            if env.now > self.now_s:
                self.now_s = env.now
            self._after_steps(lazy)
        if not self.lazy:
            self.sync()

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
            self.next_s = env.peek()
        return env

    def process(self, generator: Generator[simpy.Event, Any, Any]) -> simpy.Process:
        """Start a SimPy process now (at the device's time)."""
        process = self.sync().process(generator)
        self.next_s = self.env.peek()
        return process
