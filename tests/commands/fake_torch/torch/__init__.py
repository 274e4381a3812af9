"""A fake ``torch`` for gpumem record's tests on machines without PyTorch or a GPU.

It has what gpumem.recording uses (``cuda.is_available``, ``cuda.memory._record_memory_history``,
``_snapshot``, ``_C._cuda_attach_out_of_memory_observer``, ``OutOfMemoryError``,
``cuda.get_device_properties``) and a fake allocator for the test programs: ``torch.cuda.fake_alloc(nbytes)``
returns an address, ``torch.cuda.fake_free(addr)`` gives it back; past ``FAKE_TORCH_CAPACITY`` bytes
(default 1 MiB) an allocation calls the OOM observers, then raises ``OutOfMemoryError``.
``FAKE_TORCH_CUDA=0`` makes ``cuda.is_available()`` False. The snapshot is made with gpumem's own
exporter (with one Python frame per allocation: the caller of ``fake_alloc``), so it is a real one.
"""

import os
import sys
import types

__version__ = "0.0-fake"


class OutOfMemoryError(RuntimeError):
    pass


class _State:
    def __init__(self):
        self.capacity = int(os.environ.get("FAKE_TORCH_CAPACITY", str(1 << 20)))
        self.live = {}            # addr -> (nbytes, frame)
        self.next_addr = 1 << 32
        self.history = None       # None: off; else list of (code, addr, nbytes, time_us, frame)
        self.history_calls = []
        self.observers = []
        self.t = 0.0


_state = _State()


def _record_memory_history(enabled="all", context="all", stacks="all", max_entries=sys.maxsize, **kw):
    _state.history_calls.append({"enabled": enabled, "context": context, "stacks": stacks,
                                 "max_entries": max_entries})
    _state.history = None if enabled is None else []


def _snapshot():
    from gpumem.trace.pytorch_export import to_pytorch_snapshot
    from gpumem.trace.recorder import TraceRecorder

    rec = TraceRecorder()
    frames = []
    for code, addr, nbytes, t, frame in _state.history or ():
        if code == 0:
            rec.record_alloc(addr, nbytes, 0, t)
            frames.append([frame])
        else:
            rec.record_free(addr, 0, t)
    trace = rec.to_trace("fake")
    snap = to_pytorch_snapshot(trace, frames=frames)
    by_addr = {a: f for a, (n, f) in _state.live.items()}
    for seg in snap["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated" and blk["address"] in by_addr:
                blk["frames"] = [by_addr[blk["address"]]]
    return snap


def fake_alloc(nbytes):
    caller = sys._getframe(1)
    frame = {"filename": caller.f_code.co_filename, "line": caller.f_lineno, "name": caller.f_code.co_name}
    used = sum(n for n, _ in _state.live.values())
    _state.t += 1.0
    if used + nbytes > _state.capacity:
        for obs in list(_state.observers):
            obs(0, nbytes, _state.capacity, _state.capacity - used)  # as PyTorch: total, free
        raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes (fake)")
    addr = _state.next_addr
    _state.next_addr += (nbytes + 511) // 512 * 512
    _state.live[addr] = (nbytes, frame)
    if _state.history is not None:
        _state.history.append((0, addr, nbytes, _state.t, frame))
    return addr


def fake_free(addr):
    _state.live.pop(addr)
    _state.t += 1.0
    if _state.history is not None:
        _state.history.append((1, addr, 0, _state.t, None))


class _Props:
    def __init__(self, total):
        self.total_memory = total
        self.name = "Fake GPU"


cuda = types.ModuleType("torch.cuda")
cuda.is_available = lambda: os.environ.get("FAKE_TORCH_CUDA", "1") != "0"
cuda.is_initialized = lambda: False
cuda.get_device_properties = lambda device=0: _Props(_state.capacity)
cuda.fake_alloc = fake_alloc
cuda.fake_free = fake_free
cuda.fake_state = _state
memory = types.ModuleType("torch.cuda.memory")
memory._record_memory_history = _record_memory_history
memory._snapshot = _snapshot
cuda.memory = memory
_C = types.ModuleType("torch._C")
_C._cuda_attach_out_of_memory_observer = _state.observers.append
sys.modules["torch.cuda"] = cuda
sys.modules["torch.cuda.memory"] = memory
sys.modules["torch._C"] = _C
