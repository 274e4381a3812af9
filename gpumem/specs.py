"""Opening devices by spec: ``"sim:<profile>"`` or ``"cuda:<index>"``.

>>> dev = open_device("sim:a100-80gb")
>>> dev = open_device("sim:h200-141gb?pressure=spikes&seed=7")
>>> dev = open_device("sim:t4-16gb", pressure=sim.Step(4 * GiB, at_s=0.01), faults=sim.FaultPlan(...), seed=1)
>>> dev = open_device("cuda:0")          # needs gpumem[cuda12] or gpumem[cuda13]

Options in the spec string (after ``?``, joined by ``&``) for simulated devices:
``pressure=<preset>`` (step, ramp, spikes, random), ``seed=<int>``,
``fail_rate=<probability>`` (injected allocation failures), ``lost_at_s=<seconds>``,
``fail.<call>=<probability>`` (injected failures of one call type, e.g.
``fail.mem_unmap=0.01``; see :data:`gpumem.sim.faults.CALL_NAMES`) and
``sanitizer=raise|count|off`` (what the memory sanitizer does about a hazard;
``raise`` by default, ``count`` for replays).
Keyword arguments do the same from Python and take precedence. Each option may be given once: a
repeated one (``pressure=spikes&pressure=step``) is refused, naming it, as the command line refuses an
option given twice. A profile may be named by the start of its name (``sim:h200``) where that names one
profile; where it names several (``sim:a100``: ``a100-40gb`` and ``a100-80gb``) it is refused as
ambiguous, listing them.

``cpu`` (which ``gpumem info`` and :mod:`gpumem.discovery` list as the CPU backend) is no device spec
here: it means "keep the data in host memory" (the CPU fallback of
:func:`~gpumem.discovery.select_backend_for_model`), and gpumem has no CPU :class:`~gpumem.Device` to open
or replay on; ``open_device("cpu")`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from .device import Device, DeviceKind
from .errors import DeviceNotFoundError, InvalidArgumentError


def _shown(text: str, limit: int = 120) -> str:
    """``repr(text)``, cut to about ``limit`` characters: an error message never echoes a huge input whole."""
    shown = repr(text)
    return shown if len(shown) <= limit else f"{shown[:limit]}... ({len(text)} characters)"


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device spec."""

    kind: DeviceKind
    target: str
    """The profile name (sim) or the device index as text (cuda)."""
    options: dict[str, str] = field(default_factory=dict)

    @property
    def index(self) -> int:
        """The CUDA device index (cuda specs only)."""
        return int(self.target)

    def __str__(self) -> str:
        opts = "&".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.kind.value}:{self.target}" + (f"?{opts}" if opts else "")


_SIM_OPTIONS = ("pressure", "seed", "fail_rate", "lost_at_s", "sanitizer", "fail.<call>")
_FAIL_PREFIX = "fail."


_CPU_NOT_A_DEVICE = ("'cpu' is the CPU backend that `gpumem info` lists (the CPU fallback: keep the data in host "
                     "memory); gpumem has no CPU device to open or replay on: use 'sim:<profile>' (a simulated "
                     "GPU, see `gpumem devices`) or 'cuda:<index>'")


def _query_options(spec: str, query: str) -> dict[str, str]:
    """The ``?`` options of ``spec`` as a dict; an option given twice is refused, naming it (it would
    otherwise be decided silently by which came last)."""
    pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=False) if query else []
    options: dict[str, str] = {}
    repeated: dict[str, list[str]] = {}
    for key, value in pairs:
        if key in options:
            repeated.setdefault(key, [options[key]]).append(value)
        else:
            options[key] = value
    if repeated:
        shown = "; ".join(f"{k} ({', '.join(_shown(v, 40) for v in values)})" for k, values in repeated.items())
        raise InvalidArgumentError(f"device spec {_shown(spec)}: option(s) given more than once: {shown}; "
                                   "give each option once")
    return options


