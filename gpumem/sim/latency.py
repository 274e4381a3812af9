"""How long each simulated device call takes.

Note [Latency calibration]
--------------------------
``cudaMalloc`` + ``cudaFree`` pairs cost 89 µs at 512 B and 1 MiB, 153 µs at
64 MiB and 838 µs at 1 GiB on the H200 (``reports/anchors.md``); between those
points the cost is interpolated linearly in the size, beyond 1 GiB extrapolated
with the last slope. A pair is split between the two calls in the ratio
:attr:`LatencyModel.malloc_share`. ``cudaMemGetInfo`` costs 6.5 µs and
``cudaGetDeviceProperties`` 1.08 ms (anchors). The virtual-memory calls were
measured by ``hil/probes/calibrate.py`` on the same H200
(``reports/hil/calibration-h200-*.json``): cuMemCreate 10.5 µs, cuMemMap 2.0 µs,
cuMemSetAccess 27 µs, cuMemUnmap 17 µs, cuMemRelease 11 µs for a 2 MiB chunk;
reserve 13 µs and free 16 µs of address space. Copies run at the profile's
bandwidth plus a fixed launch cost.

The stream and event calls are estimates until measured (``hil/probes`` has no
probe for them yet): CUDA documents none, and published microbenchmarks put
``cudaEventRecord`` and ``cudaEventQuery`` at a few microseconds,
``cudaStreamCreate`` near 10 µs and a kernel launch near 4 µs of host time.

Simulated time only moves the SimPy clock; nothing sleeps for real.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from gpumem.units import GiB, MiB


@dataclass(frozen=True)
class LatencyModel:
    """Simulated cost of each device call, in microseconds."""

    malloc_free_points: tuple[tuple[int, float], ...] = ((0, 89.0), (1 * MiB, 89.0), (64 * MiB, 153.0),
                                                         (1 * GiB, 838.0))
    malloc_share: float = 0.6
    mem_get_info_us: float = 6.5
    get_properties_us: float = 1080.0
    address_reserve_us: float = 13.4
    address_free_us: float = 16.2
    mem_create_us: float = 10.5
    mem_release_us: float = 11.4
    mem_map_us: float = 2.0
    mem_set_access_us: float = 27.2
    mem_unmap_us: float = 17.0
    copy_launch_us: float = 8.0
    synchronize_us: float = 2.0
    # estimates until measured (see the Note above)
    stream_create_us: float = 10.0
    stream_destroy_us: float = 6.0
    event_record_us: float = 2.5
    event_query_us: float = 2.0
    event_destroy_us: float = 1.5
    stream_wait_event_us: float = 2.5
    launch_us: float = 4.0

    def malloc_free_us(self, nbytes: int) -> float:
        """Cost of a ``cudaMalloc`` + ``cudaFree`` pair of ``nbytes``."""
        pts = self.malloc_free_points
        sizes = [p[0] for p in pts]
        i = bisect.bisect_right(sizes, nbytes)
        if i >= len(pts):
            (s0, c0), (s1, c1) = pts[-2], pts[-1]
        else:
            (s0, c0), (s1, c1) = pts[i - 1], pts[i]
        return c0 + (c1 - c0) * (nbytes - s0) / (s1 - s0)

    def malloc_us(self, nbytes: int) -> float:
        return self.malloc_free_us(nbytes) * self.malloc_share

    def free_us(self, nbytes: int) -> float:
        return self.malloc_free_us(nbytes) * (1.0 - self.malloc_share)

    def copy_us(self, nbytes: int, bandwidth_gbps: float) -> float:
        """A host-device copy: launch cost plus bytes over the bandwidth (PCIe-limited copies are slower;
        this is a lower bound good enough for ordering events)."""
        return self.copy_launch_us + nbytes / (bandwidth_gbps * 1e3)
