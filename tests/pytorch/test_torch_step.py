"""gpumem.torch.step(): step plans for PyTorch programs (Note [Step plans] in gpumem/allocator/plan.py).

Runs without PyTorch and without a GPU: the C functions are called where no CUDA driver is (they must
fail cleanly, never crash), and the Python glue (the template's words, the offsets handed back) runs
against a stand-in library whose functions call a native engine on the simulator.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import types

import pytest

import gpumem.torch as gt
from gpumem import sim
from gpumem.allocator import CachingAllocator
from gpumem.allocator.plan import MarkResult, PlanInfo, StepState
from gpumem.errors import GpumemError, InvalidArgumentError, OutOfMemoryError
from gpumem.native import load_engine
from gpumem.units import MiB
from tests.allocator.test_plan_first_step import refuse_address_ranges_when

pytestmark = pytest.mark.skipif(load_engine() is None, reason="the native engine is not built")


def test_step_before_install_says_to_install_first():
    if gt.installed():  # pragma: no cover - only in a process that installed gpumem into PyTorch
        pytest.skip("gpumem is installed here")
    with pytest.raises(GpumemError, match=r"call gpumem.torch.install\(\) first"):
        gt.step(0)
    with pytest.raises(GpumemError, match=r"call gpumem.torch.install\(\) first"):
        gt.step_plan_info(0)


def test_the_c_functions_fail_cleanly_without_an_engine():
    lib = gt._lib()   # noqa: SLF001
    if lib.gpumem_torch_engine_state(63) == 1:  # pragma: no cover
        pytest.skip("an engine runs on device 63")
    assert lib.gpumem_torch_step_template(63, None, 0, None) == -1
    assert b"no engine" in lib.gpumem_torch_last_error()
    offs = (ctypes.c_int64 * 1)(0)
    assert lib.gpumem_torch_step_install(63, offs, 1, -1) == -1
    assert lib.gpumem_torch_step_info(63, (ctypes.c_uint64 * 11)(), 11) == 0
    assert lib.gpumem_torch_step_mark(-1) == -1   # out of range: an error, not a crash
    assert lib.gpumem_torch_last_error()


class StandIn:
    """The C functions of step plans, over a native engine on the simulator (what
    ``torch_api.cpp`` does over a device's CUDA engine), for gpumem.torch's Python glue."""

    def __init__(self, engine, granularity_nbytes: int) -> None:
        self.e, self.granularity_nbytes = engine, granularity_nbytes

    def gpumem_torch_stat_names(self):
        return b"granularity_nbytes"

    def gpumem_torch_stats(self, index, values, n):
        """The one stat the glue reads when it plans: the arena's page (Note [A plan laid out for its first step])."""
        values[0] = self.granularity_nbytes
        return 1

    def gpumem_torch_releasable(self, index, with_carried, nbytes):
        """What the engine's release would give back (the plan's room: Note [The room counts whole chunks])."""
        nbytes._obj.value = self.e.releasable_nbytes(bool(with_carried))
        return 0

    def gpumem_torch_step_mark(self, index):
        return self.e.mark_step()

    def gpumem_torch_step_template(self, index, out, n, generation):
        cols = self.e.step_template(True)
        if cols is None:
            return 0
        generation._obj.value = cols[4]
        count = len(cols[0])
        words = ctypes.cast(out, ctypes.POINTER(ctypes.c_uint64)) if out else None
        for i in range(min(count, n) if words else 0):
            for w in range(4):
                words[4 * i + w] = cols[w][i] % (1 << 64)
        return count

    def gpumem_torch_step_install(self, index, offsets, n, generation):
        try:
            installed = self.e.install_plan([offsets[i] for i in range(n)], None if generation < 0 else generation)
        except OutOfMemoryError as exc:   # torch_api.cpp: an EngineError of kind kOutOfMemory
            self.error = str(exc).encode()
            return -2
        except InvalidArgumentError as exc:
            self.error = str(exc).encode()
            return -1
        return 0 if installed else 1

    def gpumem_torch_step_info(self, index, out, n):
        v = self.e.step_plan_info()
        for i in range(min(n, len(v))):
            out[i] = v[i]
        return min(n, len(v))

    def gpumem_torch_plan_warmup(self, on):
        """Automatic marks turned on begin the engine's warm-up (Note [A memory-first warm-up])."""
        self.warmup_calls = getattr(self, "warmup_calls", []) + [on]
        if on:
            self.e.start_plan_warmup()
        else:
            self.e.stop_plan_warmup()
        return 0

    def gpumem_torch_last_error(self):
        return getattr(self, "error", b"")


def glued_allocator(monkeypatch) -> CachingAllocator:
    """A native engine on the simulator behind gpumem.torch's C functions (:class:`StandIn`)."""
    alloc = CachingAllocator(sim.SimDevice(sim.get_profile("h200-141gb")), engine="native")
    gt._refused_plans.cache_clear()   # noqa: SLF001  (a refusal of an earlier test's device 0)
    stand_in = StandIn(alloc._engine, alloc.device.properties().granularity_nbytes)   # noqa: SLF001
    monkeypatch.setattr(gt, "_lib", lambda: stand_in)
    monkeypatch.setattr(gt, "_require_installed", lambda: None)
    return alloc


class PatternLoop:
    """A training loop's allocations, one pattern per step: (bytes, stream, freed that many allocations later)."""

    PATTERN = [(3 * MiB, 0, 2), (1 * MiB + 5, 0, 1), (5 * MiB, 0, 4), (700, 0, 1), (2 * MiB, 0, 3)]

    def __init__(self, alloc: CachingAllocator) -> None:
        self.alloc, self.clock, self.live = alloc, 0, []

    def marked_step(self) -> MarkResult:
        """``gpumem.torch.step()`` at the top of the step, then the step's allocations; the mark's result."""
        result = gt.step(0)
        self.allocations()
        return result

    def allocations(self) -> None:
        """One step's allocations, each freed ``life`` allocations after it was made."""
        for size, stream, life in self.PATTERN:
            for e in [e for e in self.live if e[1] <= self.clock]:
                self.alloc.free(e[0])
                self.live.remove(e)
            self.clock += 1
            self.live.append([self.alloc.allocate(size, stream), self.clock + life])


def test_step_plans_and_installs_through_the_c_api_glue(monkeypatch):
    alloc = glued_allocator(monkeypatch)
    loop = PatternLoop(alloc)
    results = [loop.marked_step() for _ in range(6)]
    assert results[:3] == [MarkResult.NOTHING, MarkResult.NOTHING, MarkResult.READY]
    info = gt.step_plan_info(0)
    assert isinstance(info, PlanInfo) and info.state == StepState.PLANNED and info.served == 4 * len(PatternLoop.PATTERN)   # the steps from the READY mark on
    assert info.fallback == 0
    alloc.check_consistency()


def test_the_mark_bounds_the_plan_by_the_room_on_the_card_and_plans_a_refused_step_once(monkeypatch, caplog):
    """Note [A plan taller than the device]: gpumem.torch passes the room on the card (PyTorch's mem_get_info:
    free plus gpumem's idle cache, at most the total) to the planner, so a plan stacked past it is not installed
    (which raised in the training loop); the refused step is not planned again at every later match (a review:
    16 s of planning in a run of 0.2 s) and is warned about once; without PyTorch's CUDA there is no bound."""
    import types

    import gpumem.allocator.plan as plan_module

    alloc = glued_allocator(monkeypatch)
    limits, real = [], plan_module.plan_step_and_height

    def recording(t, *args, **kwargs):
        limits.append(kwargs.get("limit_nbytes"))
        return real(t, *args, **kwargs)

    monkeypatch.setattr(plan_module, "plan_step_and_height", recording)
    fake_cuda = types.SimpleNamespace(is_available=lambda: True, mem_get_info=lambda i: (1 << 19, 1 << 20))
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=fake_cuda))
    loop = PatternLoop(alloc)
    with caplog.at_level(logging.WARNING, logger="gpumem.torch"):
        results = [loop.marked_step() for _ in range(12)]
    assert results.count(MarkResult.READY) >= 3   # the step matched again and again ...
    assert len(limits) == 1 and limits[0] <= 1 << 20   # ... and was planned once: the MiBs do not fit 1 MiB
    assert sum("no step plan" in r.getMessage() for r in caplog.records) == 1
    assert gt.step_plan_info(0).plans_installed == 0
    fake_cuda.mem_get_info = lambda i: (1 << 40, 1 << 41)   # the room grew: the step is planned again, and fits
    results = [loop.marked_step() for _ in range(6)]
    assert len(limits) == 2 and gt.step_plan_info(0).plans_installed == 1
    monkeypatch.delitem(sys.modules, "torch")
    assert gt._plan_room_nbytes(0) is None   # noqa: SLF001
    alloc.check_consistency()


