"""gpumem.torch's automatic step marks: ``configure(step_marks="optimizer")`` and ``GPUMEM_STEP_MARKS``
(Note [Automatic step marks] in gpumem/torch.py).

Runs without PyTorch and without a GPU, as ``test_torch_step.py`` does: the marks reach a native engine on
the simulator through the same stand-in of the C functions (:class:`StandIn`), and a stand-in ``torch``
module gives the global optimizer hook as PyTorch does (hooks called as ``hook(optimizer, args, kwargs)``
after every ``optimizer.step()``). Where PyTorch is installed, one test runs its real optimizers on the host.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import sys
from types import ModuleType, SimpleNamespace

import pytest

import gpumem.torch as gt
from gpumem.allocator import CachingAllocator
from gpumem.allocator.plan import StepState
from gpumem.errors import BackendUnavailableError, GpumemError, InvalidArgumentError
from gpumem.native import load_engine
from gpumem.units import MiB
from tests.pytorch.test_torch_step import PatternLoop, glued_allocator

pytestmark = pytest.mark.skipif(load_engine() is None, reason="the native engine is not built")

HAVE_TORCH = importlib.util.find_spec("torch") is not None


class FakeTorch(ModuleType):
    """What gpumem.torch's step marks use of PyTorch: the global optimizer step post-hook, and whether the
    current stream captures a CUDA graph."""

    def __init__(self, with_hook: bool = True) -> None:
        super().__init__("torch")
        self.__version__ = "2.fake"
        self.hooks: list = []
        self.capturing = False
        optimizer = SimpleNamespace(register_optimizer_step_post_hook=self._register) if with_hook else SimpleNamespace()

        class Optimizer:   # torch.optim.Optimizer: a class of this module's own, so that wrapping it stays here
            def __init__(self, params) -> None:
                self.param_groups = [{"params": list(params)}]

        self.optim = SimpleNamespace(optimizer=optimizer, Optimizer=Optimizer)
        self.cuda = SimpleNamespace(is_initialized=lambda: True, is_current_stream_capturing=lambda: self.capturing,
                                    current_device=lambda: 0)
        self.amp = SimpleNamespace(GradScaler=FakeGradScaler)

    def _register(self, hook):
        self.hooks.append(hook)
        hooks = self.hooks
        return SimpleNamespace(remove=lambda: hooks.remove(hook) if hook in hooks else None)


class FakeGradScaler:
    """``torch.amp.GradScaler`` as the marks see it: ``step(optimizer)`` calls ``optimizer.step()`` unless the
    gradients held inf or NaN (``found_inf``), as PyTorch's does."""

    def __init__(self) -> None:
        self.found_inf = False

    def step(self, optimizer, *args, **kwargs):
        if not self.found_inf:
            return optimizer.step(*args, **kwargs)
        return None


class FakeOptimizer:
    """A PyTorch optimizer as the hook sees it: ``param_groups``, and ``step()`` calling the global hooks."""

    def __init__(self, torch: FakeTorch, devices=(0,)) -> None:
        self.torch = torch
        self.param_groups = [{"params": [SimpleNamespace(is_cuda=d is not None, device=SimpleNamespace(index=d))
                                         for d in devices]}]

    def step(self) -> None:
        for hook in list(self.torch.hooks):
            hook(self, (), {})


class TrainLoop(PatternLoop):
    """:class:`PatternLoop`'s allocations, one step each, with no ``gpumem.torch.step()``: the optimizer marks."""

    def train_step(self, *optimizers: FakeOptimizer) -> None:
        self.allocations()
        for opt in optimizers:
            opt.step()


@pytest.fixture
def fake_torch(monkeypatch):
    """A stand-in ``torch`` module; automatic marks off before and after."""
    torch = FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    gt._auto_marks.cache_clear()          # noqa: SLF001
    gt._step_marks_from_env.cache_clear()  # noqa: SLF001
    yield torch
    gt._auto_marks().turn(None, None)     # noqa: SLF001
    gt._auto_marks.cache_clear()          # noqa: SLF001
    gt._step_marks_from_env.cache_clear()  # noqa: SLF001


@pytest.fixture
def glued(monkeypatch, fake_torch):
    """The simulator's native engine behind gpumem.torch, with every mark's device counted."""
    alloc = glued_allocator(monkeypatch)
    stand_in = gt._lib()   # noqa: SLF001
    marked = []
    real_mark = stand_in.gpumem_torch_step_mark

    def mark(index):
        marked.append(index)
        return real_mark(index)

    stand_in.gpumem_torch_step_mark = mark
    return alloc, marked


def test_optimizer_steps_plan_a_loop_that_never_calls_step(fake_torch, glued):
    alloc, marked = glued
    gt.configure(step_marks="optimizer")
    assert len(fake_torch.hooks) == 1
    loop, opt = TrainLoop(alloc), FakeOptimizer(fake_torch)
    for _ in range(7):
        loop.train_step(opt)
    assert marked == [0] * 7   # one mark per optimizer step, on its parameters' device
    info = gt.step_plan_info(0)
    # marks 1 and 2 record, 3 plans (READY, installed): the four steps after it are served from the arena
    assert info.state == StepState.PLANNED and info.plans_installed == 1
    assert info.served == 4 * len(PatternLoop.PATTERN) and info.fallback == 0 and info.steps_missed == 0
    alloc.check_consistency()


