"""python reports/hil/long-decode-check-h200-2026-11-29/slot_placement.py slots|plain newest|lowest TRACE TOKENS FIRST_NBYTES

Replay the recorded p1024 decode, extended, under the pytorch model on a device that places malloc'd segments as
the H200's driver did in the live snapshot: 32 MiB-aligned chunks handed out top-down, a chunk's room filled
upwards by later segments that fit."""
import sys, dataclasses
from gpumem.sim import device as D
from gpumem.allocator.policy import get_policy
from gpumem.trace import load_trace
from gpumem.replay import replay_trace
from sim.extend_decode import extend_decode

mode = sys.argv[1]  # "slots" or "plain"
fill = sys.argv[2] if len(sys.argv) > 2 else "newest"  # which slot with room is tried first: newest or lowest


def patch():
    """The slot placement of ``slots_patch.py`` (beside this file) on the device of commit b4dd6bc."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("slots_patch", Path(__file__).with_name("slots_patch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.patch(D, fill)


if mode == "slots":
    patch()
pol = dataclasses.replace(get_policy("pytorch"), segments_top_down=(mode != "slots"))
tr = extend_decode(load_trace(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), 8192)
r = replay_trace(tr, "sim:h200-141gb", pol, progress=False)
print(mode, fill, "peak_alloc", f"{r.stats.peak_allocated_nbytes:,}", "peak_res", f"{r.peak_reserved_bytes:,}", flush=True)
