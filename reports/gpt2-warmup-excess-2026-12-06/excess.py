"""What the engine's excess (reserved minus live) is made of at the op where a run's reserved peaks, for the
GPT-2 traces whose peak lies in the memory-first warm-up (issue 18). Python engine, default policy,
``gpu_timing="trace"``, ``sim:h200-141gb``; no library file changed (hooks on the allocator's ``allocate``/``free``
only, and reads of the engine's state). From the repository root (about 15 s)::

    nice -n 10 python reports/gpt2-warmup-excess-2026-12-06/excess.py > reports/gpt2-warmup-excess-2026-12-06/excess.txt

Trace names as arguments replay only those; ``--pages`` lists every page with a hole and its live blocks.
Points examined per trace: the run's peak (the first call where reserved reaches its maximum), the peak of each
warm-up step that grew past the steps before (above peak live), and the highest step after the warm-up.

Two replays per trace: the first finds the first call where reserved reaches its maximum, the second stops
there and splits ``reserved - live requested`` into
  rounding      live engine blocks' size minus their request
  holes         bytes of mapped pages touched by live blocks that no live block covers (partial-page holes),
                split by the classes of the live blocks on the page: P persistent (never freed in the trace:
                weights, optimizer state), X crosses a mark (freed in a later step: gradients, ...), T step
                temporary (freed before the next mark)
  in flight     pending engine blocks (freed, their other streams' fences not done) and idle pages whose work is
                not done (an unfenced stream still busy or a recorded fence not complete)
  idle          idle pages (no live block) whose work is done; locked: idle pages of a chunk with live pages
  cached        chunks held but mapped nowhere
  arena         a step plan's mapped arena less what lives in it
  other         the rest
All in percent of the run's peak live (requested) bytes, the denominator of ``overhead``.
"""

from __future__ import annotations

import bisect
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpumem import open_device  # noqa: E402
from gpumem.allocator import CachingAllocator  # noqa: E402
from gpumem.allocator.policy import get_policy  # noqa: E402
from gpumem.replay import replay  # noqa: E402
from gpumem.trace import PlanEventKind, load_trace  # noqa: E402

TUNING = ("gpt2_fp32_train_h200",)
CHECK = ("gpt2_bf16_train_h200", "gpt2_train")
MB = 1e6


class Stop(Exception):
    pass


def lifetimes(trace):
    """Per trace op that reaches the allocator (a call): its trace op index; per alloc id: (alloc op, free op or None)."""
    kinds, ids, sizes, _ = trace.as_lists()
    calls, born, died, live = [], {}, {}, set()
    for i, (k, a, s) in enumerate(zip(kinds, ids, sizes)):
        if k == 0:
            if s:
                calls.append(i)
                born[a] = i
                live.add(a)
        elif a in live:
            calls.append(i)
            died[a] = i
            live.discard(a)
    marks = sorted(e.at_op for e in trace.plan_events if e.kind is PlanEventKind.MARK)
    return calls, born, died, marks, (kinds, ids, sizes)


def klass(aid, born, died, marks):
    d = died.get(aid)
    if d is None:
        return "P"
    nxt = bisect.bisect_right(marks, born[aid])   # the first mark after its birth
    return "X" if nxt < len(marks) and d >= marks[nxt] else "T"


def fence_done(fences, stream, number):
    if number <= fences._done.get(stream, 0):
        return True
    for n, event in fences._queues.get(stream, ()):
        if n > number:
            break
        if not event.complete:
            return False
    return True


def page_done(e, seg, q):
    streams = e.device.streams
    d = seg.dirty.get(q)
    for st in (() if d is None else (d,) if isinstance(d, int) else d):
        if streams.tail(st) is not None:
            return False
    return all(fence_done(e.fences, st, n) for st, n in (seg.page_fences.get(q) or {}).items())


