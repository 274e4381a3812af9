# wait_own_stream's step time, live, against the simulator's prediction (reports/sim-sync-drain.md): the
# workloads named in $WORKLOADS (default: GPT-2 bf16 and ResNet-50), step marks off (no plan), the rule on then
# off, rounds of gpumem.torch and PyTorch's allocator alternating. Run from the checkout on the device with the
# simpy wheel in .whl/ and OUT set: OUT=/some/dir bash reports/hil/sync-drain-h200-2026-12-01/rule_time.sh
SCRATCH=/tmp/st . "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-540}
for wl in ${WORKLOADS:-gpt2_train_bf16 resnet50_train}; do
  for w in 1 0; do
    [ $(left) -gt 60 ] || break
    GPUMEM_WAIT_OWN_STREAM=$w timeout $(left) python3 -m hil.probes.workloads live --workloads $wl --rounds ${ROUNDS:-3} \
      --no-record --steps 40 --warmup 10 --timeout 100 --gpumem-step-marks off --tag $wl-w$w --out /tmp/st \
      > $OUT/log-$wl-w$w.txt 2>&1 || echo "rc $?" >> $OUT/log-$wl-w$w.txt
  done
done
echo "total $(( $(date +%s) - START )) s" >> $OUT/log-total.txt
cp /tmp/st/*.json $OUT/ 2>/dev/null || true
