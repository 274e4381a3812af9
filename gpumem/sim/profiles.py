"""Device profiles: what each simulated GPU reports.

A profile is what ``cudaGetDeviceProperties`` and ``cudaMemGetInfo`` say about a
card: the *reported* total (always below the nominal size on the box: an H100
"80 GB" reports 81,559 MiB, an H200 "141 GB" 150,109,880,320 bytes), how much
the CUDA context takes when it is created, compute capability, SM count and
bandwidth.

Note [Where the totals come from]
---------------------------------
The H200 figures were measured on the card we test on (``reports/hil/``). The
H100's 81,559 MiB is what the card reports. For the other cards the totals are
the ``total_memory`` that PyTorch (i.e. ``cudaMemGetInfo``) commonly reports for
them, rounded to whole MiB where only the MiB figure is published; context
overheads are typical values for the driver generation (a few hundred MiB on
data-centre parts, less on small cards). Embedded parts (Jetson) share memory
with the CPU: their "total" is the board's RAM as CUDA reports it and the
operating system's own use is modelled as ``host_reserved_nbytes``.

Note [Where the latencies come from]
------------------------------------
Every built-in profile uses the default :class:`~gpumem.sim.latency.LatencyModel`, whose
figures were measured on the H200 (Note [Latency calibration] in
:mod:`gpumem.sim.latency`, ``reports/hil/calibrate-h200-2026-11-22.md``): the costs of
driver calls are host-side work of the driver, and no other card was measured.
For the H100 (the same driver on the same kind of host) they are the best
estimate there is; for older and smaller cards, and for Jetson boards (slower
CPUs), they are a lower bound. Pass ``latency=LatencyModel(...)`` to
:func:`custom_profile` to model a card measured with ``sim/calibrate.py``.

A user defines a custom profile with :func:`custom_profile` or by building a
:class:`DeviceProfile` directly, and passes it to ``gpumem.sim.SimDevice`` or
``gpumem.open_device("sim:custom", profile=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gpumem.device import DeviceProperties
from gpumem.errors import DeviceNotFoundError, InvalidArgumentError
from gpumem.units import CUDA_GRANULARITY_NBYTES, GiB, MiB

from .latency import LatencyModel


@dataclass(frozen=True)
class DeviceProfile:
    """Everything the simulator needs to impersonate one GPU model."""

    name: str
    """Profile name: lowercase model and size, e.g. ``"a100-80gb"``."""
    display_name: str
    """What ``cudaGetDeviceProperties`` calls the card."""
    total_nbytes: int
    """Total bytes ``cudaMemGetInfo`` reports."""
    context_nbytes: int
    """Bytes the CUDA context takes when it is created."""
    compute_capability: tuple[int, int]
    multiprocessor_count: int
    memory_bandwidth_gbps: float
    unified_memory: bool = False
    vmm_supported: bool = True
    granularity_nbytes: int = CUDA_GRANULARITY_NBYTES
    host_reserved_nbytes: int = 0
    """On unified-memory parts, what the operating system itself keeps."""
    latency: LatencyModel = field(default_factory=LatencyModel)

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.lower() or " " in self.name:
            raise InvalidArgumentError(f"profile name must be lowercase without spaces, got {self.name!r}")
        for what in ("total_nbytes", "granularity_nbytes"):
            value = getattr(self, what)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(f"{what} must be a positive int, got {value!r}")
        for what in ("context_nbytes", "host_reserved_nbytes"):
            value = getattr(self, what)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"{what} must be a non-negative int, got {value!r}")
        if self.context_nbytes + self.host_reserved_nbytes >= self.total_nbytes:
            raise InvalidArgumentError("context and host reservations leave no memory on the device")
        if self.granularity_nbytes & (self.granularity_nbytes - 1):
            raise InvalidArgumentError("granularity_nbytes must be a power of two")

    @property
    def spec(self) -> str:
        """The ``open_device`` spec for this profile."""
        return f"sim:{self.name}"

    def properties(self) -> DeviceProperties:
        """The :class:`~gpumem.device.DeviceProperties` a device of this profile reports."""
        return DeviceProperties(
            name=self.display_name,
            total_nbytes=self.total_nbytes,
            compute_capability=self.compute_capability,
            multiprocessor_count=self.multiprocessor_count,
            memory_bandwidth_gbps=self.memory_bandwidth_gbps,
            unified_memory=self.unified_memory,
            vmm_supported=self.vmm_supported,
            granularity_nbytes=self.granularity_nbytes,
        )


def _mib(n: int) -> int:
    return n * MiB


#: The built-in profiles, smallest first.
BUILTIN_PROFILES: tuple[DeviceProfile, ...] = (
    DeviceProfile("jetson-nano-2gb", "NVIDIA Tegra X1 (Jetson Nano 2GB)", _mib(1_980), _mib(150), (5, 3), 1, 25.6,
                  unified_memory=True, vmm_supported=False, host_reserved_nbytes=_mib(600)),
    DeviceProfile("gtx-1050-2gb", "NVIDIA GeForce GTX 1050", _mib(1_998), _mib(80), (6, 1), 5, 112.0),
    DeviceProfile("jetson-nano-4gb", "NVIDIA Tegra X1 (Jetson Nano 4GB)", _mib(3_956), _mib(150), (5, 3), 1, 25.6,
                  unified_memory=True, vmm_supported=False, host_reserved_nbytes=_mib(900)),
    DeviceProfile("gtx-1650-4gb", "NVIDIA GeForce GTX 1650", _mib(3_904), _mib(100), (7, 5), 14, 128.0),
    DeviceProfile("rtx-2060-6gb", "NVIDIA GeForce RTX 2060", _mib(5_935), _mib(120), (7, 5), 30, 336.0),
    DeviceProfile("rtx-3060-12gb", "NVIDIA GeForce RTX 3060", _mib(12_042), _mib(180), (8, 6), 28, 360.0),
    DeviceProfile("t4-16gb", "Tesla T4", _mib(15_102), _mib(250), (7, 5), 40, 320.0),
    DeviceProfile("rtx-4090-24gb", "NVIDIA GeForce RTX 4090", _mib(24_217), _mib(300), (8, 9), 128, 1008.0),
    DeviceProfile("l4-24gb", "NVIDIA L4", _mib(22_563), _mib(300), (8, 9), 58, 300.0),
    DeviceProfile("a10-24gb", "NVIDIA A10", _mib(22_731), _mib(300), (8, 6), 72, 600.0),
    DeviceProfile("a100-40gb", "NVIDIA A100-SXM4-40GB", 42_314_694_656, _mib(420), (8, 0), 108, 1555.0),
    DeviceProfile("l40s-48gb", "NVIDIA L40S", _mib(45_589), _mib(420), (8, 9), 142, 864.0),
    DeviceProfile("a100-80gb", "NVIDIA A100-SXM4-80GB", 85_198_045_184, _mib(420), (8, 0), 108, 2039.0),
    DeviceProfile("h100-80gb", "NVIDIA H100 80GB HBM3", _mib(81_559), _mib(500), (9, 0), 132, 3350.0),
    DeviceProfile("h200-141gb", "NVIDIA H200", 150_109_880_320, 150_109_880_320 - 149_557_477_376, (9, 0), 132,
                  4800.0),
)


def profile_names() -> list[str]:
    """Names of the built-in profiles, smallest first."""
    return [p.name for p in BUILTIN_PROFILES]


def get_profile(name: str) -> DeviceProfile:
    """The built-in profile called ``name`` (e.g. ``"h200-141gb"``); also accepts ``"h200"``-style prefixes
    when they name exactly one profile."""
    if not isinstance(name, str):
        raise InvalidArgumentError(f"profile name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    for p in BUILTIN_PROFILES:
        if p.name == key:
            return p
    matches = [p for p in BUILTIN_PROFILES if p.name.startswith(key + "-")]
    if len(matches) == 1:
        return matches[0]
    if matches:   # "a100": a100-40gb and a100-80gb (new-user review: it was called unknown)
        raise DeviceNotFoundError(f"simulated profile {name!r:.40} is ambiguous: it could be "
                                  f"{', '.join(p.name for p in matches)}; name one in full (e.g. {matches[0].name!r})")
    raise DeviceNotFoundError(
        f"unknown simulated profile {name!r}; known profiles: {', '.join(profile_names())} "
        "(from Python, gpumem.sim.custom_profile(...) builds a profile for another card)"
    )


def custom_profile(name: str, total_nbytes: int, *, base: str | DeviceProfile = "a100-80gb",
                   **overrides: object) -> DeviceProfile:
    """A new profile ``name`` with ``total_nbytes``, everything else taken from ``base``.

    >>> p = custom_profile("my-card-8gb", 8 * GiB, compute_capability=(8, 6))
    """
    base_profile = base if isinstance(base, DeviceProfile) else get_profile(base)
    try:
        return replace(base_profile, name=name, display_name=str(overrides.pop("display_name", name)),
                       total_nbytes=total_nbytes, **overrides)  # type: ignore[arg-type]
    except TypeError as exc:  # an unknown field: every gpumem error is a GpumemError
        raise InvalidArgumentError(f"custom_profile: {exc}") from None


__all__ = ["DeviceProfile", "BUILTIN_PROFILES", "profile_names", "get_profile", "custom_profile", "GiB"]
