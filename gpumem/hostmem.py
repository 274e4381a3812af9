"""The host's memory: how much there is and how much can be allocated now (``/proc/meminfo``, else
``os.sysconf``).

Read by backend discovery (:mod:`gpumem.discovery`, the CPU backend) and by the managers' CPU fallback
(:mod:`gpumem.managers.fallback`, whose message names the host's figures), so it sits below both.
"""

from __future__ import annotations

import logging
import os

from .errors import BackendUnavailableError, InvalidArgumentError

__all__ = ["MEMINFO_PATH", "host_memory", "parse_meminfo"]

log = logging.getLogger(__name__)

MEMINFO_PATH = "/proc/meminfo"
"""Where Linux says how much host memory is available."""


def parse_meminfo(text: str) -> tuple[int, int]:
    """``(total, available)`` bytes from the text of ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``;
    ``MemFree + Buffers + Cached`` on kernels before 3.14). Raises :class:`InvalidArgumentError` when the
    text has no ``MemTotal``."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            unit = parts[1].lower() if len(parts) > 1 else ""
            fields[key.strip()] = int(parts[0]) * (1024 if unit == "kb" else 1)
    if "MemTotal" not in fields:
        raise InvalidArgumentError("meminfo text has no MemTotal line")
    avail = fields.get("MemAvailable")
    if avail is None:
        avail = fields.get("MemFree", 0) + fields.get("Buffers", 0) + fields.get("Cached", 0)
    return fields["MemTotal"], min(avail, fields["MemTotal"])


def host_memory(meminfo_path: str = MEMINFO_PATH) -> tuple[int, int]:
    """``(total, available)`` bytes of host memory: ``/proc/meminfo`` where it exists (available = what
    can be allocated without swapping), else ``os.sysconf`` (available = free pages). Raises
    :class:`~gpumem.errors.BackendUnavailableError` when neither can tell."""
    try:
        with open(meminfo_path, encoding="ascii", errors="replace") as f:
            return parse_meminfo(f.read())
    except (OSError, InvalidArgumentError) as exc:
        log.debug("host memory from %s failed (%s); trying os.sysconf", meminfo_path, exc)
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        free = os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError, AttributeError) as exc:
        raise BackendUnavailableError(f"cannot read the host's memory ({meminfo_path} and os.sysconf both "
                                      f"failed: {exc})") from None
    if total <= 0:
        raise BackendUnavailableError("os.sysconf reports no host memory")
    return int(total), int(max(0, min(free, total)))
