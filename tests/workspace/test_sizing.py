"""calculate_gpu_workspace_size: each GPU class, each quantization type, each error, the invariants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpumem
from gpumem.device import DeviceProperties, MemInfo
from gpumem.errors import DeviceClosedError, DeviceLostError, InvalidArgumentError, OutOfMemoryError
from gpumem.sim import SimDevice, custom_profile
from gpumem.units import GiB, MiB
from gpumem.workspace import (ABSOLUTE_MAX_BATCH_SIZE, USABLE_FRACTION, GpuClass, InsufficientWorkspaceMemoryError,
                              QType, WorkspaceDeviceQueryError, calculate_gpu_workspace_size,
                              six_gb_rule_workspace_size, size_workspace)
from gpumem.workspace.sizing import reserve_nbytes_for


def _props(total_nbytes: int) -> DeviceProperties:
    return DeviceProperties(name="test", total_nbytes=total_nbytes, compute_capability=(8, 0),
                            multiprocessor_count=1, memory_bandwidth_gbps=1.0, unified_memory=False,
                            vmm_supported=True, granularity_nbytes=2 * MiB)


@pytest.mark.parametrize("profile, gpu_class, cap", [
    ("jetson-nano-2gb", GpuClass.SMALL, 64), ("gtx-1050-2gb", GpuClass.SMALL, 64),
    ("gtx-1650-4gb", GpuClass.MEDIUM, 128), ("jetson-nano-4gb", GpuClass.MEDIUM, 128),
    ("rtx-2060-6gb", GpuClass.MEDIUM, 128), ("rtx-3060-12gb", GpuClass.LARGE, 256), ("t4-16gb", GpuClass.LARGE, 256),
    ("l4-24gb", GpuClass.XLARGE, 512), ("rtx-4090-24gb", GpuClass.XLARGE, 512), ("h200-141gb", GpuClass.XLARGE, 512),
])
def test_each_gpu_class_caps_the_batch(profile, gpu_class, cap):
    ws = calculate_gpu_workspace_size(4096, 11008, "i2s", f"sim:{profile}")
    assert ws.gpu_class is gpu_class and ws.max_batch_size == cap
    assert ws.batch_size == cap  # a 7B-model layer is small beside every card: the cap binds
    assert ws.workspace_bytes == 4096 * 11008 * 2 + cap * 11008 * 4
    assert ws.device == f"sim:{profile}" and not ws.tiled


@pytest.mark.parametrize("total_gib, gpu_class", [
    (1.0, GpuClass.SMALL), (3.5, GpuClass.SMALL), (3.7, GpuClass.MEDIUM), (7.0, GpuClass.MEDIUM),
    (7.3, GpuClass.LARGE), (21.5, GpuClass.LARGE), (21.7, GpuClass.XLARGE), (1000, GpuClass.XLARGE)])
def test_class_boundaries_are_nominal_sizes_less_ten_percent(total_gib, gpu_class):
    assert GpuClass.of(int(total_gib * GiB)) is gpu_class


@pytest.mark.parametrize("qtype, dequant_bytes", [("i2s", 2), ("tl1", 2), ("tl2", 4), (QType.TL2, 4), ("I2S", 2)])
def test_each_qtype_dequantizes_to_its_width_with_fp32_intermediates(qtype, dequant_bytes):
    ws = calculate_gpu_workspace_size(1000, 3000, qtype, "sim:a100-80gb")
    assert ws.dequant_bytes == 1000 * 3000 * dequant_bytes
    assert ws.per_sample_bytes == 3000 * 4
    assert ws.workspace_bytes == ws.dequant_bytes + 512 * ws.per_sample_bytes


def test_memory_bound_batch_follows_the_formula():
    props, mem = _props(16 * GiB), MemInfo(2 * GiB, 16 * GiB)
    ws = size_workspace(8192, 28672, "tl2", props, mem, device="x", reserve_nbytes=256 * MiB)
    available = int((2 * GiB - 256 * MiB) * USABLE_FRACTION)
    assert ws.available_bytes == available
    assert ws.batch_size == min(256, (available - 8192 * 28672 * 4) // (28672 * 4))
    assert ws.workspace_bytes == ws.dequant_bytes + ws.batch_size * ws.per_sample_bytes <= available


def test_too_little_for_the_whole_matrix_gives_a_tiled_workspace_of_what_is_usable():
    props, mem = _props(2 * GiB), MemInfo(1 * GiB, 2 * GiB)
    ws = size_workspace(32768, 32768, "i2s", props, mem, device="x", reserve_nbytes=100 * MiB)
    assert ws.tiled and ws.batch_size == 1
    assert ws.workspace_bytes == ws.available_bytes == int((GiB - 100 * MiB) * USABLE_FRACTION)


def test_min_and_max_clamp():
    props, mem = _props(80 * GiB), MemInfo(70 * GiB, 80 * GiB)
    tiny = size_workspace(2, 2, "i2s", props, mem, device="x", reserve_nbytes=0)
    assert tiny.workspace_bytes == tiny.min_workspace_bytes == 1 * MiB
    capped = size_workspace(65536, 65536, "tl2", props, mem, device="x", reserve_nbytes=0,
                            max_workspace_nbytes=4 * GiB)
    assert capped.workspace_bytes == 4 * GiB


def test_caller_cap_and_absolute_maximum():
    props, mem = _props(141 * GiB), MemInfo(140 * GiB, 141 * GiB)
    assert size_workspace(64, 64, "i2s", props, mem, device="x", max_batch_size=10).batch_size == 10
    assert size_workspace(64, 64, "i2s", props, mem, device="x", max_batch_size=10**6).batch_size == 512
    assert ABSOLUTE_MAX_BATCH_SIZE >= 512


def test_insufficient_memory_names_required_available_and_device():
    dev = SimDevice(custom_profile("tiny-1gb", 1 * GiB, base="gtx-1050-2gb", context_nbytes=16 * MiB))
    try:
        with pytest.raises(InsufficientWorkspaceMemoryError) as err:
            calculate_gpu_workspace_size(1024, 1024, "i2s", dev, min_workspace_nbytes=2 * GiB)
        exc = err.value
        assert isinstance(exc, OutOfMemoryError)
        assert exc.required_nbytes == 2 * GiB and exc.device == "sim:tiny-1gb"
        assert 0 < exc.available_nbytes < GiB
        assert str(exc.required_nbytes) in str(exc) and str(exc.available_nbytes) in str(exc)
        assert "sim:tiny-1gb" in str(exc)
        assert dev.n_allocations == 0
    finally:
        dev.close()


def test_one_sample_must_fit():
    props, mem = _props(2 * GiB), MemInfo(1 * GiB, 2 * GiB)
    with pytest.raises(InsufficientWorkspaceMemoryError) as err:
        size_workspace(8, 2**30, "i2s", props, mem, device="x", reserve_nbytes=0)
    assert err.value.required_nbytes == 2**30 * 4


def test_a_closed_device_raises_the_query_error_from_the_device_error():
    dev = gpumem.open_device("sim:t4-16gb")
    dev.close()
    with pytest.raises(WorkspaceDeviceQueryError) as err:
        calculate_gpu_workspace_size(4096, 4096, "i2s", dev)
    assert isinstance(err.value.__cause__, DeviceClosedError) and err.value.device == "sim:t4-16gb"


def test_a_lost_device_raises_the_query_error():
    dev = gpumem.open_device("sim:t4-16gb?lost_at_s=0.001")
    try:
        dev.advance(0.002)
    except DeviceLostError:
        pass
    with pytest.raises(WorkspaceDeviceQueryError) as err:
        calculate_gpu_workspace_size(4096, 4096, "i2s", dev)
    assert isinstance(err.value.__cause__, DeviceLostError)
    dev.close()


@pytest.mark.parametrize("args, what", [
    ((0, 10, "i2s"), "in_features"), ((10, -1, "i2s"), "out_features"), ((10, 10, "q4"), "qtype"),
    ((True, 10, "i2s"), "in_features"), ((10.0, 10, "i2s"), "in_features"), ((10, 10, None), "qtype")])
def test_bad_arguments_raise_before_the_device_is_touched(args, what):
    dev = gpumem.open_device("sim:t4-16gb")
    before = (dev.mem_info(), dev.n_allocations)
    with pytest.raises(InvalidArgumentError, match=what):
        calculate_gpu_workspace_size(*args, dev)
    assert (dev.mem_info(), dev.n_allocations) == before
    dev.close()


@pytest.mark.parametrize("device", [None, 0.0, True, False, object(), b"sim:t4-16gb", [0]])
def test_a_bad_device_type_raises_invalid_argument(device):
    # found by review: a non-Device, non-spec device raised AttributeError from inside the sizing
    with pytest.raises(InvalidArgumentError, match="device must be"):
        calculate_gpu_workspace_size(4096, 11008, "i2s", device)


def test_an_int_device_is_a_cuda_index(monkeypatch):
    import gpumem.specs

    opened = []
    real_open = gpumem.specs.open_device

    def fake_open(spec):  # no GPU here: record the spec, size on a simulated card instead
        opened.append(spec)
        return real_open("sim:t4-16gb")

    monkeypatch.setattr(gpumem.specs, "open_device", fake_open)
    ws = calculate_gpu_workspace_size(4096, 11008, "i2s", 0)
    assert opened == ["cuda:0"] and ws.batch_size == 256
    with pytest.raises(InvalidArgumentError, match="CUDA device index"):
        calculate_gpu_workspace_size(4096, 11008, "i2s", -1)
    assert opened == ["cuda:0"]


def test_the_error_says_needs_not_tried_to_allocate():
    # found by review: a sizing allocates nothing, so "tried to allocate" was wrong
    props, mem = _props(2 * GiB), MemInfo(1 * GiB, 2 * GiB)
    with pytest.raises(InsufficientWorkspaceMemoryError) as err:
        size_workspace(8, 2**30, "i2s", props, mem, device="sim:x", reserve_nbytes=0)
    text = str(err.value)
    assert "tried to allocate" not in text
    assert text.startswith("out of memory on sim:x: a workspace needs at least 4.00 GiB (4294967296 bytes)")
    assert "one sample's intermediates" in text


def test_unknown_option_raises():
    with pytest.raises(InvalidArgumentError, match="unknown sizing option"):
        calculate_gpu_workspace_size(10, 10, "i2s", "sim:t4-16gb", reserve=1)


def test_bad_options_raise():
    props, mem = _props(2 * GiB), MemInfo(1 * GiB, 2 * GiB)
    for kwargs in ({"max_batch_size": 0}, {"reserve_nbytes": -1}, {"usable_fraction": 0.0},
                   {"usable_fraction": 1.5}, {"min_workspace_nbytes": 4 * MiB, "max_workspace_nbytes": 2 * MiB}):
        with pytest.raises(InvalidArgumentError):
            size_workspace(10, 10, "i2s", props, mem, device="x", **kwargs)


def test_the_reserve_comes_from_the_reserve_rule():
    dev = gpumem.open_device("sim:rtx-3060-12gb")
    ws = calculate_gpu_workspace_size(4096, 4096, "i2s", dev)
    assert ws.reserve_bytes == reserve_nbytes_for(dev.properties(), dev.mem_info())
    assert ws.available_bytes == int(max(0, ws.free_bytes - ws.reserve_bytes) * USABLE_FRACTION)
    dev.close()


def test_six_gb_rule_ignores_the_device():
    assert six_gb_rule_workspace_size(4096, 11008, "i2s") == (4096 * 11008 * 2 + 128 * 11008 * 4, 128)


@given(in_f=st.integers(1, 70000), out_f=st.integers(1, 70000), qtype=st.sampled_from(list(QType)),
       total=st.integers(1 * GiB, 150 * GiB), free_share=st.floats(0.0, 1.0), reserve=st.integers(0, 4 * GiB),
       cap=st.one_of(st.none(), st.integers(1, 4096)))
def test_invariants(in_f, out_f, qtype, total, free_share, reserve, cap):
    props, mem = _props(total), MemInfo(int(total * free_share), total)
    try:
        ws = size_workspace(in_f, out_f, qtype, props, mem, device="x", reserve_nbytes=reserve, max_batch_size=cap)
    except InsufficientWorkspaceMemoryError as exc:
        assert exc.available_nbytes < max(1 * MiB, out_f * 4) == exc.required_nbytes
        return
    assert ws.min_workspace_bytes <= ws.workspace_bytes <= ws.available_bytes <= max(0, mem.free_nbytes - reserve)
    assert ws.workspace_bytes <= ws.max_workspace_bytes
    assert 1 <= ws.batch_size <= min(ws.gpu_class.max_batch_size, ABSOLUTE_MAX_BATCH_SIZE, cap or 10**9)
    _assert_holds_its_batch(ws)


def _assert_holds_its_batch(ws) -> None:
    """Note [The batch a workspace holds]: the batch reported is what the workspace holds."""
    if ws.tiled:
        assert ws.batch_size == 1 and ws.per_sample_bytes <= ws.workspace_bytes < ws.dequant_bytes + ws.per_sample_bytes
    else:
        assert ws.workspace_bytes >= ws.dequant_bytes + ws.batch_size * ws.per_sample_bytes


@given(in_f=st.integers(1, 200000), out_f=st.integers(1, 200000), qtype=st.sampled_from(list(QType)),
       total=st.integers(1 * GiB, 150 * GiB), free_share=st.floats(0.0, 1.0), reserve=st.integers(0, 4 * GiB),
       cap=st.one_of(st.none(), st.integers(1, 4096)),
       max_ws=st.one_of(st.none(), st.integers(1 * MiB, 80 * GiB)))
def test_the_batch_is_what_the_clamped_workspace_holds(in_f, out_f, qtype, total, free_share, reserve, cap, max_ws):
    """Found by review: the batch was computed before the clamp to MAX_WORKSPACE_NBYTES, so a 64 GiB
    (clamped, tiled) workspace reported a batch of 512."""
    props, mem = _props(total), MemInfo(int(total * free_share), total)
    options = {} if max_ws is None else {"max_workspace_nbytes": max_ws}
    try:
        ws = size_workspace(in_f, out_f, qtype, props, mem, device="x", reserve_nbytes=reserve, max_batch_size=cap,
                            **options)
    except InsufficientWorkspaceMemoryError:
        return
    _assert_holds_its_batch(ws)


def test_the_maximum_clamp_recomputes_the_batch():
    # the review's case: a 150000 x 150000 TL2 layer (90 GB dequantized) on an H200
    ws = calculate_gpu_workspace_size(150000, 150000, "tl2", "sim:h200-141gb")
    assert ws.workspace_bytes == ws.max_workspace_bytes == 64 * GiB
    assert ws.tiled and ws.batch_size == 1
    # clamped but not tiled: the batch is what is left after the dequantized matrix
    props, mem = _props(80 * GiB), MemInfo(70 * GiB, 80 * GiB)
    ws = size_workspace(4096, 11008, "i2s", props, mem, device="x", reserve_nbytes=0,
                        max_workspace_nbytes=4096 * 11008 * 2 + 100 * 11008 * 4 + 5)
    assert not ws.tiled and ws.batch_size == 100


def test_workspace_and_sizing_share_the_batch_rule():
    from gpumem.workspace.sizing import batch_for_workspace
    from gpumem.workspace.workspace import Workspace

    props, mem = _props(80 * GiB), MemInfo(70 * GiB, 80 * GiB)
    full = size_workspace(4096, 11008, "i2s", props, mem, device="x", reserve_nbytes=0)
    for nbytes in (full.workspace_bytes // 2, full.dequant_bytes + 3 * full.per_sample_bytes, full.dequant_bytes,
                   1 * MiB):
        cut = Workspace._shrunk(full, nbytes)
        assert cut.batch_size == batch_for_workspace(nbytes, full.dequant_bytes, full.per_sample_bytes,
                                                     full.max_batch_size)
        _assert_holds_its_batch(cut)
