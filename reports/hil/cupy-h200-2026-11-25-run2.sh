#!/usr/bin/env bash
# The second CuPy device call of 2026-11-25 (after the hook read the device from the current context and
# the benchmark counted the engine's calls): as cupy-h200-2026-11-25.sh, within 330 s of $T_START:
# 1. the device tests; 2. the per-op bench (default policy), then with page_slack 0.05 and 0.2 (each a
# process of its own: the policy is the engine's from its creation); 3. CuPy's suite under both allocators
# with the folders in reverse order (the first run's deadline cut the end of the order).
set -u
left() { echo $((330 - ($(date +%s) - T_START))); }
{ echo "== native build (tail)"; tail -5 "${BUILD_LOG:-/dev/null}"; echo "== device tests"; } >"$OUT/pytest-cupy.log"
timeout 90 python3 -m pytest -q -rs --gpumem-device cuda:0 tests/hil/test_cupy_integration.py \
    tests/cuda_adapter/test_cupy_hook.py tests/hil/test_cupy_suite_runner.py tests/hil/test_ddp_probe.py \
    >>"$OUT/pytest-cupy.log" 2>&1
echo "exit $?" >>"$OUT/pytest-cupy.log"
timeout 100 python3 benchmarks/cupy_hook_bench.py --passes 3 --python-adapter --breakdown \
    --json "$OUT/cupy-hook-bench.json" >"$OUT/cupy-hook-bench.txt" 2>&1
echo "exit $? at $(( $(date +%s) - T_START )) s" >>"$OUT/cupy-hook-bench.txt"
for slack in 0.05 0.2; do
    timeout 60 python3 benchmarks/cupy_hook_bench.py --passes 3 --page-slack $slack >>"$OUT/cupy-hook-bench-slack.txt" 2>&1
    echo "exit $? at $(( $(date +%s) - T_START )) s" >>"$OUT/cupy-hook-bench-slack.txt"
done
python3 -m hil.cupy_suite --tests "$CUPY_TESTS" --out "$OUT" --stem cupy-suite --tag v14.2.0 --jobs 7 \
    --folders logic,linalg,fft,statistics,indexing,sorting,manipulation,creation \
    --deadline-s $(( $(left) - 15 )) >/dev/null 2>&1
echo "suite exit $? at $(( $(date +%s) - T_START )) s" >>"$OUT/cupy-hook-bench.txt"
