"""The growth policy of the virtual-memory backing (Note [Chunks of several pages] in gpumem.allocator.backing):
chunks of several pages sized by rule, created within the slack, stolen and given back whole."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem.allocator import CachingAllocator
from gpumem.native import load_engine
from gpumem.allocator.policy import AllocatorPolicy, GrowthRule, get_policy
from gpumem.errors import InvalidArgumentError, OutOfMemoryError
from gpumem.replay import replay
from gpumem.trace import load_trace
from gpumem.units import KiB, MiB

from allocator_helpers import small_device

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"
G = 2 * MiB


ENGINES = ["python"] + (["native"] if load_engine() is not None else [])
"""Both engines where the native one is built: the rule is the same in both (Note [An exact port])."""


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    return request.param


def policy(**knobs) -> AllocatorPolicy:
    return dataclasses.replace(get_policy("gpumem"), name="test", **knobs)


def count_calls(dev) -> Counter:
    """Wrap the device's VMM calls to count them and the size of each create (in pages)."""
    counts: Counter = Counter()
    for kind in ("mem_create", "mem_map", "mem_set_access", "mem_unmap", "mem_release"):
        fn = getattr(dev, kind)

        def wrapper(*args, _fn=fn, _kind=kind):
            out = _fn(*args)
            counts[_kind] += 1
            if _kind == "mem_create":
                counts[f"create{args[0] // G}"] += 1
            return out

        setattr(dev, kind, wrapper)
    return counts


# -- the knobs -------------------------------------------------------------------------------------

def test_default_policy_grows_in_chunks_and_the_old_behaviour_is_a_knob():
    assert get_policy("gpumem").growth is GrowthRule.CHUNKS
    assert policy(growth="pages").growth is GrowthRule.PAGES


@pytest.mark.parametrize("knobs, text", [
    ({"growth": "slabs"}, "unknown growth rule"),
    ({"page_slack": -0.1}, "page_slack"),
    ({"page_slack": 1.5}, "page_slack"),
    ({"chunk_max_fraction": 2.0}, "chunk_max_fraction"),
    ({"grow_ahead_fraction": -1.0}, "grow_ahead_fraction"),
    ({"chunk_max_nbytes": 0}, "chunk_max_nbytes"),
])
def test_bad_growth_knobs_are_refused(knobs, text):
    with pytest.raises(InvalidArgumentError, match=text):
        policy(**knobs)


# -- the rule ----------------------------------------------------------------------------------------

def test_a_run_is_covered_by_chunks_capped_by_the_memory_held(engine):
    """Uncapped fraction: each new chunk holds at most what is held already (at least a page), so a
    64 MiB block on a fresh allocator takes chunks of 1, 1, 2, 4, 8 and 16 pages, one access call."""
    dev = small_device(384)
    calls = count_calls(dev)
    alloc = CachingAllocator(dev, policy(chunk_max_fraction=1.0, grow_ahead_fraction=0.0), engine=engine)
    alloc.allocate(64 * MiB)
    assert [calls[f"create{n}"] for n in (1, 2, 4, 8, 16)] == [2, 1, 1, 1, 1]
    assert calls["mem_create"] == calls["mem_map"] == 6
    assert calls["mem_set_access"] == 1
    assert alloc.reserved_nbytes == 64 * MiB
    alloc.check_consistency()


def test_chunks_are_capped_by_chunk_max_nbytes(engine):
    dev = small_device(384)
    calls = count_calls(dev)
    alloc = CachingAllocator(dev, policy(chunk_max_fraction=1.0, chunk_max_nbytes=8 * MiB, grow_ahead_fraction=0.0),
                             engine=engine)
    alloc.allocate(64 * MiB)
    assert [calls[f"create{n}"] for n in (1, 2, 4)] == [2, 1, 7]
    assert calls["mem_set_access"] == 1
    alloc.check_consistency()


def test_pages_rule_makes_one_page_chunks(engine):
    dev = small_device(384)
    calls = count_calls(dev)
    alloc = CachingAllocator(dev, policy(growth="pages", page_slack=0.0, page_slack_min_nbytes=0), engine=engine)
    alloc.allocate(64 * MiB)
    assert calls["mem_create"] == calls["create1"] == calls["mem_map"] == 32
    alloc.check_consistency()


