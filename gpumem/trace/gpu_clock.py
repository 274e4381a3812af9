"""The GPU clock of a gpumem trace: a file beside it (Note [The trace's GPU clock] in
``gpumem/_native/torch_api.cpp``; replayed under ``gpu_timing="gpu-clock"``, Note [A replay on the recorded GPU
clock] in :mod:`gpumem.sim.gpu_work`).

One float64 per op of the trace, in op order: microseconds on the trace's clock at which the GPU had run the
work queued on the op's stream before it (NaN where unknown). Saved as NumPy's ``.npy``, gzip-compressed when the
name ends in ``.gz`` (the probes write ``TRACE.gpu-clock.npy.gz``)::

    >>> import gpumem.torch as gt
    >>> gt.start_trace(gpu_clock=True); ...; gt.stop_trace()
    >>> save_gpu_clock(gt.recorded_gpu_clock(0), "run.gmt.gz.gpu-clock.npy.gz")
    >>> replay_trace("run.gmt.gz", gpu_clock_us=load_gpu_clock("run.gmt.gz.gpu-clock.npy.gz"))
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, TraceFormatError
from ._fileio import PathLike

__all__ = ["gpu_clock_path", "load_gpu_clock", "save_gpu_clock"]

#: The most ops a clock file may hold (the trace readers' default entry limit)
_MAX_OPS = 1 << 28


def gpu_clock_path(trace_path: PathLike) -> Path:
    """Where the probes save the GPU clock of the trace at ``trace_path``: ``TRACE.gpu-clock.npy.gz`` beside it."""
    p = Path(trace_path)
    return p.with_name(p.name + ".gpu-clock.npy.gz")


def save_gpu_clock(clock_us: Any, path: PathLike) -> Path:
    """Write ``clock_us`` (one float per op) to ``path`` (gzip when it ends in ``.gz``); returns the path."""
    arr = np.asarray(clock_us)
    if arr.ndim != 1 or arr.dtype.kind != "f":
        raise InvalidArgumentError(f"a GPU clock is one float per op, not an array of shape {arr.shape} and dtype "
                                   f"{arr.dtype}")
    p = Path(path)
    if p.name.endswith(".gz"):
        with gzip.open(p, "wb", compresslevel=9) as f:
            np.save(f, arr.astype(np.float64), allow_pickle=False)
    else:
        with open(p, "wb") as f:
            np.save(f, arr.astype(np.float64), allow_pickle=False)
    return p


def load_gpu_clock(path: PathLike) -> np.ndarray:
    """Read a GPU clock written by :func:`save_gpu_clock` (``.npy``, or ``.npy.gz``); never unpickles.

    Raises:
        TraceFormatError: not a ``.npy`` file, or not an array of floats of one dimension (or too long).
        FileNotFoundError: no such file.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no GPU clock file {p}")
    try:
        with (gzip.open(p, "rb") if p.name.endswith(".gz") else open(p, "rb")) as f:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f".npy version {version} is not read here")
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = header(f)
            if len(shape) != 1 or dtype.kind != "f" or dtype.hasobject:
                raise TraceFormatError(str(p), f"expected one float per op, got an array of shape {shape} and dtype "
                                               f"{dtype}")
            if shape[0] > _MAX_OPS:
                raise TraceFormatError(str(p), f"{shape[0]:,} values is more than {_MAX_OPS:,}")
            want = shape[0] * dtype.itemsize
            data = f.read(want)
    except TraceFormatError:
        raise
    except (OSError, ValueError, EOFError) as exc:
        raise TraceFormatError(str(p), f"not a NumPy .npy file of times ({exc})") from None
    if len(data) != want:
        raise TraceFormatError(str(p), f"the file ends after {len(data):,} of {want:,} bytes of times")
    return np.frombuffer(data, dtype=dtype).astype(np.float64)
