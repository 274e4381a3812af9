# Issue 18: the page slack's live price (run on an H100 later on 2026-12-05: reports/hil/page-slack-h100-2026-12-05.md):
# the workloads whose replays moved in reports/page-slack-2026-12-05.md (MoE and Llama with variable lengths:
# no step plan forms; generate(): no marks), and GPT-2 and ResNet-50 training as controls, under gpumem.torch with
# GPUMEM_PAGE_SLACK unset (0.005) and 0.0015, in ABBA order; 40 steps, 12 untimed, no trace. Each run records peak
# reserved / peak allocated and the hooks' time in the engine's slow path a step (timed_driver.slow_ms).
# Run on the device from the repository root (OUT set, the simpy wheel in .whl/); records in $OUT/page-slack.tgz.
SCRATCH=${SCRATCH:-/tmp/page-slack}
. "$(dirname "$0")/../hil/wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-540}
run() {   # TAG WORKLOAD
  timeout $(left) python3 -m hil.probes.workloads live --workloads $2 --allocators gpumem --steps 40 --warmup 12 \
      --timeout 200 --no-record --tag $1 --out $SCRATCH/$1 >> $SCRATCH/log.txt 2>&1 || echo "$1 rc $?" >> $SCRATCH/log.txt
}
for w in moe_train llama_varlen_train llama_generate gpt2_train resnet50_train; do
  run $w-a-default $w
  GPUMEM_PAGE_SLACK=0.0015 run $w-b-slack0p0015 $w
  GPUMEM_PAGE_SLACK=0.0015 run $w-c-slack0p0015 $w
  run $w-d-default $w
  echo "$w done at $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
done
echo "total $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
tar czf "$OUT/page-slack.tgz" -C $SCRATCH .
python3 "$(dirname "$0")/../hil/sbw-default-h200-2026-12-04/table.py" $SCRATCH || true
tail -3 $SCRATCH/log.txt
