# The check programs of reports/early-leave.md (the two-optimizer GANs, GPT-2 fp16 with GradScaler, Llama with
# variable lengths) under gpumem.torch with the trace's GPU clock (start_trace(gpu_clock=True)), to set the
# default replay of a clock-less trace (`trace` timing) beside the replay on the clock (`gpu-clock`) and live.
# Run on the device from the repository root (OUT set, the simpy wheel in .whl/); the records and traces come back
# as one tar: tar xzf $OUT/check-clock.tgz -C reports/hil/check-gpu-clock-h200-2026-12-02/run
SCRATCH=/tmp/cc . "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-400}
timeout $(left) python3 -m hil.probes.workloads live \
    --workloads ${WL:-gan_train,gan_gen_first_train,gan_sgd_train,llama_varlen_train,gpt2_train_fp16_scaler} \
    --allocators gpumem --steps ${STEPS:-24} --warmup 6 --timeout 200 --tag clock --gpumem-gpu-clock --out /tmp/cc \
    > /tmp/cc/log-clock.txt 2>&1 || echo "rc $?" >> /tmp/cc/log-clock.txt
echo "total $(( $(date +%s) - START )) s" >> /tmp/cc/log-clock.txt
tar czf "$OUT/check-clock.tgz" -C /tmp/cc .
tail -n 8 /tmp/cc/log-clock.txt
