"""The workspace scenario: an inference loop on a simulated GPU shared with other tenants.

:func:`run_scenario` opens a simulated device of a profile with another tenant running a pressure preset
(:func:`gpumem.sim.pressure.preset`: ``step``, ``ramp``, ``spikes``, ``random``), lets the tenant run
alone for ``warmup_s`` (on a shared GPU the others are there first), then starts an inference process
that uses a workspace for one quantized linear layer. Every ``step_s`` of simulated time the process
checks its workspace and runs one step. Two rules are compared:

* ``adaptive``: a :class:`~gpumem.workspace.Workspace`, sized from the device and polled before every
  step (it shrinks under pressure and grows back, Note [Hysteresis]);
* ``six-gb``: the hard-coded rule it replaces (:func:`~gpumem.workspace.sizing.six_gb_rule_workspace_size`):
  a fixed workspace sized as if every GPU had 6 GiB free, allocated once through the same allocator,
  never resized; a step whose workspace could not be allocated retries the allocation at the next step.

Time moves only through SimPy: the loop calls :meth:`SimDevice.advance`, which runs the tenant's
events up to the next step, and every device call lets its own modelled cost pass.

Note [The feasible maximum]
---------------------------
At each step, the **feasible maximum** is the largest workspace the sizing rule's own limits allow
that the process could hold at that moment while leaving the reserve free::

    feasible = min(full, free + held - reserve)

``full`` is ``dequant + cap * per_sample`` clamped to [min, max] (``cap`` the GPU class's batch cap),
``free`` what the device reports free, ``held`` what this process's workspace holds, ``reserve`` the
emergency part of :func:`gpumem.managers.reserve.compute_reserve` (Note [Which part of the reserve] in
:mod:`.sizing`). ``free + held`` is what would be free with no workspace: other tenants' memory and the
CUDA context are not ours to take, and the reserve is for allocations outside the workspace. The
**share used** is ``sum(min(held, feasible)) / sum(feasible)`` over the (equally long) steps: what a
rule holds beyond the feasible maximum is not use. A step where a held workspace leaves less than the
reserve free counts in ``over_steps``; one whose feasible maximum is below the minimum workspace, in
``infeasible_steps``.

Since ``full`` holds the class's batch cap, a workspace holding the capped batch scores 100 % even where
free memory would allow far more: the definition the issue's batch caps imply. Beside it,
``used_share_uncapped`` (and ``batch_share_uncapped`` for the batch) measures against
``full_uncapped = dequant + ABSOLUTE_MAX_BATCH_SIZE * per_sample`` clamped to [min, max]: the class cap
removed, the rule's absolute limits kept. It shows how much room the class cap leaves unused.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from ..allocator import CachingAllocator
from ..errors import InternalError, OutOfMemoryError
from ..sim import SimDevice, get_profile
from ..sim.pressure import preset
from .sizing import ABSOLUTE_MAX_BATCH_SIZE, QType, query_device, reserve_nbytes_for, six_gb_rule_workspace_size, size_workspace
from .workspace import Workspace

log = logging.getLogger(__name__)


class Rule(str, enum.Enum):
    """How the inference process sizes its workspace."""

    ADAPTIVE = "adaptive"
    SIX_GB = "six-gb"


@dataclass(frozen=True)
class Layer:
    """A quantized linear layer."""

    name: str
    in_features: int
    out_features: int
    qtype: QType


@dataclass(frozen=True)
class ScenarioResult:
    """What one run of :func:`run_scenario` measured (bytes unless named otherwise)."""

    profile: str
    pressure: str
    rule: Rule
    layer: Layer
    steps: int
    first_workspace_bytes: int
    """The workspace when the process started (0 if it could not allocate one)."""
    first_batch_size: int
    min_workspace_bytes: int
    """The smallest workspace held at a step (0 if a step had none)."""
    max_workspace_bytes: int
    min_batch_size: int
    max_batch_size: int
    used_share: float
    """``sum(min(held, feasible)) / sum(feasible)``: Note [The feasible maximum]."""
    batch_share: float
    """The same for the batch: ``sum(min(batch, feasible batch)) / sum(feasible batch)``."""
    used_share_uncapped: float
    """``sum(min(held, feasible_uncapped)) / sum(feasible_uncapped)``: the share of what free memory would
    allow without the class's batch cap (Note [The feasible maximum])."""
    batch_share_uncapped: float
    """The same for the batch: the feasible batch capped by ``ABSOLUTE_MAX_BATCH_SIZE`` only."""
    resizes: int
    ooms: int
    """Out-of-memory errors the process met: workspace allocations or resizes that failed."""
    steps_without_workspace: int
    over_steps: int
    """Steps where the process held a workspace and less than the reserve was free (it ate into the reserve)."""
    infeasible_steps: int
    tenant_denied: int
    """Takes of the other tenant that the device refused (it had too little free)."""


def _feasible(full_nbytes: int, free_nbytes: int, held_nbytes: int, reserve_nbytes: int) -> int:
    return max(0, min(full_nbytes, free_nbytes + held_nbytes - reserve_nbytes))