def test_growing_ahead_at_the_top_maps_the_next_blocks_pages(engine):
    """With slack, a chunk for a run that ends at the top of the range is extended past it, so that
    the next blocks grown there need no device call; what is mapped ahead is empty, held memory."""
    dev = small_device(384)
    calls = count_calls(dev)
    alloc = CachingAllocator(dev, policy(chunk_max_fraction=1.0, page_slack=1.0, grow_ahead_fraction=1.0),
                             engine=engine)
    alloc.allocate(32 * MiB)  # chunks of 1, 1, 2, 4, 8, 16 pages: the cap (what is held) stops growing ahead
    assert alloc.reserved_nbytes == 32 * MiB
    alloc.allocate(G)  # a one-page run at the top: its chunk is grown ahead to the cap, 16 pages
    assert alloc.reserved_nbytes == 64 * MiB
    creates, maps = calls["mem_create"], calls["mem_map"]
    for _ in range(15):
        alloc.allocate(G)  # each lands on pages mapped ahead
    assert (calls["mem_create"], calls["mem_map"]) == (creates, maps)
    assert alloc.reserved_nbytes == 64 * MiB
    alloc.check_consistency()


SIZE_CYCLE = (512, 4 * KiB, 64 * KiB, 1 * MiB, 3 * MiB, 8 * MiB + 4 * KiB)
"""``python -m hil.probes.op_cost``'s pair loop: the small pool and the large pool's fifth page take turns."""


@pytest.mark.parametrize("floor_nbytes, calls_at_most", [(4 * MiB, 30), (0, 12_000)])
def test_two_pools_taking_turns_do_not_steal_a_page_back_and_forth(engine, floor_nbytes, calls_at_most):
    """Note [A slack of at least one page]: with the slack's floor the two pools keep a page each (20 calls
    in all); without it every cycle of sizes stole twice (6,011 calls for 6,000 allocations, live 18 µs each)."""
    from gpumem import open_device

    dev = open_device("sim:h200-141gb")
    alloc = CachingAllocator(dev, policy(page_slack_min_nbytes=floor_nbytes), engine=engine)
    for i in range(6000):
        alloc.free(alloc.allocate(SIZE_CYCLE[i % len(SIZE_CYCLE)]))
    assert alloc.stats.device_calls <= calls_at_most
    if floor_nbytes:
        assert alloc.reserved_nbytes == 12 * MiB   # the 5 pages of the largest block, one small page, one to spare
    else:
        assert alloc.stats.device_calls > 6000 and alloc.reserved_nbytes == 10 * MiB
    alloc.check_consistency()
    alloc.close()


def test_the_slack_floor_stops_at_the_limit(engine):
    """At its limit the allocator steals rather than creating within the floor and retrying."""
    alloc = CachingAllocator(small_device(384), get_policy("gpumem"), engine=engine, limit=10 * MiB)
    for i in range(600):
        alloc.free(alloc.allocate(SIZE_CYCLE[i % len(SIZE_CYCLE)]))
    assert alloc.stats.num_alloc_retries == 0 and alloc.reserved_nbytes <= 10 * MiB
    alloc.check_consistency()
    alloc.close()


def test_the_slack_floor_is_refused_out_of_range():
    with pytest.raises(InvalidArgumentError, match=r"page_slack_min_nbytes must be an int in \[0, 2\*\*63\)"):
        policy(page_slack_min_nbytes=-1)


def test_without_slack_a_whole_idle_chunk_is_stolen_not_created(engine):
    """Past the slack (0 here) memory moves: chunks whose pages are all empty are unmapped whole and
    mapped where the new block needs them; nothing is created and memory held stays the same."""
    dev = small_device(384)
    calls = count_calls(dev)
    alloc = CachingAllocator(dev, policy(chunk_max_fraction=1.0, page_slack=0.0, page_slack_min_nbytes=0, grow_ahead_fraction=0.0),
                             engine=engine)
    a = alloc.allocate(16 * MiB, stream=0)  # chunks of 1, 1, 2 and 4 pages
    alloc.free(a)
    held = alloc.reserved_nbytes
    creates = calls["mem_create"]
    alloc.allocate(16 * MiB, stream=1)  # another stream's free list: grows at the top
    assert calls["mem_create"] == creates
    assert calls["mem_unmap"] == 4  # the four idle chunks, whole
    assert alloc.reserved_nbytes == held
    assert "4 steals)" in alloc.memory_summary()
    alloc.check_consistency()


