# Note [A plan that leaves early] on the H200: the WGAN (its live peak set by a plan of the critic's steps that
# the generator's step left) under both allocators, and, under gpumem.torch, the other two-optimizer programs and
# two whose steps vary (variable lengths, GradScaler skips) as the check that nothing else moves. Run on the
# device (OUT set, the simpy wheel in .whl/); the records and traces come back as one tar.
SCRATCH=/tmp/el . "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-500}
timeout $(left) python3 -m hil.probes.workloads live --workloads wgan_critic_train \
    --allocators default,gpumem --steps ${STEPS:-24} --warmup 6 --timeout 200 --tag wgan --out /tmp/el \
    > /tmp/el/log-wgan.txt 2>&1 || echo "rc $?" >> /tmp/el/log-wgan.txt
timeout $(left) python3 -m hil.probes.workloads live \
    --workloads ${WL:-gan_train,gan_gen_first_train,gan_sgd_train,llama_varlen_train,gpt2_train_fp16_scaler} \
    --allocators gpumem --steps ${STEPS:-24} --warmup 6 --timeout 200 --tag check --out /tmp/el \
    > /tmp/el/log-check.txt 2>&1 || echo "rc $?" >> /tmp/el/log-check.txt
echo "total $(( $(date +%s) - START )) s" >> /tmp/el/log-check.txt
tar czf $OUT/early-leave.tgz -C /tmp/el .
tail -30 /tmp/el/log-wgan.txt /tmp/el/log-check.txt