def test_an_arena_the_card_refuses_leaves_the_mark_quiet_and_a_later_match_plans(monkeypatch, caplog):
    """Attacker review (B3): an arena whose address range the device refused made gpumem.torch.step() raise
    'gpumem refused the step plan' (the C function's -1); it returns -2 for out of memory now, which the mark
    warns about, and a later match plans."""
    alloc = glued_allocator(monkeypatch)
    dev = alloc.device
    refusing = refuse_address_ranges_when(dev)
    loop = PatternLoop(alloc)
    with caplog.at_level(logging.WARNING, logger="gpumem.torch"):
        for i in range(10):
            refusing[0] = i < 5
            gt.step(0)
            refusing[0] = False
            loop.allocations()
    assert any("arena could not be reserved" in r.getMessage() for r in caplog.records)
    assert gt.step_plan_info(0).plans_installed == 1
    alloc.check_consistency()


@pytest.mark.parametrize("cuda", [None, types.SimpleNamespace(), types.SimpleNamespace(is_available=lambda: True),
                                  types.SimpleNamespace(is_available=lambda: False)])
def test_a_stand_in_torch_without_cuda_leaves_the_plan_unbounded(monkeypatch, cuda):
    """A program's own stand-in ``torch`` module (the tests' stand-ins, a CPU build) has no or a partial
    ``torch.cuda``: the mark plans with no bound instead of raising AttributeError (CI, 2026-12-05: 15 tests)."""
    alloc = glued_allocator(monkeypatch)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda) if cuda is not None
                        else types.SimpleNamespace())
    assert gt._plan_room_nbytes(0) is None   # noqa: SLF001
    loop = PatternLoop(alloc)
    for _ in range(4):
        loop.marked_step()
    assert gt.step_plan_info(0).plans_installed == 1
    alloc.check_consistency()


