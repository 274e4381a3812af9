"""``wait_own_stream`` (Note [Wait for the program's own stream] in gpumem/allocator/backing.py) in both engines:
random programs on four streams with the GPU behind (kernels on a block's streams, ``record_stream``), limits,
faults on the calls the rule makes, step marks and the warm-up; the Python and the native engine must make the
same device calls, reach the same stats, steals and waits, raise the same errors, and never unmap memory queued
work still touches. The random machine of test_native_differential.py seldom reaches the rule (its slack and its
chunks rarely leave a busy chunk to wait for), so this one is built to (review attacker 30, F2)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from gpumem import sim
from gpumem.allocator import backing
from gpumem.allocator.policy import get_policy
from gpumem.units import KiB, MiB

from allocator_helpers import small_profile
from test_allocator_streams import _stats
from test_native_differential import Pair

# the steal before a warm-up (on by default) off: these programs never mark, and under it the stream-ordered steal
# would take the chunks the wait-own rule is about (Note [The ordered steal before a warm-up])
_BASE = dataclasses.replace(get_policy("gpumem"), steal_before_warmup=False)
_STREAMS = (0, 0, 3, 5)
_SIZES = (700, 300 * KiB, 1 * MiB + 1, 2 * MiB, 3 * MiB, 5 * MiB, 9 * MiB)
_FAULTED = ("event_synchronize", "mem_unmap", "mem_map", "event_query", "event_record", "mem_create")


def _run(seed: int) -> None:
    rng = random.Random(seed)
    policy = dataclasses.replace(
        _BASE, name="wait-own-random", wait_own_stream=True, page_slack=rng.choice([0.0, 0.05]),
        page_slack_min_nbytes=0, busy_slack=rng.choice([0.0, 0.05, 0.5, float("inf")]),
        stream_ordered_steal=rng.random() < 0.3, chunk_max_fraction=rng.choice([1 / 64, 1 / 16, 1.0]),
        chunk_max_nbytes=rng.choice([2, 4, 16]) * MiB, plan_warmup=rng.random() < 0.5)
    rate = rng.choice([0.0, 0.0, 0.03, 0.1])
    faults = sim.FaultPlan(call_failure_rates={c: rate for c in _FAULTED}) if rate else sim.FaultPlan()
    pair = Pair(lambda: sim.SimDevice(small_profile(384), faults=faults, seed=seed), policy=policy,
                limit=rng.choice([None, 48 * MiB, 96 * MiB]))
    live: dict[int, int] = {}  # pointer -> its stream
    for _ in range(rng.randrange(50, 200)):
        r = rng.random()
        if r < 0.4 or not live:
            stream = rng.choice(_STREAMS)
            out = pair.both("allocate", rng.choice(_SIZES), stream)
            if out[0] == "ok":
                ptr = out[1]
                live[ptr] = stream
                if rng.random() < 0.8:   # a kernel on the block's stream reads it
                    size = pair.allocs[0].block_size(ptr)
                    duration_s = rng.choice([1e-3, 1e-2, 5e-2])
                    pair.on_devices(lambda d: d.launch(stream, duration_s, touches=[(ptr, size)]))
                    pair.compare("launch")
        elif r < 0.75:
            ptr = rng.choice(list(live))
            if rng.random() < 0.3:   # used on another stream too, as record_stream tells the allocator
                other = rng.choice(_STREAMS)
                pair.both("record_stream", ptr, other)
                duration_s = rng.choice([1e-3, 5e-2])
                pair.on_devices(lambda d: d.launch(other, duration_s, touches=[(ptr, 4096)]))
                pair.compare("launch")
            if pair.both("free", ptr)[0] == "ok":
                del live[ptr]
        elif r < 0.8:
            advance_s = rng.choice([1e-3, 1e-2])
            pair.on_devices(lambda d: d.advance(advance_s))
            pair.compare("advance")
        elif r < 0.83:
            pair.both("empty_cache")
        elif r < 0.87:
            pair.both("mark_step")
        elif r < 0.88:
            pair.both("start_plan_warmup")
        elif r < 0.9:
            pair.both("synchronize")
        py, nat = (_stats(alloc) for alloc in pair.allocs)
        assert (py["n_steals"], py["n_waits"]) == (nat["n_steals"], nat["n_waits"])
        assert not pair.devs[0].hazards and not pair.devs[1].hazards
        pair.both("check_consistency")
    for ptr in list(live):
        pair.both("free", ptr)
    pair.both("empty_cache")
    pair.both("check_consistency")
    pair.both("close")


@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_both_engines_wait_for_the_own_stream_alike_on_random_programs(monkeypatch):
    """Sixty random programs (seeds 0-59): every op compared as above; and the rule did wait and steal in
    them (else the test would prove nothing about it)."""
    taken = []
    chunk_of_stream = backing.VirtualBacking._chunk_of_stream

    def counted(self, *args):
        found = chunk_of_stream(self, *args)
        if found is not None and not self.knobs.stream_ordered_steal:   # only the rule's call: see _steal_chunk
            taken.append(found[1])
        return found

    monkeypatch.setattr(backing.VirtualBacking, "_chunk_of_stream", counted)
    for seed in range(60):
        _run(seed)
    assert len(taken) >= 20


@pytest.mark.parametrize("wait_own_stream", [False, True])
def test_chunks_busy_on_another_stream_are_queried_once_per_pass(wait_own_stream):
    """300 idle chunks still read by a kernel on stream 5, then allocations on stream 0 that each need a chunk:
    the rule looks at every one of them, and queried each (301 event queries per allocation where the steal
    without it made 1: attacker 30, F1). Fences complete in order, so a fence of stream 5 found pending stands
    for every later one in the pass (``_fence_done``); both engines make the same calls."""
    policy = dataclasses.replace(_BASE, name="many-busy", wait_own_stream=wait_own_stream, page_slack=0.0,
                                 page_slack_min_nbytes=0, busy_slack=float("inf"), chunk_max_fraction=1 / 1024,
                                 chunk_max_nbytes=2 * MiB)
    pair = Pair(lambda: sim.SimDevice(sim.get_profile("h200-141gb")), policy=policy)
    ptrs = [pair.both("allocate", 2 * MiB, 5)[1] for _ in range(300)]
    for ptr in ptrs:
        pair.on_devices(lambda d: d.launch(5, 10.0, touches=[(ptr, 4096)]))
    pair.compare("launch")
    for ptr in ptrs:
        pair.both("free", ptr)
    for _ in range(20):
        for log in pair.logs:
            log.take()
        for alloc in pair.allocs:
            alloc.allocate(2 * MiB, 0)
        calls = [log.take() for log in pair.logs]
        assert calls[0] == calls[1]
        assert sum(1 for c in calls[0] if c[0] == "event_query") <= 1
    pair.both("close")
