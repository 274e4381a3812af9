# Issue 18: the rule of steal_before_warmup (on by default) now counts allocations that stole, once each however many
# chunks they took, and ends past 512 plus one per 256 allocations (an attacker's review: counted per chunk, one
# large allocation at load ended it). The check of sbw-latch-h200-2026-12-04.md again on the new count: training with
# gpumem.torch's step marks off (ResNet-50 off, on, on; GPT-2 on, on: its off runs are in the records before) and
# generate() with nothing set. 40 steps, 12 untimed, no trace. First the PyTorch tests of gpumem.torch on the card.
# Run on the device from the repository root (OUT set, the simpy wheel in .whl/); records in $OUT/sbw-per-alloc.tgz:
#   tar xzf $OUT/sbw-per-alloc.tgz -C reports/hil/sbw-per-alloc-h200-2026-12-04/run
SCRATCH=${SCRATCH:-/tmp/sbw-per-alloc}
. "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-400}
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/pytorch/test_torch_on_gpumem.py --gpumem-device cuda:0 > $SCRATCH/torch-tests.txt 2>&1 || true
tail -2 $SCRATCH/torch-tests.txt
nomarks() {   # TAG WORKLOAD: gpumem.torch with its step marks off
  timeout $(left) python3 -m hil.probes.workloads live --workloads $2 --allocators gpumem --steps 40 --warmup 12 \
      --timeout 200 --no-record --gpumem-step-marks off --tag $1 --out $SCRATCH/$1 >> $SCRATCH/log.txt 2>&1 || echo "$1 rc $?" >> $SCRATCH/log.txt
}
GPUMEM_STEAL_BEFORE_WARMUP=0 nomarks resnet50_train-a-off resnet50_train
nomarks resnet50_train-b-on resnet50_train
nomarks resnet50_train-c-on resnet50_train
nomarks gpt2_train-b-on gpt2_train
nomarks gpt2_train-c-on gpt2_train
timeout $(left) python3 -m hil.probes.workloads live --workloads llama_generate --allocators gpumem --steps 40 \
    --warmup 12 --timeout 200 --no-record --tag generate-default --out $SCRATCH/generate-default >> $SCRATCH/log.txt 2>&1 || true
echo "total $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
tar czf "$OUT/sbw-per-alloc.tgz" -C $SCRATCH .
python3 "$(dirname "$0")/../sbw-default-h200-2026-12-04/table.py" $SCRATCH || true
tail -3 $SCRATCH/log.txt