def test_turning_marks_on_begins_the_memory_first_warm_up_before_the_first_step(fake_torch, glued):
    """Note [A memory-first warm-up]: the first automatic mark comes after the first step, which decides the
    run's peak, so turning marks on begins the warm-up at once; the plan ends it; off asks for no more."""
    alloc, _ = glued
    stand_in = gt._lib()   # noqa: SLF001
    assert gt.step_plan_info(0).warmup == 0
    gt.configure(step_marks="optimizer")
    assert stand_in.warmup_calls == [1] and gt.step_plan_info(0).warmup == 1
    gt.configure(step_marks="optimizer")   # on again: nothing asked
    assert stand_in.warmup_calls == [1]
    loop, opt = TrainLoop(alloc), FakeOptimizer(fake_torch)
    for _ in range(4):
        loop.train_step(opt)
    info = gt.step_plan_info(0)
    assert info.plans_installed == 1 and info.warmup == 0
    gt.configure(step_marks=None)
    assert stand_in.warmup_calls == [1, 0]
    alloc.check_consistency()


def test_the_end_of_the_warm_up_is_logged(fake_torch, glued, caplog):
    alloc, _ = glued
    gt.configure(step_marks="optimizer")
    loop, opt = TrainLoop(alloc), FakeOptimizer(fake_torch)
    with caplog.at_level(logging.INFO, logger="gpumem.torch"):
        for _ in range(4):
            loop.train_step(opt)
    assert caplog.text.count("memory-first warm-up on cuda:0 ended: a step plan is installed") == 1


def test_turning_marks_off_stops_a_warm_up_under_way(fake_torch, glued):
    """An attacker's finding: with marks off the engine went on growing memory-first for WARMUP_ALLOCS
    allocations; now it stops at once, and its idle cache goes back."""
    alloc, _ = glued
    gt.configure(step_marks="optimizer")
    for p in [alloc.allocate(3 * MiB) for _ in range(6)]:
        alloc.free(p)
    held = alloc.memory_stats()["reserved_nbytes"]
    assert gt.step_plan_info(0).warmup == 1
    gt.configure(step_marks=None)
    assert gt.step_plan_info(0).warmup == 0 and alloc.memory_stats()["reserved_nbytes"] < held
    alloc.check_consistency()


def test_only_the_first_optimizer_that_steps_marks(fake_torch, glued):
    """A GAN's two optimizers: one mark per iteration, from the first one that stepped."""
    alloc, marked = glued
    gt.configure(step_marks="optimizer")
    loop, first, second = TrainLoop(alloc), FakeOptimizer(fake_torch), FakeOptimizer(fake_torch, devices=(0,))
    for _ in range(7):
        loop.train_step(first, second)
    assert len(marked) == 7
    info = gt.step_plan_info(0)
    assert info.state == StepState.PLANNED and info.served == 4 * len(PatternLoop.PATTERN)


def test_two_marks_per_iteration_would_never_plan(glued):
    """Why one marker: marks after each of two optimizers cut every iteration into two halves that differ
    (here: the generator's step allocates, the discriminator's does not), and no two steps in a row match."""
    alloc, _ = glued
    loop = TrainLoop(alloc)
    for _ in range(10):
        loop.allocations()
        gt.step(0)                          # after the first optimizer's step
        alloc.free(alloc.allocate(7 * MiB))  # the second one's half of the iteration
        gt.step(0)                          # after the second's
    info = gt.step_plan_info(0)
    assert info.plans_installed == 0 and info.state != StepState.PLANNED


def test_a_collected_marker_hands_over_to_the_next_optimizer(fake_torch, glued):
    alloc, marked = glued
    gt.configure(step_marks="optimizer")
    loop, first = TrainLoop(alloc), FakeOptimizer(fake_torch)
    loop.train_step(first)
    second = FakeOptimizer(fake_torch)
    loop.train_step(second)   # the first one still lives and stepped last: the second's step does not mark
    assert marked == [0]
    del first
    gc.collect()
    loop.train_step(second)
    assert marked == [0, 0]


def test_an_idle_marker_hands_over_after_a_floor_of_steps_of_another(fake_torch, glued):
    """A warm-up (or LR-finder) optimizer still referenced: the real one marks from its 16th step (review
    attacker 11, F4: it never did while the first lived)."""
    alloc, marked = glued
    gt.configure(step_marks="optimizer")
    loop, warmup = TrainLoop(alloc), FakeOptimizer(fake_torch)
    for _ in range(3):
        loop.train_step(warmup)
    real = FakeOptimizer(fake_torch)
    for _ in range(gt.HANDOVER_MIN_STEPS + 4):
        loop.train_step(real)
    assert marked == [0] * 3 + [0] * 5   # its first 15 steps do not mark, the 16th takes over
    loop.train_step(warmup)              # the warm-up one steps once more: it is no longer the marker
    assert len(marked) == 8


def test_a_critic_stepping_ten_times_per_generator_step_does_not_take_over(fake_torch, glued):
    alloc, marked = glued
    gt.configure(step_marks="optimizer")
    loop, gen, critic = TrainLoop(alloc), FakeOptimizer(fake_torch), FakeOptimizer(fake_torch)
    loop.train_step(gen)
    for _ in range(8):
        for _ in range(10):
            critic.step()
        loop.train_step(gen)
    assert marked == [0] * 9


