"""PyTorch on gpumem through PyTorch's C++ allocator interface: every hook, not only alloc and free.

Call :func:`install` at the very start of the program, before PyTorch touches the GPU::

    import gpumem.torch_shim
    gpumem.torch_shim.install()     # before the first CUDA tensor

    import torch
    ...                             # Tensor.record_stream, CUDA graphs, torch.cuda.empty_cache(),
                                    # torch.cuda.memory_stats() now reach gpumem

The first call compiles a small C++ extension against the installed PyTorch
(``gpumem/_shim/torch_shim.cpp``, with ``torch.utils.cpp_extension.load``; PyTorch caches the build
under ``TORCH_EXTENSIONS_DIR``, so later programs load it in a second). It subclasses
``torch::cuda::CUDAPluggableAllocator`` and sets its hooks to gpumem's native engine: record_stream
(stream-ordered fences), the private pools of CUDA graphs and ``torch.cuda.MemPool`` (an engine per
pool), empty_cache, the memory fraction and the statistics (Note [What the C++ interface adds to
the two C hooks] in that file). Where the extension cannot be built (no compiler, no CUDA headers,
no ninja), :func:`install` says so once, in one warning, and installs gpumem through
:func:`gpumem.torch.install`, the two C hooks without those features.

:func:`mem_pool` puts one region of a program on gpumem without replacing PyTorch's allocator::

    pool = gpumem.torch_shim.mem_pool()
    with torch.cuda.use_mem_pool(pool):
        big = torch.empty(...)      # gpumem's memory, sub-allocated by PyTorch's allocator
"""

from __future__ import annotations

import enum
import functools
import logging
from pathlib import Path
from typing import Any

from .errors import BackendUnavailableError, GpumemError
from . import torch as gtorch
from .native import library_path
from .torch import ALLOC_FN, FREE_FN, TooLateError

