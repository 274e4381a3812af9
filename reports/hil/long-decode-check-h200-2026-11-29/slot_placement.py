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

SLOT = 32 << 20
TOP = 0x7F50_0000_0000
mode = sys.argv[1]  # "slots" or "plain"
fill = sys.argv[2] if len(sys.argv) > 2 else "newest"

def patch():
    orig = D.SimDevice._do_malloc
    def _do_malloc(self, nbytes):
        if nbytes <= D.SMALL_MALLOC_MAX_NBYTES:
            return orig(self, nbytes)
        st = self.__dict__.setdefault("_slots", {"low": TOP, "chunks": []})
        span = D.align_up(nbytes, self._gran)
        self._call("malloc", 0.0, nbytes)
        if span > self._free_nbytes():
            raise self._oom(nbytes)
        chunks = st["chunks"] if fill == "newest" else sorted(st["chunks"], key=lambda c: c[0])
        order = reversed(chunks) if fill == "newest" else chunks
        for c in order:
            if c[1] - c[2] >= span:
                start = c[0] + c[2]; c[2] += span; break
        else:
            size = -(-span // SLOT) * SLOT
            st["low"] -= size
            c = [st["low"], size, span]; st["chunks"].append(c); start = c[0]
        alloc = D._Allocation(start, nbytes, span, None)
        self._space_add(start, span, alloc)
        self._take_pages(span // self._gran)
        return alloc
    D.SimDevice._do_malloc = _do_malloc

if mode == "slots":
    patch()
pol = dataclasses.replace(get_policy("pytorch"), segments_top_down=(mode != "slots"))
tr = extend_decode(load_trace(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), 8192)
r = replay_trace(tr, "sim:h200-141gb", pol, progress=False)
print(mode, fill, "peak_alloc", f"{r.stats.peak_allocated_nbytes:,}", "peak_res", f"{r.peak_reserved_bytes:,}", flush=True)
