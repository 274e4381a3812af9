"""Sparse byte storage behind simulated device memory.

A simulated 1 GiB allocation must not cost 1 GiB of host memory: bytes live in
64 KiB chunks created on first write. Bytes never written read back as zeros
(a real GPU returns whatever was there; tests only rely on what they wrote).
"""

from __future__ import annotations

CHUNK_NBYTES = 64 * 1024


class SparseStore:
    """``nbytes`` of addressable bytes, materialised lazily in :data:`CHUNK_NBYTES` chunks."""

    __slots__ = ("nbytes", "_chunks")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._chunks: dict[int, bytearray] = {}

    def write(self, offset: int, data: memoryview) -> None:
        pos = 0
        n = len(data)
        while pos < n:
            index, within = divmod(offset + pos, CHUNK_NBYTES)
            take = min(CHUNK_NBYTES - within, n - pos)
            chunk = self._chunks.get(index)
            if chunk is None:
                chunk = self._chunks[index] = bytearray(CHUNK_NBYTES)
            chunk[within:within + take] = data[pos:pos + take]
            pos += take

    def read(self, offset: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        pos = 0
        while pos < nbytes:
            index, within = divmod(offset + pos, CHUNK_NBYTES)
            take = min(CHUNK_NBYTES - within, nbytes - pos)
            chunk = self._chunks.get(index)
            if chunk is not None:
                out[pos:pos + take] = chunk[within:within + take]
            pos += take
        return bytes(out)

    @property
    def materialised_nbytes(self) -> int:
        """Host bytes actually used."""
        return len(self._chunks) * CHUNK_NBYTES
