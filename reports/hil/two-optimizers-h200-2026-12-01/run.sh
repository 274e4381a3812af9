# Three programs with two optimizers of one class, written after Note [Two optimizers of one class] (the rule was
# built on gan_train of snapshot-marks-h200-2026-12-01) and run once as its check: each under PyTorch's allocator
# (snapshot) and gpumem.torch, nothing set. Run on the device (OUT set, the simpy wheel in .whl/); the records and
# traces come back as one tar.
SCRATCH=/tmp/to . "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-400}
timeout $(left) python3 -m hil.probes.workloads live --workloads ${WL:-wgan_critic_train,gan_gen_first_train,gan_sgd_train} \
    --allocators default,gpumem --steps ${STEPS:-24} --warmup 6 --timeout 200 --tag check --out /tmp/to \
    > /tmp/to/log-check.txt 2>&1 || echo "rc $?" >> /tmp/to/log-check.txt
echo "total $(( $(date +%s) - START )) s" >> /tmp/to/log-check.txt
tar czf $OUT/two-optimizers.tgz -C /tmp/to .
tail -40 /tmp/to/log-check.txt
