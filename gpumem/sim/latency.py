"""How long each simulated device call takes.

Note [Latency calibration]
--------------------------
Every figure below is a median measured on the H200 we test on by
``hil/probes/calibrate.py`` (``reports/hil/calibrate-h200-2026-11-22.{md,json}``,
30 samples per call unless noted, driver 580.159.04). The driver calls were
timed from Python through cuda-bindings; the binding's own cost (a call that
does nothing, ``cuCtxGetDevice``: 0.78 µs) is taken off each, since the native
engine calls the driver directly. The runtime calls (``cudaMalloc``,
``cudaFree``, ``cudaMemGetInfo``) are as CuPy sees them.

* ``cudaMalloc`` + ``cudaFree`` pairs: 86.7 µs at 512 B and 1 MiB, 154 µs at
  64 MiB, 793 µs at 1 GiB; interpolated linearly in the size between those
  points, extrapolated with the last slope beyond 1 GiB, and split between the
  two calls in the ratio :attr:`LatencyModel.malloc_share`.
* ``cuMemCreate``: 13.2 µs up to 32 MiB (2 MiB: 13.2, 32 MiB: 12.8), 21.5 µs
  at 256 MiB, 117.6 µs at 1 GiB; ``cuMemRelease``: 14.1, 30.6, 160.6 and
  585.2 µs at those sizes (releasing costs more than creating, and grows with
  the size). Interpolated like the malloc pairs.
* ``cuMemMap``: 2.4 µs, the same for one 2 MiB page and for a 64 MiB chunk.
* ``cuMemSetAccess`` over a range of ``k`` mappings and ``n`` MiB:
  4.8 + 30.2 k + 0.17 n µs, fitted exactly to one page (35.4 µs), one call over
  32 one-page mappings (983 µs: the cost is per mapping, one call over many
  saves almost nothing) and one 64 MiB mapping (46.0 µs).
* ``cuMemUnmap`` likewise: 1.5 + 20.4 k + 0.088 n µs (one page 22.1 µs, 32
  one-page mappings in one call 659 µs, one 64 MiB mapping 27.5 µs).
* ``cuMemAddressReserve`` 3.7 µs and ``cuMemAddressFree`` 6.1 µs (1 TiB; 1 GiB
  costs 3.2 and 3.4 µs).
* ``cudaMemGetInfo`` 7.1 µs (``cuMemGetInfo`` 7.0); ``cudaGetDeviceProperties``
  1.46 ms (devices cache it: a simulated ``properties()`` costs nothing).
* Events and streams: ``cuEventCreate`` + ``cuEventRecord`` (what
  ``event_record`` stands for) 1.3 µs, ``cuEventQuery`` 0.6 µs,
  ``cuEventDestroy`` 0.7 µs, ``cuStreamWaitEvent`` 1.1 µs,
  ``cuStreamSynchronize`` / ``cuEventSynchronize`` with nothing to wait for
  1.1 µs (waiting adds the simulated time the work still needs),
  ``cuCtxSynchronize`` 1.3 µs, ``cuStreamCreate`` 2.8 µs, ``cuStreamDestroy``
  2.4 µs.

Not measured yet, estimates: a kernel launch (``launch_us``, near 4 µs of host
time in published microbenchmarks) and the fixed cost of a copy
(``copy_launch_us``); copies then run at the profile's bandwidth.

The same driver costs serve every profile: they are host-side driver work, and
no other card was measured (an H100 runs the same driver on the same kind of
host; smaller cards are likely slower, never measured here).

Simulated time only moves the SimPy clock; nothing sleeps for real.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

from gpumem.units import GiB, MiB

Points = tuple[tuple[int, float], ...]


def interpolate_us(points: Points, nbytes: int, sizes: Sequence[int] | None = None) -> float:
    """The cost at ``nbytes`` on the piecewise-linear curve through ``points`` (``(nbytes, µs)``, sizes
    increasing): the first point's cost below it, the last segment's slope beyond the last point.
    ``sizes``: the points' sizes, if the caller keeps them."""
    if nbytes <= points[0][0]:
        return points[0][1]
    i = bisect.bisect_right(sizes if sizes is not None else [p[0] for p in points], nbytes)
    if i >= len(points):
        (s0, c0), (s1, c1) = points[-2], points[-1]
    else:
        (s0, c0), (s1, c1) = points[i - 1], points[i]
    return c0 + (c1 - c0) * (nbytes - s0) / (s1 - s0)


