"""Other tenants: SimPy processes that take and give back device memory.

On a shared GPU other processes come and go. A tenant here is a SimPy process
that calls :meth:`TenantContext.take` and :meth:`TenantContext.give` on a
schedule; the device accounts its memory (rounded to the allocation
granularity, as a real process's ``cudaMalloc`` would be) and publishes
TENANT_TOOK / TENANT_RETURNED events. A tenant that asks for more than is free
gets nothing (TENANT_DENIED), as a real process would get an out-of-memory error.

Scenarios:

* :class:`Step` - take ``nbytes`` at ``at_s`` (and give it back at ``until_s``);
* :class:`Ramp` - grow to ``nbytes`` in ``steps`` equal steps over ``duration_s``, hold, then release;
* :class:`PeriodicSpikes` - every ``period_s``, take ``nbytes`` for ``spike_s``;
* :class:`RandomArrivals` - Poisson arrivals of jobs with random sizes and exponential hold times;
* :class:`TraceTenant` - a recorded allocation trace replayed as a tenant, on its own time line.

All randomness comes from the device's seeded generator.
"""

from __future__ import annotations

import abc
import random
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator, Sequence

from gpumem.errors import InvalidArgumentError
from gpumem.validate import check_int_in_range, check_real_in_range

if TYPE_CHECKING:  # pragma: no cover
    import simpy

ProcessGenerator = Generator["simpy.events.Event", object, None]


class TenantContext(abc.ABC):
    """What a tenant process may do: take and give memory, and know the clock."""

    env: "simpy.Environment"
    name: str
    rng: random.Random

    @abc.abstractmethod
    def take(self, nbytes: int) -> bool:
        """Take ``nbytes``; False (and nothing taken) when the device has too little free."""

    @abc.abstractmethod
    def give(self, nbytes: int) -> None:
        """Give back ``nbytes`` this tenant took earlier."""

    @property
    @abc.abstractmethod
    def held_nbytes(self) -> int:
        """Bytes this tenant holds now (as requested, before granularity rounding)."""


class Scenario(abc.ABC):
    """A pressure pattern; :meth:`process` is the SimPy process body of one tenant."""

    @abc.abstractmethod
    def process(self, ctx: TenantContext) -> ProcessGenerator:
        """Yield SimPy timeouts between takes and gives."""


def _number(scenario: Scenario, name: str, *, positive: bool = False, optional: bool = False) -> None:
    """Check ``scenario``'s field ``name`` (seconds, a rate, a scale): a finite number, > 0 where
    ``positive``, else >= 0, kept as a float (None passes where ``optional``). A comparison alone let NaN
    through: a SimPy timeout at time NaN, a tenant that silently never ran."""
    value = getattr(scenario, name)
    if value is None and optional:
        return
    what = f"{type(scenario).__name__}.{name}"
    x = check_real_in_range(value, what, 0.0, sys.float_info.max)
    if positive and x == 0:
        raise InvalidArgumentError(f"{what} must be positive, got {value!r}")
    object.__setattr__(scenario, name, x)


def _integer(scenario: Scenario, name: str, lo: int, *, optional: bool = False) -> None:
    """Check ``scenario``'s field ``name`` (bytes, a count): an integer >= ``lo``, kept as an int (a float
    or NaN size made the device's tenant_nbytes one)."""
    value = getattr(scenario, name)
    if value is None and optional:
        return
    object.__setattr__(scenario, name, check_int_in_range(value, f"{type(scenario).__name__}.{name}", lo))


@dataclass(frozen=True)
class Step(Scenario):
    """Take ``nbytes`` at ``at_s``; give it back at ``until_s`` if given."""

    nbytes: int
    at_s: float = 0.0
    until_s: float | None = None

    def __post_init__(self) -> None:
        _integer(self, "nbytes", 1)
        _number(self, "at_s")
        _number(self, "until_s", optional=True)
        if self.until_s is not None and self.until_s <= self.at_s:
            raise InvalidArgumentError("until_s must come after at_s")

    def process(self, ctx: TenantContext) -> ProcessGenerator:
        yield ctx.env.timeout(self.at_s)
        took = ctx.take(self.nbytes)
        if took and self.until_s is not None:
            yield ctx.env.timeout(self.until_s - self.at_s)
            ctx.give(self.nbytes)


@dataclass(frozen=True)
class Ramp(Scenario):
    """From ``start_s``, grow to ``nbytes`` in ``steps`` steps over ``duration_s``; hold ``hold_s``
    (forever when None), then give everything back at once."""

    nbytes: int
    duration_s: float
    start_s: float = 0.0
    steps: int = 10
    hold_s: float | None = None

    def __post_init__(self) -> None:
        _integer(self, "nbytes", 1)
        _number(self, "duration_s", positive=True)
        _integer(self, "steps", 1)
        _number(self, "start_s")
        _number(self, "hold_s", optional=True)

    def process(self, ctx: TenantContext) -> ProcessGenerator:
        yield ctx.env.timeout(self.start_s)
        step_nbytes = self.nbytes // self.steps
        for _ in range(self.steps):
            ctx.take(step_nbytes)
            yield ctx.env.timeout(self.duration_s / self.steps)
        if self.hold_s is not None:
            yield ctx.env.timeout(self.hold_s)
            if ctx.held_nbytes:
                ctx.give(ctx.held_nbytes)


