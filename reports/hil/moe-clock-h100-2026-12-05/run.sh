# Issue 18: the MoE program (moe_train), whose replay under gpumem (1.25 %) sits 0.7-1.2 points under live
# gpumem.torch (1.90-2.44 %: reports/hil/page-slack-h100-2026-12-05.md), recorded under gpumem.torch twice: with
# the trace's GPU clock (--gpumem-gpu-clock) and without, so that each trace's replay can be set beside its run.
# Run on the device from the repository root (OUT set, the simpy wheel in .whl/); records and traces in
# $OUT/moe-clock.tgz: tar xzf it -C reports/hil/moe-clock-h100-2026-12-05/run
SCRATCH=/tmp/mc . "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-240}
for arm in plain clock; do
  flag=""; [ $arm = clock ] && flag=--gpumem-gpu-clock
  timeout $(left) python3 -m hil.probes.workloads live --workloads moe_train --allocators gpumem --steps 24 \
      --warmup 6 --timeout 120 --tag $arm $flag --out /tmp/mc/$arm >> /tmp/mc/log.txt 2>&1 || echo "$arm rc $?" >> /tmp/mc/log.txt
done
echo "total $(( $(date +%s) - START )) s" >> /tmp/mc/log.txt
tar czf "$OUT/moe-clock.tgz" -C /tmp/mc .
grep -E "overhead|rc|total" /tmp/mc/log.txt | sed 's/plan {.*//'