def test_a_critic_that_stepped_first_hands_the_marks_to_the_rarer_generator(fake_torch, glued, caplog):
    """A WGAN whose critic steps first, five times per generator step: the critic marked five times per iteration
    and the plan missed one step in five (live on the H200: 684 MiB held to the end for 386 MiB live); the
    generator takes over at its second step after the critic stepped twice or more since its first."""
    alloc, marked = glued
    gt.configure(step_marks="optimizer")
    loop, gen, critic = TrainLoop(alloc), FakeOptimizer(fake_torch), FakeOptimizer(fake_torch)
    with caplog.at_level(logging.INFO, logger="gpumem.torch"):
        for _ in range(4):
            for _ in range(5):
                critic.step()
            loop.train_step(gen)
    assert len(marked) == 10 + 3   # the critic's ten, then the generator's from its second step on
    assert "steps once per 5 steps of the optimizer that marked cuda:0" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


class _RaisesOnEq(FakeOptimizer):
    def __eq__(self, other):
        raise TypeError("an optimizer whose == raises")

    __hash__ = FakeOptimizer.__hash__


class _AlwaysEqual(FakeOptimizer):
    def __eq__(self, other):
        return True

    __hash__ = FakeOptimizer.__hash__


@pytest.mark.parametrize("cls", [_RaisesOnEq, _AlwaysEqual])
def test_optimizers_are_compared_by_identity_never_by_their_eq(fake_torch, glued, cls):
    """Attacker 43: the marker rule compared weak references, which call the optimizers' own ``__eq__``: one
    that raised failed the user's step(), one always equal merged a GAN's two optimizers."""
    alloc, marked = glued
    gt.configure(step_marks="optimizer")
    loop, first, second = TrainLoop(alloc), cls(fake_torch), cls(fake_torch)
    for _ in range(5):
        loop.train_step(first, second)
    assert len(marked) == 5


def test_each_device_has_its_own_marker(fake_torch, glued):
    """Two optimizers on two devices both mark (F4: the second device never got a mark)."""
    _, marked = glued
    gt.configure(step_marks="optimizer")
    on0, on1 = FakeOptimizer(fake_torch, devices=(0,)), FakeOptimizer(fake_torch, devices=(1,))
    for _ in range(3):
        on0.step()
        on1.step()
    assert marked == [0, 1] * 3


def test_the_marker_marks_its_parameters_devices_and_a_host_optimizer_none(fake_torch, glued):
    _, marked = glued
    gt.configure(step_marks="optimizer")
    FakeOptimizer(fake_torch, devices=(3, 1, 3)).step()
    assert marked == [1, 3]
    marked.clear()
    asked = []
    fake_torch.cuda.current_device = lambda: asked.append(1) or 0   # PyTorch would initialise CUDA here
    FakeOptimizer(fake_torch, devices=(None, None)).step()   # parameters on the host: nothing to mark
    assert marked == [] and asked == []


def test_a_failing_mark_is_logged_and_turns_marks_off_without_failing_the_step(fake_torch, glued, caplog):
    """The hook runs after the update: a raise would fail a step that happened (F3). step() by hand raises."""
    _, marked = glued
    gt.configure(step_marks="optimizer")
    stand_in = gt._lib()   # noqa: SLF001
    working = stand_in.gpumem_torch_step_mark
    stand_in.gpumem_torch_step_mark = lambda index: (marked.append(index), -1)[1]
    stand_in.error = b"the device was lost (simulated)"
    opt = FakeOptimizer(fake_torch)
    with caplog.at_level("WARNING", logger="gpumem.torch"):
        opt.step()   # no raise
        opt.step()   # off now: no second try
    assert marked == [0] and "automatic step marks are off" in caplog.text
    with pytest.raises(GpumemError, match="the device was lost"):
        gt.step(0)
    stand_in.gpumem_torch_step_mark = working
    gt.configure(step_marks=None)
    gt.configure(step_marks="optimizer")   # off and on: marks again
    marked.clear()
    opt.step()
    assert marked == [0]


def test_a_failing_mark_stops_the_warm_up_as_turning_marks_off_does(fake_torch, glued):
    """Review attacker 15: after a failed automatic mark the marks were off but the engine's warm-up went on,
    growing memory-first with no mark to end it (as configure(step_marks=None) did before it stopped it)."""
    alloc, _ = glued
    gt.configure(step_marks="optimizer")
    assert gt.step_plan_info(0).warmup == 1
    stand_in = gt._lib()   # noqa: SLF001
    working = stand_in.gpumem_torch_step_mark
    stand_in.gpumem_torch_step_mark = lambda index: -1
    TrainLoop(alloc).train_step(FakeOptimizer(fake_torch))
    assert gt.automatic_step_marks() is None and gt.step_plan_info(0).warmup == 0
    assert stand_in.warmup_calls == [1, 0]
    stand_in.gpumem_torch_step_mark = working
    gt.configure(step_marks=None)
    gt.configure(step_marks="optimizer")   # off and on: the warm-up begins again
    assert gt.step_plan_info(0).warmup == 1
    alloc.check_consistency()


