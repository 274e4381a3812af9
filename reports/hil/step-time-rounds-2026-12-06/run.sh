# Issue 18: step time of gpumem.torch against PyTorch's allocator, more rounds than first-step-h100-2026-12-05 had
# (ResNet-50: 4 rounds, interval -2.15 ... +2.46 %), with the code of this session (the plan's room: Note [The room
# counts whole chunks]). Rounds alternate the two allocators, each in its own process, nothing recorded.
# Run on the device from the repository root (OUT set, the simpy wheel in .whl/); records in $OUT/st.
SCRATCH=${SCRATCH:-$OUT/st}
. "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-560}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $SCRATCH/gpu.txt
timeout $(left) python3 -m hil.probes.workloads live --workloads resnet50_train --rounds 10 --no-record --steps 40 \
    --warmup 10 --timeout 100 --tag resnet-rounds --out $SCRATCH > $SCRATCH/resnet.log 2>&1 || echo "resnet rc $?"
timeout $(left) python3 -m hil.probes.workloads live --workloads gpt2_train --rounds 7 --no-record --steps 40 \
    --warmup 10 --timeout 100 --tag gpt2-rounds --out $SCRATCH > $SCRATCH/gpt2.log 2>&1 || echo "gpt2 rc $?"
echo "total $(( $(date +%s) - START )) s"
for f in $SCRATCH/workloads-*.json; do python3 -m hil.probes.workloads steptime $f || true; done
grep -h "overhead" $SCRATCH/resnet.log $SCRATCH/gpt2.log | sed 's/ plan {.*//' | sort | uniq -c | head -40
