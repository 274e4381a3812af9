"""Which allocator engine gpumem runs on: the native C++ engine, or the pure-Python reference.

gpumem's allocator exists twice: the pure-Python reference (:mod:`gpumem.allocator`) and a C++
port of its virtual-memory path, the extension module ``gpumem._engine``, compiled by
``pip install`` where a C++ compiler exists (``setup.py``; no CUDA toolkit needed). Both make the
same decisions; the native one is what makes gpumem fast enough to be a real program's allocator,
and the only one PyTorch can use (:mod:`gpumem.torch`).

>>> import gpumem
>>> gpumem.engine()          # doctest: +SKIP
'native'

Where the extension was not built (no compiler at install time), :func:`engine` says ``"python"``
and warns once, saying why and how to get the native engine.
"""

from __future__ import annotations

import functools
import importlib
import logging
import warnings
from pathlib import Path
from types import ModuleType

from .errors import BackendUnavailableError

__all__ = ["engine", "load_engine", "native_module", "library_path", "NativeEngineWarning"]

log = logging.getLogger(__name__)

#: How to get the native engine, for messages.
HOW_TO_BUILD = ("install a C++ compiler (g++ or clang++) and reinstall gpumem from its checkout "
                "(pip install -e .)")


class NativeEngineWarning(RuntimeWarning):
    """gpumem's native engine is not available; gpumem runs on its pure-Python engine."""


# Note [Loading the engine once]: the import is attempted once per process and its outcome
# (module or reason) cached by functools.cache, so the warning is given once and a failed import
# is not retried on every call. The cache is the only state; tests clear it with
# ``_load.cache_clear()``.
@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    try:
        module = importlib.import_module("gpumem._engine")
    except ImportError as exc:
        return None, f"gpumem._engine cannot be imported ({exc})"
    return module, ""


def load_engine(*, warn: bool = False) -> ModuleType | None:
    """The native extension module ``gpumem._engine``, or None when it was not built (imported once per
    process: Note [Loading the engine once]); with ``warn``, a missing engine warns once
    (:class:`NativeEngineWarning`)."""
    module, why = _load()
    if module is None and warn:
        _warn_once(why)
    return module


def native_module() -> ModuleType:
    """The native extension module ``gpumem._engine``.

    Raises :class:`~gpumem.errors.BackendUnavailableError` saying why and how to build it when it
    is not there.
    """
    module, why = _load()
    if module is None:
        raise BackendUnavailableError(f"gpumem's native engine is not available: {why}; to build it, {HOW_TO_BUILD}")
    return module


def engine() -> str:
    """``"native"`` when gpumem's C++ engine is built and importable, else ``"python"``.

    The first call that finds no native engine warns once (:class:`NativeEngineWarning`) with the reason and how to build it; gpumem keeps working on its pure-Python engine,
    only slower.
    """
    return "python" if load_engine(warn=True) is None else "native"


@functools.cache
def _warn_once(why: str) -> None:
    message = (f"gpumem's native engine is not available ({why}); gpumem runs on its pure-Python engine, "
               f"which is much slower. To build the native engine, {HOW_TO_BUILD}.")
    log.debug(message)  # the warning below is the one message people see
    warnings.warn(message, NativeEngineWarning, stacklevel=4)


def library_path() -> str:
    """The file of the native library (the ``gpumem._engine`` extension): what
    ``torch.cuda.memory.CUDAPluggableAllocator`` loads the ``gpumem_torch_*`` functions from.

    Raises :class:`~gpumem.errors.BackendUnavailableError` when the native engine is not built.
    """
    path = getattr(native_module(), "__file__", None)
    if not path or not Path(path).is_file():
        raise BackendUnavailableError(f"gpumem's native engine has no library file ({path!r})")
    return str(Path(path).resolve())