def test_marking_one_device_by_hand_stands_the_hook_down_there_only(fake_torch, glued, caplog):
    _, marked = glued
    gt.configure(step_marks="optimizer")
    opt = FakeOptimizer(fake_torch, devices=(0, 1))
    with caplog.at_level("WARNING", logger="gpumem.torch"):
        gt.step(1)
    assert "for cuda:1" in caplog.text
    marked.clear()
    opt.step()
    opt.step()
    assert marked == [0, 0]


def test_step_marks_off_before_install_keep_the_environment_variable_off(fake_torch, glued, monkeypatch):
    monkeypatch.setattr(gt, "_installed_allocator", lambda: None)
    monkeypatch.setenv(gt.STEP_MARKS_ENV, "optimizer")
    monkeypatch.delenv(gt.TRACE_OUT_ENV, raising=False)
    gt.configure(step_marks=None)   # the program said no before install
    gt.install()
    assert fake_torch.hooks == [] and gt._auto_marks().mode is None   # noqa: SLF001


def test_the_environment_variable_on_a_torch_without_the_hook_installs_nothing(monkeypatch, glued):
    monkeypatch.setitem(sys.modules, "torch", FakeTorch(with_hook=False))
    installs = []
    monkeypatch.setattr(gt, "_installed_allocator", lambda: installs.append(1))
    monkeypatch.setenv(gt.STEP_MARKS_ENV, "optimizer")
    with pytest.raises(BackendUnavailableError, match="register_optimizer_step_post_hook"):
        gt.install()
    assert installs == []


def test_no_mark_while_a_cuda_graph_is_captured(fake_torch, glued):
    _, marked = glued
    gt.configure(step_marks="optimizer")
    opt = FakeOptimizer(fake_torch)
    fake_torch.capturing = True
    opt.step()
    fake_torch.capturing = False
    opt.step()
    assert marked == [0]


def run_skipping(alloc: CachingAllocator, fake_torch: FakeTorch, skipped: set[int], steps: int = 16,
                 skipped_allocations: int | None = None):
    """``steps`` iterations, ``optimizer.step()`` skipped in those of ``skipped``; ``skipped_allocations``: a
    skipped iteration makes only its first that many allocations (a real optimizer's ``step()`` allocates)."""
    loop, opt = TrainLoop(alloc), FakeOptimizer(fake_torch)
    for i in range(steps):
        if i in skipped and skipped_allocations is not None:
            loop.PATTERN = PatternLoop.PATTERN[:skipped_allocations]
        loop.allocations()
        loop.PATTERN = PatternLoop.PATTERN
        if i not in skipped:   # GradScaler found inf or NaN: no optimizer.step(), no hook
            opt.step()
    return gt.step_plan_info(0), alloc.stats.peak_reserved_nbytes


def test_a_skipped_optimizer_step_restarts_the_planned_step_and_peak_stays_at_the_marked_figure(fake_torch, glued,
                                                                                                  monkeypatch):
    """GradScaler skipping ``optimizer.step()`` makes no mark: the next iteration's first allocation comes
    after the planned step's last slot, fits slot 0, and starts a planned step there (Note [An implicit step
    restart] in gpumem/allocator/plan.py): no miss, nothing served by the engine, peak reserved as when every
    step is marked (before: one miss and up to a step's temporaries more, 16 -> 24 MiB)."""
    alloc, _ = glued
    gt.configure(step_marks="optimizer")
    info, peak = run_skipping(alloc, fake_torch, skipped={8})
    assert info.state == StepState.PLANNED and info.plans_installed == 1 and info.plans_dropped == 0
    assert info.implicit_steps == 1 and info.steps_missed == 0 and info.fallback == 0
    assert info.steps_hit == 16 - 3 - 1 - 1 + 2   # 3 marks before the plan, the last unclosed, the skipped: two steps
    alloc.check_consistency()
    # the same loop with no skip, on a fresh engine
    gt._auto_marks().turn(None, None)   # noqa: SLF001
    clean = glued_allocator(monkeypatch)
    gt.configure(step_marks="optimizer")
    clean_info, clean_peak = run_skipping(clean, fake_torch, skipped=set())
    assert clean_info.steps_missed == 0 and clean_info.fallback == 0 and clean_info.implicit_steps == 0
    assert peak == clean_peak == 16 * MiB


def test_skips_in_three_steps_in_a_row_keep_the_plan(fake_torch, glued):
    alloc, _ = glued
    gt.configure(step_marks="optimizer")
    info, _ = run_skipping(alloc, fake_torch, skipped={6, 8, 10}, steps=24)
    assert info.plans_dropped == 0 and info.plans_installed == 1 and info.state == StepState.PLANNED
    assert info.implicit_steps == 3 and info.steps_missed == 0
    alloc.check_consistency()


