"""Can one physical chunk be mapped, or unmapped, a page at a time? Asked of the real driver.

Issue 18, point 3 names it as worth measuring: "one physical allocation mapped as page-sized mappings
(``cuMemMap`` with offsets), so pages can be stolen one by one". gpumem's chunks move whole (Note
[Chunks of several pages] in ``gpumem/allocator/backing.py``) because the CUDA documentation says
``cuMemMap``'s offset "currently must be zero" and ``cuMemUnmap`` takes "the entire contiguous address
range that was mapped". This probe asks the driver instead of the documentation. On a chunk of
``--pages`` pages it tries, each on a fresh reservation:

* ``whole``: the chunk mapped whole at offset 0 (the baseline, must succeed);
* ``first_page``: the first page alone, offset 0 (a mapping shorter than the chunk);
* ``second_page``: the second page alone, offset one page (a nonzero offset);
* ``every_page``: every page as its own mapping, offsets 0, 1, 2 ... pages;
* ``unmap_one_page``: the chunk mapped whole, then its second page unmapped alone;
* ``same_page_twice``: the first page mapped at two addresses (one page stolen while the other stays).

Each try records the driver's result and, where the mapping succeeded, whether a write and read
through it (after ``cuMemSetAccess``) return what was written. Needs cuda-bindings and CuPy::

    python -m hil.probes.map_offset --json build/map-offset.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any

from gpumem.errors import CudaError

log = logging.getLogger(__name__)

PROG = "python -m hil.probes.map_offset"


@dataclasses.dataclass
class Attempt:
    """One try: which call failed (if any), the driver's error, and whether data went through."""

    name: str
    ok: bool
    failed_call: str = ""
    error: str = ""
    data_checked: bool = False


class Chunk:
    """A physical chunk of ``pages`` pages and a reservation of twice its size for each try."""

    def __init__(self, cupy: Any, driver: Any, ordinal: int, pages: int) -> None:
        from gpumem.cuda.vmm import VmmDriver  # noqa: PLC0415 - needs cuda-bindings

        cupy.cuda.runtime.setDevice(ordinal)
        cupy.zeros(1)  # makes the primary context current on this thread for the driver calls
        self.cupy = cupy
        self.vmm = VmmDriver(driver, ordinal)
        if not self.vmm.supported():
            raise CudaError("cuDeviceGetAttribute", "CUDA_ERROR_NOT_SUPPORTED",
                            f"CUDA device {ordinal} does not support virtual memory management")
        self.page_nbytes = self.vmm.granularity()
        self.pages = pages
        self.nbytes = pages * self.page_nbytes

    def _check_data(self, va: int, nbytes: int, value: int) -> bool:
        """Write ``value`` through ``va`` and read it back (a CuPy view on the mapped range)."""
        cp = self.cupy
        mem = cp.cuda.UnownedMemory(va, nbytes, None)
        view = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        view.fill(value)
        cp.cuda.runtime.deviceSynchronize()
        return bool((view == value).all())

    def attempt(self, name: str) -> Attempt:
        """Run one named try on a fresh chunk and reservation; undo everything it made."""
        vmm, page, n = self.vmm, self.page_nbytes, self.nbytes
        if name == "whole":
            plan = [(0, n, 0)]
        elif name == "first_page":
            plan = [(0, page, 0)]
        elif name == "second_page":
            plan = [(0, page, page)]
        elif name == "every_page":
            plan = [(i * page, page, i * page) for i in range(self.pages)]
        elif name == "unmap_one_page":
            plan = [(0, n, 0)]
        elif name == "same_page_twice":
            plan = [(0, page, 0), (n, page, 0)]
        else:
            raise ValueError(f"unknown try {name!r}")
        va = vmm.address_reserve(2 * n, page)   # the plan's addresses are offsets into it
        plan = [(va + at, size, offset) for at, size, offset in plan]
        handle = None
        mapped: list[tuple[int, int]] = []
        step = "cuMemCreate"
        try:
            handle = vmm.create(n)
            step = "cuMemMap"
            for at, size, offset in plan:
                vmm.map(at, size, handle, offset)
                mapped.append((at, size))
            step = "cuMemSetAccess"
            for at, size in mapped:
                vmm.set_access(at, size)
            if name == "unmap_one_page":
                step = "cuMemUnmap (one page of a whole mapping)"
                vmm.unmap(va + page, page)
                mapped = [(va, page), (va + 2 * page, n - 2 * page)] if self.pages > 2 else [(va, page)]
                checked = self._check_data(va, page, 7)
            else:
                step = "data"
                checked = all(self._check_data(at, size, 5 + i) for i, (at, size) in enumerate(mapped))
            return Attempt(name, True, data_checked=checked)
        except CudaError as exc:
            return Attempt(name, False, failed_call=step, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - CuPy's own errors in the data check: this try's verdict, not the run's end
            return Attempt(name, False, failed_call=step, error=f"{type(exc).__name__}: {exc}")
        finally:
            for at, size in mapped:
                try:
                    vmm.unmap(at, size)
                except CudaError as exc:  # an unmap of a range the driver kept otherwise: say so, go on
                    log.warning("cleanup unmap of %#x + %d failed: %s", at, size, exc)
            if handle is not None:
                vmm.release(handle)
            vmm.address_free(va, 2 * n)


TRIES = ("whole", "first_page", "second_page", "every_page", "unmap_one_page", "same_page_twice")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    parser.add_argument("--pages", type=int, default=4, help="pages in the chunk (default 4; 2 to 64)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    if not 2 <= args.pages <= 64:
        parser.error("--pages must be in [2, 64]")
    if args.device < 0:
        parser.error("--device must be a CUDA device ordinal >= 0")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        import cupy  # noqa: PLC0415 - a real-GPU probe
        from cuda.bindings import driver  # noqa: PLC0415
    except ImportError as exc:
        print(f"{PROG}: needs CuPy and cuda-bindings, which could not be imported ({exc})", file=sys.stderr)
        return 2
    chunk = Chunk(cupy, driver, args.device, args.pages)
    attempts = [chunk.attempt(name) for name in TRIES]
    for a in attempts:
        print(f"{a.name:16} {'ok' if a.ok else 'FAILED':7} {a.failed_call:42} {a.error[:90]}"
              + ("  data ok" if a.data_checked else ""))
    if args.json:
        result = {"device": cupy.cuda.runtime.getDeviceProperties(args.device)["name"].decode(),
                  "driver_version": int(driver.cuDriverGetVersion()[1]), "page_nbytes": chunk.page_nbytes,
                  "pages": args.pages, "attempts": [dataclasses.asdict(a) for a in attempts]}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":  # pragma: no cover - a real-GPU probe
    sys.exit(main())