def test_a_mark_from_another_thread_while_step_plans_installs_nothing(monkeypatch):
    """gpumem.torch.step() reads the template, plans and installs in three calls: another thread's mark in
    between made the install fail (a GpumemError in the training loop). The template's generation goes
    with the install now: nothing is installed, nothing raised, and later steps plan again."""
    import threading

    import gpumem.allocator.plan as plan_module

    alloc = glued_allocator(monkeypatch)
    real, interrupted = plan_module.plan_step_and_height, []

    def planning_while_another_thread_marks(t, *args, **kwargs):
        if not interrupted:
            interrupted.append(1)
            worker = threading.Thread(target=gt.step, args=(0,))
            worker.start()
            worker.join()
        return real(t, *args, **kwargs)

    monkeypatch.setattr(plan_module, "plan_step_and_height", planning_while_another_thread_marks)
    loop, results = PatternLoop(alloc), []
    for _ in range(8):
        results.append(loop.marked_step())
        if len(results) == 3:
            assert results[2] is MarkResult.READY and interrupted
            assert gt.step_plan_info(0).plans_installed == 0
    info = gt.step_plan_info(0)
    assert info.plans_installed == 1 and info.state == StepState.PLANNED and info.served > 0
    alloc.check_consistency()


def test_memory_summary_names_the_arena_and_leaves_it_out_of_inactive_split(monkeypatch):
    """Note [The step plan's arena in the summary]: the arena's free bytes were counted as inactive split."""
    alloc = glued_allocator(monkeypatch)
    loop = PatternLoop(alloc)
    for _ in range(5):
        loop.marked_step()
    gt.step(0)   # the top of a step: nothing of the plan live
    info = gt.step_plan_info(0)
    assert info.mapped_nbytes > 0 and info.live_nbytes < info.mapped_nbytes
    inactive = info.mapped_nbytes - info.live_nbytes + 2 * MiB   # the arena's free bytes, and 2 MiB of the engine's
    stats = {f"{k}.all.{w}": 0 for k in ("allocated_bytes", "requested_bytes", "reserved_bytes", "active_bytes")
             for w in ("current", "peak")}
    stats.update({"inactive_split_bytes.all.current": inactive, "num_allocs": 0, "num_frees": 0, "num_ooms": 0,
                  "num_alloc_retries": 0, "num_device_calls": 0, "num_event_calls": 0, "gpumem.n_chunks": 0,
                  "gpumem.n_steals": 0, "gpumem.n_waits": 0, "gpumem.va_nbytes": 0, "gpumem.granularity_nbytes": 2 * MiB,
                  "gpumem.free_errors": 0, "gpumem.torch_errors": 0, "gpumem.driver_memory_ns": 0,
                  "gpumem.driver_event_ns": 0, "gpumem.driver_wait_ns": 0, "gpumem.engine_slow_ns": 0,
                  "gpumem.engine_slow_calls": 0})
    monkeypatch.setattr(gt, "memory_stats", lambda device=None: stats)
    text = gt.memory_summary(0)
    assert "step plan: PLANNED" in text
    assert next(line for line in text.splitlines() if "inactive split" in line).split("|")[2].strip() == "2.00 MiB"
