# Issue 18: does the stream-ordered steal before a warm-up (steal_before_warmup, off by default) cost generate()
# step time? The record before (sos-nomarks-h200-2026-12-03.md) saw +18.2 %, +5.2 % and -0.5 % by the sums of step
# minima, from runs of one setting made one after the other. Here the two settings alternate in ABBA order
# (GPUMEM_STEAL_BEFORE_WARMUP=0 then =1, =1 then =0, ...), ROUNDS pairs, llama_generate under gpumem only, 40 steps,
# 12 untimed, no trace; each run also records every step's process CPU time (host_cpu_step_ms) and its driver calls.
# Run on the device from the repository root (OUT set, the simpy wheel in .whl/); records in $OUT/sbw.tgz:
#   tar xzf $OUT/sbw.tgz -C reports/hil/sbw-ab-h200-2026-12-04/run
SCRATCH=${SCRATCH:-/tmp/sbw}
. "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-560}
. "$(dirname "$0")/../sos-nomarks-h200-2026-12-03/live.sh"
R=${ROUNDS:-3}
for i in $(seq 1 $R); do
  GPUMEM_STEAL_BEFORE_WARMUP=0 live r${i}a-off llama_generate gpumem
  GPUMEM_STEAL_BEFORE_WARMUP=1 live r${i}b-on llama_generate gpumem
  GPUMEM_STEAL_BEFORE_WARMUP=1 live r${i}c-on llama_generate gpumem
  GPUMEM_STEAL_BEFORE_WARMUP=0 live r${i}d-off llama_generate gpumem
  echo "round $i done at $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
  [ $(left) -gt 120 ] || break
done
echo "total $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
tar czf "$OUT/sbw.tgz" -C $SCRATCH .
python3 "$(dirname "$0")/ab.py" $SCRATCH || true
tail -5 $SCRATCH/log.txt
