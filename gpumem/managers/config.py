"""MemoryConfig: what a :class:`~gpumem.managers.GpuMemoryManager` may use and how it behaves.

A frozen dataclass: every ``with_...`` method returns a new config (a fluent builder), presets
start from a workload's needs, and :meth:`MemoryConfig.from_env` overrides fields from
environment variables. Every value is checked when a config is made; an out-of-range one raises
:class:`~gpumem.errors.InvalidArgumentError` naming the field and its range.

Environment variables (read by :meth:`MemoryConfig.from_env`):

=================================  ===========================  ===================================
variable                           field                        value
=================================  ===========================  ===================================
``GPUMEM_GPU_MEMORY_FRACTION``     ``gpu_memory_fraction``      a number in [2**-20, 1]
``GPUMEM_CPU_FALLBACK``            ``cpu_fallback_enabled``     1/0, true/false, yes/no, on/off
``GPUMEM_MIN_FREE_BYTES``          ``min_free_bytes``           bytes: ``536870912``, ``512MB``, ``1GiB``
``GPUMEM_TRACK_ALLOCATIONS``       ``track_allocations``        boolean
``GPUMEM_CAPTURE_STACKS``          ``capture_stacks``           boolean
``GPUMEM_MAX_POOLED_PER_BUCKET``   ``max_pooled_per_bucket``    an int >= 0 in ASCII digits
``GPUMEM_PREALLOCATE``             ``preallocate_nbytes``       sizes separated by commas: ``64MiB,1GiB`` (no empty entry)
``GPUMEM_POOL_POLICY``             ``pool_policy``              ``gpumem``, ``bestfit``, ``pytorch``, ``cupy``, ``bucket``
``GPUMEM_OOM_FORENSICS_DIR``       ``oom_forensics_dir``        a directory ('' switches off; blank refused)
``GPUMEM_LEAK_REPORT_AT_EXIT``     ``leak_report_at_exit``      boolean
``GPUMEM_FRAGMENTATION_WARNING``   ``fragmentation_warning``    a number in [0, 1]
=================================  ===========================  ===================================
"""

from __future__ import annotations

import math
import re
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from gpumem.errors import InvalidArgumentError
from gpumem.units import GiB, MiB
from gpumem.validate import parse_nbytes

