"""Regenerate the small trace fixtures in this folder from the shared real traces.

    PYTHONPATH=. python3 tests/trace/data/make_fixtures.py   (from the repository root)

Writes, from ``data/traces/resnet_train.*`` (ResNet-50 training on an H200):

* ``resnet_head.snapshot.pickle.gz`` -- the real snapshot dict cut to the entries
  that hold its first 2000 ops (alloc / free_requested); every entry keeps its
  real fields, ``frames`` cut to the innermost frame to keep the file small;
  ``segments`` emptied (they describe the state at the end of the full run).
* ``resnet_head.rmm_log.csv.gz`` -- the header and first 2000 lines of the real
  RMM log (the same workload replayed through RMM; the same first 2000 ops).
* ``resnet_head.gmt.gz`` -- the first 2000 ops in gpumem's native format.
* ``resnet_head.snapshot_export.pickle.gz`` -- the same ops exported by
  ``save_pytorch_snapshot`` (what PyTorch's memory viewer would be given).

The gzip members are written with mtime 0, so rerunning gives identical bytes.
"""

from __future__ import annotations

import gzip
import pickle
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SHARED = REPO / "data" / "traces"
N_OPS = 2000

sys.path.insert(0, str(REPO))

from gpumem.trace import load_snapshot_dict, load_trace, save_pytorch_snapshot, save_trace  # noqa: E402


def _write_gz(path: Path, data: bytes) -> None:
    with open(path, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz:
        gz.write(data)


def main() -> None:
    snap = load_snapshot_dict(SHARED / "resnet_train.snapshot.pickle.gz")
    entries = snap["device_traces"][0]
    n_ops = 0
    for end, e in enumerate(entries):
        n_ops += e["action"] in ("alloc", "free_requested")
        if n_ops == N_OPS:
            break
    head = [dict(e, frames=e["frames"][:1]) for e in entries[: end + 1]]
    small = {"segments": [], "device_traces": [head], "allocator_settings": snap.get("allocator_settings", {})}
    _write_gz(HERE / "resnet_head.snapshot.pickle.gz", pickle.dumps(small, protocol=4))

    with gzip.open(SHARED / "resnet_train.rmm_log.csv.gz", "rt") as f:
        lines = [next(f) for _ in range(N_OPS + 1)]
    _write_gz(HERE / "resnet_head.rmm_log.csv.gz", "".join(lines).encode())

    trace = load_trace(HERE / "resnet_head.snapshot.pickle.gz")
    assert trace.n_ops == N_OPS, trace
    save_trace(trace, HERE / "resnet_head.gmt.gz")
    save_pytorch_snapshot(trace, HERE / "resnet_head.snapshot_export.pickle.gz")
    rmm = load_trace(HERE / "resnet_head.rmm_log.csv.gz")
    assert rmm.ops_equal(trace, times=False, addrs=False), "RMM head and snapshot head differ"
    for p in sorted(HERE.glob("resnet_head.*")):
        print(f"{p.name}: {p.stat().st_size:,} bytes")
    print(trace.summary())


if __name__ == "__main__":
    main()