@pytest.mark.parametrize("early_leave_steps", [None, 0])
def test_skipped_steps_that_allocate_less_leave_the_plan_and_it_is_dropped(fake_torch, glued, early_leave_steps):
    """A skipped iteration without its optimizer's allocations: the next iteration meets a later slot, leaves
    the plan and no restart comes (what the implicit restart cannot do). By default the first such leave, within
    the plan's first planned steps, drops the plan at once (Note [A plan that leaves early] in
    gpumem/allocator/plan.py) and so does the next one's; with the early drop off (``early_leave_steps`` 0), the
    miss rules alone: three such steps in a row drop the plan, which is recorded again."""
    alloc, _ = glued
    if early_leave_steps is not None:
        alloc._engine.set_early_leave_steps(early_leave_steps)   # noqa: SLF001
    gt.configure(step_marks="optimizer")
    info, _ = run_skipping(alloc, fake_torch, skipped={6, 8, 10}, steps=24, skipped_allocations=4)
    if early_leave_steps is None:
        assert info.plans_dropped == 2 and info.plans_installed == 3
    else:
        assert info.plans_dropped == 1 and info.plans_installed == 2
    assert info.state == StepState.PLANNED and info.implicit_steps == 0
    alloc.check_consistency()


class ScaledLoop(TrainLoop):
    """:class:`TrainLoop` whose iterations may skip their last allocations (the optimizer's temporaries: a step
    GradScaler skips makes none) while every other block is freed where it is in a full iteration: the clock
    still ticks at a skipped allocation, as a real program frees at the same places whether the update ran."""

    def allocations(self, made: int | None = None) -> None:
        for pos, (size, stream, life) in enumerate(self.PATTERN):
            for e in [e for e in self.live if e[1] <= self.clock]:
                self.alloc.free(e[0])
                self.live.remove(e)
            self.clock += 1
            if made is None or pos < made:
                self.live.append([self.alloc.allocate(size, stream), self.clock + life])


def run_scaled(alloc: CachingAllocator, fake_torch: FakeTorch, skipped: set[int], steps: int = 24,
               skipped_allocations: int = 2):
    """``scaler.step(opt)`` every iteration, the optimizer's step skipped in ``skipped``, which make only their
    first ``skipped_allocations`` allocations (:class:`ScaledLoop`)."""
    loop, opt, scaler = ScaledLoop(alloc), FakeOptimizer(fake_torch), fake_torch.amp.GradScaler()
    for i in range(steps):
        loop.allocations(skipped_allocations if i in skipped else None)
        scaler.found_inf = i in skipped
        scaler.step(opt)
    return gt.step_plan_info(0), alloc.stats.peak_reserved_nbytes


def test_a_step_gradscaler_skips_is_marked_and_its_short_iteration_stays_on_the_plan(fake_torch, glued, monkeypatch):
    """GradScaler skipping ``optimizer.step()``: the wrapped ``GradScaler.step`` marks where the optimizer's hook
    would have (Note [Automatic step marks]); the skipped iteration, short of the optimizer's allocations, is the
    template's prefix and a hit (Note [A step that ends early]). Before: no mark, the next iteration met a later
    slot, three such in a row dropped the plan (the test above, which has no GradScaler)."""
    alloc, marked = glued
    gt.configure(step_marks="optimizer")
    info, peak = run_scaled(alloc, fake_torch, skipped={6, 8, 10, 12, 14, 16})
    assert marked == [0] * 24   # one mark per iteration, skipped or not
    assert info.state == StepState.PLANNED and info.plans_installed == 1 and info.plans_dropped == 0
    assert info.steps_missed == 0 and info.fallback == 0 and info.implicit_steps == 0
    alloc.check_consistency()
    gt._auto_marks().turn(None, None)   # noqa: SLF001
    clean = glued_allocator(monkeypatch)
    gt.configure(step_marks="optimizer")
    clean_info, clean_peak = run_scaled(clean, fake_torch, skipped=set())
    assert clean_info.steps_missed == 0 and peak == clean_peak


def test_a_step_gradscaler_makes_is_marked_once(fake_torch, glued):
    alloc, marked = glued
    gt.configure(step_marks="optimizer")
    scaler, opt = fake_torch.amp.GradScaler(), FakeOptimizer(fake_torch)
    scaler.step(opt)
    assert marked == [0]
    scaler.found_inf = True
    scaler.step(opt)
    assert marked == [0, 0]


def test_gradscaler_is_put_back_when_marks_go_off_and_marks_nothing_then(fake_torch, glued):
    _, marked = glued
    original = FakeGradScaler.__dict__["step"]
    gt.configure(step_marks="optimizer")
    assert FakeGradScaler.__dict__["step"] is not original
    gt.configure(step_marks=None)
    assert FakeGradScaler.__dict__["step"] is original
    scaler, opt = FakeGradScaler(), FakeOptimizer(fake_torch)
    scaler.found_inf = True
    scaler.step(opt)
    assert marked == []


def test_a_wrapper_put_on_gradscaler_after_ours_is_kept_when_marks_go_off(fake_torch, glued):
    _, marked = glued
    original = FakeGradScaler.__dict__["step"]
    try:
        gt.configure(step_marks="optimizer")
        ours = FakeGradScaler.__dict__["step"]
        theirs = lambda self, optimizer: ours(self, optimizer)   # noqa: E731 - another library's wrapper
        FakeGradScaler.step = theirs
        gt.configure(step_marks=None)
        assert FakeGradScaler.__dict__["step"] is theirs
        scaler = FakeGradScaler()
        scaler.found_inf = True
        scaler.step(FakeOptimizer(fake_torch))   # ours, still called, marks nothing while marks are off
        assert marked == []
    finally:
        FakeGradScaler.step = original