def test_a_chunk_with_live_data_is_never_stolen(engine):
    dev = small_device(384)
    alloc = CachingAllocator(dev, policy(chunk_max_fraction=1.0, page_slack=0.0, page_slack_min_nbytes=0, grow_ahead_fraction=0.0),
                             engine=engine)
    a = alloc.allocate(16 * MiB, stream=0)
    alloc.free(a)
    b = alloc.allocate(1 * MiB + 4096, stream=0)  # reuses the start of a's block: its chunk holds live data
    dev.write(b, b"x" * 64)
    handles_before = {va: h for va, n, h in dev.mapping_ranges()}
    alloc.allocate(16 * MiB, stream=1)
    after = {va: h for va, n, h in dev.mapping_ranges()}
    assert after[b - b % G] == handles_before[b - b % G]
    assert dev.read(b, 64) == b"x" * 64
    alloc.check_consistency()


def test_a_block_over_mapped_empty_pages_is_committed_without_a_device_call(engine, monkeypatch):
    """Note [A quiet commit]: a block over several pages that fell empty, their chunks still mapped, is
    served by the hot path (no device call, not through commit()), and the pages it covers are live
    again: a later steal leaves them alone."""
    dev = small_device(384)
    calls = count_calls(dev)
    alloc = CachingAllocator(dev, policy(chunk_max_fraction=1.0, page_slack=0.0, page_slack_min_nbytes=0, grow_ahead_fraction=0.0),
                             engine=engine)
    a = alloc.allocate(16 * MiB)
    alloc.allocate(G)   # above it: a's block stays a free block of the range when freed
    alloc.free(a)
    before = dict(calls)
    if engine == "python":
        def no_commit(block):
            raise AssertionError("the quiet commit should have served this block")
        monkeypatch.setattr(alloc.backing, "commit", no_commit)
    b = alloc.allocate(16 * MiB)
    assert b == a and dict(calls) == before
    dev.write(b + 16 * MiB - 64, b"y" * 64)
    monkeypatch.undo()
    alloc.allocate(16 * MiB, stream=1)   # past the slack: only idle chunks may move, and b's are live
    assert dev.read(b + 16 * MiB - 64, 64) == b"y" * 64
    alloc.check_consistency()


def test_a_block_over_unmapped_pages_is_mapped_not_committed_quietly(engine):
    """The quiet commit refuses a block whose pages lost their chunks (empty_cache unmapped them): the
    allocation maps them, and the memory is usable."""
    dev = small_device(384)
    calls = count_calls(dev)
    alloc = CachingAllocator(dev, policy(chunk_max_fraction=1.0, grow_ahead_fraction=0.0), engine=engine)
    a = alloc.allocate(16 * MiB)
    alloc.allocate(G)
    alloc.free(a)
    alloc.empty_cache()   # a's chunks are idle: unmapped and released; its free block stays
    maps = calls["mem_map"]
    b = alloc.allocate(16 * MiB)
    assert b == a and calls["mem_map"] > maps
    dev.write(b + 16 * MiB - 64, b"z" * 64)
    assert dev.read(b + 16 * MiB - 64, 64) == b"z" * 64
    alloc.check_consistency()


def test_empty_cache_gives_back_idle_chunks_whole(engine):
    dev = small_device(384)
    calls = count_calls(dev)
    alloc = CachingAllocator(dev, policy(chunk_max_fraction=1.0, grow_ahead_fraction=0.0), engine=engine)
    a = alloc.allocate(16 * MiB)
    alloc.free(a)
    assert alloc.empty_cache() == 16 * MiB
    assert calls["mem_unmap"] == calls["mem_release"] == 4
    assert alloc.reserved_nbytes == 0
    alloc.check_consistency()


