"""How long each simulated device call takes.

Note [Latency calibration]
--------------------------
Every figure below is the geometric mean of three calibrations of the H200
we test on by ``sim/calibrate.py`` (driver 580.159.04):
``reports/hil/calibrate-h200-2026-11-22.json`` and the two HIL records'
fidelity runs of 2026-11-22 (``reports/hil/hil-nvidia-h200-2026-11-22.json``
keeps the calibration it measured); ``python -m sim.fit_latency FILE...``
prints the table and the fits. The runs differ more than expected: the same
call took up to 2.7x longer in one run than in another (the host's load and
clock, the driver's state), so a model fitted to one run was up to 2.9x off
on the next. The geometric mean is the figure whose largest ratio to any run
is smallest. ``cuMemCreate`` of 1 GiB is bimodal (117.6 and 116.9 µs in two
runs, 16.3 µs in the third): no figure is within 2x of both modes.

The driver calls were timed from Python through cuda-bindings; the binding's
own cost (a call that does nothing, ``cuCtxGetDevice``: 0.2-0.8 µs) is taken
off each, since the native engine calls the driver directly. The runtime
calls (``cudaMalloc``, ``cudaFree``, ``cudaMemGetInfo``) are as CuPy sees them.

* ``cudaMalloc`` + ``cudaFree`` pairs: 84.6 µs up to 1 MiB, 152.0 µs at
  64 MiB, 641.4 µs at 1 GiB; interpolated linearly in the size between those
  points, extrapolated with the last slope beyond 1 GiB, and split between the
  two calls in the ratio :attr:`LatencyModel.malloc_share`.
* ``cuMemCreate``: 10.7 µs at 2 MiB, 11.1 at 32 MiB, 16.5 at 256 MiB, 60.8 at
  1 GiB; ``cuMemRelease``: 12.1, 25.4, 118.7 and 437.2 µs at those sizes
  (releasing costs more than creating, and grows with the size). Interpolated
  like the malloc pairs.
* ``cuMemMap``: 2.1 µs, about the same for one 2 MiB page and a 64 MiB chunk.
* ``cuMemSetAccess`` over a range of ``k`` mappings and ``n`` MiB:
  1.5 + 29.5 k + 0.18 n µs, fitted to one page (31.3 µs), one call over 32
  one-page mappings (957 µs: the cost is per mapping, one call over many saves
  almost nothing) and one 64 MiB mapping (42.6 µs).
* ``cuMemUnmap`` likewise: 19.4 k + 0.10 n µs (one page 19.4 µs, 32 one-page
  mappings in one call 630 µs, one 64 MiB mapping 25.8 µs; the exact fit has
  a fixed part of -0.3 µs, taken as none).
* ``cuMemAddressReserve`` 2.8 µs for every size (1 GiB and 1 TiB cost 2.7
  and 3.0 µs); ``cuMemAddressFree`` grows with the size: 2.8 µs at 1 GiB,
  5.1 µs at 1 TiB, interpolated like the malloc pairs (one figure for both,
  3.6 µs, was 2.2x off on a run that freed 1 GiB in 1.6 µs).
* ``cudaMemGetInfo`` 5.8 µs (6.0; ``cuMemGetInfo`` 5.7); ``cudaGetDeviceProperties``
  1.26 ms (devices cache it: a simulated ``properties()`` costs nothing).
* Events and streams: ``cuEventCreate`` + ``cuEventRecord`` (what
  ``event_record`` stands for) 0.9 µs, ``cuEventQuery`` 0.35 µs,
  ``cuEventDestroy`` 0.4 µs, ``cuStreamWaitEvent`` 0.8 µs,
  ``cuStreamSynchronize`` / ``cuEventSynchronize`` with nothing to wait for
  0.7 µs (waiting adds the simulated time the work still needs),
  ``cuCtxSynchronize`` 0.8 µs, ``cuStreamCreate`` 2.8 µs, ``cuStreamDestroy``
  2.0 µs.

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

    malloc_free_points: Points = ((0, 84.6), (1 * MiB, 84.6), (64 * MiB, 152.0), (1 * GiB, 641.4))
    malloc_share: float = 0.6
    mem_get_info_us: float = 5.8
    get_properties_us: float = 1257.0
    address_reserve_us: float = 2.8
    address_free_points: Points = ((1 * GiB, 2.8), (1024 * GiB, 5.1))
    mem_create_points: Points = ((2 * MiB, 10.7), (32 * MiB, 11.1), (256 * MiB, 16.5), (1 * GiB, 60.8))
    mem_release_points: Points = ((2 * MiB, 12.1), (32 * MiB, 25.4), (256 * MiB, 118.7), (1 * GiB, 437.2))
    mem_map_us: float = 2.1
    mem_set_access_us: float = 1.5
    """Per call; plus :attr:`mem_set_access_mapping_us` per mapping and :attr:`mem_set_access_mib_us` per MiB."""
    mem_set_access_mapping_us: float = 29.5
    mem_set_access_mib_us: float = 0.18
    mem_unmap_us: float = 0.0
    """Per call; plus :attr:`mem_unmap_mapping_us` per mapping and :attr:`mem_unmap_mib_us` per MiB."""
    mem_unmap_mapping_us: float = 19.4
    mem_unmap_mib_us: float = 0.10
    copy_launch_us: float = 8.0
    synchronize_us: float = 0.7
    """``cudaStreamSynchronize`` / ``cudaEventSynchronize`` with nothing left to wait for."""
    device_synchronize_us: float = 0.8
    """``cudaDeviceSynchronize`` with nothing left to wait for."""
    stream_create_us: float = 2.8
    stream_destroy_us: float = 2.0
    event_record_us: float = 0.9
    event_query_us: float = 0.35
    event_destroy_us: float = 0.4
    stream_wait_event_us: float = 0.8
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

    def address_free_cost_us(self, nbytes: int) -> float:
        """Cost of a ``cuMemAddressFree`` of a range of ``nbytes``."""
        return interpolate_us(self.address_free_points, nbytes)

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
