"""FallbackBuffer: on the GPU, on the CPU when the GPU is full (fallback on), back when memory frees up."""

from __future__ import annotations

import numpy as np
import pytest

from gpumem.errors import InvalidArgumentError, InvalidPointerError, OutOfMemoryError
from gpumem.managers import FallbackBuffer, GpuMemoryManager, Location, MemoryConfig
from gpumem.units import MiB

# a small usable memory (~a tenth of a 2 GB card) keeps the copies small
CFG = MemoryConfig(gpu_memory_fraction=0.1, min_free_bytes=0).with_cpu_fallback(True)


@pytest.fixture(params=[True, False], ids=["pooled", "unpooled"])
def m(request):
    with GpuMemoryManager("sim:gtx-1050-2gb", enable_pooling=request.param, config=CFG) as mgr:
        yield mgr


def _payload(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_on_gpu_when_it_fits(m):
    data = _payload(MiB)
    with m.create_buffer(2 * MiB, data=data, tag="small") as buf:
        assert buf.on_gpu and buf.location is Location.GPU and buf.ptr is not None
        assert buf.read(0, MiB) == data.tobytes()
        assert m.get_detailed_stats().cpu_fallbacks == 0
    assert buf.freed and m.get_detailed_stats().allocated_nbytes == 0


def test_falls_back_and_moves_back_with_data(m):
    hog = m.allocate(m.usable_memory - 4 * MiB)
    data = _payload(8 * MiB, 1)
    buf = m.create_buffer(8 * MiB, data=data, tag="kv")
    assert not buf.on_gpu and buf.ptr is None
    st = m.get_detailed_stats()
    assert st.cpu_fallbacks == 1 and st.cpu_fallback_nbytes == 8 * MiB
    assert m.tracker.nbytes_at(Location.CPU) == 8 * MiB
    assert buf.read() == data.tobytes()
    buf.write(b"\xff" * 16, offset=100)
    expected = bytearray(data.tobytes())
    expected[100:116] = b"\xff" * 16

    assert buf.try_move_to_gpu() is False               # still no room: nothing changes
    assert not buf.on_gpu and buf.read() == bytes(expected)

    m.deallocate(hog)
    assert buf.try_move_to_gpu() is True and buf.on_gpu
    assert buf.read() == bytes(expected)                # the bytes made the trip
    st = m.get_detailed_stats()
    assert st.cpu_fallbacks == 1 and st.cpu_fallback_nbytes == 0
    assert m.tracker.nbytes_at(Location.CPU) == 0 and m.tracker.nbytes_at(Location.GPU) == 8 * MiB

    buf.move_to_cpu()                                   # an explicit move is not a fallback
    assert not buf.on_gpu and buf.read() == bytes(expected)
    assert m.get_detailed_stats().cpu_fallbacks == 1
    assert m.restore_fallbacks() == 1 and buf.on_gpu
    buf.free()
    buf.free()
    assert m.get_detailed_stats().allocated_nbytes == 0


def test_without_fallback_the_error_propagates():
    with GpuMemoryManager("sim:gtx-1050-2gb", config=CFG.with_cpu_fallback(False)) as m:
        hog = m.allocate(m.usable_memory)
        before = m.get_detailed_stats()
        with pytest.raises(OutOfMemoryError):
            FallbackBuffer(m, MiB)
        assert m.get_detailed_stats().cpu_fallbacks == before.cpu_fallbacks == 0
        buf = FallbackBuffer(m, MiB, allow_cpu=True)    # per-buffer override
        assert not buf.on_gpu and buf.to_numpy().sum() == 0   # zeros on the CPU
        buf.free()
        m.deallocate(hog)


@pytest.mark.parametrize("kwargs,match", [
    (dict(nbytes=0), "nbytes"), (dict(nbytes=1.5), "nbytes"), (dict(nbytes=4, data=b"12345"), "more than"),
    (dict(nbytes=4, data=object()), "bytes-like"), (dict(nbytes=4, allow_cpu="yes"), "allow_cpu"),
    (dict(nbytes=4, tag=5), "tag"),
])
def test_bad_arguments_change_nothing(m, kwargs, match):
    before = m.get_detailed_stats()
    with pytest.raises(InvalidArgumentError, match=match):
        FallbackBuffer(m, **kwargs)
    assert m.get_detailed_stats() == before


def test_bad_ranges_and_use_after_free(m):
    buf = m.create_buffer(64)
    for call in (lambda: buf.write(b"x" * 65), lambda: buf.write(b"x", offset=-1), lambda: buf.read(60, 10)):
        with pytest.raises(InvalidArgumentError):
            call()
    buf.free()
    for call in (buf.read, lambda: buf.write(b"x"), buf.try_move_to_gpu, buf.move_to_cpu):
        with pytest.raises(InvalidPointerError, match="FallbackBuffer was freed"):
            call()
    with pytest.raises(InvalidArgumentError, match="GpuMemoryManager"):
        FallbackBuffer("sim:t4-16gb", 4)


def test_manager_close_forgets_buffers():
    m = GpuMemoryManager("sim:gtx-1050-2gb", config=CFG)
    hog = m.allocate(m.usable_memory)
    buf = m.create_buffer(MiB)
    assert not buf.on_gpu and hog
    m.close()
    assert buf.freed
    buf.free()


def test_manager_close_frees_gpu_resident_buffers_too():
    # a buffer on the GPU kept its pointer after close(): a write reached memory the close gave back
    import gpumem
    dev = gpumem.open_device("sim:gtx-1050-2gb")
    m = GpuMemoryManager(dev, config=CFG)
    gpu_buf = m.create_buffer(MiB, data=b"A" * MiB)
    cpu_buf = FallbackBuffer(m, MiB, allow_cpu=True)
    assert gpu_buf.on_gpu
    m.close()
    assert gpu_buf.freed and cpu_buf.freed and not gpu_buf.on_gpu and gpu_buf.ptr is None
    m2 = GpuMemoryManager(dev, config=CFG)
    other = m2.allocate(MiB)
    dev.write(other.ptr, b"B" * 16)
    with pytest.raises(InvalidPointerError, match="was freed"):
        gpu_buf.write(b"CORRUPT!")
    with pytest.raises(InvalidPointerError, match="was freed"):
        gpu_buf.read(0, 8)
    assert dev.read(other.ptr, 16) == b"B" * 16
    gpu_buf.free()                                        # idempotent after close
    m2.deallocate(other)
    m2.close()
    dev.close()


def test_a_fallback_writes_no_forensics(tmp_path):
    with GpuMemoryManager("sim:gtx-1050-2gb", config=CFG.with_oom_forensics(tmp_path)) as m:
        hog = m.allocate(m.usable_memory)
        buf = m.create_buffer(MiB)
        assert not buf.on_gpu and not buf.try_move_to_gpu()
        assert list(tmp_path.iterdir()) == []
        with pytest.raises(OutOfMemoryError, match="OOM forensics"):
            FallbackBuffer(m, MiB, allow_cpu=False)      # no fallback: a real failure, with forensics
        assert len(list(tmp_path.iterdir())) == 2
        buf.free()
        m.deallocate(hog)


def test_fallback_round_trip_on_the_device(device):
    """On any device (a real GPU with --gpumem-device cuda:0): the bytes survive GPU -> CPU -> GPU."""
    mem = device.mem_info()
    fraction = min(1.0, (mem.used_nbytes + 256 * MiB) / mem.total_nbytes)
    cfg = MemoryConfig(gpu_memory_fraction=fraction, min_free_bytes=0).with_cpu_fallback(True)
    with GpuMemoryManager(device, config=cfg) as m:
        hog = m.allocate(m.usable_memory - 4 * MiB)
        data = _payload(8 * MiB, 7)
        buf = m.create_buffer(8 * MiB, data=data)
        assert not buf.on_gpu and m.get_detailed_stats().cpu_fallbacks == 1
        m.deallocate(hog)
        assert buf.try_move_to_gpu() and buf.read() == data.tobytes()
        buf.move_to_cpu()
        assert buf.to_numpy().tobytes() == data.tobytes()
        buf.free()


def test_a_fallback_the_host_cannot_hold_raises_gpumems_oom_naming_the_cpu(m, monkeypatch):
    """NumPy's bare MemoryError used to escape create_buffer(10**12, allow_cpu=True)."""
    import numpy as np

    from gpumem.managers import fallback as fb

    def no_host_memory(*a, **k):
        raise MemoryError("Unable to allocate")

    monkeypatch.setattr(fb.np, "zeros", no_host_memory)
    before = m.get_detailed_stats()
    with pytest.raises(OutOfMemoryError, match=r"cpu \(host memory, CPU fallback\).*GPU \(sim:") as info:
        m.create_buffer(10**12, allow_cpu=True)
    assert not isinstance(info.value, MemoryError) or isinstance(info.value, OutOfMemoryError)
    after = m.get_detailed_stats()
    assert (after.cpu_fallbacks, after.cpu_fallback_nbytes, after.allocated_nbytes) == \
        (before.cpu_fallbacks, before.cpu_fallback_nbytes, before.allocated_nbytes)
    assert np.zeros is not None


def test_a_fallback_moves_back_by_itself_when_memory_frees_up(m):
    """Note [Fallbacks move back by themselves]: issue 8's 'moves back when memory frees up', without
    the program calling try_move_to_gpu()."""
    hog = m.allocate(m.usable_memory - 4 * MiB)
    small_hog = m.allocate(2 * MiB)
    data = _payload(8 * MiB, 3)
    buf = m.create_buffer(8 * MiB, data=data)
    big = m.create_buffer(64 * MiB)
    assert not buf.on_gpu and not big.on_gpu
    m.deallocate(small_hog)                 # 2 MiB freed: headroom too small, nothing is tried
    assert not buf.on_gpu and not big.on_gpu
    m.deallocate(hog)                       # now there is room: both move back, bytes intact
    assert buf.on_gpu and big.on_gpu and buf.read() == data.tobytes()
    st = m.get_detailed_stats()
    assert st.cpu_fallbacks == 2 and st.cpu_fallback_nbytes == 0
    buf.move_to_cpu()                       # asked for: stays on the CPU through later frees
    other = m.allocate(1 * MiB)
    m.deallocate(other)
    m.empty_cache()
    assert not buf.on_gpu and buf.read() == data.tobytes()
    buf.free()
    big.free()


def test_empty_cache_moves_a_fallback_back(m):
    hog = m.allocate(m.usable_memory - 4 * MiB)
    buf = m.create_buffer(8 * MiB, data=b"z" * 8)
    assert not buf.on_gpu
    # hide the buffer from deallocate's move back, so that empty_cache's own move back is what is seen
    m._fell_back_saved = set(m._fell_back)
    m._fell_back.clear()
    m.deallocate(hog)
    assert not buf.on_gpu
    m._fell_back.update(m._fell_back_saved)
    m.empty_cache()
    assert buf.on_gpu and buf.read(0, 8) == b"z" * 8
    buf.free()