def run_scenario(profile_name: str, pressure_name: str, rule: Rule | str, layer: Layer, *, steps: int = 400,
                 step_s: float = 1e-3, warmup_s: float = 0.02, seed: int = 0) -> ScenarioResult:
    """Run the inference loop for ``steps`` steps of ``step_s`` on ``sim:<profile_name>`` with the pressure
    preset ``pressure_name`` (``"none"``: no other tenant) and return what it measured."""
    from ..device import MemInfo
    from ..events import MemoryEventKind

    rule = Rule(rule)
    profile = get_profile(profile_name)
    scenario = None if pressure_name == "none" else preset(pressure_name, profile.total_nbytes)
    dev = SimDevice(profile, pressure=scenario, seed=seed)
    denied = [0]
    dev.subscribe(lambda e: denied.__setitem__(0, denied[0] + (e.kind is MemoryEventKind.TENANT_DENIED)))
    try:
        dev.advance(warmup_s)
        props, mem = query_device(dev)
        full = size_workspace(layer.in_features, layer.out_features, layer.qtype, props,
                              MemInfo(props.total_nbytes, props.total_nbytes), device=dev.spec, reserve_nbytes=0)
        full_nbytes = full.desired_bytes
        cap = full.max_batch_size
        full_uncapped_nbytes = min(max(full.dequant_bytes + ABSOLUTE_MAX_BATCH_SIZE * full.per_sample_bytes,
                                       full.min_workspace_bytes), full.max_workspace_bytes)
        held_u_sum = feasible_u_sum = batch_u_sum = feasible_batch_u_sum = 0
        ooms = resizes = without = over = infeasible = 0
        held_sum = feasible_sum = batch_sum = feasible_batch_sum = 0
        held_list: list[int] = []
        batch_list: list[int] = []
        ws: Workspace | None = None
        alloc: CachingAllocator | None = None
        ptr: int | None = None
        six_nbytes, six_batch = six_gb_rule_workspace_size(layer.in_features, layer.out_features, layer.qtype)
        first: tuple[int, int] | None = None
        if rule is Rule.ADAPTIVE:
            try:
                ws = Workspace(dev, layer.in_features, layer.out_features, layer.qtype)
            except OutOfMemoryError:
                ooms += 1
        else:
            alloc = CachingAllocator(dev)
        for _ in range(steps):
            if rule is Rule.ADAPTIVE:
                try:
                    if ws is None:
                        ws = Workspace(dev, layer.in_features, layer.out_features, layer.qtype)
                    elif ws.poll():
                        resizes += 1
                except OutOfMemoryError:
                    ooms += 1
                held = ws.nbytes if ws is not None else 0
                batch = ws.batch_size if ws is not None else 0
            else:
                if alloc is None:
                    raise InternalError("the fixed-rule run has no allocator")
                if ptr is None:
                    try:
                        ptr = alloc.allocate(six_nbytes)
                    except OutOfMemoryError:
                        ooms += 1
                held = six_nbytes if ptr is not None else 0
                batch = six_batch if ptr is not None else 0
            if first is None:
                first = (held, batch)
            props, mem = query_device(dev)
            reserve = reserve_nbytes_for(props, MemInfo(mem.free_nbytes + held, mem.total_nbytes))
            feasible = _feasible(full_nbytes, mem.free_nbytes, held, reserve)
            if feasible < full.min_workspace_bytes:
                infeasible += 1
            rest = feasible - full.dequant_bytes
            feasible_batch = max(1, min(cap, rest // full.per_sample_bytes if rest > 0 else 0))
            if held == 0:
                without += 1
            if held and mem.free_nbytes < reserve:
                over += 1
            held_sum += min(held, feasible)
            feasible_sum += feasible
            feasible_u = _feasible(full_uncapped_nbytes, mem.free_nbytes, held, reserve)
            held_u_sum += min(held, feasible_u)
            feasible_u_sum += feasible_u
            rest_u = feasible_u - full.dequant_bytes
            feasible_batch_u = max(1, min(ABSOLUTE_MAX_BATCH_SIZE, rest_u // full.per_sample_bytes if rest_u > 0 else 0))
            batch_u_sum += min(batch, feasible_batch_u)
            feasible_batch_u_sum += feasible_batch_u
            batch_sum += min(batch, feasible_batch)
            feasible_batch_sum += feasible_batch
            held_list.append(held)
            batch_list.append(batch)
            dev.advance(step_s)  # the step runs; the tenant acts meanwhile (SimPy events only)
        if ws is not None:
            ws.close()
        if alloc is not None:
            if ptr is not None:
                alloc.free(ptr)
            alloc.close()
        if first is None:
            raise InternalError("the scenario ran no step")
        return ScenarioResult(
            profile=profile.name, pressure=pressure_name, rule=rule, layer=layer, steps=steps,
            first_workspace_bytes=first[0], first_batch_size=first[1], min_workspace_bytes=min(held_list),
            max_workspace_bytes=max(held_list), min_batch_size=min(batch_list), max_batch_size=max(batch_list),
            used_share=held_sum / feasible_sum if feasible_sum else 0.0,
            batch_share=batch_sum / feasible_batch_sum if feasible_batch_sum else 0.0,
            used_share_uncapped=held_u_sum / feasible_u_sum if feasible_u_sum else 0.0,
            batch_share_uncapped=batch_u_sum / feasible_batch_u_sum if feasible_batch_u_sum else 0.0,
            resizes=resizes, ooms=ooms, steps_without_workspace=without, over_steps=over,
            infeasible_steps=infeasible, tenant_denied=denied[0])
    finally:
        dev.close()