def replay_once(name, stop_calls=()):
    """One replay; without ``stop_calls``: reserved and the warm-up flag after every call; with them: a snapshot
    after each of those calls, stopping after the last."""
    trace = load_trace(Path("data/traces") / f"{name}.snapshot.pickle.gz")
    calls, born, died, marks, (kinds, ids, sizes) = lifetimes(trace)
    alloc = CachingAllocator(open_device("sim:h200-141gb"), get_policy("gpumem"), engine="python")
    e = alloc._engine
    st = {"n": 0, "res": [], "warm": [], "aid_of": {}, "snaps": {}, "install": None}
    allocate, free, mark = alloc.allocate, alloc.free, alloc.mark_step
    stops = set(stop_calls)
    last = max(stops, default=None)

    def after():
        n = st["n"]
        st["n"] += 1
        if not stops:
            st["res"].append(alloc.reserved_nbytes)
            st["warm"].append(bool(e.backing.warmup))
        elif n in stops:
            st["snaps"][n] = snapshot(alloc, e, st, calls[n], born, died, marks, sizes, ids)
            if n == last:
                raise Stop

    def a(nbytes, stream=0):
        p = allocate(nbytes, stream)
        st["aid_of"][p] = ids[calls[st["n"]]]
        after()
        return p

    def f(p):
        free(p)
        after()

    def m():
        r = mark()
        if st["install"] is None and alloc.step_plan_info().state.name == "PLANNED":
            st["install"] = calls[st["n"]] if st["n"] < len(calls) else None
        return r

    alloc.allocate, alloc.free, alloc.mark_step = a, f, m
    result = None
    try:
        result = replay(trace, alloc, progress=False, gpu_timing="trace")
    except Stop:
        pass
    alloc.close()
    return result, st, calls, marks, trace


