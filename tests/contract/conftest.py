"""Helpers for the contract suite: free-memory slack and a canary that proves a failed call changed nothing.

The suite talks to :class:`gpumem.Device` only. On a simulated device free memory is
exact; on a real GPU other processes (and the driver) may move it a little between two
``mem_info`` calls, so comparisons allow :data:`CUDA_SLACK_NBYTES`. The suite expects a
quiet device: simulated specs without ``pressure=``/``fail_rate=`` options.
"""

from __future__ import annotations

import contextlib
import random

import pytest

from gpumem import DeviceKind, GpumemError, MiB

#: How far free memory may drift between two mem_info calls on a real GPU.
CUDA_SLACK_NBYTES = 8 * MiB


@pytest.fixture
def slack(device) -> int:
    """0 on simulated devices (exact accounting), a few MiB on real ones."""
    return 0 if device.kind is DeviceKind.SIM else CUDA_SLACK_NBYTES


@pytest.fixture
def rng(request) -> random.Random:
    """A generator seeded by the test id, so data differ between tests but not between runs."""
    return random.Random(request.node.nodeid)


class Canary:
    """Live allocations with known contents, and the free bytes, taken before a call that must fail.

    ``assert_unchanged()`` checks free memory (within ``slack``) and that the data still read back.
    """

    SMALL = 4096
    LARGE = 3 * MiB + 123

    def __init__(self, dev, slack: int, rng: random.Random) -> None:
        self.dev = dev
        self.slack = slack
        self.small_ptr = dev.malloc(self.SMALL)
        self.large_ptr = dev.malloc(self.LARGE)
        self.small_data = rng.randbytes(self.SMALL)
        self.large_data = rng.randbytes(4096)
        self.large_offset = 2 * MiB - 1000  # straddles the first 2 MiB page boundary
        dev.write(self.small_ptr, self.small_data)
        dev.write(self.large_ptr + self.large_offset, self.large_data)
        self.free_nbytes = dev.mem_info().free_nbytes

    def assert_unchanged(self, *, free_nbytes: int | None = None) -> None:
        expected = self.free_nbytes if free_nbytes is None else free_nbytes
        now = self.dev.mem_info().free_nbytes
        assert abs(now - expected) <= self.slack, f"free bytes moved by {now - expected} (slack {self.slack})"
        assert self.dev.read(self.small_ptr, self.SMALL) == self.small_data
        assert self.dev.read(self.large_ptr + self.large_offset, len(self.large_data)) == self.large_data

    def release(self) -> None:
        for ptr in (self.small_ptr, self.large_ptr):
            try:
                self.dev.free(ptr)
            except GpumemError:
                pass  # the test closed the device or freed the canary itself


@pytest.fixture
def canary(device, slack, rng):
    """A :class:`Canary` on ``device``, freed after the test."""
    c = Canary(device, slack, rng)
    yield c
    c.release()


class Vmm:
    """Tracks what a test reserved, created and mapped, and undoes it all at the end."""

    def __init__(self, dev) -> None:
        self.dev = dev
        self.gran = dev.granularity_nbytes
        self.reservations: list[tuple[int, int]] = []
        self.handles: list = []
        self.mappings: list[tuple[int, int]] = []

    def reserve(self, n_gran: int) -> int:
        va = self.dev.address_reserve(n_gran * self.gran)
        self.reservations.append((va, n_gran * self.gran))
        return va

    def create(self, n_gran: int):
        h = self.dev.mem_create(n_gran * self.gran)
        self.handles.append(h)
        return h

    def map(self, va: int, handle, *, access: bool = True) -> None:
        self.dev.mem_map(va, handle.nbytes, handle)
        self.mappings.append((va, handle.nbytes))
        if access:
            self.dev.mem_set_access(va, handle.nbytes)

    def unmap(self, va: int, nbytes: int) -> None:
        self.dev.mem_unmap(va, nbytes)
        self.mappings.remove((va, nbytes))

    def release(self, handle) -> None:
        self.dev.mem_release(handle)
        self.handles.remove(handle)

    def address_free(self, va: int) -> None:
        nbytes = dict(self.reservations)[va]
        self.dev.address_free(va, nbytes)
        self.reservations.remove((va, nbytes))

    def cleanup(self) -> None:
        for va, n in reversed(self.mappings):
            with contextlib.suppress(Exception):
                self.dev.mem_unmap(va, n)
        for h in self.handles:
            with contextlib.suppress(Exception):
                self.dev.mem_release(h)
        for va, n in self.reservations:
            with contextlib.suppress(Exception):
                self.dev.address_free(va, n)


@pytest.fixture
def vmm(device):
    """A :class:`Vmm` on ``device``; everything it still holds is undone after the test."""
    v = Vmm(device)
    yield v
    v.cleanup()