#: Prefix of every environment variable :meth:`MemoryConfig.from_env` reads.
ENV_PREFIX = "GPUMEM_"
_POLICIES = ("gpumem", "bestfit", "pytorch", "cupy", "bucket")


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class MemoryConfig:
    """How a manager uses its GPU (module docstring). Defaults suit a process that has the GPU to itself."""

    gpu_memory_fraction: float = 0.9
    """The most of the device's total this process may hold, what was in use at start included (0, 1]."""
    cpu_fallback_enabled: bool = False
    """Whether a :class:`~gpumem.managers.FallbackBuffer` may live on the CPU when the GPU is full."""
    min_free_bytes: int = 512 * 1000**2
    """Keep at least this much free (raises the reserve's emergency part, up to an eighth of the card:
    Note [The reserve rule])."""
    track_allocations: bool = True
    """Register every allocation in an :class:`~gpumem.managers.AllocationTracker`."""
    capture_stacks: bool = False
    """Keep the Python stack of every allocation (for leak reports and OOM forensics; a few µs each)."""
    max_pooled_per_bucket: int = 64
    """With ``pool_policy="bucket"``: the most free buffers the size-bucket pool keeps per size bucket
    (0: none kept, every free goes back to the device). The caching allocator's policies ignore it."""
    preallocate_nbytes: tuple[int, ...] = ()
    """Sizes allocated and freed once at start, so the pool holds them before the first request."""
    pool_policy: str = "gpumem"
    """The pool when pooling is on: a caching allocator's policy (``gpumem``, ``bestfit``, ``pytorch``,
    ``cupy``) or ``bucket``, the size-bucket pool (:class:`~gpumem.allocator.bucket.BucketAllocator`,
    power-of-two buckets, at most ``max_pooled_per_bucket`` free blocks kept per bucket)."""
    oom_forensics_dir: str | None = None
    """Where to write a snapshot and report when an allocation fails (None: off)."""
    leak_report_at_exit: bool = False
    """Log the tracker's leak report at interpreter exit (until the manager is closed)."""
    fragmentation_warning: float = 0.3
    """``log_memory_usage`` warns when the pool's fragmentation passes this ratio [0, 1]."""

    def __post_init__(self) -> None:
        def bad(name: str, rng: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"MemoryConfig.{name} must be {rng}, got {getattr(self, name)!r}")

        f = self.gpu_memory_fraction
        if not _is_number(f) or not 0 < f <= 1:
            raise bad("gpu_memory_fraction", "a number in (0, 1]")
        if f < MIN_GPU_MEMORY_FRACTION:
            raise InvalidArgumentError(
                f"MemoryConfig.gpu_memory_fraction={f!r} is below {MIN_GPU_MEMORY_FRACTION}: that leaves less than "
                "1 MiB of even a 1 TiB device, so no manager could use anything")
        for name in ("cpu_fallback_enabled", "track_allocations", "capture_stacks", "leak_report_at_exit"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool")
        if type(self.min_free_bytes) is not int or not 0 <= self.min_free_bytes <= 1 << 50:
            raise bad("min_free_bytes", "an int in [0, 2**50] (bytes)")
        if type(self.max_pooled_per_bucket) is not int or not 0 <= self.max_pooled_per_bucket <= 1 << 20:
            raise bad("max_pooled_per_bucket", "an int in [0, 1048576]")
        pre = self.preallocate_nbytes
        if not isinstance(pre, tuple) or any(type(n) is not int or n <= 0 for n in pre):
            raise bad("preallocate_nbytes", "a tuple of ints > 0 (bytes)")
        if self.pool_policy not in _POLICIES:
            raise bad("pool_policy", f"one of {', '.join(_POLICIES)}")
        if self.oom_forensics_dir is not None and (not isinstance(self.oom_forensics_dir, str)
                                                   or not self.oom_forensics_dir):
            raise bad("oom_forensics_dir", "None or a non-empty path")
        w = self.fragmentation_warning
        if not _is_number(w) or not 0 <= w <= 1:
            raise bad("fragmentation_warning", "a number in [0, 1]")

    # -- presets ----------------------------------------------------------------------------------------
    @classmethod
    def for_inference(cls) -> "MemoryConfig":
        """Serving: most of the card (0.92) for weights and KV cache, no stacks, a pre-warmed 256 MiB block."""
        return cls(gpu_memory_fraction=0.92, track_allocations=True, capture_stacks=False,
                   preallocate_nbytes=(256 * MiB,))

    @classmethod
    def for_training(cls) -> "MemoryConfig":
        """Training: 0.9 of the card, 1 GiB kept free for cuDNN/NCCL workspaces, stacks for OOM forensics."""
        return cls(gpu_memory_fraction=0.9, min_free_bytes=1 * GiB, capture_stacks=True)

    @classmethod
    def for_constrained(cls) -> "MemoryConfig":
        """Small cards (2–6 GB): 0.95 of the card, 128 MiB kept free, CPU fallback on, small pools."""
        return cls(gpu_memory_fraction=0.95, min_free_bytes=128 * MiB, cpu_fallback_enabled=True,
                   max_pooled_per_bucket=8)

    # -- fluent builder ---------------------------------------------------------------------------------
    def _with(self, **changes: Any) -> "MemoryConfig":
        return replace(self, **changes)

    def with_gpu_memory_fraction(self, fraction: float) -> "MemoryConfig":
        """A copy with ``gpu_memory_fraction``."""
        return self._with(gpu_memory_fraction=fraction)

    def with_cpu_fallback(self, enabled: bool = True) -> "MemoryConfig":
        """A copy with ``cpu_fallback_enabled``."""
        return self._with(cpu_fallback_enabled=enabled)

    def with_min_free_bytes(self, nbytes: int | str) -> "MemoryConfig":
        """A copy with ``min_free_bytes`` (an int, or text such as ``"512MB"``)."""
        return self._with(min_free_bytes=parse_nbytes(nbytes) if isinstance(nbytes, str) else nbytes)

    def with_tracking(self, enabled: bool = True, *, capture_stacks: bool | None = None) -> "MemoryConfig":
        """A copy with ``track_allocations`` (and ``capture_stacks`` if given)."""
        return self._with(track_allocations=enabled,
                          capture_stacks=self.capture_stacks if capture_stacks is None else capture_stacks)

    def with_max_pooled_per_bucket(self, n: int) -> "MemoryConfig":
        """A copy with ``max_pooled_per_bucket``."""
        return self._with(max_pooled_per_bucket=n)

    def with_preallocation(self, *nbytes: int) -> "MemoryConfig":
        """A copy with ``preallocate_nbytes``."""
        return self._with(preallocate_nbytes=tuple(nbytes))

    def with_pool_policy(self, policy: str) -> "MemoryConfig":
        """A copy with ``pool_policy``."""
        return self._with(pool_policy=policy)

    def with_oom_forensics(self, directory: str | os.PathLike[str] | None) -> "MemoryConfig":
        """A copy that writes OOM forensics to ``directory`` (None: off)."""
        return self._with(oom_forensics_dir=None if directory is None else os.fspath(directory))

    def with_leak_report_at_exit(self, enabled: bool = True) -> "MemoryConfig":
        """A copy with ``leak_report_at_exit``."""
        return self._with(leak_report_at_exit=enabled)

    def with_fragmentation_warning(self, ratio: float) -> "MemoryConfig":
        """A copy with ``fragmentation_warning``."""
        return self._with(fragmentation_warning=ratio)

    # -- environment ------------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, base: "MemoryConfig | None" = None, environ: Mapping[str, str] | None = None) -> "MemoryConfig":
        """``base`` (default: ``MemoryConfig()``) with the fields the ``GPUMEM_*`` variables set (module
        docstring). A malformed value raises :class:`~gpumem.errors.InvalidArgumentError` naming the
        variable."""
        if base is None:
            base = cls()
        if not isinstance(base, MemoryConfig):
            raise InvalidArgumentError(f"base must be a MemoryConfig, got {type(base).__name__}")
        env = os.environ if environ is None else environ
        changes: dict[str, Any] = {}
        for var, (name, parse) in ENV_VARIABLES.items():
            if var in env:
                try:
                    changes[name] = parse(env[var])
                except (ValueError, TypeError) as exc:
                    raise InvalidArgumentError(f"{var}={env[var]!r}: {exc}") from None
        try:
            return replace(base, **changes)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"from the environment: {exc}") from None