def test_a_limit_is_kept_by_giving_back_an_idle_chunk_too_large_to_move(engine):
    """An idle chunk larger than every run cannot be mapped where it is needed: once memory would run
    short it is given back and a chunk of the size needed is created."""
    dev = small_device(384)
    alloc = CachingAllocator(dev, policy(chunk_max_fraction=1.0, page_slack=0.0, page_slack_min_nbytes=0, grow_ahead_fraction=0.0),
                             engine=engine, limit=32 * MiB)
    a = alloc.allocate(30 * MiB, stream=0)  # chunks of 1, 1, 2, 4, 7 pages
    alloc.free(a)
    ptrs = [alloc.allocate(G, stream=1) for _ in range(15)]  # one page each, all at the top
    assert alloc.reserved_nbytes <= 32 * MiB
    assert len(set(ptrs)) == 15
    alloc.check_consistency()
    with pytest.raises(OutOfMemoryError):
        alloc.allocate(4 * MiB, stream=1)
    alloc.check_consistency()


# -- bookkeeping matches the device under random workloads ------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free", "empty"]),
                         st.one_of(st.integers(1, 3 * MiB), st.integers(3 * MiB, 48 * MiB)),
                         st.integers(0, 2), st.integers(0, 1 << 16)), min_size=1, max_size=40)


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=60, deadline=None)
@given(ops=OPS, cap=st.sampled_from([1.0, 1 / 4, 1 / 256]), slack=st.sampled_from([0.0, 0.005, 0.5]),
       ahead=st.sampled_from([0.0, 0.004, 0.5]), limit=st.sampled_from([None, 96 * MiB]))
def test_bookkeeping_matches_the_device(engine, ops, cap, slack, ahead, limit):
    dev = small_device(256)
    alloc = CachingAllocator(dev, policy(chunk_max_fraction=cap, page_slack=slack, grow_ahead_fraction=ahead),
                             limit=limit, engine=engine)
    live: dict[int, bytes] = {}
    for op, nbytes, stream, pick in ops:
        if op == "alloc":
            try:
                ptr = alloc.allocate(nbytes, stream)
            except OutOfMemoryError:
                alloc.check_consistency()
                continue
            tag = bytes([pick & 0xFF]) * 16
            dev.write(ptr, tag)
            live[ptr] = tag
        elif op == "free" and live:
            ptr = sorted(live)[pick % len(live)]
            assert dev.read(ptr, 16) == live.pop(ptr)
            alloc.free(ptr)
        elif op == "empty":
            alloc.empty_cache()
        alloc.check_consistency()
        if engine == "python":
            held_breakdown_adds_up(alloc.backing)
        for ptr, tag in live.items():
            assert dev.read(ptr, 16) == tag
    alloc.close()


def held_breakdown_adds_up(backing) -> None:
    """The breakdown's parts add up to the memory held, and its live part is the pages live blocks touch."""
    b = backing.held_breakdown()
    assert b.live_nbytes + b.locked_nbytes + b.idle_nbytes + b.cached_nbytes == backing.reserved_nbytes
    assert b.live_nbytes == backing.live_pages * G
    assert (b.locked_nbytes == 0) == (b.locked_chunks == 0)


def test_held_breakdown_tells_locked_pages_from_idle_chunks():
    """A 64 MiB block grows chunks of 1, 1, 2, 4, 8 and 16 pages (uncapped: each at most what is held);
    a 10 MiB block in its place after it is freed keeps pages 0-4 live: pages 5-7 of the 4-page chunk are
    locked, the 8- and 16-page chunks idle (what sim/peak_composition.py reports at the peak)."""
    alloc = CachingAllocator(small_device(), policy(chunk_max_fraction=1.0), engine="python")
    alloc.free(alloc.allocate(64 * MiB))
    alloc.allocate(10 * MiB)
    b = alloc.backing.held_breakdown()
    assert (b.live_nbytes, b.locked_nbytes, b.locked_chunks, b.idle_nbytes, b.cached_nbytes) == \
        (10 * MiB, 6 * MiB, 1, 48 * MiB, 0)
    held_breakdown_adds_up(alloc.backing)
    alloc.empty_cache()  # the idle chunks go back whole; the locked pages stay with their chunk
    b = alloc.backing.held_breakdown()
    assert (b.live_nbytes, b.locked_nbytes, b.idle_nbytes, b.cached_nbytes) == (10 * MiB, 6 * MiB, 0, 0)
    alloc.close()