@dataclass(frozen=True)
class PeriodicSpikes(Scenario):
    """Every ``period_s`` from ``start_s``, take ``nbytes`` for ``spike_s``; ``count`` spikes (None: forever)."""

    nbytes: int
    period_s: float
    spike_s: float
    start_s: float = 0.0
    count: int | None = None

    def __post_init__(self) -> None:
        _integer(self, "nbytes", 1)
        _number(self, "period_s", positive=True)
        _number(self, "spike_s", positive=True)
        _number(self, "start_s")
        _integer(self, "count", 0, optional=True)
        if self.spike_s >= self.period_s:
            raise InvalidArgumentError("spike_s must be shorter than period_s")

    def process(self, ctx: TenantContext) -> ProcessGenerator:
        yield ctx.env.timeout(self.start_s)
        n = 0
        while self.count is None or n < self.count:
            took = ctx.take(self.nbytes)
            yield ctx.env.timeout(self.spike_s)
            if took:
                ctx.give(self.nbytes)
            yield ctx.env.timeout(self.period_s - self.spike_s)
            n += 1


@dataclass(frozen=True)
class RandomArrivals(Scenario):
    """Jobs arrive as a Poisson process (``rate_per_s``), each takes a size uniform in
    [``min_nbytes``, ``max_nbytes``] for an exponential time of mean ``mean_hold_s``."""

    rate_per_s: float
    mean_hold_s: float
    min_nbytes: int
    max_nbytes: int
    until_s: float | None = None

    def __post_init__(self) -> None:
        _number(self, "rate_per_s", positive=True)
        _number(self, "mean_hold_s", positive=True)
        _integer(self, "min_nbytes", 1)
        _integer(self, "max_nbytes", 1)
        _number(self, "until_s", optional=True)
        if self.max_nbytes < self.min_nbytes:
            raise InvalidArgumentError("max_nbytes must be >= min_nbytes")

    def process(self, ctx: TenantContext) -> ProcessGenerator:
        env = ctx.env
        while self.until_s is None or env.now < self.until_s:
            yield env.timeout(ctx.rng.expovariate(self.rate_per_s))
            nbytes = ctx.rng.randint(self.min_nbytes, self.max_nbytes)
            if ctx.take(nbytes):
                env.process(self._release_later(ctx, nbytes, ctx.rng.expovariate(1.0 / self.mean_hold_s)))

    @staticmethod
    def _release_later(ctx: TenantContext, nbytes: int, hold_s: float) -> ProcessGenerator:
        yield ctx.env.timeout(hold_s)
        ctx.give(nbytes)


@dataclass(frozen=True)
class TraceTenant(Scenario):
    """Replay a recorded allocation trace as another tenant.

    ``ops`` is a sequence of ``(time_s, alloc_id, nbytes, is_alloc)`` relative to
    the trace's start; use :meth:`from_trace` for a :class:`gpumem.trace.Trace`.
    ``time_scale`` stretches (>1) or compresses (<1) the trace's time line.
    """

    ops: Sequence[tuple[float, int, int, bool]]
    start_s: float = 0.0
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        _number(self, "time_scale", positive=True)
        _number(self, "start_s")

    @classmethod
    def from_trace(cls, trace: object, *, start_s: float = 0.0, time_scale: float = 1.0) -> "TraceTenant":
        """Build from any object with ``kinds``, ``alloc_ids``, ``nbytes`` and ``times_us`` arrays (a Trace)."""
        kinds = list(getattr(trace, "kinds"))
        ids = list(getattr(trace, "alloc_ids"))
        sizes = list(getattr(trace, "nbytes"))
        times = list(getattr(trace, "times_us"))
        t0 = times[0] if times else 0.0
        ops = tuple(((float(t) - t0) / 1e6, int(i), int(n), int(k) == 0) for k, i, n, t in zip(kinds, ids, sizes, times))
        return cls(ops=ops, start_s=start_s, time_scale=time_scale)

    def process(self, ctx: TenantContext) -> ProcessGenerator:
        yield ctx.env.timeout(self.start_s)
        origin = ctx.env.now
        held: dict[int, int] = {}
        for time_s, alloc_id, nbytes, is_alloc in self.ops:
            due = origin + time_s * self.time_scale
            if due > ctx.env.now:
                yield ctx.env.timeout(due - ctx.env.now)
            if is_alloc:
                if ctx.take(nbytes):
                    held[alloc_id] = nbytes
            elif alloc_id in held:
                ctx.give(held.pop(alloc_id))


def preset(name: str, total_nbytes: int) -> Scenario:
    """A named pressure scenario scaled to a device of ``total_nbytes`` (for ``sim:...?pressure=NAME``).

    ``step``: a quarter of the device taken at 1 ms. ``ramp``: up to half over 100 ms.
    ``spikes``: a fifth of the device for 2 ms every 10 ms. ``random``: jobs of 1-5% of the
    device arriving 200 times a second, held 20 ms on average.
    """
    presets = {
        "step": lambda: Step(nbytes=total_nbytes // 4, at_s=1e-3),
        "ramp": lambda: Ramp(nbytes=total_nbytes // 2, duration_s=0.1, steps=20),
        "spikes": lambda: PeriodicSpikes(nbytes=total_nbytes // 5, period_s=0.01, spike_s=0.002),
        "random": lambda: RandomArrivals(rate_per_s=200.0, mean_hold_s=0.02, min_nbytes=total_nbytes // 100,
                                         max_nbytes=total_nbytes // 20),
    }
    if name not in presets:
        raise InvalidArgumentError(f"unknown pressure preset {name!r}; choose one of {', '.join(presets)}")
    return presets[name]()


PRESET_NAMES = ("step", "ramp", "spikes", "random")