@dataclass(frozen=True)
class LatencyModel:
    """Simulated cost of each device call, in microseconds (Note [Latency calibration])."""

    malloc_free_points: Points = ((0, 86.7), (1 * MiB, 86.7), (64 * MiB, 154.0), (1 * GiB, 793.5))
    malloc_share: float = 0.6
    mem_get_info_us: float = 7.1
    get_properties_us: float = 1461.0
    address_reserve_us: float = 3.7
    address_free_us: float = 6.1
    mem_create_points: Points = ((2 * MiB, 13.2), (32 * MiB, 13.2), (256 * MiB, 21.5), (1 * GiB, 117.6))
    mem_release_points: Points = ((2 * MiB, 14.1), (32 * MiB, 30.6), (256 * MiB, 160.6), (1 * GiB, 585.2))
    mem_map_us: float = 2.4
    mem_set_access_us: float = 4.8
    """Per call; plus :attr:`mem_set_access_mapping_us` per mapping and :attr:`mem_set_access_mib_us` per MiB."""
    mem_set_access_mapping_us: float = 30.2
    mem_set_access_mib_us: float = 0.17
    mem_unmap_us: float = 1.5
    """Per call; plus :attr:`mem_unmap_mapping_us` per mapping and :attr:`mem_unmap_mib_us` per MiB."""
    mem_unmap_mapping_us: float = 20.4
    mem_unmap_mib_us: float = 0.088
    copy_launch_us: float = 8.0
    synchronize_us: float = 1.1
    """``cudaStreamSynchronize`` / ``cudaEventSynchronize`` with nothing left to wait for."""
    device_synchronize_us: float = 1.3
    """``cudaDeviceSynchronize`` with nothing left to wait for."""
    stream_create_us: float = 2.8
    stream_destroy_us: float = 2.4
    event_record_us: float = 1.3
    event_query_us: float = 0.6
    event_destroy_us: float = 0.7
    stream_wait_event_us: float = 1.1
    launch_us: float = 4.0  # an estimate (see the Note above)

    def __post_init__(self) -> None:
        # the sizes of the malloc curve, kept: malloc and free interpolate it on every call
        object.__setattr__(self, "_malloc_sizes", tuple(p[0] for p in self.malloc_free_points))

    def malloc_free_us(self, nbytes: int) -> float:
        """Cost of a ``cudaMalloc`` + ``cudaFree`` pair of ``nbytes``."""
        return interpolate_us(self.malloc_free_points, nbytes, self._malloc_sizes)  # type: ignore[attr-defined]

    def malloc_us(self, nbytes: int) -> float:
        return self.malloc_free_us(nbytes) * self.malloc_share

    def free_us(self, nbytes: int) -> float:
        return self.malloc_free_us(nbytes) * (1.0 - self.malloc_share)

    def mem_create_cost_us(self, nbytes: int) -> float:
        """Cost of a ``cuMemCreate`` of ``nbytes``."""
        return interpolate_us(self.mem_create_points, nbytes)

    def mem_release_cost_us(self, nbytes: int) -> float:
        """Cost of a ``cuMemRelease`` of a chunk of ``nbytes``."""
        return interpolate_us(self.mem_release_points, nbytes)

    def mem_set_access_cost_us(self, n_mappings: int, nbytes: int) -> float:
        """Cost of one ``cuMemSetAccess`` over ``nbytes`` covered by ``n_mappings`` mappings."""
        return self.mem_set_access_us + self.mem_set_access_mapping_us * n_mappings \
            + self.mem_set_access_mib_us * nbytes / MiB

    def mem_unmap_cost_us(self, n_mappings: int, nbytes: int) -> float:
        """Cost of one ``cuMemUnmap`` over ``nbytes`` covered by ``n_mappings`` mappings."""
        return self.mem_unmap_us + self.mem_unmap_mapping_us * n_mappings + self.mem_unmap_mib_us * nbytes / MiB

    def copy_us(self, nbytes: int, bandwidth_gbps: float) -> float:
        """A host-device copy: launch cost plus bytes over the bandwidth (PCIe-limited copies are slower;
        this is a lower bound good enough for ordering events)."""
        return self.copy_launch_us + nbytes / (bandwidth_gbps * 1e3)