# -- the real traces -----------------------------------------------------------------------------------

def _replay_counts(name: str, pol: AllocatorPolicy, engine: str = "python",
                   step_marks: bool = True) -> tuple[Counter, float]:
    from gpumem import open_device

    dev = open_device("sim:h200-141gb")
    calls = count_calls(dev)
    alloc = CachingAllocator(dev, pol, engine=engine)
    # the growth rule's figures (reports/growth-sweep.md) are measured with the GPU idle; with it behind
    # (the default timing since issue 18) see tests/sim/test_gpu_timing.py
    result = replay(load_trace(TRACES / name, step_marks=step_marks), alloc, progress=False, gpu_timing="idle")
    alloc.check_consistency()
    return calls, result.overhead


#: Traces recorded for issue 18 on which the default policy holds more than 1 % with the GPU idle and the step
#: marks read off each snapshot's optimizer steps (docs/allocator.md): issue 18 point 3 chooses the policy that
#: brings them down; strict, so that a policy that does makes these pass and fails here until the mark goes.
#: GPT-2 fp32 and bf16 (3.38 and 2.72 % at the split, without marks) left it when the marks were read: 0.56 and
#: 0.87 % (reports/snapshot-step-marks.md); ViT (1.01 %) when its plan was laid out for its first step: 0.90 %
#: (Note [A plan laid out for its first step] in gpumem/allocator/plan.py).
ABOVE_ONE_PERCENT = {"moe_train_h200.snapshot.pickle.gz": "1.25 %",
                     "llama_kvcache_generate_h200.snapshot.pickle.gz": "1.45 %"}
REAL = [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=f"default policy {ABOVE_ONE_PERCENT[n]} (issue 18 point 3)"))
        if n in ABOVE_ONE_PERCENT else n
        for n in sorted(p.name for p in TRACES.iterdir() if ".trace." in p.name or ".snapshot." in p.name)]


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL)
def test_default_policy_overhead_at_most_one_percent_on_real_traces(name, engine):
    _, overhead = _replay_counts(name, get_policy("gpumem"), engine)
    assert overhead <= 0.01


@pytest.mark.slow
@pytest.mark.parametrize("name, factor", [("gpt2_train.snapshot.pickle.gz", 5), ("resnet_train.snapshot.pickle.gz", 2)])
def test_chunks_make_far_fewer_device_calls_than_pages(name, factor, engine):
    """Measured (reports/growth-sweep.md): 5.9x fewer VMM calls on gpt2, 2.3x on resnet with chunks capped at
    1/256 of the memory held (the default); at 1/1024 (the memory-first setting, Note [Chunks of several
    pages]) 2.3x on gpt2 and 1.2x on resnet. Without step marks: the memory-first warm-up they begin grows by
    single pages whatever the growth rule (Note [A memory-first warm-up] in gpumem/allocator/plan.py)."""
    before, _ = _replay_counts(name, policy(growth="pages", page_slack=0.0, page_slack_min_nbytes=0), engine,
                               step_marks=False)
    after, _ = _replay_counts(name, get_policy("gpumem"), engine, step_marks=False)
    kinds = ("mem_create", "mem_map", "mem_set_access", "mem_unmap", "mem_release")
    assert sum(after[k] for k in kinds) * factor <= sum(before[k] for k in kinds)
    assert after["mem_create"] * factor <= before["mem_create"]
    assert after["mem_map"] * factor <= before["mem_map"]