def test_a_skip_in_one_thread_is_not_hidden_by_another_threads_optimizer_step(fake_torch, glued):
    """The optimizer steps seen are counted per thread: another thread's step during a skipped
    ``scaler.step`` does not make the skip look like a step."""
    import threading

    _, marked = glued
    gt.configure(step_marks="optimizer")
    opt, other = FakeOptimizer(fake_torch), FakeOptimizer(fake_torch, devices=(1,))

    class Interleaved(FakeGradScaler):
        def step(self, optimizer, *args, **kwargs):   # another thread steps while this one is inside step
            t = threading.Thread(target=other.step)
            t.start()
            t.join()
            return super().step(optimizer, *args, **kwargs)

    scaler = Interleaved()
    scaler.found_inf = True
    scaler.step(opt)
    assert marked.count(0) == 1


def test_a_program_that_calls_step_keeps_its_own_marks(fake_torch, glued, caplog):
    """step() by hand with marks automatic: the hook stands down (one warning); the plan comes from the
    program's marks alone, as without automatic marks."""
    alloc, marked = glued
    gt.configure(step_marks="optimizer")
    loop, opt = TrainLoop(alloc), FakeOptimizer(fake_torch)
    with caplog.at_level(logging.WARNING, logger="gpumem.torch"):
        for _ in range(7):
            gt.step(0)
            loop.train_step(opt)
    assert marked == [0] * 7   # the program's seven, none from the optimizer
    assert sum("program's own marks are kept" in r.message for r in caplog.records) == 1
    info = gt.step_plan_info(0)   # marks at the top: the third mark's step is served too
    assert info.state == StepState.PLANNED and info.served == 5 * len(PatternLoop.PATTERN) and info.steps_missed == 0
    gt.configure(step_marks="optimizer")   # on already: nothing changes, the hook still stands down
    opt.step()
    assert len(marked) == 7 and len(fake_torch.hooks) == 1


def test_step_marks_none_removes_the_hook(fake_torch, glued):
    _, marked = glued
    gt.configure(step_marks="optimizer")
    gt.configure(step_marks="optimizer")   # on twice: one hook
    assert len(fake_torch.hooks) == 1
    opt = FakeOptimizer(fake_torch)
    opt.step()
    gt.configure(step_marks=None)
    assert fake_torch.hooks == []
    opt.step()
    assert marked == [0]
    gt.configure(step_marks=None)   # off twice: nothing to remove
    gt.step(0)                      # by hand, marks off: no warning state kept
    assert gt._auto_marks().devices == {}   # noqa: SLF001


@pytest.mark.parametrize("bad", ["adam", "Optimizer", "", " optimizer", 1, True, ["optimizer"]])
def test_an_unknown_step_marks_value_names_the_accepted_ones_and_changes_nothing(fake_torch, glued, bad):
    gt.configure(step_marks="optimizer")
    hooks = list(fake_torch.hooks)
    with pytest.raises(InvalidArgumentError, match=r"step_marks must be 'optimizer' or None \(off\), not "):
        gt.configure(step_marks=bad)
    # the policy is not configured either: the stand-in library has no gpumem_torch_configure to reach
    with pytest.raises(InvalidArgumentError, match="step_marks must be"):
        gt.configure("gpumem", step_marks=bad)
    assert fake_torch.hooks == hooks and gt._auto_marks().mode == "optimizer"   # noqa: SLF001


def test_a_bad_policy_with_step_marks_turns_nothing_on(fake_torch, glued):
    with pytest.raises(InvalidArgumentError, match="unknown allocator policy"):
        gt.configure("nope", step_marks="optimizer")
    assert fake_torch.hooks == [] and gt._auto_marks().mode is None   # noqa: SLF001


def test_configure_needs_an_argument(fake_torch):
    with pytest.raises(InvalidArgumentError, match="needs a policy, step_marks, or both"):
        gt.configure()


def test_step_marks_before_install_say_to_install_first(fake_torch, monkeypatch):
    monkeypatch.setattr(gt, "installed", lambda: False)   # another test of this process may have installed the shim
    with pytest.raises(GpumemError, match=r"call gpumem.torch.install\(\) first"):
        gt.configure(step_marks="optimizer")
    assert fake_torch.hooks == []
    gt.configure(step_marks=None)   # turning off needs nothing


def test_a_torch_without_the_global_hook_is_a_clear_error(monkeypatch, glued):
    old = FakeTorch(with_hook=False)
    monkeypatch.setitem(sys.modules, "torch", old)
    with pytest.raises(BackendUnavailableError, match="register_optimizer_step_post_hook, PyTorch 2.0"):
        gt.configure(step_marks="optimizer")
    assert gt._auto_marks().mode is None   # noqa: SLF001


def test_the_environment_variable_turns_marks_on_at_install_once(fake_torch, glued, monkeypatch):
    installs = []
    monkeypatch.setattr(gt, "_installed_allocator", lambda: installs.append(1))
    monkeypatch.setenv(gt.STEP_MARKS_ENV, "optimizer")
    monkeypatch.delenv(gt.TRACE_OUT_ENV, raising=False)
    gt.install()
    assert installs == [1] and len(fake_torch.hooks) == 1
    gt.configure(step_marks=None)
    gt.install()   # again: the variable was read once; the program's configure stands
    assert installs == [1, 1] and fake_torch.hooks == []


