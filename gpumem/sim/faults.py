"""Fault injection for the simulated device.

A :class:`FaultPlan` says which calls fail and how; the device draws from its own
seeded random generator, so the same plan and seed always fail the same calls.

* ``malloc_failure_rate``: each allocation call (``malloc`` or ``mem_create``)
  fails with :class:`~gpumem.errors.OutOfMemoryError` with this probability;
* ``fail_allocation_calls``: these allocation calls (1-based count) fail the same way;
* ``transient_error_calls``: these allocation calls raise
  :class:`~gpumem.errors.TransientDeviceError` once (a retry succeeds);
* ``device_lost_at_s``: from this simulated time on, every call raises
  :class:`~gpumem.errors.DeviceLostError`.

A failed call changes nothing: the fault is decided before any state moves.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

from gpumem.errors import InvalidArgumentError


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

    def __post_init__(self) -> None:
        if not 0.0 <= self.malloc_failure_rate <= 1.0:
            raise InvalidArgumentError(f"malloc_failure_rate must be in [0, 1], got {self.malloc_failure_rate}")
        if self.device_lost_at_s is not None and self.device_lost_at_s < 0:
            raise InvalidArgumentError("device_lost_at_s must not be negative")
        object.__setattr__(self, "fail_allocation_calls", frozenset(self.fail_allocation_calls))
        object.__setattr__(self, "transient_error_calls", frozenset(self.transient_error_calls))

    @property
    def injects_anything(self) -> bool:
        return bool(self.malloc_failure_rate or self.fail_allocation_calls or self.transient_error_calls
                    or self.device_lost_at_s is not None)


class FaultInjector:
    """Decides, call by call, whether an allocation call fails under a :class:`FaultPlan`."""

    def __init__(self, plan: FaultPlan, rng: random.Random) -> None:
        self.plan = plan
        self._rng = rng
        self.allocation_calls = 0
        self.injected = 0

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
