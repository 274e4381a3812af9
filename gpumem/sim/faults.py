"""Fault injection for the simulated device.

A :class:`FaultPlan` says which calls fail and how; the device draws from its own
seeded random generator, so the same plan and seed always fail the same calls.

* ``malloc_failure_rate``: each allocation call (``malloc`` or ``mem_create``)
  fails with :class:`~gpumem.errors.OutOfMemoryError` with this probability;
* ``fail_allocation_calls``: these allocation calls (1-based count) fail the same way;
* ``transient_error_calls``: these allocation calls raise
  :class:`~gpumem.errors.TransientDeviceError` once (a retry succeeds);
* ``device_lost_at_s``: this many simulated seconds after the device was created (its time, on its
  own environment), and from then on, every call raises :class:`~gpumem.errors.DeviceLostError`;
* ``fail_calls``: per call type (a :data:`CALL_NAMES` entry, the :class:`gpumem.Device`
  method's name), the 1-based indices of that type's calls to fail, e.g.
  ``{"mem_unmap": {3}}`` fails the third ``mem_unmap``;
* ``call_failure_rates``: per call type, the probability that each call fails
  (spec option ``fail.<call>=<probability>``).

An injected failure raises what the real call would: ``malloc`` and ``mem_create``
an :class:`~gpumem.errors.OutOfMemoryError`, every other call a
:class:`~gpumem.errors.CudaError` ``CUDA_ERROR_UNKNOWN``; both with ``injected=True``.
A failed call changes nothing: the fault is decided before any state moves.
"""

from __future__ import annotations

import enum
import numbers
import random
from dataclasses import dataclass, field
from typing import Mapping

from gpumem.errors import InvalidArgumentError
from gpumem.validate import check_duration

#: The device calls whose failures can be injected per call type (the Device method names).
CALL_NAMES = (
    "malloc", "free", "address_reserve", "address_free", "mem_create", "mem_release", "mem_map",
    "mem_set_access", "mem_unmap", "stream_create", "stream_destroy", "event_record", "event_query",
    "event_synchronize", "event_destroy", "stream_synchronize", "stream_wait_event", "synchronize",
)


class FaultKind(str, enum.Enum):
    OOM = "oom"
    TRANSIENT = "transient"


@dataclass(frozen=True)
class FaultPlan:
    """Which device calls fail. The default plan injects nothing."""

    malloc_failure_rate: float = 0.0
    fail_allocation_calls: frozenset[int] = field(default_factory=frozenset)
    transient_error_calls: frozenset[int] = field(default_factory=frozenset)
    device_lost_at_s: float | None = None
    fail_calls: Mapping[str, frozenset[int]] = field(default_factory=dict)
    call_failure_rates: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "malloc_failure_rate", _probability(self.malloc_failure_rate, "malloc_failure_rate"))
        if self.device_lost_at_s is not None:
            lost_s = check_duration(self.device_lost_at_s, what="device_lost_at_s")
            object.__setattr__(self, "device_lost_at_s", lost_s)
        object.__setattr__(self, "fail_allocation_calls",
                           _call_indices(self.fail_allocation_calls, "fail_allocation_calls"))
        object.__setattr__(self, "transient_error_calls",
                           _call_indices(self.transient_error_calls, "transient_error_calls"))
        fail_calls: dict[str, frozenset[int]] = {}
        for name, indices in _items(self.fail_calls, "fail_calls"):
            _check_call_name(name, "fail_calls")
            idx = _call_indices(indices, f"fail_calls[{name!r}]")
            if idx:
                fail_calls[name] = idx
        rates: dict[str, float] = {}
        for name, rate in _items(self.call_failure_rates, "call_failure_rates"):
            _check_call_name(name, "call_failure_rates")
            rate = _probability(rate, f"call_failure_rates[{name!r}]")
            if rate:
                rates[name] = rate
        object.__setattr__(self, "fail_calls", fail_calls)
        object.__setattr__(self, "call_failure_rates", rates)

    @property
    def injects_anything(self) -> bool:
        return bool(self.malloc_failure_rate or self.fail_allocation_calls or self.transient_error_calls
                    or self.device_lost_at_s is not None or self.fail_calls or self.call_failure_rates)


def _probability(value: object, what: str) -> float:
    """``value`` as a float probability in [0, 1], else :class:`InvalidArgumentError`."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real)
    try:
        ok = ok and 0.0 <= float(value) <= 1.0  # type: ignore[arg-type]
    except (OverflowError, ValueError, TypeError):
        ok = False
    if not ok:
        raise InvalidArgumentError(f"{what} must be a probability in [0, 1], got {type(value).__name__} "
                                   f"{value!r}"[:200])
    return float(value)


def _call_indices(value: object, what: str) -> frozenset[int]:
    """``value`` as a frozenset of 1-based call indices (positive ints), else :class:`InvalidArgumentError`."""
    if isinstance(value, (str, bytes, bytearray, Mapping)):
        raise InvalidArgumentError(f"{what} must be a set of call indices (ints >= 1), got {type(value).__name__}")
    try:
        indices = frozenset(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(f"{what} must be a set of call indices (ints >= 1), got "
                                   f"{type(value).__name__}") from None
    bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or i < 1]
    if bad:
        raise InvalidArgumentError(f"{what}: call indices are ints >= 1 (1 is the first call), got "
                                   f"{sorted(bad, key=repr)[:5]!r}"[:200])
    return indices


def _items(value: object, what: str) -> list[tuple[object, object]]:
    """The ``(call name, value)`` pairs of a mapping, else :class:`InvalidArgumentError`."""
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"{what} must be a mapping of call names, got {type(value).__name__}")
    return list(value.items())


def _check_call_name(name: object, what: str) -> None:
    if name not in CALL_NAMES:
        raise InvalidArgumentError(f"{what}: unknown call {name!r}; known: {', '.join(CALL_NAMES)}")


class FaultInjector:
    """Decides, call by call, whether an allocation call fails under a :class:`FaultPlan`."""

    def __init__(self, plan: FaultPlan, rng: random.Random) -> None:
        self.plan = plan
        self._rng = rng
        self.allocation_calls = 0
        self.injected = 0
        self.calls: dict[str, int] = {}
        """How many calls of each type were counted (only types the plan fails are counted)."""
        self.per_call = bool(plan.fail_calls or plan.call_failure_rates)
        """Whether any per-call-type fault is planned (the device skips :meth:`call_fails` otherwise)."""

    def call_fails(self, name: str) -> bool:
        """Count one call of type ``name`` and say whether it fails (per-call-type faults only)."""
        plan = self.plan
        indices = plan.fail_calls.get(name)
        rate = plan.call_failure_rates.get(name)
        if indices is None and rate is None:
            return False
        n = self.calls[name] = self.calls.get(name, 0) + 1
        if (indices is not None and n in indices) or (rate is not None and self._rng.random() < rate):
            self.injected += 1
            return True
        return False

    def next_allocation_fault(self) -> FaultKind | None:
        """Count one allocation call and say which fault, if any, it gets."""
        self.allocation_calls += 1
        n = self.allocation_calls
        fault: FaultKind | None = None
        if n in self.plan.transient_error_calls:
            fault = FaultKind.TRANSIENT
        elif n in self.plan.fail_allocation_calls:
            fault = FaultKind.OOM
        elif self.plan.malloc_failure_rate and self._rng.random() < self.plan.malloc_failure_rate:
            fault = FaultKind.OOM
        if fault is not None:
            self.injected += 1
        return fault