@pytest.mark.parametrize("bad", ["0", "none", "OFF", "Optimizer", "adam"])
def test_a_bad_environment_variable_installs_nothing(fake_torch, glued, monkeypatch, bad):
    installs = []
    monkeypatch.setattr(gt, "_installed_allocator", lambda: installs.append(1))
    monkeypatch.setenv(gt.STEP_MARKS_ENV, bad)
    with pytest.raises(InvalidArgumentError,
                       match=rf"GPUMEM_STEP_MARKS must be 'optimizer' or 'off' \(unset: 'optimizer'\), not '{bad}'"):
        gt.install()
    assert installs == [] and fake_torch.hooks == [] and gt.automatic_step_marks() is None


def default_install(monkeypatch) -> None:
    """gpumem.torch.install() as a program with nothing set calls it: GPUMEM_STEP_MARKS and GPUMEM_TRACE_OUT
    unset, PyTorch's allocator left alone (nothing to install it in here)."""
    monkeypatch.setattr(gt, "_installed_allocator", lambda: None)
    monkeypatch.delenv(gt.STEP_MARKS_ENV, raising=False)
    monkeypatch.delenv(gt.TRACE_OUT_ENV, raising=False)


@pytest.mark.parametrize("value", [None, ""])
def test_marks_are_on_by_default(fake_torch, glued, monkeypatch, value):
    """Unset or empty: install turns the optimizer's marks on, and the engines begin the warm-up."""
    default_install(monkeypatch)
    if value is not None:
        monkeypatch.setenv(gt.STEP_MARKS_ENV, value)
    gt.install()
    assert len(fake_torch.hooks) == 1 and gt.automatic_step_marks() == gt.DEFAULT_STEP_MARKS == "optimizer"


def test_off_in_the_environment_keeps_marks_off(fake_torch, glued, monkeypatch):
    default_install(monkeypatch)
    monkeypatch.setenv(gt.STEP_MARKS_ENV, gt.STEP_MARKS_OFF)
    gt.install()
    assert fake_torch.hooks == [] and gt.automatic_step_marks() is None


def test_by_default_a_torch_without_the_hook_installs_with_marks_off(monkeypatch, glued, caplog):
    """Only an explicit GPUMEM_STEP_MARKS=optimizer needs the hook; the default does without (logged)."""
    monkeypatch.setitem(sys.modules, "torch", FakeTorch(with_hook=False))
    installs = []
    monkeypatch.setattr(gt, "_installed_allocator", lambda: installs.append(1))
    monkeypatch.delenv(gt.STEP_MARKS_ENV, raising=False)
    monkeypatch.delenv(gt.TRACE_OUT_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="gpumem.torch"):
        gt.install()
    assert installs == [1] and gt.automatic_step_marks() is None
    assert "no automatic step marks by default" in caplog.text


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed")
def test_real_pytorch_optimizers_mark_through_the_global_hook(monkeypatch):  # pragma: no cover - needs PyTorch
    """PyTorch's own hook, with its optimizers on the host: one mark per step of the first optimizer."""
    import torch

    gt._auto_marks.cache_clear()   # noqa: SLF001
    alloc = glued_allocator(monkeypatch)
    stand_in, marked = gt._lib(), []   # noqa: SLF001
    real_mark = stand_in.gpumem_torch_step_mark
    stand_in.gpumem_torch_step_mark = lambda index: (marked.append(index), real_mark(index))[1]
    monkeypatch.setattr(gt, "_optimizer_devices", lambda opt: (0,))   # host optimizers stand for ones on cuda:0
    w1, w2 = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    first, second = torch.optim.SGD([w1], lr=0.1), torch.optim.AdamW([w2], lr=0.1)
    try:
        gt.configure(step_marks="optimizer")
        loop = TrainLoop(alloc)
        for _ in range(6):
            loop.allocations()
            for opt, w in ((first, w1), (second, w2)):
                opt.zero_grad()
                (w * w).sum().backward()
                opt.step()
        assert marked == [0] * 6 and gt.step_plan_info(0).state == StepState.PLANNED
        gt.configure(step_marks=None)
        first.step()
        assert len(marked) == 6
    finally:
        gt._auto_marks().turn(None, None)   # noqa: SLF001
        gt._auto_marks.cache_clear()        # noqa: SLF001


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed")
def test_real_gradscaler_skipped_steps_mark_too(monkeypatch):  # pragma: no cover - needs PyTorch
    """PyTorch's own GradScaler (on the host): a step whose gradients hold inf is skipped (no optimizer.step,
    no hook) and still marks once, as a step it makes does (Note [Automatic step marks])."""
    import torch

    gt._auto_marks.cache_clear()   # noqa: SLF001
    glued_allocator(monkeypatch)
    stand_in, marked = gt._lib(), []   # noqa: SLF001
    real_mark = stand_in.gpumem_torch_step_mark
    stand_in.gpumem_torch_step_mark = lambda index: (marked.append(index), real_mark(index))[1]
    monkeypatch.setattr(gt, "_optimizer_devices", lambda opt: (0,))   # host optimizers stand for ones on cuda:0
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    original = torch.amp.GradScaler.__dict__["step"]
    try:
        gt.configure(step_marks="optimizer")
        skipped = 0
        for i in range(6):
            opt.zero_grad()
            scale = float("inf") if i in (2, 4) else 1.0
            scaler.scale((w * w).sum() * scale).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
        assert skipped == 2 and marked == [0] * 6
        gt.configure(step_marks=None)
        assert torch.amp.GradScaler.__dict__["step"] is original
    finally:
        gt._auto_marks().turn(None, None)   # noqa: SLF001
        gt._auto_marks.cache_clear()        # noqa: SLF001


