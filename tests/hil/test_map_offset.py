"""The page-sized mapping probe (no GPU here): its arguments, and each try's bookkeeping on a stand-in
driver that refuses what the H200's driver refused (offsets, mappings shorter than the chunk, unmapping
part of a mapping): the verdicts, and that every try gives back what it made."""

from __future__ import annotations

import pytest

from gpumem.errors import CudaError
from hil.probes import map_offset as probe

PAGE = 2 << 20


@pytest.mark.parametrize("argv, why", [(["--pages", "1"], "--pages must be in [2, 64]"),
                                       (["--pages", "100000000"], "--pages must be in [2, 64]"),
                                       (["--device", "-1"], "--device must be a CUDA device ordinal >= 0")])
def test_refuses_bad_arguments(argv, why, capsys):
    with pytest.raises(SystemExit) as exc:
        probe.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m hil.probes.map_offset") and why in err


def test_a_failed_create_or_data_check_is_the_try_s_verdict_and_gives_back_the_reservation():
    chunk, vmm = _chunk(2)

    def no_memory(nbytes):
        raise CudaError("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY")

    vmm.create = no_memory
    a = chunk.attempt("whole")
    assert (a.ok, a.failed_call) == (False, "cuMemCreate") and vmm.reserved == {}
    chunk, vmm = _chunk(2)

    def cupy_fails(va, nbytes, value):
        raise RuntimeError("cudaErrorIllegalAddress")

    chunk._check_data = cupy_fails
    a = chunk.attempt("whole")
    assert (a.ok, a.failed_call, a.error) == (False, "data", "RuntimeError: cudaErrorIllegalAddress")
    assert (vmm.mappings, vmm.handles, vmm.reserved) == ({}, set(), {})


class _StrictVmm:
    """Maps a chunk only whole at offset 0 and unmaps only whole mappings, as the H200's driver did."""

    def __init__(self, chunk_nbytes: int) -> None:
        self.chunk_nbytes = chunk_nbytes
        self.reserved: dict[int, int] = {}
        self.handles: set[int] = set()
        self.mappings: dict[int, int] = {}
        self.next_va, self.next_handle = 1 << 40, 1

    def address_reserve(self, nbytes: int, alignment: int = 0) -> int:
        va, self.next_va = self.next_va, self.next_va + (1 << 34)
        self.reserved[va] = nbytes
        return va

    def address_free(self, va: int, nbytes: int) -> None:
        assert self.reserved.pop(va) == nbytes and not any(va <= m < va + nbytes for m in self.mappings)

    def create(self, nbytes: int) -> int:
        self.next_handle += 1
        self.handles.add(self.next_handle)
        return self.next_handle

    def release(self, handle: int) -> None:
        self.handles.remove(handle)

    def map(self, va: int, nbytes: int, handle: int, offset: int = 0) -> None:
        if offset != 0 or nbytes != self.chunk_nbytes or handle in self.mappings.values():
            raise CudaError("cuMemMap", "CUDA_ERROR_NOT_SUPPORTED", "operation not supported")
        self.mappings[va] = handle

    def set_access(self, va: int, nbytes: int) -> None:
        assert va in self.mappings

    def unmap(self, va: int, nbytes: int) -> None:
        if va not in self.mappings or nbytes != self.chunk_nbytes:
            raise CudaError("cuMemUnmap", "CUDA_ERROR_INVALID_VALUE", "invalid argument")
        del self.mappings[va]


def _chunk(pages: int) -> tuple[probe.Chunk, _StrictVmm]:
    chunk = object.__new__(probe.Chunk)
    vmm = _StrictVmm(pages * PAGE)
    chunk.vmm, chunk.page_nbytes, chunk.pages, chunk.nbytes = vmm, PAGE, pages, pages * PAGE
    chunk._check_data = lambda va, nbytes, value: True  # type: ignore[method-assign]
    return chunk, vmm


@pytest.mark.parametrize("pages", [2, 4])
def test_verdicts_of_a_driver_that_moves_chunks_only_whole(pages):
    chunk, vmm = _chunk(pages)
    attempts = {a.name: a for a in (chunk.attempt(name) for name in probe.TRIES)}
    assert attempts["whole"].ok and attempts["whole"].data_checked
    for name in ("first_page", "second_page", "every_page", "same_page_twice"):
        assert (attempts[name].ok, attempts[name].failed_call) == (False, "cuMemMap"), name
        assert "CUDA_ERROR_NOT_SUPPORTED" in attempts[name].error
    a = attempts["unmap_one_page"]
    assert (a.ok, a.failed_call) == (False, "cuMemUnmap (one page of a whole mapping)")
    assert "CUDA_ERROR_INVALID_VALUE" in a.error
    # every try gave back its mappings, its chunk and its reservation
    assert (vmm.mappings, vmm.handles, vmm.reserved) == ({}, set(), {})


def test_an_unknown_try_is_refused_and_gives_back_what_it_made():
    chunk, vmm = _chunk(2)
    with pytest.raises(ValueError, match="unknown try 'sideways'"):
        chunk.attempt("sideways")
    assert (vmm.mappings, vmm.handles, vmm.reserved) == ({}, set(), {})
