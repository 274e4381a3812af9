"""Regions: ``with region("forward"):`` names every allocation made inside.

Regions nest (``"forward"`` inside ``"step"`` is ``"step/forward"``), and follow the code that
runs, not the thread that happens to run it: the current region lives in a
:class:`contextvars.ContextVar`, so each thread starts outside every region and each asyncio task
sees the regions of the code that created it, unaffected by other tasks.

An :class:`~gpumem.managers.tracker.AllocationTracker` stamps each buffer it registers with
:func:`current_region`, so its statistics, leak reports and the OOM forensics' snapshots attribute
memory by region. PyTorch users get this today by placing dummy allocations on the timeline.

Note [The region context variable]
----------------------------------
The one module-level object is the ``ContextVar`` itself: a context variable is the standard way
to hold per-thread, per-task state, and it is never mutated in place (``region`` sets a new tuple
and resets it with its token on exit, also on an exception), so there is no shared mutable state.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator

from gpumem.errors import InvalidArgumentError

#: The separator between nested region names.
SEPARATOR = "/"

_REGION: ContextVar[tuple[str, ...]] = ContextVar("gpumem_region", default=())


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name.strip():
        raise InvalidArgumentError(f"a region name must be a non-empty str, got {name!r}")
    if SEPARATOR in name:
        raise InvalidArgumentError(f"a region name cannot contain {SEPARATOR!r} (it separates nested regions), "
                                   f"got {name!r}")
    return name.strip()


@contextlib.contextmanager
def region(name: str) -> Iterator[str]:
    """Enter region ``name`` (nested inside the current one); yields the full path, e.g. ``"step/forward"``.

    Raises :class:`~gpumem.errors.InvalidArgumentError` for an empty name or one containing ``"/"``.
    """
    path = _REGION.get() + (_check_name(name),)
    token = _REGION.set(path)
    try:
        yield SEPARATOR.join(path)
    finally:
        _REGION.reset(token)


def current_region() -> str | None:
    """The full path of the current region (``"step/forward"``), or ``None`` outside every region."""
    path = _REGION.get()
    return SEPARATOR.join(path) if path else None


def region_ancestors(path: str | None) -> list[str]:
    """``"a/b/c"`` -> ``["a", "a/b", "a/b/c"]`` (the regions an allocation in ``path`` counts towards)."""
    if not path:
        return []
    parts = path.split(SEPARATOR)
    return [SEPARATOR.join(parts[: i + 1]) for i in range(len(parts))]


__all__ = ["region", "current_region", "region_ancestors", "SEPARATOR"]
