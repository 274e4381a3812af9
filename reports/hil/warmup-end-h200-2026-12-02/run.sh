# Llama with variable lengths and the MoE block (no step plan forms in either: the memory-first warm-up ends at its
# 8th mark with none) under PyTorch's allocator, gpumem.torch's default (warmup_give_back off) and gpumem.torch with
# GPUMEM_WARMUP_GIVE_BACK=1 (the rule before 2026-12-02), no trace, the two gpumem settings in alternating
# invocations, ROUNDS rounds of STEPS steps; then one run of each setting recorded with the GPU clock (RECORD=0:
# none). Run on the device from the repository root (OUT set, the simpy wheel in .whl/); the records come back as
# one tar:
#   tar xzf $OUT/warmup-end.tgz -C reports/hil/warmup-end-h200-2026-12-02/run
SCRATCH=/tmp/we . "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-540}
WL=${WL:-llama_varlen_train,moe_train}
S=${STEPS:-40}
for r in $(seq 1 ${ROUNDS:-3}); do
  timeout $(left) python3 -m hil.probes.workloads live --workloads $WL --allocators gpumem,default --steps $S \
      --warmup 6 --timeout 200 --no-record --tag keep$r --out /tmp/we/keep$r >> /tmp/we/log.txt 2>&1 || echo "keep$r rc $?" >> /tmp/we/log.txt
  GPUMEM_WARMUP_GIVE_BACK=1 timeout $(left) python3 -m hil.probes.workloads live --workloads $WL --allocators gpumem \
      --steps $S --warmup 6 --timeout 200 --no-record --tag give$r --out /tmp/we/give$r >> /tmp/we/log.txt 2>&1 || echo "give$r rc $?" >> /tmp/we/log.txt
done
if [ "${RECORD:-1}" = 1 ]; then
  timeout $(left) python3 -m hil.probes.workloads live --workloads $WL --allocators gpumem --steps 24 --warmup 6 \
      --timeout 200 --gpumem-gpu-clock --tag keep-rec --out /tmp/we/keep-rec >> /tmp/we/log.txt 2>&1 || echo "keep-rec rc $?" >> /tmp/we/log.txt
  GPUMEM_WARMUP_GIVE_BACK=1 timeout $(left) python3 -m hil.probes.workloads live --workloads $WL --allocators gpumem \
      --steps 24 --warmup 6 --timeout 200 --gpumem-gpu-clock --tag give-rec --out /tmp/we/give-rec >> /tmp/we/log.txt 2>&1 || echo "give-rec rc $?" >> /tmp/we/log.txt
fi
echo "total $(( $(date +%s) - START )) s" >> /tmp/we/log.txt
tar czf "$OUT/warmup-end.tgz" -C /tmp/we .
cut -c1-170 /tmp/we/log.txt | tail -n 24
