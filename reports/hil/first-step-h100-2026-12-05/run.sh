# Issue 18: the first-step plan layout (Note [A plan laid out for its first step]) on a card. Step time in rounds
# against PyTorch's allocator, nothing recorded, as in reports/hil/step-time-rounds-h200-2026-11-29.md.
# Run on the device from the repository root (OUT set, the simpy wheel in .whl/); records in $OUT/st.
SCRATCH=${SCRATCH:-$OUT/st}
. "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-540}
timeout $(left) python3 -m hil.probes.workloads live --workloads resnet50_train --rounds 4 --no-record --steps 40 \
    --warmup 10 --timeout 100 --tag resnet-rounds --out $SCRATCH > $SCRATCH/resnet.log 2>&1 || echo "resnet rc $?"
timeout $(left) python3 -m hil.probes.workloads live --workloads gpt2_train --rounds 6 --no-record --steps 40 \
    --warmup 10 --timeout 100 --tag gpt2-rounds --out $SCRATCH > $SCRATCH/gpt2.log 2>&1 || echo "gpt2 rc $?"
echo "total $(( $(date +%s) - START )) s"
for f in $SCRATCH/workloads-*.json; do python3 -m hil.probes.workloads steptime $f || true; done
tail -5 $SCRATCH/resnet.log $SCRATCH/gpt2.log
