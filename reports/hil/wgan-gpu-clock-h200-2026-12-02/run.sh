# The WGAN of reports/early-leave.md on the H200 under gpumem.torch with the trace's GPU clock (start_trace(
# gpu_clock=True)): when the GPU ran each op's work, to check the trace timing's lag where its replay first differs
# from the live engine (op 789, +16 MiB). Once without the clock as the check that recording it moves nothing.
# Run on the device (OUT set, the simpy wheel in .whl/); the records and traces come back as one tar.
SCRATCH=/tmp/wc . "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-300}
mkdir -p /tmp/wc/clock /tmp/wc/plain
timeout $(left) python3 -m hil.probes.workloads live --workloads wgan_critic_train \
    --allocators gpumem --steps ${STEPS:-24} --warmup 6 --timeout 200 --tag clock --gpumem-gpu-clock --out /tmp/wc/clock \
    > /tmp/wc/log-clock.txt 2>&1 || echo "rc $?" >> /tmp/wc/log-clock.txt
timeout $(left) python3 -m hil.probes.workloads live --workloads wgan_critic_train \
    --allocators gpumem --steps ${STEPS:-24} --warmup 6 --timeout 200 --tag plain --out /tmp/wc/plain \
    > /tmp/wc/log-plain.txt 2>&1 || echo "rc $?" >> /tmp/wc/log-plain.txt
echo "total $(( $(date +%s) - START )) s" >> /tmp/wc/log-plain.txt
tar czf "$OUT/wgan-clock.tgz" -C /tmp/wc .
tail -n 8 /tmp/wc/log-clock.txt /tmp/wc/log-plain.txt
