#!/usr/bin/env bash
# The third CuPy device call of 2026-11-25 (issue 19 point 3, after the quiet commit and the engine's hot
# path work): from the checkout's root with gpumem importable (PYTHONPATH) and the native engine built,
# $OUT a folder for the results, $T_START the call's start (seconds since the epoch):
# 1. the device tests of the CuPy hook; 2. the per-op bench under the policy install() gives (CuPy's page
# slack, 0.2), with the breakdown; 3. the same with page_slack 0.005, the default policy's (each a process of
# its own: the engine's policy is fixed at its creation) ($SLACKS, when set, names other values; empty: none).
set -u
{ echo "== native build (tail)"; tail -5 "${BUILD_LOG:-/dev/null}"; echo "== device tests"; } >"$OUT/pytest-cupy.log"
timeout 60 python3 -m pytest -q -rs --gpumem-device cuda:0 tests/cuda_adapter/test_cupy_integration.py \
    tests/cuda_adapter/test_cupy_hook.py >>"$OUT/pytest-cupy.log" 2>&1
echo "exit $? at $(( $(date +%s) - T_START )) s" >>"$OUT/pytest-cupy.log"
timeout 60 python3 benchmarks/cupy_hook_bench.py --passes 5 --breakdown --json "$OUT/cupy-hook-bench.json" \
    >"$OUT/cupy-hook-bench.txt" 2>&1
echo "exit $? at $(( $(date +%s) - T_START )) s" >>"$OUT/cupy-hook-bench.txt"
for slack in ${SLACKS-0.005}; do
    timeout 35 python3 benchmarks/cupy_hook_bench.py --passes 3 --page-slack $slack >>"$OUT/cupy-hook-bench-slack.txt" 2>&1
    echo "exit $? at $(( $(date +%s) - T_START )) s" >>"$OUT/cupy-hook-bench-slack.txt"
done
