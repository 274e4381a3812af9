# The WGAN of run.sh again under gpumem.torch alone, after the rarer-optimizer hand-over (Note [Automatic step
# marks]: RARER_GAPS), to set its own trace beside the snapshot's replay under the same rule.
SCRATCH=/tmp/tr . "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-300}
timeout $(left) python3 -m hil.probes.workloads live --workloads wgan_critic_train \
    --allocators gpumem --steps ${STEPS:-24} --warmup 6 --timeout 200 --tag rule --out /tmp/tr \
    > /tmp/tr/log-rule.txt 2>&1 || echo "rc $?" >> /tmp/tr/log-rule.txt
echo "total $(( $(date +%s) - START )) s" >> /tmp/tr/log-rule.txt
tar czf $OUT/rule.tgz -C /tmp/tr .
tail -20 /tmp/tr/log-rule.txt