def test_a_pytorch_before_2_3_has_its_gradscaler_in_torch_cuda_amp_and_its_skips_are_marked(fake_torch, glued):
    """PyTorch 2.0 to 2.2 (the optimizer hook, no ``torch.amp.GradScaler``): ``torch.cuda.amp.GradScaler`` is wrapped
    (before: nothing was, and a skipped step made no mark there)."""
    _, marked = glued

    class OldGradScaler(FakeGradScaler):
        step = FakeGradScaler.step   # the class's own step, as torch.cuda.amp.GradScaler's before 2.3

    fake_torch.amp = SimpleNamespace()
    fake_torch.cuda.amp = SimpleNamespace(GradScaler=OldGradScaler)
    original = OldGradScaler.__dict__["step"]
    gt.configure(step_marks="optimizer")
    assert OldGradScaler.__dict__["step"] is not original
    scaler, opt = OldGradScaler(), FakeOptimizer(fake_torch)
    scaler.found_inf = True
    scaler.step(opt)
    assert marked == [0]
    gt.configure(step_marks=None)
    assert OldGradScaler.__dict__["step"] is original


def _cuda_param(index):
    return SimpleNamespace(is_cuda=index is not None, device=SimpleNamespace(index=index))


def test_marks_turned_on_at_install_begin_the_warm_up_at_the_first_optimizer_on_a_gpu(fake_torch, glued, monkeypatch,
                                                                                         caplog):
    """A program that never trains never grows memory-first (live multistream inference: +7.6 % and +23 % step time
    when the warm-up began at install); a training loop's warm-up still begins before its first step."""
    default_install(monkeypatch)
    stand_in, opt_cls = gt._lib(), fake_torch.optim.Optimizer   # noqa: SLF001
    original = opt_cls.__dict__["__init__"]
    gt.install()
    assert gt.automatic_step_marks() == "optimizer" and getattr(stand_in, "warmup_calls", []) == []
    assert gt.step_plan_info(0).warmup == 0 and opt_cls.__dict__["__init__"] is not original
    opt_cls([_cuda_param(None)])   # on the host: nothing
    assert getattr(stand_in, "warmup_calls", []) == []
    with caplog.at_level(logging.INFO, logger="gpumem.torch"):
        opt = opt_cls([_cuda_param(0)])
    assert opt.param_groups and stand_in.warmup_calls == [1] and gt.step_plan_info(0).warmup == 1
    assert "the memory-first warm-up begins" in caplog.text
    assert opt_cls.__dict__["__init__"] is original   # put back once begun
    opt_cls([_cuda_param(0)])
    assert stand_in.warmup_calls == [1]


def test_marks_turned_off_before_an_optimizer_put_the_class_back_and_begin_nothing(fake_torch, glued, monkeypatch):
    default_install(monkeypatch)
    stand_in, opt_cls = gt._lib(), fake_torch.optim.Optimizer   # noqa: SLF001
    original = opt_cls.__dict__["__init__"]
    gt.install()
    gt.configure(step_marks=None)
    assert opt_cls.__dict__["__init__"] is original and stand_in.warmup_calls == [0]
    opt_cls([_cuda_param(0)])
    assert stand_in.warmup_calls == [0] and gt.step_plan_info(0).warmup == 0


def test_a_failure_to_begin_the_warm_up_does_not_fail_making_the_optimizer(fake_torch, glued, monkeypatch, caplog):
    default_install(monkeypatch)
    gt.install()

    def boom(optimizer):
        raise RuntimeError("odd param groups")

    monkeypatch.setattr(gt, "_optimizer_devices", boom)
    with caplog.at_level(logging.WARNING, logger="gpumem.torch"):
        opt = fake_torch.optim.Optimizer([_cuda_param(0)])
    assert opt.param_groups and "could not begin the memory-first warm-up" in caplog.text


def test_the_log_says_when_the_warm_up_begins(fake_torch, glued, monkeypatch, caplog):
    """New user 12: configure(step_marks=...) began the warm-up without a word; install says it waits for the
    first optimizer on a GPU."""
    with caplog.at_level(logging.INFO, logger="gpumem.torch"):
        gt.configure(step_marks="optimizer")
    assert "automatic step marks optimizer; the memory-first warm-up begins" in caplog.text
    gt.configure(step_marks=None)
    gt._auto_marks.cache_clear()           # noqa: SLF001
    gt._step_marks_from_env.cache_clear()  # noqa: SLF001
    default_install(monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gpumem.torch"):
        gt.install()
    assert "the memory-first warm-up begins with the first optimizer on a GPU" in caplog.text
