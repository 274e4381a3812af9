#!/usr/bin/env bash
# What the GPU record reports/hil/record-<device>-2026-11-25.{md,json} ran, from the checkout's root, with
# gpumem importable (PYTHONPATH) and $OUT a folder for the results: `gpumem record` on
# examples/train_small.py under PyTorch's allocator and gpumem's, an out-of-memory run under each, and
# the snapshot-on-OOM opt-in called from Python (gpumem.torch.snapshot_on_oom) under each.
set -u
ROOT=$PWD
W=$(mktemp -d)
EX=$ROOT/examples/train_small.py
cases=()
run() {  # run NAME COMMAND...: in the work folder, at most 50 s, output and exit status kept
    local name=$1; shift
    cases+=("$name")
    local t0=$SECONDS
    (cd "$W" && timeout 50 "$@") >"$W/$name.log" 2>&1
    echo $? >"$W/$name.rc"
    echo $((SECONDS - t0)) >"$W/$name.s"
    printf '%s\n' "$*" >"$W/$name.cmd"
}
run pytorch python3 -m gpumem record --out pytorch --report -- python3 "$EX" --steps 30
run gpumem python3 -m gpumem record --out gpumem --allocator gpumem --report -- python3 "$EX" --steps 30
run oom-pytorch python3 -m gpumem record --out oom-pytorch --report -- python3 "$EX" --oom --steps 2
run oom-gpumem python3 -m gpumem record --out oom-gpumem --allocator gpumem --report -- python3 "$EX" --oom --steps 2
run call-pytorch python3 -c "import sys, runpy, gpumem.torch; gpumem.torch.snapshot_on_oom('call-pytorch'); sys.argv=['train_small.py', '--oom']; runpy.run_path('$EX', run_name='__main__')"
run call-gpumem python3 -c "import sys, runpy, gpumem.torch; gpumem.torch.install(); gpumem.torch.snapshot_on_oom('call-gpumem'); sys.argv=['train_small.py', '--oom']; runpy.run_path('$EX', run_name='__main__')"
python3 - "$W" "$OUT" "${cases[@]}" <<'PY'
import json, os, subprocess, sys
from pathlib import Path
w, out, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except OSError as exc:
    gpu = f"nvidia-smi: {exc}"
import torch
rec = {"gpu": gpu, "torch": torch.__version__, "python": sys.version.split()[0], "cases": []}
logs = []
for n in names:
    d = w / n
    files = sorted(str(p.relative_to(w)) for p in d.rglob("*") if p.is_file()) if d.is_dir() else []
    case = {"name": n, "command": (w / f"{n}.cmd").read_text().strip().replace(str(Path.cwd()) + "/", ""),
            "exit_status": int((w / f"{n}.rc").read_text()), "wall_s": int((w / f"{n}.s").read_text()),
            "files": files}
    st = d / "record.json"
    if st.is_file():
        case["record"] = json.loads(st.read_text())
    summ = d / "report" / "summary.json"
    if summ.is_file():
        case["report_summary"] = json.loads(summ.read_text())
    case["oom_reports"] = [p.read_text()[:4000] for p in sorted(d.rglob("oom-*.txt"))] if d.is_dir() else []
    log = (w / f"{n}.log").read_text(errors="replace")
    case["log_tail"] = log.splitlines()[-25:]
    logs.append(f"===== {n}: {case['command']} -> {case['exit_status']} ({case['wall_s']} s)\n{log}")
    rec["cases"].append(case)
(out / "record.json").write_text(json.dumps(rec, indent=2))
(out / "logs.txt").write_text("\n".join(logs))
print(json.dumps([{k: c.get(k) for k in ("name", "exit_status", "wall_s")} for c in rec["cases"]]))
PY