#: The smallest ``gpu_memory_fraction`` accepted: 2**-20 of a 1 TiB device is 1 MiB, so anything below
#: leaves no device a usable byte worth having (1e-300 passed "(0, 1]" and the manager then refused
#: to start with an out-of-memory error for 1 byte).
MIN_GPU_MEMORY_FRACTION = 2.0 ** -20


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def _float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError("expected a finite number")
    return v


def _int(text: str) -> int:
    # int() also takes "1_0" and non-ASCII digits ("٣"): a variable that looks like a typo or another
    # script is refused rather than read as a number nobody wrote
    t = text.strip()
    if not re.fullmatch(r"[+-]?[0-9]+", t):
        raise ValueError("expected an integer written in ASCII digits 0-9")
    return int(t)


def _sizes(text: str) -> tuple[int, ...]:
    """``"64MiB,1GiB"`` -> sizes; an empty value is no size at all. An empty entry (``64MiB,,1``, a
    trailing comma) is refused rather than dropped: it is a typo for a size the user meant to name."""
    if not text.strip():
        return ()
    entries = [t.strip() for t in text.split(",")]
    if not all(entries):
        raise ValueError(f"entry {entries.index('') + 1} of {len(entries)} is empty: name a size between "
                         "every two commas")
    return tuple(parse_nbytes(t) for t in entries)


def _dir(text: str) -> str | None:
    if text and not text.strip():
        # a blank value names no directory (forensics would go to a folder called "   "): refused;
        # the empty value is the documented way to switch forensics off
        raise ValueError("a blank directory name; set it to '' to switch OOM forensics off")
    return text or None


#: ``variable -> (field, parser)`` for :meth:`MemoryConfig.from_env`.
ENV_VARIABLES: Mapping[str, tuple[str, Callable[[str], Any]]] = {
    "GPUMEM_GPU_MEMORY_FRACTION": ("gpu_memory_fraction", _float),
    "GPUMEM_CPU_FALLBACK": ("cpu_fallback_enabled", _bool),
    "GPUMEM_MIN_FREE_BYTES": ("min_free_bytes", lambda t: parse_nbytes(t.strip())),
    "GPUMEM_TRACK_ALLOCATIONS": ("track_allocations", _bool),
    "GPUMEM_CAPTURE_STACKS": ("capture_stacks", _bool),
    "GPUMEM_MAX_POOLED_PER_BUCKET": ("max_pooled_per_bucket", _int),
    "GPUMEM_PREALLOCATE": ("preallocate_nbytes", _sizes),
    "GPUMEM_POOL_POLICY": ("pool_policy", lambda t: t.strip()),
    "GPUMEM_OOM_FORENSICS_DIR": ("oom_forensics_dir", _dir),
    "GPUMEM_LEAK_REPORT_AT_EXIT": ("leak_report_at_exit", _bool),
    "GPUMEM_FRAGMENTATION_WARNING": ("fragmentation_warning", _float),
}


__all__ = ["MemoryConfig", "ENV_VARIABLES", "ENV_PREFIX"]
