"""A SimPy-driven simulated GPU for gpumem.

``SimDevice`` implements :class:`gpumem.Device` for any :class:`DeviceProfile`
(from 2 GB Jetson boards to the 141 GB H200), with other tenants creating
memory pressure (:mod:`sim.pressure`), injected faults (:mod:`sim.faults`) and
memory events (:mod:`sim.events`). Open one with ``gpumem.open_device("sim:h200-141gb")``.
"""

from .device import SimCallStats, SimDevice
from .events import MemoryEvent, MemoryEventKind, Subscription
from .faults import FaultPlan
from .latency import LatencyModel
from .pressure import PeriodicSpikes, Ramp, RandomArrivals, Scenario, Step, TraceTenant, preset
from .profiles import BUILTIN_PROFILES, DeviceProfile, custom_profile, get_profile, profile_names

__all__ = [
    "SimDevice", "SimCallStats", "MemoryEvent", "MemoryEventKind", "Subscription", "FaultPlan", "LatencyModel",
    "Scenario", "Step", "Ramp", "PeriodicSpikes", "RandomArrivals", "TraceTenant", "preset",
    "BUILTIN_PROFILES", "DeviceProfile", "custom_profile", "get_profile", "profile_names",
]
