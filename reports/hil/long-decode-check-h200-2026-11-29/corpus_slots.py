"""python reports/hil/long-decode-check-h200-2026-11-29/corpus_slots.py: every PyTorch snapshot of data/traces replayed under the
`pytorch` model as shipped (plain) and on a device placing segments in 32 MiB slots (slots_patch.py), against the
peak of the segments each snapshot records."""
import sys, dataclasses, glob
import importlib.util
from gpumem.trace.pytorch import load_snapshot_dict
from gpumem.trace import load_trace
from gpumem.replay import replay_trace
from gpumem.allocator.policy import get_policy
from gpumem.sim import device as D

def measured(path):
    d = load_snapshot_dict(path)
    tr = d["device_traces"][0]
    cur = peak = 0
    live = {}
    for e in tr:
        a = e["action"]
        if a == "segment_alloc":
            cur += e["size"]; live[e["addr"]] = e["size"]; peak = max(peak, cur)
        elif a == "segment_free":
            cur -= e["size"]; live.pop(e["addr"], None)
    return peak, len(tr)

orig = D.SimDevice._do_malloc
def run(path, mode):
    D.SimDevice._do_malloc = orig
    if mode == "slots":
        spec = importlib.util.spec_from_file_location("sp", "reports/hil/long-decode-check-h200-2026-11-29/slots_patch.py")
        m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m.patch(D)
    pol = dataclasses.replace(get_policy("pytorch"), segments_top_down=(mode != "slots"))
    r = replay_trace(load_trace(path), "sim:h200-141gb", pol, progress=False, engine="native")
    return r.peak_reserved_bytes

for path in sorted(glob.glob("data/traces/*.snapshot.pickle.gz")):
    m, n = measured(path)
    a = run(path, "plain"); b = run(path, "slots")
    print(f"{path.split('/')[-1]:42} measured {m:>15,}  plain {a:>15,} {a/m-1:+.3%}  slots {b:>15,} {b/m-1:+.3%}", flush=True)