def snapshot(alloc, e, st, op, born, died, marks, sizes, ids):
    live_ids = [a for a, b in born.items() if b <= op and died.get(a, 1 << 62) > op]
    live_req = sum(sizes[born[a]] for a in live_ids)
    b = e.backing
    out = Counter()
    out["reserved"] = alloc.reserved_nbytes
    out["live"] = live_req
    blocks = sorted((blk.addr, blk.addr + blk.size, klass(st["aid_of"][p], born, died, marks), st["aid_of"][p])
                    for p, blk in e._live.items())
    out["rounding"] = sum(blk.size - blk.requested for blk in e._live.values())
    eng_req = sum(blk.requested for blk in e._live.values())
    for lo, hi, k, _ in blocks:
        out["bytes " + k] += hi - lo
        out["blocks " + k] += 1
    p_birth = Counter()
    for p, blk in e._live.items():
        aid = st["aid_of"][p]
        if aid not in died:
            p_birth[bisect.bisect_right(marks, born[aid])] += blk.size
    pend = sorted((blk.addr, blk.addr + blk.size) for blk in e._pending)
    out["in flight: pending blocks"] = sum(hi - lo for lo, hi in pend)
    starts = [lo for lo, _, _, _ in blocks]
    pstarts = [lo for lo, _ in pend]
    page = 0
    pages_touched = Counter()   # class set -> pages
    holed = Counter()           # class set -> pages with a hole
    hole_pages = []             # (hole bytes, class set, [(class, block size, birth op, free op)])
    for seg in b.vsegments.values():
        g = page = seg.page_nbytes
        for p in range(-(-seg.top // g)):
            h = seg.chunks[p]
            if h is None:
                continue
            lo, hi = seg.base + p * g, seg.base + (p + 1) * g
            if seg.refs[p] == 0:
                s = b._chunk_start(seg, p)
                n = h.nbytes // g
                if any(seg.refs[q] for q in range(s, s + n)):
                    out["locked idle pages"] += g
                elif page_done(e, seg, p):
                    out["idle pages, work done"] += g
                else:
                    out["in flight: idle pages"] += g
                continue
            cov, classes, on = 0, set(), []
            i = max(bisect.bisect_right(starts, lo) - 1, 0)
            while i < len(blocks) and blocks[i][0] < hi:
                ov = min(hi, blocks[i][1]) - max(lo, blocks[i][0])
                if ov > 0:
                    cov += ov
                    classes.add(blocks[i][2])
                    aid = blocks[i][3]
                    on.append((blocks[i][2], blocks[i][1] - blocks[i][0], born[aid], died.get(aid)))
                i += 1
            i = max(bisect.bisect_right(pstarts, lo) - 1, 0)
            while i < len(pend) and pend[i][0] < hi:
                cov += max(0, min(hi, pend[i][1]) - max(lo, pend[i][0]))
                i += 1
            key = "".join(sorted(classes)) or "pending only"
            out["holes " + key] += g - cov
            pages_touched[key] += 1
            holed[key] += g - cov > 0
            if g - cov > 0:
                hole_pages.append((g - cov, key, on))
    out["cached"] = sum(h.nbytes for h in b.unmapped)
    info = alloc.step_plan_info()
    out["arena"] = e._plan.mapped_nbytes - (live_req - eng_req)
    out["deferred chunks"] = len(b.deferred)
    parts = ("rounding", "in flight: pending blocks", "locked idle pages", "idle pages, work done",
             "in flight: idle pages", "cached", "arena") + tuple(k for k in out if k.startswith("holes "))
    out["other"] = out["reserved"] - live_req - sum(out[k] for k in parts)
    return {"out": out, "pages": pages_touched, "page": page, "state": info.state.name, "op": op,
            "warmup": info.warmup, "p_birth": p_birth, "holed": holed, "hole_pages": hole_pages}


def run(name):
    res1, st1, calls, marks, trace = replay_once(name)
    r, warm = st1["res"], st1["warm"]
    peak = max(r)
    k = r.index(peak)
    assert peak == res1.peak_reserved_bytes, (peak, res1.peak_reserved_bytes)
    pl = res1.peak_live_bytes
    step_of = [bisect.bisect_right(marks, calls[n]) for n in range(len(r))]   # 0: before the first mark
    # per step: the first call where the step's highest reserved is reached, and whether the warm-up was on there
    steps = {}
    for n, v in enumerate(r):
        j = step_of[n]
        if j not in steps or v > steps[j][0]:
            steps[j] = (v, n, warm[n])
    # the points: the run's peak; in the warm-up, each step's peak above peak live that grew past the steps before
    points = {k: "run peak"}
    best = 0
    for j, (v, n, w) in sorted(steps.items()):
        if w and v > pl and v > best:
            points.setdefault(n, f"warm-up, step {j} peak")
        best = max(best, v)
    # after the warm-up: the highest step (planned or not), if it is not the run's peak
    after = [(v, -n, j) for j, (v, n, w) in steps.items() if not w and n > max(i for i, x in enumerate(warm) if x)]
    if after:
        v, n, j = max(after)
        points.setdefault(-n, f"after the warm-up, step {j} peak")
    _, st2, _, _, _ = replay_once(name, stop_calls=sorted(points))
    return dict(name=name, pl=pl, overhead=res1.overhead, points=points, snaps=st2["snaps"], marks=marks,
                install=st1["install"], steps={j: (v / pl - 1, w) for j, (v, n, w) in sorted(steps.items())},
                step_of=step_of)


def pct(x, pl):
    return f"{100 * x / pl:.3f}"


def main():
    names = [a for a in sys.argv[1:] if not a.startswith("-")] or TUNING + CHECK
    for name in names:
        d = run(name)
        pl = d["pl"]
        print(f"== {name} ({'tuning' if name in TUNING else 'check'}): overhead {d['overhead']:.3%}, peak live "
              f"{pl / MB:.1f} MB; marks at trace ops {d['marks']}; plan installed at op {d['install']}")
        print("   per step (step j: after j marks), highest reserved over peak live, %, (w: warm-up on there): "
              + ", ".join(f"{j}: {100 * v:.3f}{' w' if w else ''}" for j, (v, w) in d["steps"].items()))
        for n in sorted(d["points"]):
            s = d["snaps"][n]
            o, g = s["out"], s["page"]
            at = o["reserved"] / pl - 1
            print(f"-- {d['points'][n]}: trace op {s['op']} (step {d['step_of'][n]}), layer {s['state']}, warm-up on: "
                  f"{bool(s['warmup'])}; reserved {o['reserved'] / MB:.1f} MB = {100 * at:.3f} % over peak live")
            excess = o["reserved"] - o["live"]
            print(f"   live (requested) {o['live'] / MB:.1f} MB, excess {excess / MB:.2f} MB = {pct(excess, pl)} % of peak "
                  f"live (live below its run peak by {pct(pl - o['live'], pl)} %)")
            for key in sorted(k for k in o if k not in ("reserved", "live", "deferred chunks")
                              and not k.startswith(("bytes ", "blocks "))):
                pages = f" ({s['pages'][key[6:]]} pages, {s['holed'][key[6:]]} with a hole)" if key.startswith("holes ") else ""
                print(f"     {key:28s} {o[key] / MB:8.2f} MB  {pct(o[key], pl):>7s} %{pages}")
            lp = {c: o["bytes " + c] for c in "PXT"}
            print(f"   live engine blocks: " + ", ".join(f"{c} {o['blocks ' + c]} ({lp[c] / MB:.1f} MB)" for c in "PXT")
                  + f"; P by birth step (MB): " + ", ".join(f"{j}: {v / MB:.1f}" for j, v in sorted(s["p_birth"].items()))
                  + f"; stolen chunks still deferred: {o['deferred chunks']}; page {g / 2**20:g} MiB")
            if "--pages" in sys.argv[1:]:
                for hole, key, on in sorted(s["hole_pages"], key=lambda t: -t[0]):
                    print(f"     page with a hole of {hole / MB:.3f} MB ({key}, {len(on)} live blocks): " + "; ".join(
                        f"{c} {sz / MB:.3f} MB born {b} freed {f}" for c, sz, b, f in on[:3]))
            one = [h for h, _, on in s["hole_pages"] if len(on) == 1]
            print(f"   pages with a hole: {len(s['hole_pages'])}, {len(one)} of them touched by one live block only "
                  f"(the edge of a block larger than the rest: {sum(one) / MB:.2f} MB of the holes)")
            holes = {k[6:]: v for k, v in o.items() if k.startswith("holes ")}
            pages_live = sum(s["pages"].values())
            L, T = lp["P"] + lp["X"], lp["T"]
            ideal_sep = pages_live * g - (-(-L // g) + -(-T // g)) * g
            ideal_one = pages_live * g - (-(-(L + T) // g)) * g
            idle = o["idle pages, work done"] + o["cached"]
            flight = o["in flight: idle pages"] + o["in flight: pending blocks"]
            print("   rules, what each could take off reserved at this op (MB, % of peak live, the op's overhead after):")
            for label, v in (("idle chunks back at once, work done", idle),
                             ("idle chunks and in flight back at once (waiting)", idle + flight),
                             ("locked idle pages (chunks split to one page)", o["locked idle pages"]),
                             ("holes on pages with a long-lived (P or X) block", sum(v for k, v in holes.items() if set(k) & set("PX"))),
                             ("holes on pages with only step temporaries (T)", holes.get("T", 0)),
                             ("ideal: P+X and T each packed on pages of their own", ideal_sep),
                             ("ideal: all live blocks packed together", ideal_one)):
                print(f"     {label:52s} {v / MB:8.2f}  {pct(v, pl):>7s} %  -> {100 * (at - v / pl):.3f} %")
        print(flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