# -- every knob has a range (issue 20 item 12) ---------------------------------------------------------
@pytest.mark.parametrize("knobs, text", [
    ({"small_max_nbytes": -1}, r"AllocatorPolicy.small_max_nbytes must be an int in \[0, 2\*\*63\), got -1"),
    ({"min_split_large_nbytes": -5}, r"AllocatorPolicy.min_split_large_nbytes must be an int in \[0, 2\*\*63\)"),
    ({"min_split_small_nbytes": -1}, r"min_split_small_nbytes must be an int in \[0, 2\*\*63\)"),
    ({"small_segment_nbytes": 0}, r"small_segment_nbytes must be an int in \[1, 2\*\*63\)"),
    ({"round_nbytes": 0}, r"round_nbytes must be an int in \[1, 2\*\*62\]"),
    ({"round_nbytes": 3}, r"round_nbytes must be a power of two in \[1, 2\*\*62\]"),
    ({"round_nbytes": 2**63}, r"round_nbytes must be an int in \[1, 2\*\*62\]"),
    ({"small_max_nbytes": 2**64}, r"small_max_nbytes must be an int in \[0, 2\*\*63\)"),
    ({"small_max_nbytes": 1.5}, "small_max_nbytes must be an int, got float"),
    ({"chunk_max_nbytes": True}, "chunk_max_nbytes must be an int, got bool"),
    ({"va_reserve_factor": 0.5}, r"va_reserve_factor must be a finite number in \[1.0, 4096.0\]"),
    ({"va_reserve_factor": float("inf")}, r"va_reserve_factor must be a finite number in \[1.0, 4096.0\]"),
    ({"page_slack": float("nan")}, r"page_slack must be a finite number in \[0.0, 1.0\]"),
    ({"grow_ahead_fraction": "0.1"}, r"grow_ahead_fraction must be a number in \[0.0, 1.0\], got str"),
    ({"separate_small_pool": 1}, "separate_small_pool must be a bool"),
    ({"steal_empty_pages": None}, "steal_empty_pages must be a bool"),
    ({"large_page_nbytes": -2}, r"large_page_nbytes must be an int in \[1, 2\*\*63\)"),
    ({"vmm": "sometimes"}, "vmm: unknown vmm mode 'sometimes'"),
    ({"segment_rule": 3}, "segment_rule: unknown segment rule 3"),
    ({"description": None}, "description must be a str"),
])
def test_every_policy_field_out_of_range_is_refused_by_name_and_range(knobs, text):
    with pytest.raises(InvalidArgumentError, match=text):
        policy(**knobs)


def test_policy_integers_of_any_type_become_ints_and_every_field_is_checked():
    np = pytest.importorskip("numpy")
    p = policy(small_max_nbytes=np.int64(4096), round_nbytes=np.uint32(1024), vmm="never")
    assert p.small_max_nbytes == 4096 and type(p.small_max_nbytes) is int and type(p.round_nbytes) is int
    assert p.vmm.value == "never"
    from gpumem.allocator import policy as policy_module

    fields = {f.name for f in dataclasses.fields(policy_module.AllocatorPolicy)}
    assert fields == set(policy_module._FIELD_RANGES) | {"vmm", "segment_rule", "growth"}, \
        "a field without a range: add it to _FIELD_RANGES"


def test_peak_composition_study_splits_the_overhead_and_refuses_a_policy_without_virtual_memory():
    """sim/peak_composition.py: the parts at the peak add up to the overhead; a segment policy is refused."""
    from gpumem.trace import Trace
    from gpumem.trace.model import OpKind
    from sim.peak_composition import peak_composition

    A, F = OpKind.ALLOC, OpKind.FREE
    trace = Trace.from_ops("t", "test", [(A, 0, 64 * MiB, 0, 0.0, 0), (F, 0, 64 * MiB, 0, 1.0, 0),
                                         (A, 1, 10 * MiB, 0, 2.0, 0), (A, 2, 1 * MiB, 0, 3.0, 0),
                                         (F, 1, 10 * MiB, 0, 4.0, 0), (F, 2, 1 * MiB, 0, 5.0, 0)])
    r = peak_composition(trace, policy(chunk_max_fraction=1.0), "sim:h200-141gb", "idle")
    a = r.at_peak
    assert r.peak_reserved_nbytes == a.live_nbytes + a.locked_nbytes + a.idle_nbytes + a.cached_nbytes
    assert r.overhead == pytest.approx(r.peak_reserved_nbytes / r.peak_allocated_nbytes - 1)
    assert r.memory_calls > 0 and 0 <= r.memory_calls_second_half <= r.memory_calls
    with pytest.raises(InvalidArgumentError, match="does not use virtual memory"):
        peak_composition(trace, get_policy("bestfit"), "sim:h200-141gb", "idle")
