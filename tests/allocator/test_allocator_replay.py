"""Replaying traces through the caching allocator: synthetic traces, prefixes of the real ones
(``data/traces``, shipped with the project) and, marked slow,
whole real traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpumem import sim
from gpumem import open_device
from gpumem.allocator import CachingAllocator
from gpumem.allocator.policy import get_policy
from gpumem.replay import ReplayResult, replay, replay_trace
from gpumem.trace import Trace, load_trace
from gpumem.units import GiB, KiB, MiB

from allocator_helpers import check_structure, small_device

ALL_POLICIES = ["gpumem", "bestfit", "pytorch", "cupy"]
REPO = Path(__file__).resolve().parents[2]
TRACE_DIRS = [REPO / "data" / "traces"]  # the real traces ship with the project
JSON_KEYS = {"trace", "device", "policy", "n_ops", "n_allocs", "peak_live_bytes", "peak_reserved_bytes", "overhead",
             "ooms", "wall_s", "ns_per_op"}


def real_trace_path(name: str) -> Path:
    for d in TRACE_DIRS:
        if (d / name).is_file():
            return d / name
    pytest.fail(f"real trace {name} not found in {', '.join(map(str, TRACE_DIRS))}")


_cache: dict[str, Trace] = {}


def real_trace(name: str) -> Trace:
    if name not in _cache:
        _cache[name] = load_trace(real_trace_path(name))
    return _cache[name]


def synthetic_trace(name: str = "synthetic") -> Trace:
    """Two streams, sizes from 1 B to 40 MiB, frees out of order, a few allocations never freed."""
    sizes = [1, 512, 513, 4 * KiB, 300 * KiB, 1 * MiB, 1 * MiB + 1, 3 * MiB, 11 * MiB + 1, 40 * MiB]
    ops = []
    live: list[int] = []
    aid = 0
    t = 0.0
    for step in range(120):
        n = sizes[(step * 7) % len(sizes)]
        ops.append((0, aid, n, step % 2, t, 0x10000 + aid * 0x1000))
        live.append(aid)
        aid += 1
        t += 1.0
        if step % 3 == 2:
            for victim in (live.pop(0), live.pop(-2)):
                ops.append((1, victim, ops_size(ops, victim), 0, t, 0x10000 + victim * 0x1000))
                t += 1.0
    return Trace.from_ops(name, "gpumem", ops)


def ops_size(ops, alloc_id):
    return next(o[2] for o in ops if o[0] == 0 and o[1] == alloc_id)


def check_result(result: ReplayResult, trace: Trace, policy: str) -> None:
    assert result.ooms == 0 and result.oom_message is None
    assert result.n_ops == result.completed_ops == trace.n_ops
    assert result.n_allocs == trace.n_allocs
    assert result.peak_live_bytes == trace.peak_live_nbytes
    assert result.peak_reserved_bytes >= result.peak_live_bytes
    assert result.overhead >= 0.0
    assert result.policy == policy
    assert result.wall_s >= 0 and result.ns_per_op >= 0
    out = result.as_json()
    assert JSON_KEYS <= set(out)
    assert "oom" not in out
    json.dumps(out)  # serialisable
    assert out["peak_live_bytes"] == trace.peak_live_nbytes
    assert out["overhead"] == result.overhead


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_replay_synthetic_trace(policy):
    trace = synthetic_trace()
    result = replay_trace(trace, "sim:t4-16gb", policy, progress=False)
    check_result(result, trace, policy)
    assert result.device == "sim:t4-16gb"
    assert result.trace == "synthetic"
    assert result.sim_time_s is not None and result.sim_time_s > 0
    st = result.stats
    assert st.num_allocs == trace.n_allocs and st.num_frees == trace.n_frees


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_replay_keeps_the_allocator_state(policy):
    trace = synthetic_trace()
    dev = small_device(384)
    alloc = CachingAllocator(dev, policy)
    result = replay(trace, alloc, progress=False)
    assert result.ooms == 0
    assert len(alloc.live_blocks()) == trace.n_live_at_end
    assert alloc.snapshot_stats().requested_nbytes == int(trace.live_nbytes()[-1]) == sum(live_request_sizes(trace))
    assert sum(n for _, n in alloc.live_blocks()) == alloc.allocated_nbytes
    check_structure(alloc)


def test_replay_trace_leaves_a_given_device_open():
    dev = small_device(384)
    result = replay_trace(synthetic_trace(), dev, "gpumem", progress=False)
    assert result.ooms == 0
    assert dev.process_used_nbytes == 0  # the allocator was closed ...
    dev.mem_info()  # ... the device was not


def test_replay_with_pressure_in_the_spec():
    trace = synthetic_trace()
    result = replay_trace(trace, "sim:t4-16gb?pressure=spikes&seed=3", "gpumem", progress=False)
    check_result(result, trace, "gpumem")


def test_replay_skips_zero_byte_allocations():
    ops = [(0, 0, 100, 0, 0.0, 0x1000), (0, 1, 0, 0, 1.0, 0x2000), (0, 2, 5000, 0, 2.0, 0x3000),
           (1, 1, 0, 0, 3.0, 0x2000), (1, 0, 100, 0, 4.0, 0x1000)]
    trace = Trace.from_ops("zero", "gpumem", ops)
    for policy in ALL_POLICIES:
        result = replay_trace(trace, "sim:t4-16gb", policy, progress=False)
        check_result(result, trace, policy)
        assert result.stats.num_allocs == 2


def test_replay_empty_trace():
    result = replay_trace(Trace.empty(), "sim:t4-16gb", progress=False)
    assert result.n_ops == result.completed_ops == 0
    assert result.peak_live_bytes == result.peak_reserved_bytes == 0
    assert result.overhead == 0.0 and result.ns_per_op == 0.0


def oversized_trace() -> Trace:
    """1.2 GiB live at once: more than a 1 GiB card holds."""
    ops = [(0, i, 400 * MiB, 0, float(i), 0x1000_0000 * (i + 1)) for i in range(3)]
    ops += [(1, i, 400 * MiB, 0, 10.0 + i, 0x1000_0000 * (i + 1)) for i in range(3)]
    return Trace.from_ops("too-big", "gpumem", ops)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_a_trace_that_does_not_fit_stops_at_the_first_oom(policy):
    trace = oversized_trace()
    dev = sim.SimDevice(sim.custom_profile("card-1gb", 1 * GiB, context_nbytes=64 * MiB))
    result = replay_trace(trace, dev, policy, progress=False)
    assert result.ooms == 1
    assert result.completed_ops < result.n_ops
    assert result.oom_message and "out of memory" in result.oom_message
    assert "(419430400 bytes)" in result.oom_message
    out = result.as_json()
    assert out["ooms"] == 1 and out["oom"] == result.oom_message
    assert result.peak_live_bytes == 800 * MiB  # the two that fitted
    assert dev.process_used_nbytes == 0


def test_stop_on_oom_false_skips_the_failed_allocation_and_its_free():
    trace = oversized_trace()
    dev = sim.SimDevice(sim.custom_profile("card-1gb", 1 * GiB, context_nbytes=64 * MiB))
    result = replay_trace(trace, dev, "bestfit", stop_on_oom=False, progress=False)
    assert result.ooms == 1
    assert result.completed_ops == result.n_ops
    assert result.stats.num_allocs == 2 and result.stats.num_frees == 2


def test_a_limit_makes_the_replay_stop():
    trace = synthetic_trace()
    result = replay_trace(trace, "sim:t4-16gb", "gpumem", limit=16 * MiB, progress=False)
    assert result.ooms == 1
    assert "limit" in result.oom_message


# -- real traces ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("name", ["resnet_train.snapshot.pickle.gz", "gpt2_train.snapshot.pickle.gz"])
def test_replay_real_trace_prefix(name, policy):
    trace = real_trace(name).head(5000)
    result = replay_trace(trace, "sim:h200-141gb", policy, progress=False)
    check_result(result, trace, policy)


def live_request_sizes(trace: Trace) -> list[int]:
    """Requested sizes of the allocations a trace never frees."""
    freed = np.zeros(trace.n_allocs, dtype=bool)
    freed[trace.alloc_ids[trace.kinds == 1]] = True
    return trace.nbytes[trace.kinds == 0][~freed].tolist()


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_invariants_hold_after_a_real_trace_prefix(policy):
    trace = real_trace("resnet_train.snapshot.pickle.gz").head(5000)
    dev = open_device("sim:h200-141gb")
    alloc = CachingAllocator(dev, policy)
    replay(trace, alloc, progress=False)
    live = live_request_sizes(trace)
    blocks = sorted(alloc.live_blocks())
    assert len(blocks) == len(live)
    for (a, na), (b, _) in zip(blocks, blocks[1:]):
        assert a + na <= b
    st = alloc.snapshot_stats()
    assert st.requested_nbytes == sum(live)
    assert st.allocated_nbytes == sum(n for _, n in blocks) >= sum(live)
    assert st.reserved_nbytes == alloc.backing.reserved_nbytes >= st.allocated_nbytes
    if policy != "cupy":
        assert dev.process_used_nbytes == st.reserved_nbytes
    dev.check_invariants()
    check_structure(alloc)
    alloc.close()
    assert dev.process_used_nbytes == 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("name", ["resnet_train.snapshot.pickle.gz", "gpt2_train.snapshot.pickle.gz",
                                  "resnet_train.rmm_log.csv.gz", "bert_varlen.trace.pickle.gz"])
def test_replay_whole_real_trace(name, policy):
    trace = real_trace(name)
    result = replay_trace(trace, "sim:h200-141gb", policy, progress=False)
    check_result(result, trace, policy)
    if policy == "gpumem":
        # pages follow live data: with the GPU idle, what it holds at its peak is within 1% of the program's
        # peak; with the GPU behind (the default timing) busy idle chunks may be grown past within busy_slack
        idle = replay_trace(trace, "sim:h200-141gb", policy, progress=False, gpu_timing="idle")
        assert idle.overhead < 0.01
        slack = get_policy(policy)
        assert result.overhead < 0.01 + slack.page_slack + slack.busy_slack


@pytest.mark.slow
def test_the_smallest_card_cannot_hold_gpt2():
    trace = real_trace("gpt2_train.snapshot.pickle.gz")
    assert trace.peak_live_nbytes > 2 * GiB
    result = replay_trace(trace, "sim:jetson-nano-2gb", "gpumem", progress=False)
    assert result.ooms == 1 and "out of memory" in result.oom_message


def test_a_replay_on_a_counting_sanitizer_says_the_hazards_it_saw():
    """``sanitizer=count`` records hazards instead of raising: the replay reports those of its own run (attacker
    review of 2026-12-04: the command line showed none of them), none where the sanitizer raises."""
    from gpumem.sim.device import Hazard

    trace = real_trace("multistream_infer_h200.snapshot.pickle.gz")
    dev = open_device("sim:h200-141gb?sanitizer=count")
    dev.hazards.append(Hazard(0.0, "alias", 1, 0, 1, "before", "made before the replay"))
    result = replay_trace(trace, dev)
    assert result.extra["sanitizer_hazards"] == {} and result.as_json()["sanitizer_hazards"] == {}
    dev.close()
    assert "sanitizer_hazards" not in replay_trace(trace, "sim:h200-141gb").extra
