#!/usr/bin/env bash
# What the CuPy records reports/hil/cupy-{hook-bench,suite}-h200-2026-11-25.* and the DDP world-size-1 run
# came from, in one device call, from the checkout's root with gpumem importable (PYTHONPATH), $OUT a folder
# for the results, $CUPY_TESTS a checkout of CuPy's tests at the installed tag, and $T_START the call's start
# (seconds since the epoch; everything ends before 575 s after it):
# 1. the device tests of the CuPy hook and the runners' own tests;
# 2. the hook's cost per operation against CuPy's pool (alone on the machine, for timing);
# 3. CuPy's suite under both allocators at once, and the DDP probe at world size 1 beside it.
set -u
left() { echo $((575 - ($(date +%s) - T_START))); }
{ echo "== native build (tail)"; tail -5 "${BUILD_LOG:-/dev/null}"; echo "== device tests"; } >"$OUT/pytest-cupy.log"
timeout 120 python3 -m pytest -q -rs --gpumem-device cuda:0 tests/hil/test_cupy_integration.py \
    tests/cuda_adapter/test_cupy_hook.py tests/hil/test_cupy_suite_runner.py tests/hil/test_ddp_probe.py \
    >>"$OUT/pytest-cupy.log" 2>&1
echo "exit $?" >>"$OUT/pytest-cupy.log"
timeout 170 python3 benchmarks/cupy_hook_bench.py --passes 3 --python-adapter --breakdown \
    --json "$OUT/cupy-hook-bench.json" >"$OUT/cupy-hook-bench.txt" 2>&1
echo "exit $? at $(( $(date +%s) - T_START )) s" >>"$OUT/cupy-hook-bench.txt"
timeout $(( $(left) - 10 )) python3 hil/ddp_probe.py run --nproc 1 --steps 20 --timeout-s 200 \
    --out-json "$OUT/ddp-ws1.json" >"$OUT/ddp-ws1.log" 2>&1 &
ddp=$!
python3 -m hil.cupy_suite --tests "$CUPY_TESTS" --out "$OUT" --stem cupy-suite --tag v14.2.0 --jobs 7 \
    --deadline-s $(( $(left) - 25 )) >/dev/null 2>&1
echo "suite exit $? at $(( $(date +%s) - T_START )) s" >>"$OUT/cupy-hook-bench.txt"
wait $ddp
echo "exit $?" >>"$OUT/ddp-ws1.log"
