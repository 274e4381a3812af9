# Three training programs never looked at when the step marks read off a snapshot were designed (Note [Step marks
# read off a snapshot's optimizer steps]): each under PyTorch's allocator (snapshot) and gpumem.torch, nothing set.
# Run on the device (OUT set, the simpy wheel in .whl/); the records and traces come back as one tar.
SCRATCH=/tmp/sm . "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-560}
timeout $(left) python3 -m hil.probes.workloads live --workloads ${WL:-vit_train_fp16_scaler,resnet50_train_accum,gan_train} \
    --allocators default,gpumem --steps ${STEPS:-24} --warmup 6 --timeout 240 --tag check --out /tmp/sm \
    > /tmp/sm/log-check.txt 2>&1 || echo "rc $?" >> /tmp/sm/log-check.txt
echo "total $(( $(date +%s) - START )) s" >> /tmp/sm/log-check.txt
tar czf $OUT/snapshot-marks.tgz -C /tmp/sm .
tail -40 /tmp/sm/log-check.txt
