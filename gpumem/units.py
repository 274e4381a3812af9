"""Byte units and small helpers for sizes (parsing sizes and limits is argument checking: :mod:`gpumem.validate`).

Names carry their unit (``nbytes``, ``_s``, ``_us``); these constants keep the
arithmetic readable: ``64 * MiB`` rather than ``67108864``.
"""

from __future__ import annotations

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

#: Allocation granularity of CUDA's physical memory on every current GPU.
CUDA_GRANULARITY_NBYTES = 2 * MiB


def align_up(nbytes: int, alignment: int) -> int:
    """Round ``nbytes`` up to a multiple of ``alignment`` (a positive integer)."""
    return -(-nbytes // alignment) * alignment


def align_down(nbytes: int, alignment: int) -> int:
    """Round ``nbytes`` down to a multiple of ``alignment``."""
    return (nbytes // alignment) * alignment


def format_bytes(nbytes: int | float) -> str:
    """Human-readable size with binary units: ``format_bytes(3 * GiB) == '3.00 GiB'``."""
    value = float(nbytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= scale:
            return f"{sign}{value / scale:.2f} {unit}"
    return f"{sign}{int(value)} B"
