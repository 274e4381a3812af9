SLOT = 32 << 20
TOP = 0x7F50_0000_0000
def patch(D, fill="newest"):
    """Slots for the device of commit b4dd6bc; ``fill``: the slot with room tried first, the newest or the lowest."""
    orig = D.SimDevice._do_malloc
    def _do_malloc(self, nbytes):
        if nbytes <= D.SMALL_MALLOC_MAX_NBYTES:
            return orig(self, nbytes)
        st = self.__dict__.setdefault("_slots", {"low": TOP, "chunks": []})
        span = D.align_up(nbytes, self._gran)
        self._call("malloc", 0.0, nbytes)
        if span > self._free_nbytes():
            raise self._oom(nbytes)
        chunks = reversed(st["chunks"]) if fill == "newest" else sorted(st["chunks"], key=lambda c: c[0])
        for c in chunks:
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
