"""A SimPy-driven simulated GPU for gpumem.

``SimDevice`` implements :class:`gpumem.Device` for any :class:`DeviceProfile`
(from 2 GB Jetson boards to the 141 GB H200), with other tenants creating
memory pressure (:mod:`gpumem.sim.pressure`), injected faults (:mod:`gpumem.sim.faults`),
memory events (:mod:`gpumem.events`), and streams running queued work in simulated
time under a memory sanitizer (:mod:`gpumem.sim.streams`). Open one with ``gpumem.open_device("sim:h200-141gb")``.
"""

from .device import Hazard, SimCallStats, SimDevice, SimEvent
from ..events import MemoryEvent, MemoryEventKind, Subscription
from .faults import CALL_NAMES, FaultPlan
from .streams import Work
from .latency import LatencyModel
from .pressure import PeriodicSpikes, Ramp, RandomArrivals, Scenario, Step, TraceTenant, preset
from .profiles import BUILTIN_PROFILES, DeviceProfile, custom_profile, get_profile, profile_names

__all__ = [
    "SimDevice", "SimCallStats", "SimEvent", "Work", "Hazard", "CALL_NAMES", "MemoryEvent", "MemoryEventKind", "Subscription", "FaultPlan", "LatencyModel",
    "Scenario", "Step", "Ramp", "PeriodicSpikes", "RandomArrivals", "TraceTenant", "preset",
    "BUILTIN_PROFILES", "DeviceProfile", "custom_profile", "get_profile", "profile_names",
]
