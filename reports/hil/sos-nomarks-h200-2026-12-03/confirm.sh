# Issue 18: the default of commit de74743 (steal_before_warmup on; off since) run as a user runs it, nothing set, and with
# GPUMEM_STEAL_BEFORE_WARMUP=0; 40 steps, 12 untimed, no trace; records as in run.sh (timed_driver):
#   * generate() and multistream_infer (no marks): the default, then GPUMEM_STEAL_BEFORE_WARMUP=0;
#   * GPT-2 and ResNet-50 training with marks (the default): the default, for the figures a plan gives;
#   * the same with GPUMEM_STEP_MARKS=off: the default (the steal now), then GPUMEM_STEAL_BEFORE_WARMUP=0.
# Run on the device from the repository root (OUT set, the simpy wheel in .whl/); records in $OUT/sosc.tgz:
#   tar xzf $OUT/sosc.tgz -C reports/hil/sos-nomarks-h200-2026-12-03/confirm
SCRATCH=${SCRATCH:-/tmp/sosc}  # a plain assignment: one before `.` would not outlive it
. "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-500}
. "$(dirname "$0")/live.sh"
live infer-default llama_generate,multistream_infer gpumem,default
GPUMEM_STEAL_BEFORE_WARMUP=0 live infer-before0 llama_generate,multistream_infer gpumem
live train-marks gpt2_train,resnet50_train gpumem
GPUMEM_STEP_MARKS=off live train-nomarks gpt2_train,resnet50_train gpumem
GPUMEM_STEP_MARKS=off GPUMEM_STEAL_BEFORE_WARMUP=0 live train-nomarks-before0 gpt2_train,resnet50_train gpumem
echo "total $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
tar czf "$OUT/sosc.tgz" -C $SCRATCH .
for f in $SCRATCH/*/workloads-*.json; do
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[1].split('/')[-2], r['workload'], r['allocator'], r.get('gpumem_env'), round((r['peak_reserved_bytes']/r['peak_allocated_bytes']-1)*100,2), round(r['mean_step_ms'],2), r.get('timed_driver')) for r in d['runs']]" $f || true
done
