# Issue 18: steal_before_warmup on by default, its rule ending for the run where the steals made under it (of every
# kind) pass 512 plus one per 256 allocations (Note [The ordered steal before a warm-up]). The case that kept the knob
# off (sbw-default-h200-2026-12-04.md): training with gpumem.torch's step marks off, GPT-2 and ResNet-50, the knob
# off and on in ABBA order; then generate() with nothing set, twice. Each run records the hooks' time in the
# engine's slow path a step (timed_driver.slow_ms). 40 steps, 12 untimed, no trace. First the PyTorch tests of
# gpumem.torch on the card.
# Run on the device from the repository root (OUT set, the simpy wheel in .whl/); records in $OUT/sbw-latch.tgz:
#   tar xzf $OUT/sbw-latch.tgz -C reports/hil/sbw-latch-h200-2026-12-04/run
SCRATCH=${SCRATCH:-/tmp/sbw-latch}
. "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-540}
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/pytorch/test_torch_on_gpumem.py --gpumem-device cuda:0 > $SCRATCH/torch-tests.txt 2>&1 || true
tail -2 $SCRATCH/torch-tests.txt
nomarks() {   # TAG WORKLOAD: gpumem.torch with its step marks off
  timeout $(left) python3 -m hil.probes.workloads live --workloads $2 --allocators gpumem --steps 40 --warmup 12 \
      --timeout 200 --no-record --gpumem-step-marks off --tag $1 --out $SCRATCH/$1 >> $SCRATCH/log.txt 2>&1 || echo "$1 rc $?" >> $SCRATCH/log.txt
}
for w in resnet50_train gpt2_train; do
  GPUMEM_STEAL_BEFORE_WARMUP=0 nomarks $w-a-off $w
  GPUMEM_STEAL_BEFORE_WARMUP=1 nomarks $w-b-on $w
  GPUMEM_STEAL_BEFORE_WARMUP=1 nomarks $w-c-on $w
  GPUMEM_STEAL_BEFORE_WARMUP=0 nomarks $w-d-off $w
  echo "$w done at $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
done
for i in 1 2; do
  timeout $(left) python3 -m hil.probes.workloads live --workloads llama_generate --allocators gpumem --steps 40 \
      --warmup 12 --timeout 200 --no-record --tag generate-default-$i --out $SCRATCH/generate-default-$i >> $SCRATCH/log.txt 2>&1 || true
done
echo "total $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
tar czf "$OUT/sbw-latch.tgz" -C $SCRATCH .
python3 "$(dirname "$0")/../sbw-default-h200-2026-12-04/table.py" $SCRATCH || true
tail -3 $SCRATCH/log.txt
