"""What the engine holds beyond its live bytes at the peak op of the first planned step, split by chunk:
(a) idle chunks (no live block on them), (b) chunks that hold a live leftover (an engine block live at the plan's
install and freed within the first planned step), (c) chunks that hold only other live engine blocks, (d) the rest
(chunks held but mapped nowhere, and whatever the chunks do not account for). For each idle chunk: the op at which
its last page fell empty, which free did it, and whether the chunk's work was done then (no unfenced stream with
unfinished work, every recorded fence complete: read off the simulated streams, no device call).
Replays on the Python engine, the default policy, ``gpu_timing="trace"``, ``sim:h200-141gb``; from the
repository root (about 30 s)::

    python reports/first-step-holes-2026-12-05/holes.py > reports/first-step-holes-2026-12-05/holes.txt
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpumem import open_device  # noqa: E402
from gpumem.allocator import CachingAllocator  # noqa: E402
from gpumem.allocator.policy import get_policy  # noqa: E402
from gpumem.replay import replay  # noqa: E402
from gpumem.trace import load_trace  # noqa: E402

TUNING = ("gpt2_bf16_train_h200", "resnet50_train_h200", "gpt2_fp32_train_h200")
CHECK = ("vit_train_h200", "unet_train_h200")
MB = 1e6


class Probe:
    """Hooks on one allocator: op counter, engine block births, page-empty times, the plan's phases."""

    def __init__(self, alloc: CachingAllocator) -> None:
        self.alloc = alloc
        self.e = alloc._engine
        self.b = self.e.backing
        self.dev = self.e.device
        self.op = 0
        self.birth: dict[int, int] = {}          # engine ptr -> op of its allocation (live ones)
        self.freed_at: dict[int, int] = {}       # birth op -> op of its free
        self.install_op: int | None = None
        self.live_at_install: set[int] = set()   # birth ops of engine blocks live at the install
        self.step_of_op: dict[int, int] = {}     # op -> planned step index (PLANNED only)
        self.idle_since: dict[tuple[int, int], tuple[int, int | None, bool]] = {}
        # (range base, chunk's first page) -> (op its last page fell empty, birth op of the freed block, work done then)
        self.cur_free_birth: int | None = None
        self.reserved: dict[int, int] = {}
        self.snaps: dict[int, dict] = {}
        self.best = -1
        self.k1: int | None = None
        self.later: dict = {}
        allocate, free, mark = alloc.allocate, alloc.free, alloc.mark_step
        real_decommit = self.b.decommit

        def decommit(block):
            real_decommit(block)
            seg, first, last = self.b._pages(block)
            for p in range(first, last + 1):
                if seg.refs[p] == 0 and seg.chunks[p] is not None:
                    s = self.b._chunk_start(seg, p)
                    n = seg.chunks[s].nbytes // seg.page_nbytes
                    if all(seg.refs[q] == 0 for q in range(s, s + n)):
                        self.idle_since[(seg.base, s)] = (self.op, self.cur_free_birth, self.chunk_done(seg, s))

        self.b.decommit = decommit
        real_unmap = self.b._unmap_chunk
        self.unmaps: list[tuple[int, int, tuple | None]] = []   # (op, bytes, idle_since entry) of chunks given back

        def unmap_chunk(seg, s):
            h = real_unmap(seg, s)
            self.unmaps.append((self.op, h.nbytes, self.idle_since.get((seg.base, s))))
            return h

        self.b._unmap_chunk = unmap_chunk

        def allocate_and_look(nbytes: int, stream: int = 0) -> int:
            self.op += 1
            ptr = allocate(nbytes, stream)
            if ptr in self.e._live:
                self.birth[ptr] = self.op
            self.look()
            return ptr

        def free_and_look(ptr: int) -> None:
            self.op += 1
            self.cur_free_birth = self.birth.pop(ptr, None)
            if self.cur_free_birth is not None:
                self.freed_at[self.cur_free_birth] = self.op
            free(ptr)
            self.cur_free_birth = None
            self.look()

        def mark_and_look():
            r = mark()
            if self.install_op is None and alloc.step_plan_info().state.name == "PLANNED":
                self.install_op = self.op
                self.live_at_install = set(self.birth.values())
            return r

        alloc.allocate, alloc.free, alloc.mark_step = allocate_and_look, free_and_look, mark_and_look

    def chunk_done(self, seg, s: int) -> bool:
        """Whether the work on the chunk's pages is done now: read off the simulated streams (no device call)."""
        n = seg.chunks[s].nbytes // seg.page_nbytes
        streams = self.dev.streams
        for q in range(s, s + n):
            d = seg.dirty.get(q)
            for st in (() if d is None else (d,) if isinstance(d, int) else d):
                if streams.tail(st) is not None:
                    return False
            for st, number in (seg.page_fences.get(q) or {}).items():
                if not _fence_done_quietly(self.e.fences, st, number):
                    return False
        return True

    def look(self) -> None:
        info = self.alloc.step_plan_info()
        if info.state.name != "PLANNED":
            return
        step = info.steps_hit + info.steps_missed
        self.step_of_op[self.op] = step
        r = self.alloc.reserved_nbytes
        self.reserved[self.op] = r
        if "install" not in self.__dict__:   # after the first op of the first planned step
            self.install = self.snapshot()
        if step == 1:
            if self.k1 is None:
                ops0 = sorted(o for o, st in self.step_of_op.items() if st == 0)
                self.k1 = ops0.index(self.snaps["op"])
                self.n1 = 0
            if self.n1 == self.k1:
                self.later = {"op": self.op, **self.snapshot()}
            self.n1 += 1
        if step == 0 and r > self.best:
            self.best = r
            self.snaps = {"op": self.op, **self.snapshot()}

    def snapshot(self) -> dict:
        """The engine's chunks with the live engine blocks on them."""
        b, e = self.b, self.e
        blocks = sorted((blk.addr, blk.addr + blk.size, self.birth.get(a)) for a, blk in e._live.items())
        chunks = []
        for seg in b.vsegments.values():
            g = seg.page_nbytes
            n_pages = -(-seg.top // g)
            p = 0
            while p < n_pages:
                h = seg.chunks[p]
                if h is None:
                    p += 1
                    continue
                n = h.nbytes // g
                chunks.append((seg.base + p * g, seg.base + (p + n) * g, seg.base, p,
                               sum(1 for q in range(p, p + n) if seg.refs[q] == 0),
                               self.chunk_done(seg, p) if all(seg.refs[q] == 0 for q in range(p, p + n)) else None))
                p += n
        return {"blocks": blocks, "chunks": chunks, "unmapped": sum(h.nbytes for h in b.unmapped),
                "reserved": b.reserved_nbytes, "engine_live": sum(hi - lo for lo, hi, _ in blocks),
                "page": max((s.page_nbytes for s in b.vsegments.values()), default=0)}


def _fence_done_quietly(fences, stream: int, number: int) -> bool:
    if number <= fences._done.get(stream, 0):
        return True
    for n, event in fences._queues.get(stream, ()):
        if n > number:
            break
        if not event.complete:
            return False
    return True


def run(name: str) -> dict:
    path = Path("data/traces") / f"{name}.snapshot.pickle.gz"
    alloc = CachingAllocator(open_device("sim:h200-141gb"), get_policy("gpumem"), engine="python")
    pr = Probe(alloc)
    result = replay(load_trace(path), alloc, progress=False, gpu_timing="trace")
    alloc.close()
    s = pr.snaps
    step0_ops = [o for o, st in pr.step_of_op.items() if st == 0]
    end0 = max(step0_ops)
    leftovers = {bo for bo in pr.live_at_install if pr.freed_at.get(bo, 1 << 60) <= end0}
    import bisect
    blocks = s["blocks"]
    starts = [lo for lo, _, _ in blocks]
    bparts = Counter()          # (b) chunks: leftover bytes, other live bytes, free bytes; pages with leftovers only
    cat = Counter()
    cat_chunks = Counter()
    locked = Counter()          # empty pages of (b) and (c) chunks
    idle_rows = []
    for lo, hi, base, p0, n_empty, done_now in s["chunks"]:
        i = bisect.bisect_right(starts, lo) - 1
        live = 0
        births = []
        j = max(i, 0)
        while j < len(blocks) and blocks[j][0] < hi:
            blo, bhi, bo = blocks[j]
            ov = min(hi, bhi) - max(lo, blo)
            if ov > 0:
                live += ov
                births.append(bo)
            j += 1
        beyond = (hi - lo) - live
        if not births:
            k = "a"
            since = pr.idle_since.get((base, p0))
            idle_rows.append((hi - lo, since, done_now))
        elif any(bo in leftovers for bo in births):
            k = "b"
            j = max(i, 0)
            mine = 0
            while j < len(blocks) and blocks[j][0] < hi:
                blo, bhi, bo = blocks[j]
                ov = min(hi, bhi) - max(lo, blo)
                if ov > 0 and bo in leftovers:
                    mine += ov
                j += 1
            bparts["leftover"] += mine
            bparts["other"] += live - mine
            bparts["only leftovers"] += (hi - lo) if mine == live else 0
            bparts["pages"] += (hi - lo) // s["page"]
        else:
            k = "c"
        cat[k] += beyond
        cat_chunks[k] += 1
        if k in "bc":
            locked[k] += n_empty * s["page"]
    total_beyond = s["reserved"] - s["engine_live"]
    cat["d"] = total_beyond - cat["a"] - cat["b"] - cat["c"]
    # when the idle chunks fell idle
    when = Counter()
    for nb, since, done_now in idle_rows:
        if since is None:
            when["unknown", done_now] += nb
            continue
        op, fb, done_then = since
        phase = ("recorded" if pr.install_op is None or op <= pr.install_op
                 else "first planned step" if pr.step_of_op.get(op, -1) == 0 else "between install and step 0")
        who = "a leftover's free" if fb in leftovers else "another engine free" if fb is not None else "?"
        when[phase, who, "work done then" if done_then else "in flight then",
             "done at peak" if done_now else "in flight at peak"] += nb
    # the same split after the first op of the first planned step (the leftovers as above): were the holes there?
    inst = pr.install
    ib = Counter()
    istarts = [lo for lo, _, _ in inst["blocks"]]
    for lo, hi, base, p0, n_empty, done_now in inst["chunks"]:
        i = max(bisect.bisect_right(istarts, lo) - 1, 0)
        live, births = 0, []
        while i < len(inst["blocks"]) and inst["blocks"][i][0] < hi:
            blo, bhi, bo = inst["blocks"][i]
            ov = min(hi, bhi) - max(lo, blo)
            if ov > 0:
                live += ov
                births.append(bo)
            i += 1
        ib["a" if not births else "b" if any(bo in leftovers for bo in births) else "c"] += (hi - lo) - live
    ib["total"] = inst["reserved"] - inst["engine_live"]
    # the same op one step later: the engine beyond live, split alike (leftovers: none; the plan serves them now)
    lt = pr.later
    lb = Counter()
    lstarts = [lo for lo, _, _ in lt["blocks"]]
    for lo, hi, base, p0, n_empty, done_now in lt["chunks"]:
        i = max(bisect.bisect_right(lstarts, lo) - 1, 0)
        live, births = 0, []
        while i < len(lt["blocks"]) and lt["blocks"][i][0] < hi:
            blo, bhi, bo = lt["blocks"][i]
            ov = min(hi, bhi) - max(lo, blo)
            if ov > 0:
                live += ov
                births.append(bo)
            i += 1
        lb["a" if not births else "c"] += (hi - lo) - live
    lb["total"] = lt["reserved"] - lt["engine_live"]
    lb["d"] = lb["total"] - lb["a"] - lb["c"]
    # chunks that fell idle in the first planned step: by whose free, work done then, and when given back
    fell = Counter()
    for op, nb, since in pr.unmaps:
        if pr.step_of_op.get(op, -1) != 0 or since is None:
            continue
        iop, fb, done_then = since
        who = "leftover" if fb in leftovers else "other"
        fell[who, "done" if done_then else "in flight", "MB"] += nb
        fell[who, "done" if done_then else "in flight", "chunks"] += 1
        fell[who, "lag"] = max(fell[who, "lag"], op - iop)
    lfree = sorted(pr.freed_at[bo] for bo in leftovers)
    return dict(name=name, page=s["page"], fell=fell, lfree=(lfree[0], lfree[-1]) if lfree else None, later=lb, later_op=lt["op"], peak_live=result.peak_live_bytes, first_peak=pr.best,
                bparts=bparts, at_install=ib, overhead=result.overhead, peak_op=s["op"], install_op=pr.install_op,
                step0=(min(step0_ops), end0), cat=cat, cat_chunks=cat_chunks, locked=locked,
                n_leftovers=len(leftovers), leftover_live_at_peak=sum(1 for _, _, bo in blocks if bo in leftovers),
                total_beyond=total_beyond, unmapped=s["unmapped"], when=when, idle_rows=idle_rows)


def main() -> int:
    names = TUNING + (CHECK if "--check" in sys.argv[1:] else ())
    print("| trace | peak op (install op; step 0 ops) | engine beyond live, MB | (a) idle chunks | (b) with live leftovers "
          "(empty pages) | (c) other live only (empty pages) | (d) rest (unmapped) | leftovers (live at peak) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    out = []
    for name in names:
        r = run(name)
        out.append(r)
        c, n, lk = r["cat"], r["cat_chunks"], r["locked"]
        print(f"| {name} | {r['peak_op']} ({r['install_op']}; {r['step0'][0]}-{r['step0'][1]}) | {r['total_beyond'] / MB:.1f} "
              f"| {c['a'] / MB:.1f} ({n['a']} chunks) | {c['b'] / MB:.1f} ({n['b']} chunks; {lk['b'] / MB:.1f}) "
              f"| {c['c'] / MB:.1f} ({n['c']} chunks; {lk['c'] / MB:.1f}) | {c['d'] / MB:.1f} ({r['unmapped'] / MB:.1f}) "
              f"| {r['n_leftovers']} ({r['leftover_live_at_peak']}) |", flush=True)
    print()
    print("Chunks with live leftovers at the peak op (MB): leftover bytes / other live bytes / chunks holding only leftovers; "
          "pages they span against the pages the leftovers would fill packed; "
          "and the engine beyond live after the first op of the first planned step: total / (a) / (b) / (c)")
    for r in out:
        bp, ib = r["bparts"], r["at_install"]
        packed = -(-bp["leftover"] // r["page"]) if r["page"] else 0
        print(f"  {r['name']}: {bp['leftover'] / MB:.1f} / {bp['other'] / MB:.1f} / {bp['only leftovers'] / MB:.1f}; "
              f"pages {bp['pages']} against {packed} packed ({r['page'] / 2**20:g} MiB each); "
              f"first op: {ib['total'] / MB:.1f} / {ib['a'] / MB:.1f} / {ib['b'] / MB:.1f} / {ib['c'] / MB:.1f}")
    print()
    print("The same op one step later (engine beyond live, MB: total / idle chunks / chunks with live blocks / rest); "
          "the first planned step's peak over peak allocated, and with (b) taken off")
    for r in out:
        lb = r["later"]
        print(f"  {r['name']}: op {r['later_op']}: {lb['total'] / MB:.1f} / {lb['a'] / MB:.1f} / {lb['c'] / MB:.1f} / "
              f"{lb['d'] / MB:.1f}; first planned step {r['first_peak'] / r['peak_live'] - 1:.3%}, less (b) "
              f"{(r['first_peak'] - r['cat']['b']) / r['peak_live'] - 1:.3%}; run {r['overhead']:.3%}")
    print()
    print("Leftovers' frees (first and last op); chunks given back within the first planned step, by the free that "
          "idled them and whether their work was done then: MB (chunks), and the longest lag idle -> given back in ops")
    for r in out:
        f = r["fell"]
        cells = "; ".join(f"{who}/{st}: {f[who, st, 'MB'] / MB:.1f} ({f[who, st, 'chunks']})"
                          for who in ("leftover", "other") for st in ("done", "in flight") if f[who, st, "chunks"])
        print(f"  {r['name']}: leftovers freed at ops {r['lfree']}; given back: {cells or 'none'}; "
              f"lag leftover {f['leftover', 'lag']}, other {f['other', 'lag']}")
    print()
    print("Idle chunks at the peak op, by when they fell idle (MB):")
    for r in out:
        for key, nb in sorted(r["when"].items(), key=lambda kv: -kv[1]):
            print(f"  {r['name']}: {' / '.join(map(str, key))}: {nb / MB:.1f}")
        sizes = Counter(nb for nb, _, _ in r["idle_rows"])
        print(f"  {r['name']}: idle chunk sizes (MiB x count): "
              + (", ".join(f"{nb / 2**20:g} x {k}" for nb, k in sorted(sizes.items())) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
