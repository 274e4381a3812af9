"""``gpumem._engine.Allocator.run_ops`` and ``PtrTable`` (Note [A step's ops in one call] in
``gpumem/_native/op_table.h``): a batch of ops in one call makes the per-op loop's calls, to the pointer, the
stat and the error; bad input changes nothing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpumem import sim
from gpumem.allocator import CachingAllocator
from gpumem.allocator.policy import GrowthRule, get_policy
from gpumem.errors import (DeviceClosedError, GpumemError, InternalError, InvalidArgumentError, InvalidPointerError,
                           OutOfMemoryError)
from gpumem.native import load_engine
from gpumem.units import KiB, MiB

from allocator_helpers import small_profile

if load_engine() is None:  # pragma: no cover - the engine is optional
    pytest.skip("the native engine (gpumem._engine) is not built", allow_module_level=True)

PtrTable = load_engine().PtrTable


def _allocator(total_mib: int = 256, limit: int | None = None, policy: str = "gpumem") -> CachingAllocator:
    return CachingAllocator(sim.SimDevice(small_profile(total_mib)), policy, limit=limit, engine="native")


def _loop(alloc: CachingAllocator, ptrs: dict, kinds, ids, sizes, stream: int = 0) -> tuple[int, BaseException | None]:
    """The per-op loop run_ops stands for: (ops completed, the error that stopped it)."""
    for q, (k, i, n) in enumerate(zip(kinds, ids, sizes)):
        try:
            if k == 0:
                ptrs[i] = alloc.allocate(n, stream) if n else 0
            else:
                p = ptrs.pop(i, 0)
                if p:
                    alloc.free(p)
        except GpumemError as exc:
            return q, exc
    return len(kinds), None


def _state(alloc: CachingAllocator, table) -> tuple:
    """Stats, live blocks and the id -> pointer table (a PtrTable or a dict)."""
    return alloc.snapshot_stats(), sorted(alloc.live_blocks()), sorted(table.items())


def _arrays(ops):
    kinds = np.array([k for k, _, _ in ops], np.int8)
    ids = np.array([i for _, i, _ in ops], np.int64)
    sizes = np.array([n for _, _, n in ops], np.int64)
    return kinds, ids, sizes


# -- the table -------------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "pop", "pop_default", "get", "in", "del"]),
                          st.integers(-40, 40) | st.integers(-2**63 + 1, 2**63 - 1), st.integers(0, 2**64 - 1)),
                max_size=300))
def test_the_table_is_a_dict_of_ints(ops):
    t, d = PtrTable(), {}
    for what, k, v in ops:
        if what == "set":
            t[k] = v
            d[k] = v
        elif what == "pop":
            if k in d:
                assert t.pop(k) == d.pop(k)
            else:
                with pytest.raises(KeyError):
                    t.pop(k)
        elif what == "pop_default":
            assert t.pop(k, 0) == d.pop(k, 0)
        elif what == "get":
            assert t.get(k) == d.get(k) and t.get(k, 7) == d.get(k, 7)
        elif what == "in":
            assert (k in t) == (k in d)
        elif k in d:
            del t[k]
            del d[k]
        else:
            with pytest.raises(KeyError):
                del t[k]
        assert len(t) == len(d)
    assert sorted(t.items()) == sorted(d.items())
    t.clear()
    assert len(t) == 0 and t.items() == []


def test_the_table_grows_and_shrinks_through_many_keys():
    t, d = PtrTable(), {}
    rng = np.random.default_rng(5)
    for k, v, drop in zip(rng.integers(0, 50_000, 200_000).tolist(), rng.integers(1, 2**62, 200_000).tolist(),
                          rng.random(200_000).tolist()):
        if drop < 0.5:
            assert t.pop(k, 0) == d.pop(k, 0)
        else:
            t[k] = d[k] = v
    assert len(t) == len(d) and sorted(t.items()) == sorted(d.items())


def test_the_table_refuses_what_it_cannot_hold():
    t = PtrTable()
    t[1] = 5
    with pytest.raises(TypeError, match="op ids are ints"):
        t["a"] = 1
    with pytest.raises(TypeError, match="pointers are ints"):
        t[2] = 1.0
    for key in (-2**63, 2**63, -2**63 - 1):  # -2**63 marks an empty slot
        with pytest.raises(OverflowError, match="op id"):
            t[key] = 1
        assert key not in t and t.pop(key, None) is None and t.get(key) is None
    for ptr in (-1, 2**64):
        with pytest.raises(OverflowError, match="pointer"):
            t[3] = ptr
    assert sorted(t.items()) == [(1, 5)]
    with pytest.raises(TypeError):
        PtrTable(1)


# -- run_ops against the loop -----------------------------------------------------------------------------------

@st.composite
def op_batches(draw):
    """Ops as the fast replay makes them (fresh ids for allocations, frees of earlier ids, some unknown or
    freed twice, zero-byte requests), cut into batches; sizes from bytes to tens of MiB, so that a small device
    runs out of memory at some point."""
    ops, live, next_id = [], [], 0
    for _ in range(draw(st.integers(1, 120))):
        if live and draw(st.booleans()):
            i = live.pop(draw(st.integers(0, len(live) - 1)))
            ops.append((1, i, 0))
            if draw(st.integers(0, 9)) == 0:
                ops.append((1, i, 0))  # popped already: no call
        elif draw(st.integers(0, 15)) == 0:
            ops.append((1, 10_000 + next_id, 0))  # never allocated: no call
        else:
            n = draw(st.sampled_from([0, 1, 511, 512, 4 * KiB, 1 * MiB - 1, 1 * MiB + 1, 3 * MiB, 20 * MiB, 70 * MiB]))
            n = n + draw(st.integers(0, 3)) * 512 if n else 0
            ops.append((0, next_id, n))
            live.append(next_id)
            next_id += 1
    cuts = sorted(draw(st.lists(st.integers(0, len(ops)), max_size=4)))
    return ops, cuts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op_batches(), st.sampled_from([None, 96 * MiB, 160 * MiB]), st.sampled_from([0, 3]),
       st.sampled_from(["gpumem", "gpumem-pages"]))
def test_run_ops_makes_the_loops_calls(batch, limit, stream, policy):
    pol = get_policy("gpumem")
    if policy == "gpumem-pages":
        pol = dataclasses.replace(pol, name="pages", growth=GrowthRule.PAGES, page_slack=0.0)
    ops, cuts = batch
    ref = CachingAllocator(sim.SimDevice(small_profile(256)), pol, limit=limit, engine="native")
    got = CachingAllocator(sim.SimDevice(small_profile(256)), pol, limit=limit, engine="native")
    ref_ptrs, table = {}, PtrTable()
    ref_done, ref_err = _loop(ref, ref_ptrs, *zip(*ops), stream=stream) if ops else (0, None)
    done, err = 0, None
    for lo, hi in zip([0, *cuts], [*cuts, len(ops)]):
        if hi <= lo:
            continue
        try:
            n = got._engine.run_ops(*_arrays(ops[lo:hi]), table, stream=stream)
            assert n == hi - lo == table.last_ops_done
            done = hi
        except GpumemError as exc:
            err = exc
            done = lo + table.last_ops_done
            break
    event(f"stopped by {type(ref_err).__name__}" if ref_err else "ran to the end")
    if ref_err is not None:
        event("stopped mid-batch" if done not in (0, *cuts) else "stopped at a batch's first op")
    assert done == ref_done
    assert type(err) is type(ref_err) and str(err) == str(ref_err)
    assert sorted(dict(table.items()).items()) == sorted(ref_ptrs.items())
    assert got.snapshot_stats() == ref.snapshot_stats()
    assert sorted(got.live_blocks()) == sorted(ref.live_blocks())
    assert not got._engine.consistency_problems()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op_batches(), st.sampled_from([None, 96 * MiB]), st.sampled_from(["gpumem", "pytorch", "expandable"]))
def test_the_tables_log_is_the_pointer_each_allocation_got_in_order(batch, limit, policy):
    """Note [The pointers a run got] (op_table.h): while the table logs, run_ops leaves there the pointer of each
    allocation it completed, in order (0 for a zero-byte one), also up to an out-of-memory error; ``take_log``
    empties it, ``log_puts(False)`` stops and drops it."""
    ops, cuts = batch
    ref = _allocator(limit=limit, policy=policy)
    got = _allocator(limit=limit, policy=policy)
    want, ptrs = [], {}
    for k, i, n in ops:  # the loop's pointers, one per allocation completed
        try:
            if k == 0:
                ptrs[i] = ref.allocate(n, 0) if n else 0
                want.append(ptrs[i])
            elif p := ptrs.pop(i, 0):
                ref.free(p)
        except GpumemError:
            break
    table = PtrTable()
    table.log_puts(True)
    logged = []
    for lo, hi in zip([0, *cuts], [*cuts, len(ops)]):
        if hi <= lo:
            continue
        try:
            got._engine.run_ops(*_arrays(ops[lo:hi]), table)
        except GpumemError:
            break
        finally:
            logged += np.frombuffer(table.take_log(), np.uint64).tolist()
    assert logged == want
    assert table.take_log() == b""
    table.log_puts(False)
    table[10**9] = 1
    assert table.take_log() == b""


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op_batches(), st.sampled_from([None, 96 * MiB]), st.sampled_from(["gpumem", "pytorch", "expandable"]))
def test_stop_at_slow_stops_before_each_slow_allocation_and_changes_nothing_of_it(batch, limit, policy):
    """Note [Stopping before a slow allocation] (module.cpp): run_ops(..., stop_at_slow=True) returns the ops it
    completed, stopping only before an allocation that needs the full operation (a cache miss, or pages to map
    under a cached block; the allocator's state then is the loop's after those ops); that op sent on its own and
    the rest again with stop_at_slow end where the loop ends."""
    ops, _ = batch
    ref, got = _allocator(limit=limit, policy=policy), _allocator(limit=limit, policy=policy)
    ref_ptrs, table = {}, PtrTable()
    kinds, ids, sizes = _arrays(ops) if ops else (np.zeros(0, np.int8), np.zeros(0, np.int64), np.zeros(0, np.int64))
    q, stops, err = 0, 0, None
    while q < len(ops) and err is None:
        try:
            done = got._engine.run_ops(kinds[q:], ids[q:], sizes[q:], table, stop_at_slow=True)
        except GpumemError as exc:
            err, q = exc, q + table.last_ops_done + 1  # (not expected: errors come from the slow paths, not run here)
            break
        assert done == table.last_ops_done
        _loop(ref, ref_ptrs, kinds[q:q + done].tolist(), ids[q:q + done].tolist(), sizes[q:q + done].tolist())
        q += done
        assert _state(got, table) == _state(ref, ref_ptrs)
        if q == len(ops):
            break
        stops += 1
        assert kinds[q] == 0 and sizes[q] > 0  # only an allocation stops it
        before = ref.snapshot_stats()
        n, e = _loop(ref, ref_ptrs, [0], [int(ids[q])], [int(sizes[q])])
        after = ref.snapshot_stats()
        # one the fast path could not serve: a cache miss, or a cached block whose pages had to be mapped
        assert after.cache_misses > before.cache_misses or after.device_calls > before.device_calls or e is not None
        try:
            got._engine.run_ops(kinds[q:q + 1], ids[q:q + 1], sizes[q:q + 1], table)
        except GpumemError as exc:
            err = exc
        assert (err is None) == (e is None) and str(err) == str(e)
        q += 1
    event(f"stopped {stops if stops < 3 else '3 or more'} times")
    ref_done, ref_err = _loop(_allocator(limit=limit, policy=policy), {}, *zip(*ops)) if ops else (0, None)
    assert str(err) == str(ref_err) and (q if err is None else q - 1) == ref_done
    assert _state(got, table) == _state(ref, ref_ptrs)


def test_an_out_of_memory_error_mid_batch_stops_where_the_loop_stops():
    ops = [(0, i, 40 * MiB) for i in range(10)]  # a 256 MiB card, 32 MiB of it the context: the 6th fails
    ref, got = _allocator(), _allocator()
    ref_ptrs, table = {}, PtrTable()
    ref_done, ref_err = _loop(ref, ref_ptrs, *zip(*ops))
    with pytest.raises(OutOfMemoryError) as info:
        got._engine.run_ops(*_arrays(ops), table)
    assert 0 < ref_done < len(ops) and table.last_ops_done == ref_done
    assert str(info.value) == str(ref_err) and isinstance(ref_err, OutOfMemoryError)
    assert ref_done not in dict(table.items())  # the failed allocation keeps nothing
    assert _state(got, table) == _state(ref, ref_ptrs)
    # the next batch goes on from there, as the loop would
    more = [(1, 0, 0), (0, 99, 40 * MiB)]
    _loop(ref, ref_ptrs, *zip(*more))
    got._engine.run_ops(*_arrays(more), table)
    assert got.snapshot_stats() == ref.snapshot_stats() and dict(table.items()) == ref_ptrs


def test_errors_of_single_ops_are_those_of_allocate_and_free():
    ref, got = _allocator(), _allocator()
    ref_ptrs, table = {}, PtrTable()
    for t in (ref_ptrs, table):
        t[7] = 0x1234  # a pointer neither allocated
    ops = [(0, 1, 4096), (1, 7, 0), (0, 2, 512)]
    ref_done, ref_err = _loop(ref, ref_ptrs, *zip(*ops))
    with pytest.raises(InvalidPointerError) as info:
        got._engine.run_ops(*_arrays(ops), table)
    assert table.last_ops_done == ref_done == 1 and str(info.value) == str(ref_err)
    assert 7 not in table and dict(table.items()) == ref_ptrs  # the failed free's entry is gone, as in the loop
    # a negative request: allocate()'s own argument error
    ops = [(0, 3, 512), (0, 4, -5)]
    ref_done, ref_err = _loop(ref, ref_ptrs, *zip(*ops))
    with pytest.raises(InvalidArgumentError) as info:
        got._engine.run_ops(*_arrays(ops), table)
    assert table.last_ops_done == ref_done == 1 and str(info.value) == str(ref_err)
    assert got.snapshot_stats() == ref.snapshot_stats() and dict(table.items()) == ref_ptrs


def test_a_closed_device_is_refused_as_allocate_refuses_it():
    alloc = _allocator()
    table = PtrTable()
    alloc._engine.run_ops(*_arrays([(0, 0, 4096), (1, 0, 0)]), table)  # cached: a hit without a device call
    alloc.device.close()
    with pytest.raises(DeviceClosedError) as info:
        alloc._engine.run_ops(*_arrays([(0, 1, 4096)]), table)
    with pytest.raises(DeviceClosedError) as ref:
        alloc.allocate(4096)
    assert str(info.value) == str(ref.value) and table.last_ops_done == 0 and len(table) == 0


# -- bad input ------------------------------------------------------------------------------------------------

def _bad_inputs():
    k, i, n = _arrays([(0, 0, 4096), (0, 1, 8192), (1, 0, 0)])
    return [
        ("kinds", (k.astype(np.int64), i, n)),
        ("ids", (k, i.astype(np.int32), n)),
        ("nbytes", (k, i, n.astype(np.float64))),
        ("nbytes", (k, i, n.astype(np.uint32))),
        ("ids", (k, [0, 1, 0], n)),  # a list, not an array
        ("ids", (k, np.arange(6, dtype=np.int64)[::2], n)),  # not contiguous
        ("nbytes", (k, i, n.reshape(3, 1))),  # two dimensions
        ("one length", (k, i[:2], n)),
        ("one length", (k[:2], i[:2], n)),
        ("kind 2", (np.array([0, 2, 1], np.int8), i, n)),
        ("kind 255 ", (np.array([0, 255, 1], np.uint8), i, n)),   # uint8 kinds: the value given, not -1
        ("-2\\*\\*63", (k, np.array([0, -2**63, 0], np.int64), n)),
    ]


@pytest.mark.parametrize("what,args", _bad_inputs(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_is_refused_and_changes_nothing(what, args):
    alloc = _allocator()
    table = PtrTable()
    alloc._engine.run_ops(*_arrays([(0, 50, 1 * MiB), (0, 51, 512)]), table)
    before = _state(alloc, table)
    with pytest.raises(InvalidArgumentError, match=what):
        alloc._engine.run_ops(*args, table)
    assert _state(alloc, table) == before
    assert table.last_ops_done == 2   # the last batch that ran (the refused call ran none: as documented)


def test_a_table_that_is_not_a_ptr_table_is_refused():
    alloc = _allocator()
    with pytest.raises(InvalidArgumentError, match="PtrTable"):
        alloc._engine.run_ops(*_arrays([(0, 0, 4096)]), {})
    assert alloc.snapshot_stats().num_allocs == 0


def test_run_ops_from_inside_a_device_call_is_refused():
    alloc = _allocator()
    table = PtrTable()
    seen = []
    real = alloc.device.mem_create

    def mem_create(*a, **kw):
        with pytest.raises(InternalError, match="inside"):
            alloc._engine.run_ops(*_arrays([(0, 9, 4096)]), table)
        seen.append(True)
        return real(*a, **kw)

    alloc.device.mem_create = mem_create
    p = alloc.allocate(4 * MiB)
    assert seen and p and len(table) == 0


# -- what runs between ops -------------------------------------------------------------------------------------

def test_a_subscriber_that_calls_back_or_closes_the_device_sees_what_it_sees_with_the_loop():
    """Memory events reach subscribers after each slow path (device.deferred_events()), in the middle of a batch;
    a subscriber that allocates there, then closes the device, meets the same ops as with the loop, and the batch
    meets the closed device where the loop meets it."""
    ops = [(0, i, (i % 3 + 1) * 3 * MiB) for i in range(12)] + [(1, i, 0) for i in range(0, 12, 2)] + \
        [(0, 100 + i, 512 * (i + 1)) for i in range(8)]

    def watched():
        alloc = _allocator()
        seen, kept = [], []

        def on_event(event):
            seen.append((event.kind, event.nbytes, event.free_nbytes))
            if len(seen) == 4:
                kept.append(alloc.allocate(64 * KiB))  # re-enters the allocator between two ops
            if len(seen) == 9:
                alloc.device.close()

        for level in range(4 * MiB, 256 * MiB, 2 * MiB):  # an event at every 2 MiB the allocator takes or gives
            alloc.device.watch_free_level(level)
        alloc.device.subscribe(on_event)
        return alloc, seen, kept

    ref, ref_seen, ref_kept = watched()
    got, got_seen, got_kept = watched()
    ref_ptrs, table = {}, PtrTable()
    ref_done, ref_err = _loop(ref, ref_ptrs, *zip(*ops))
    with pytest.raises(DeviceClosedError) as info:
        got._engine.run_ops(*_arrays(ops), table)
    assert isinstance(ref_err, DeviceClosedError) and str(info.value) == str(ref_err) and 0 < ref_done < len(ops)
    assert table.last_ops_done == ref_done and got_seen == ref_seen and got_kept == ref_kept
    assert _state(got, table) == _state(ref, ref_ptrs)


def test_other_threads_may_use_the_allocator_while_batches_run():
    """No deadlock with a thread that allocates and frees meanwhile (each waits for the lock with the GIL given
    back, Note [Waiting for the engine's lock]); everything adds up at the end."""
    import threading

    alloc = _allocator(1024)
    table = PtrTable()
    stop, errors, other = threading.Event(), [], []

    def hammer():
        try:
            while not stop.is_set():
                p = alloc.allocate(3 * MiB if len(other) % 2 else 2 * KiB)
                other.append(p)
                alloc.free(p)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=hammer)
    t.start()
    try:
        rng = np.random.default_rng(3)
        for step in range(200):
            base = step * 50
            sizes = rng.choice([512, 8 * KiB, 1 * MiB + 512, 5 * MiB], 50).astype(np.int64)
            allocs = _arrays([(0, base + j, int(n)) for j, n in enumerate(sizes)])
            frees = _arrays([(1, base + j, 0) for j in range(50)])
            assert alloc._engine.run_ops(*allocs, table) == 50
            assert alloc._engine.run_ops(*frees, table) == 50
    finally:
        stop.set()
        t.join()
    assert not errors and other
    st = alloc.snapshot_stats()
    assert st.num_allocs == 200 * 50 + len(other) and st.allocated_nbytes == 0 and len(table) == 0
    assert not alloc._engine.consistency_problems()


def test_a_device_closed_by_another_thread_while_the_batch_waited_for_the_lock_stops_it_at_the_next_allocation():
    """The loop checks the device before each allocation; run_ops checks it before a run of fast paths, and when
    taking the lock for that run made it wait (other threads ran meanwhile) it runs one op only, then checks
    again: the allocation after the wait meets the closed device, as the loop's would."""
    import threading
    import time

    alloc = _allocator()
    for p in [alloc.allocate(512), alloc.allocate(512)]:
        alloc.free(p)  # two cached small blocks: the batch's allocations are cache hits (no device call)
    inside, outcome = threading.Event(), []
    real = alloc.device.mem_create

    def slow_mem_create(*a, **kw):  # called under the engine's lock by the other thread's allocation
        inside.set()
        time.sleep(0.3)  # the GIL is free: the batch takes its device check, then waits for the engine's lock
        alloc.device.close()
        return real(*a, **kw)

    alloc.device.mem_create = slow_mem_create

    def other():
        try:
            alloc.allocate(64 * MiB)
        except GpumemError as exc:
            outcome.append(exc)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(5)
    table = PtrTable()
    with pytest.raises(DeviceClosedError):
        alloc._engine.run_ops(*_arrays([(0, 0, 512), (0, 1, 512)]), table)
    t.join()
    assert outcome  # the other thread's allocation met the closed device
    assert table.last_ops_done == 1 and table[0] != 0 and 1 not in table


def test_arrays_written_by_python_mid_batch_do_not_change_the_batch():
    """A subscriber (Python run by a slow path, mid-batch) that writes the reserved id -2**63 and a bad kind into
    the caller's arrays: the batch runs the ops as they were at the call (before: the reserved id went into the
    table as its empty marker, len() lost count, and a free popped an empty slot's stale pointer, a double free)."""
    ops = [(0, i, 3 * MiB) for i in range(8)] + [(1, i, 0) for i in range(8)] + [(1, -5, 0), (1, -5, 0)]
    alloc = _allocator()
    kinds, ids, sizes = _arrays(ops)
    fired = []

    def on_event(event):
        if not fired:
            fired.append(event)
            ids[:] = -2**63
            kinds[-1] = 7
            sizes[:] = -1

    for level in range(4 * MiB, 256 * MiB, 2 * MiB):
        alloc.device.watch_free_level(level)
    alloc.device.subscribe(on_event)
    table = PtrTable()
    assert alloc._engine.run_ops(kinds, ids, sizes, table) == len(ops)
    assert fired and len(table) == 0 and table.items() == [] and alloc.live_blocks() == []
    assert table.last_ops_done == len(ops)
    alloc.check_consistency()
