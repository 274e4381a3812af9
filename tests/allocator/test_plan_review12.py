"""Step plans and the Python engine's hot path after review attacker 12: a move off kept blocks waits for the
arena's streams (F1), a run unmapped whose release failed is mapped again before a slot uses it (F2),
``live_blocks()`` lists arena allocations (F4), and a value whose ``__class__`` answers ``int`` goes through the
checks (F5). Both engines, the same answers."""

from __future__ import annotations

import pytest

from gpumem import sim
from gpumem.allocator import CachingAllocator
from gpumem.errors import MemoryHazardError
from gpumem.units import MiB

ENGINES = ["python", "native"]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_move_waits_for_the_arena_s_streams_before_a_slot_lands_on_a_freed_block(engine):
    """A block kept on stream 0, then freed after queued stream-0 work on it; a later move (off a block kept on
    stream 7) placed a stream-7 slot over its bytes with that work still queued: a race on a GPU."""
    dev = sim.SimDevice(sim.get_profile("h200-141gb"))
    a = CachingAllocator(dev, engine=engine)
    k0 = work = None
    raced = []
    for i in range(40):
        a.mark_step()
        x = a.allocate(64 * MiB, 0)
        a.free(x)
        b = a.allocate(512, 0)
        f = a.allocate(4 * MiB, 7)
        a.free(f)
        g = a.allocate(3 * MiB + MiB // 2, 7)
        d = a.allocate(512, 7)
        a.free(g)
        if i == 5:
            k0 = b
        else:
            a.free(b)
        if i != 20:
            a.free(d)
        if i == 12:
            work = dev.launch(0, 1000.0, [(k0, 512)], name="stream-0 work on the kept block")
            a.free(k0)
        if work is not None and d <= k0 < d + 512 and i != 20:
            raced.append(work.state != 2)   # 2: done
    assert raced and not any(raced)   # the slot did land there, and only once stream 0's work was done
    a.check_consistency()
    a.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_run_whose_release_failed_after_its_unmap_is_mapped_again_before_use(engine):
    dev = sim.SimDevice(sim.get_profile("h200-141gb"))
    a = CachingAllocator(dev, engine=engine)

    def step() -> int:
        a.mark_step()
        p = a.allocate(64 * MiB)
        a.free(p)
        return p

    for _ in range(4):
        step()
    real = dev.mem_release

    def failing(handle):
        raise RuntimeError("injected mem_release failure")

    dev.mem_release = failing
    with pytest.raises(RuntimeError, match="injected mem_release failure"):
        a.empty_cache()
    dev.mem_release = real
    a.mark_step()
    p = a.allocate(64 * MiB)
    try:
        dev.launch(0, 1e-3, [(p, 64 * MiB)])   # was MemoryHazardError: served over unmapped memory
    except MemoryHazardError as exc:  # pragma: no cover - the bug
        pytest.fail(f"a planned step was served over unmapped memory: {exc}")
    a.free(p)
    for _ in range(3):
        step()
    a.check_consistency()
    a.close()
    assert dev.n_mappings == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_live_blocks_lists_the_arena_s_live_allocations(engine):
    a = CachingAllocator(sim.SimDevice(sim.get_profile("h200-141gb")), engine=engine)
    for _ in range(4):
        a.mark_step()
        a.free(a.allocate(8 * MiB))
    a.mark_step()
    p = a.allocate(8 * MiB)
    assert a.step_plan_info().served >= 1 and a.live_blocks() == [(p, 8 * MiB)]
    assert a.stats.num_live_blocks == 1
    a.free(p)
    a.close()


class _LooksLikeInt:
    """A proxy whose ``__class__`` answers ``int``: the hot path must not take it for one."""

    __class__ = int  # type: ignore[assignment]

    def __index__(self) -> int:
        return 512


@pytest.mark.parametrize("engine", ENGINES)
def test_an_object_answering_int_as_its_class_is_read_by_its_index(engine):
    """The Python engine handed out a block, then raised, leaving it live and its stats half-updated; the
    native engine refused it with nothing changed. Then both refused it in the checks (TypeError); since
    attacker 45's F4 both read it by its ``__index__`` (``as_int`` checks ``type()``, which the object cannot fake),
    as any integer type: a block of 512 bytes, the books whole."""
    a = CachingAllocator(sim.SimDevice(sim.get_profile("h200-141gb")), engine=engine)
    ptr = a.allocate(_LooksLikeInt())
    st = a.stats
    assert (st.requested_nbytes, st.num_allocs, a.block_size(ptr)) == (512, 1, 512)
    a.check_consistency()
    a.free(ptr)
    assert a.stats.allocated_nbytes == 0
    a.check_consistency()
    a.close()
