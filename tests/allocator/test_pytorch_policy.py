"""The ``pytorch`` policy: a model of PyTorch's default CUDACachingAllocator (Note [Segments top-down])."""

import pytest

from gpumem import open_device
from gpumem.allocator import CachingAllocator
from gpumem.allocator.block import FreeList, TopDownFreeList
from gpumem.allocator.policy import get_policy
from gpumem.replay import replay_trace
from gpumem.units import MiB

TRACES = "data/traces"


@pytest.fixture
def alloc():
    dev = open_device("sim:h200-141gb")
    a = CachingAllocator(dev, "pytorch", engine="python")
    yield a
    a.close()
    dev.close()


def test_pytorch_orders_segments_top_down():
    assert get_policy("pytorch").segments_top_down
    assert not any(get_policy(n).segments_top_down for n in ("gpumem", "bestfit", "cupy", "expandable"))


def test_equal_free_blocks_go_to_the_newest_segment_first(alloc):
    old = alloc.allocate(40 * MiB)   # a 40 MiB segment
    new = alloc.allocate(40 * MiB)   # another, at a higher simulated address
    assert new > old
    alloc.free(old)
    alloc.free(new)
    # PyTorch takes the lowest address, and cudaMalloc places new segments below old ones
    assert alloc.allocate(40 * MiB) == new
    assert alloc.allocate(40 * MiB) == old
    assert all(isinstance(fl, TopDownFreeList) for fl in alloc._engine._free_lists.values())
    alloc.check_consistency()


def test_inside_a_segment_the_lowest_offset_first(alloc):
    ptrs = [alloc.allocate(4 * MiB) for _ in range(4)]   # one 20 MiB segment, tiled from its base
    assert ptrs == sorted(ptrs)
    alloc.free(ptrs[2])
    alloc.free(ptrs[0])
    assert alloc.allocate(4 * MiB) == ptrs[0]
    alloc.check_consistency()


def test_other_segment_policies_keep_address_order():
    dev = open_device("sim:h200-141gb")
    a = CachingAllocator(dev, "bestfit", engine="python")
    try:
        old, new = a.allocate(40 * MiB), a.allocate(40 * MiB)
        a.free(old)
        a.free(new)
        assert a.allocate(40 * MiB) == min(old, new)
        assert all(type(fl) is FreeList for fl in a._engine._free_lists.values())
    finally:
        a.close()
        dev.close()


@pytest.mark.slow
@pytest.mark.parametrize("trace, measured", [
    # reports/anchors.md: PyTorch's default allocator on the H200
    ("gpt2_train.snapshot.pickle.gz", 0.181),
    ("resnet_train.snapshot.pickle.gz", 0.453),
    ("bert_varlen.trace.pickle.gz", 0.243),
    ("llama_generate.trace.pickle.gz", 0.200),   # 12.8 % before Note [Segments top-down]
])
def test_overhead_matches_pytorch_measured_on_the_h200(trace, measured):
    r = replay_trace(f"{TRACES}/{trace}", "sim:h200-141gb", policy="pytorch", progress=False)
    assert r.ooms == 0
    assert abs(r.overhead - measured) < 0.001


def test_replays_a_real_7b_generate_segment_for_segment():
    """``data/generate_7b_b16_p4096_n8.snapshot.pickle.gz``: PyTorch 2.11 on the H200, ``benchmarks/hf_memory.py
    --models llama-7b --no-train --quick --trace-big`` (generate() of the multi-head 7B at batch 16 x prompt 4096,
    8 new tokens: 1376 MiB MLP tensors, 512 MiB cache tensors grown by ``torch.cat``), recorded after the weights
    were loaded. The model makes the same 76 segments as PyTorch's ``segment_alloc`` entries, the large ones in the same order."""
    from gpumem.trace import load_trace
    from gpumem.trace.pytorch import load_snapshot_dict

    path = "tests/allocator/data/generate_7b_b16_p4096_n8.snapshot.pickle.gz"
    real = [e["size"] for e in load_snapshot_dict(path)["device_traces"][0] if e["action"] == "segment_alloc"]
    trace = load_trace(path)
    dev = open_device("sim:h200-141gb")
    a = CachingAllocator(dev, "pytorch", engine="python")
    made = []
    new_segment = a.backing.new_segment

    def spy(small, stream, nbytes):
        seg = new_segment(small, stream, nbytes)
        made.append(seg.nbytes)
        return seg

    a.backing.new_segment = spy
    try:
        ptrs = {}
        for kind, i, n in zip(trace.kinds, trace.alloc_ids, trace.nbytes):
            if kind == 0:
                ptrs[i] = a.allocate(int(n))
            else:
                a.free(ptrs.pop(i))
        # the large segments in the same order; one small (2 MiB) one earlier than PyTorch's, which had room
        # left in a small segment made before recording began (not in the trace's operations)
        assert [n for n in made if n > 2 * MiB] == [n for n in real if n > 2 * MiB]
        assert sorted(made) == sorted(real) and len(real) == 76
        assert a.stats.peak_reserved_nbytes == sum(real)  # 62.79 GiB, beside the 12.58 GiB held before recording
    finally:
        a.close()
        dev.close()


def test_synthetic_7b_generate_makes_the_recorded_segments():
    """``gpumem.estimate.inference_trace`` of the same 7B run follows the recording's order (Note [Prefill] in
    ``gpumem/estimate/workload.py``): after the weights, the cuBLAS workspace and the bookkeeping buffers it makes
    the 73 large segments of ``data/generate_7b_b16_p4096_n8.snapshot.pickle.gz`` in the same order."""
    from gpumem.estimate.shape import ModelShape
    from gpumem.estimate.workload import inference_trace
    from gpumem.trace.pytorch import load_snapshot_dict

    path = "tests/allocator/data/generate_7b_b16_p4096_n8.snapshot.pickle.gz"
    real = [e["size"] for e in load_snapshot_dict(path)["device_traces"][0]
            if e["action"] == "segment_alloc" and e["size"] > 2 * MiB]
    trace = inference_trace(ModelShape(4096, 11008, 32, 32000, 32, 32), 2, batch_size=16, prompt_len=4096,
                            new_tokens=8).trace
    dev = open_device("sim:h200-141gb")
    a = CachingAllocator(dev, "pytorch", engine="python")
    made = []
    new_segment = a.backing.new_segment

    def spy(small, stream, nbytes):
        seg = new_segment(small, stream, nbytes)
        made.append(seg.nbytes)
        return seg

    a.backing.new_segment = spy
    try:
        ptrs = {}
        for kind, i, n in zip(trace.kinds, trace.alloc_ids, trace.nbytes):
            if kind == 0:
                ptrs[i] = a.allocate(int(n))
            else:
                a.free(ptrs.pop(i))
        large = [n for n in made if n > 2 * MiB]
        assert len(real) == 73 and large[-len(real):] == real
        assert large[-len(real) - 3:-len(real)] == [250 * MiB, 12 * MiB, 32 * MiB]  # embedding, misc, cuBLAS
    finally:
        a.close()
        dev.close()