def parse_spec(spec: str) -> DeviceSpec:
    """Parse ``"sim:<profile>[?opts]"`` or ``"cuda:<index>"``; raise :class:`InvalidArgumentError` otherwise."""
    if not isinstance(spec, str):
        raise InvalidArgumentError(f"device spec must be a str, got {type(spec).__name__}")
    head, _, query = spec.strip().partition("?")
    kind_text, sep, target = head.partition(":")
    kind_text = kind_text.lower()
    if kind_text.strip() == "cpu":
        raise InvalidArgumentError(f"device spec {_shown(spec)}: {_CPU_NOT_A_DEVICE}")
    if not sep or not target:
        raise InvalidArgumentError(f"device spec {_shown(spec)} must look like 'sim:<profile>' or 'cuda:<index>'")
    try:
        kind = DeviceKind(kind_text)
    except ValueError:
        raise InvalidArgumentError(f"device spec {_shown(spec)}: unknown kind {kind_text!r} (use 'sim' or 'cuda')") from None
    options = _query_options(spec, query)
    if kind is DeviceKind.CUDA:
        if options:
            raise InvalidArgumentError(f"device spec {_shown(spec)}: cuda devices take no options")
        if not (target.isascii() and target.isdigit()):  # isdigit alone accepts "²", which int() refuses
            raise InvalidArgumentError(f"device spec {_shown(spec)}: the CUDA index must be a non-negative integer")
    else:
        unknown = {k for k in options if k not in _SIM_OPTIONS and not k.startswith(_FAIL_PREFIX)}
        if unknown:
            raise InvalidArgumentError(f"device spec {_shown(spec)}: unknown option(s) {_shown(str(sorted(unknown)))}; "
                                       f"known: {', '.join(_SIM_OPTIONS)}")
    return DeviceSpec(kind, target.lower() if kind is DeviceKind.SIM else target, options)


def _sim_device(parsed: DeviceSpec, spec: str, kwargs: dict[str, Any]) -> Device:
    from gpumem import sim  # the simulator is part of this distribution; imported lazily to keep gpumem light

    profile = kwargs.pop("profile", None)
    if profile is None:
        profile = sim.get_profile(parsed.target)   # an ambiguous start of a name is refused there
    elif not isinstance(profile, sim.DeviceProfile):
        raise InvalidArgumentError(f"profile must be a sim.DeviceProfile, got {type(profile).__name__}")
    opts = parsed.options
    try:
        seed = int(kwargs.pop("seed", opts.get("seed", 0)))
        pressure = kwargs.pop("pressure", None)
        if pressure is None and "pressure" in opts:
            pressure = sim.preset(opts["pressure"], profile.total_nbytes)
        faults = kwargs.pop("faults", None)
        call_rates = {k[len(_FAIL_PREFIX):]: float(v) for k, v in opts.items() if k.startswith(_FAIL_PREFIX)}
        if faults is None and ("fail_rate" in opts or "lost_at_s" in opts or call_rates):
            faults = sim.FaultPlan(
                malloc_failure_rate=float(opts.get("fail_rate", 0.0)),
                device_lost_at_s=float(opts["lost_at_s"]) if "lost_at_s" in opts else None,
                call_failure_rates=call_rates,
            )
        sanitizer = kwargs.pop("sanitizer", opts.get("sanitizer", "raise"))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, InvalidArgumentError):
            raise
        raise InvalidArgumentError(f"device spec {_shown(spec)}: bad option value: {str(exc)[:200]}") from None
    env = kwargs.pop("env", None)
    if kwargs:
        raise InvalidArgumentError(f"unknown keyword argument(s) for a simulated device: {sorted(kwargs)}")
    canonical = DeviceSpec(parsed.kind, profile.name, parsed.options)
    return sim.SimDevice(profile, env=env, pressure=pressure, faults=faults, seed=seed, spec=str(canonical),
                         sanitizer=sanitizer)


def open_device(spec: str, **kwargs: Any) -> Device:
    """Open the device named by ``spec`` (see the module docstring).

    Simulated devices accept ``profile=``, ``pressure=``, ``faults=``, ``seed=``, ``sanitizer=`` and ``env=``
    (a ``simpy.Environment`` to share with other simulated devices). Real devices need the
    ``gpumem[cuda12]`` or ``gpumem[cuda13]`` extra; without it a clear
    :class:`~gpumem.errors.BackendUnavailableError` says which to install.
    """
    parsed = parse_spec(spec)
    if parsed.kind is DeviceKind.SIM:
        return _sim_device(parsed, spec, dict(kwargs))
    if kwargs:
        raise InvalidArgumentError(f"cuda devices take no keyword arguments, got {sorted(kwargs)}")
    from .cuda import CudaDevice

    return CudaDevice(parsed.index)


__all__ = ["DeviceSpec", "parse_spec", "open_device", "DeviceNotFoundError"]
