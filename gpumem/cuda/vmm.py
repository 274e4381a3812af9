"""CUDA's virtual memory management, through the driver API of cuda-bindings.

The driver lets a program separate *address space* from *memory*:

1. ``cuMemAddressReserve`` reserves a range of virtual addresses (no memory yet);
2. ``cuMemCreate`` creates a physical chunk (memory, no address), a multiple of
   the allocation granularity (2 MiB on every current GPU);
3. ``cuMemMap`` maps (part of) a chunk at an address inside a reservation;
4. ``cuMemSetAccess`` makes the mapped range readable and writable by a device
   (a fresh mapping is not accessible at all);
5. ``cuMemUnmap``, ``cuMemRelease`` and ``cuMemAddressFree`` undo each step. A
   released chunk's memory returns to the device once its last mapping is gone.

This is what lets an allocator grow a segment in place (PyTorch's
"expandable segments") instead of allocating a bigger one and copying.

:class:`VmmDriver` is a thin, stateless wrapper for one device: it builds the
``CUmemAllocationProp`` and ``CUmemAccessDesc`` structures once and turns every
failed call into a :class:`~gpumem.errors.CudaError` named by CUDA. The
bookkeeping that keeps bad input away from the driver lives in
:class:`~gpumem.cuda.CudaDevice`.

The driver acts on the calling thread's current CUDA context, so the device
makes its primary context current (``cudaSetDevice``) before calling here.
"""

from __future__ import annotations

import logging
from typing import Any

from gpumem.errors import CudaError

from .errors import driver_call

log = logging.getLogger(__name__)


class VmmDriver:
    """Virtual memory calls for the device with CUDA ordinal ``ordinal``.

    ``driver`` is ``cuda.bindings.driver`` (or an object with the same API).
    Creating one calls ``cuInit`` (cheap and idempotent; it creates no context)
    and ``cuDeviceGet``; either can raise :class:`~gpumem.errors.CudaError`.
    """

    def __init__(self, driver: Any, ordinal: int) -> None:
        self.driver = driver
        self.ordinal = ordinal
        driver_call(driver, "cuInit", 0)
        self.cu_device = driver_call(driver, "cuDeviceGet", ordinal)
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        self._prop = prop
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = ordinal
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.peers = self._peers(driver, ordinal)
        self._access = [access] + [self._access_desc(driver, peer) for peer in self.peers]

    @staticmethod
    def _access_desc(driver: Any, ordinal: int) -> Any:
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = ordinal
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return access

    def _peers(self, driver: Any, ordinal: int) -> list[int]:
        """The ordinals of the other devices that can reach this one's memory (Note [Peers read mapped
        memory] in ``gpumem/_native/cuda_backend.cpp``: cuMemMap'd memory is readable only by the devices
        ``cuMemSetAccess`` names, so a copy to another GPU needs that GPU named too)."""
        # A peer that cannot be queried is left out, with a warning, as the native backend does: the
        # device itself keeps virtual memory (a failure here must not turn VMM off for it).
        peers = []
        try:
            count = int(driver_call(driver, "cuDeviceGetCount"))
        except CudaError as exc:
            log.warning("CUDA device %d: cannot count the devices (%s); no peer GPU gets access to its memory",
                        ordinal, exc)
            return peers
        for other in range(count):
            if other == ordinal:
                continue
            try:
                peer = driver_call(driver, "cuDeviceGet", other)
                if driver_call(driver, "cuDeviceCanAccessPeer", peer, self.cu_device):
                    peers.append(other)
            except CudaError as exc:
                log.warning("CUDA device %d: cannot ask whether device %d reaches it (%s); device %d gets no "
                            "access to its memory", ordinal, other, exc, other)
        return peers

    # -- what the device can do ----------------------------------------------------------------
    def supported(self) -> bool:
        """``CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED``: whether the calls below work at all."""
        attr = self.driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        return bool(driver_call(self.driver, "cuDeviceGetAttribute", attr, self.cu_device))

    def granularity(self) -> int:
        """The minimum granularity of ``cuMemCreate`` sizes and ``cuMemMap`` addresses (bytes)."""
        flag = self.driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(driver_call(self.driver, "cuMemGetAllocationGranularity", self._prop, flag))

    # -- address space -------------------------------------------------------------------------------
    def address_reserve(self, nbytes: int, alignment: int = 0) -> int:
        """``cuMemAddressReserve``: reserve ``nbytes`` of virtual addresses (alignment 0: the driver's default)."""
        return int(driver_call(self.driver, "cuMemAddressReserve", nbytes, alignment, 0, 0))

    def address_free(self, va: int, nbytes: int) -> None:
        """``cuMemAddressFree``: give back a whole reservation (it must have no mappings)."""
        driver_call(self.driver, "cuMemAddressFree", va, nbytes)

    # -- physical memory ------------------------------------------------------------------------------
    def create(self, nbytes: int) -> Any:
        """``cuMemCreate``: a pinned physical chunk on this device; returns the driver's handle object."""
        return driver_call(self.driver, "cuMemCreate", nbytes, self._prop, 0)

    def release(self, handle: Any) -> None:
        """``cuMemRelease``: drop the handle; the memory returns once the chunk is unmapped everywhere."""
        driver_call(self.driver, "cuMemRelease", handle)

    # -- mappings ------------------------------------------------------------------------------------
    def map(self, va: int, nbytes: int, handle: Any, offset: int = 0) -> None:
        """``cuMemMap``: map ``nbytes`` of the chunk from ``offset`` at ``va`` (inside a reservation)."""
        driver_call(self.driver, "cuMemMap", va, nbytes, offset, handle, 0)

    def set_access(self, va: int, nbytes: int) -> None:
        """``cuMemSetAccess``: make a mapped range readable and writable by this device and its peers."""
        driver_call(self.driver, "cuMemSetAccess", va, nbytes, self._access, len(self._access))

    def unmap(self, va: int, nbytes: int) -> None:
        """``cuMemUnmap``: unmap a range that was mapped as a whole."""
        driver_call(self.driver, "cuMemUnmap", va, nbytes)


def open_vmm(driver: Any | None, ordinal: int, missing: str) -> tuple[VmmDriver | None, bool, int | None, str]:
    """Probe virtual memory support: ``(vmm, supported, granularity, why_not)``.

    Never raises: a missing cuda-bindings (``driver is None``, ``missing`` says
    why), a driver that cannot be loaded or a device without VMM all give
    ``supported == False`` and the reason, logged at debug level.
    """
    if driver is None:
        return None, False, None, missing or "cuda-bindings is not installed"
    try:
        vmm = VmmDriver(driver, ordinal)
        if not vmm.supported():
            why = f"CUDA device {ordinal} does not support virtual memory management"
            log.debug(why)
            return vmm, False, None, why
        return vmm, True, vmm.granularity(), ""
    except CudaError as exc:
        why = f"virtual memory management unavailable on CUDA device {ordinal}: {exc}"
        log.debug(why)
        return None, False, None, why


__all__ = ["VmmDriver", "open_vmm"]
