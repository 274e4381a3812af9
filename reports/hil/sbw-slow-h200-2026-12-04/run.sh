# Issue 18: what does the stream-ordered steal before a warm-up (steal_before_warmup, off by default) add to
# generate()'s host time? Wall step times of one setting spread 289-389 ms on this shared host
# (sbw-ab-h200-2026-12-04.md), so each run now also records the hooks' time in the engine's slow path
# (timed_driver.slow_ms: every allocation and free the fast path does not serve, driver calls included; Note
# [Time in the engine's slow path] in gpumem/_native/torch_api.cpp). Per round: PyTorch's allocator, then gpumem
# with the knob off, on, on, off (ABBA), then PyTorch's again; llama_generate, 40 steps of which 12 untimed, no trace.
# Run on the device from the repository root (OUT set, the simpy wheel in .whl/); records in $OUT/sbw-slow.tgz:
#   tar xzf $OUT/sbw-slow.tgz -C reports/hil/sbw-slow-h200-2026-12-04/run
SCRATCH=${SCRATCH:-/tmp/sbw-slow}
. "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-540}
. "$(dirname "$0")/../sos-nomarks-h200-2026-12-03/live.sh"
R=${ROUNDS:-2}
for i in $(seq 1 $R); do
  live r${i}a-pt llama_generate default
  GPUMEM_STEAL_BEFORE_WARMUP=0 live r${i}b-off llama_generate gpumem
  GPUMEM_STEAL_BEFORE_WARMUP=1 live r${i}c-on llama_generate gpumem
  GPUMEM_STEAL_BEFORE_WARMUP=1 live r${i}d-on llama_generate gpumem
  GPUMEM_STEAL_BEFORE_WARMUP=0 live r${i}e-off llama_generate gpumem
  live r${i}f-pt llama_generate default
  echo "round $i done at $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
  [ $(left) -gt 200 ] || break
done
echo "total $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
tar czf "$OUT/sbw-slow.tgz" -C $SCRATCH .
python3 "$(dirname "$0")/ab.py" $SCRATCH || true
tail -5 $SCRATCH/log.txt
