#!/usr/bin/env bash
# Hardware-in-the-loop run on a real GPU: the same suites as on a laptop, on cuda:0,
# plus the device-call probe and the real-device replay benchmark.
#   gpumem/hil/run_gpu.sh OUT_DIR [TRACES_DIR]      (from the repository root; TRACES_DIR: data/traces)
# Writes into OUT_DIR: the pytest record (JSON + Markdown), the full pytest log,
# calibrate.json, the benchmark tables and JSON.
set -uo pipefail
out=${1:?usage: gpumem/hil/run_gpu.sh OUT_DIR [TRACES_DIR]}
traces=${2:-data/traces}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import gpumem; d = gpumem.open_device('cuda:0'); print(d.properties()); print(d.mem_info()); d.close()" 2>&1 | tee "$out/pytest-cuda.log"
python3 -m pytest tests/contract tests/hil tests/cuda_adapter --gpumem-device cuda:0 --gpumem-record "$out" -q -p no:cacheprovider 2>&1 | tee -a "$out/pytest-cuda.log" | tail -40
rc=${PIPESTATUS[0]}
python3 -m gpumem.hil.probes.calibrate --out "$out/calibrate.json" > /dev/null 2>&1 || echo "calibration probe failed"
if [ -d "$traces" ]; then
  python3 benchmarks/replay_bench.py --traces "$traces" --skip-sim --cuda --repeat 3 --json "$out/bench-cuda.json" 2>&1 | tee "$out/bench-cuda.md"
  for t in "$traces"/*.pickle.gz "$traces"/*.csv.gz; do
    [ -f "$t" ] || continue
    python3 -m gpumem replay "$t" --device cuda:0 --json >> "$out/replay-cuda0.jsonl" 2>> "$out/replay-cuda0.err"
  done
fi
exit $rc