__all__ = ["install", "installed", "InstallPath", "mem_pool", "build", "ShimBuildError", "pool_table"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "_shim" / "torch_shim.cpp"
NATIVE_INCLUDE = Path(__file__).resolve().parent / "_native"
MODULE_NAME = "gpumem_torch_shim"


class InstallPath(enum.Enum):
    """How :func:`install` made gpumem PyTorch's allocator."""

    SHIM = "shim"      # the C++ extension: every hook of torch::cuda::CUDAPluggableAllocator
    CTYPES = "ctypes"  # gpumem.torch.install(): alloc and free only (the shim could not be built, or came second)


class ShimBuildError(BackendUnavailableError):
    """The C++ shim could not be built or loaded against the installed PyTorch."""


def _torch() -> Any:
    return gtorch._torch("gpumem.torch_shim")


# Note [Building once per process]: functools.cache keeps the loaded module; a failed build caches
# nothing (it raises), so a program that installs a compiler may retry.
@functools.cache
def build(verbose: bool = False) -> Any:
    """Compile (or load from PyTorch's extension cache) the shim against the installed PyTorch.

    Raises:
        ShimBuildError: the shim's source is missing, ninja or a C++ compiler or the CUDA headers
            are not there, or the compile failed (the compiler's message is in the error).
        BackendUnavailableError: PyTorch is not installed.
    """
    torch = _torch()
    if not SOURCE.is_file():
        raise ShimBuildError(f"gpumem's PyTorch shim source is missing ({SOURCE.name}): reinstall gpumem")
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise ShimBuildError("building gpumem's PyTorch shim needs ninja (pip install ninja)")
    if cpp_extension.CUDA_HOME is None:
        raise ShimBuildError("building gpumem's PyTorch shim needs the CUDA toolkit's headers (CUDA_HOME not found)")
    log.info("building gpumem's PyTorch shim against torch %s (cached after the first build)", torch.__version__)
    try:
        return cpp_extension.load(name=MODULE_NAME, sources=[str(SOURCE)], extra_include_paths=[str(NATIVE_INCLUDE)],
                                  extra_cflags=["-O2"], with_cuda=True, verbose=verbose)
    except Exception as exc:  # noqa: BLE001 - the compiler's and loader's errors all end the same way
        raise ShimBuildError(f"gpumem's PyTorch shim could not be built against torch {torch.__version__}: "
                             f"{str(exc).strip()[-2000:]}") from exc


def _c_hooks_came_first() -> InstallPath:
    """gpumem.torch.install() made PyTorch's allocator before the shim could (Note [Installing once] in
    gpumem/torch.py): said once, and gpumem.torch.install() called again, which makes no second allocator and
    finishes what an earlier call (the shim's fallback included) may have left undone."""
    log.warning("gpumem is PyTorch's allocator through its two C hooks already (gpumem.torch.install() came first), "
                "and PyTorch takes one allocator per process: the shim cannot take over (no record_stream, "
                "empty_cache or torch.cuda.memory_stats, and CUDA graph capture raises); call "
                "gpumem.torch_shim.install() instead of gpumem.torch.install()")
    gtorch.install()
    return InstallPath.CTYPES


@functools.cache
def _installed() -> InstallPath:
    torch = _torch()
    if gtorch._installed_through_c_hooks():   # Note [Installing once] in gpumem/torch.py
        return _c_hooks_came_first()
    if torch.cuda.is_initialized():
        raise TooLateError(
            "gpumem.torch_shim.install() was called after PyTorch initialised CUDA, when its allocator can no "
            "longer be replaced; call it at the start of the program, before the first CUDA tensor")
    marks = gtorch._env_step_marks()  # GPUMEM_STEP_MARKS checked before anything is installed
    try:
        module = build()
    except ShimBuildError as exc:
        log.warning("%s; installing gpumem through its two C hooks instead (gpumem.torch: no record_stream, "
                    "empty_cache or torch.cuda.memory_stats, and CUDA graph capture raises)", exc)
        gtorch.install()
        return InstallPath.CTYPES
    if gtorch._installed_through_c_hooks():   # made by another thread while the shim was built
        return _c_hooks_came_first()
    try:
        module.install(library_path())
    except RuntimeError as exc:  # "Can't swap an already initialized allocator"
        if gtorch._installed_through_c_hooks():   # as above, between the test and the swap
            return _c_hooks_came_first()
        raise TooLateError(f"PyTorch refused gpumem's allocator ({exc}); call gpumem.torch_shim.install() before "
                           "PyTorch first uses the GPU") from None
    gtorch._installed_through_shim()
    if marks:
        gtorch._step_marks_from_env(marks)
    log.info("PyTorch allocates through gpumem's C++ shim (%s)", library_path())
    return InstallPath.SHIM


def install() -> InstallPath:
    """Make gpumem PyTorch's CUDA allocator, with every hook PyTorch's C++ interface has.

    Call it once, at program start, before PyTorch first uses the GPU. Calling it again returns the
    first call's result.

    Returns:
        :attr:`InstallPath.SHIM`, or :attr:`InstallPath.CTYPES` where the shim could not be built (one warning
        says why; gpumem is then installed through :func:`gpumem.torch.install`) or where
        :func:`gpumem.torch.install` came first (one warning: PyTorch takes one allocator per process).

    Raises:
        gpumem.torch.TooLateError: PyTorch had already initialised CUDA.
        BackendUnavailableError: PyTorch or gpumem's native engine is missing.
    """
    return _installed()


def installed() -> "InstallPath | None":
    """How :func:`install` installed gpumem in this process, or None when it has not."""
    if _installed.cache_info().currsize == 0:
        return None
    return _installed()


def pool_table() -> list[tuple[int, int, int, int, int]]:
    """``(device, pool id, pool id, use count, live blocks)`` of every private pool gpumem holds.

    Raises:
        GpumemError: the shim is not PyTorch's allocator in this process.
    """
    if installed() is not InstallPath.SHIM:
        raise GpumemError("gpumem's PyTorch shim is not installed in this process (gpumem.torch_shim.install())")
    return [tuple(row) for row in build().pool_table()]


def mem_pool() -> Any:
    """A ``torch.cuda.MemPool`` whose memory comes from gpumem, for ``torch.cuda.use_mem_pool``.

    Where gpumem is PyTorch's allocator through the shim, the pool is a private pool of gpumem (an
    engine of its own). Otherwise PyTorch's own allocator stays in charge and takes the pool's
    segments from gpumem's engine (alloc and free through ``gpumem_torch_alloc_hook`` and
    ``gpumem_torch_free``), so one region of a program runs on gpumem without replacing PyTorch's
    allocator.

    Raises:
        BackendUnavailableError: PyTorch, its MemPool (PyTorch 2.8 or later) or gpumem's native
            engine is missing.
        GpumemError: gpumem was installed through its two C hooks, which cannot serve a pool.
    """
    torch = _torch()
    if not hasattr(torch.cuda, "MemPool"):
        raise BackendUnavailableError(f"torch {torch.__version__} has no torch.cuda.MemPool (PyTorch 2.8 or later)")
    how = installed()
    if how is InstallPath.SHIM:
        return torch.cuda.MemPool()
    if how is InstallPath.CTYPES or gtorch.installed():
        raise GpumemError("gpumem is PyTorch's allocator through its two C hooks (the shim could not be built, or "
                          "gpumem.torch.install() came first), "
                          "which cannot serve a torch.cuda.MemPool")
    allocator = _plain_allocator()
    return torch.cuda.MemPool(allocator.allocator())


@functools.cache
def _plain_allocator() -> Any:
    return _torch().cuda.memory.CUDAPluggableAllocator(library_path(), ALLOC_FN, FREE_FN)
