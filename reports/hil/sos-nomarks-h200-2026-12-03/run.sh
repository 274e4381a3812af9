# Issue 18: the stream-ordered steal for programs that never mark a step? Each run records the engine's driver
# calls over its timed steps and the host's time inside them (hil.probes.workloads' timed_driver; Note [Time in
# driver calls] in gpumem/_native/cuda_backend.h), so the steal's cost is measured in the run, not read off step
# times that move by 10-20 % on this host. Runs, 40 steps with the first 12 untimed, no trace recorded:
#   * generate() (GEN rounds, default 2): the steal on and off (GPUMEM_STREAM_ORDERED_STEAL=1/0), in the order
#     on, off in odd rounds and off, on in even ones; PyTorch's allocator once a round;
#   * training without step marks (GPUMEM_STEP_MARKS=off; TRAIN, default gpt2_train,resnet50_train): on, then off.
# Run on the device from the repository root (OUT set, the simpy wheel in .whl/); the records come back as one
# tar of SCRATCH's content (default /tmp/sosn): tar xzf $OUT/sosn.tgz -C reports/hil/sos-nomarks-h200-2026-12-03/run
SCRATCH=${SCRATCH:-/tmp/sosn}  # a plain assignment: one before `.` would not outlive it
. "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-560}
. "$(dirname "$0")/live.sh"
for r in $(seq 1 ${GEN:-2}); do
  if [ $((r % 2)) = 1 ]; then order="1 0"; else order="0 1"; fi
  for v in $order; do GPUMEM_STREAM_ORDERED_STEAL=$v live gen$v-$r llama_generate gpumem; done
  live gent-$r llama_generate default
done
for v in 1 0; do
  GPUMEM_STEP_MARKS=off GPUMEM_STREAM_ORDERED_STEAL=$v live train$v ${TRAIN:-gpt2_train,resnet50_train} gpumem
done
echo "total $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
tar czf "$OUT/sosn.tgz" -C $SCRATCH .
cut -c1-150 $SCRATCH/log.txt | grep -v "^|" | tail -n 30
for f in $SCRATCH/*/workloads-*.json; do
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[1].split('/')[-2], r['workload'], r['allocator'], r.get('gpumem_env'), round((r['peak_reserved_bytes']/r['peak_allocated_bytes']-1)*100,2), r.get('timed_driver')) for r in d.get('runs', d if isinstance(d, list) else [])]" $f || true
done
