# Llama with variable lengths and the MoE block (no step plan forms in either) under PyTorch's allocator, gpumem.torch's
# default and gpumem.torch with GPUMEM_WAIT_OWN_STREAM=1, two rounds each, no trace (step time as a program runs),
# then one recorded run of each with the knob and the clock (memory, and replays; RECORD=0: none). STEPS and ROUNDS
# change the runs' length and rounds (2026-12-02: 24 steps, 2 rounds, in run/; 40 steps, 3 rounds, RECORD=0, in
# run/long/ with OUT's tar unpacked there). Run on the device from the
# repository root (OUT set, the simpy wheel in .whl/); the records come back as one tar:
#   tar xzf $OUT/wait-own.tgz -C reports/hil/wait-own-varlen-h200-2026-12-02/run
SCRATCH=/tmp/wo . "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-480}
WL=${WL:-llama_varlen_train,moe_train}
timeout $(left) python3 -m hil.probes.workloads live --workloads $WL --allocators gpumem,default --rounds ${ROUNDS:-2} \
    --steps ${STEPS:-24} --warmup 6 --timeout 200 --no-record --tag off --out /tmp/wo/off >> /tmp/wo/log.txt 2>&1 || echo "off rc $?" >> /tmp/wo/log.txt
GPUMEM_WAIT_OWN_STREAM=1 timeout $(left) python3 -m hil.probes.workloads live --workloads $WL --allocators gpumem \
    --rounds ${ROUNDS:-2} --steps ${STEPS:-24} --warmup 6 --timeout 200 --no-record --tag on --out /tmp/wo/on >> /tmp/wo/log.txt 2>&1 || echo "on rc $?" >> /tmp/wo/log.txt
[ "${RECORD:-1}" = 1 ] && GPUMEM_WAIT_OWN_STREAM=1 timeout $(left) python3 -m hil.probes.workloads live --workloads $WL --allocators gpumem \
    --steps ${STEPS:-24} --warmup 6 --timeout 200 --gpumem-gpu-clock --tag on-rec --out /tmp/wo/on-rec >> /tmp/wo/log.txt 2>&1 || echo "rec rc $?" >> /tmp/wo/log.txt
echo "total $(( $(date +%s) - START )) s" >> /tmp/wo/log.txt
tar czf "$OUT/wait-own.tgz" -C /tmp/wo .
cut -c1-170 /tmp/wo/log.txt | tail -n 16
