# Llama with variable lengths and the MoE block (no step plan forms in either: the memory-first warm-up ends at its
# 8th mark with none) under PyTorch's allocator, gpumem.torch with GPUMEM_WARMUP_GIVE_BACK=0 (kept; the default when
# this ran) and with GPUMEM_WARMUP_GIVE_BACK=1 (given back: the rule before, and again the default now), each set explicitly so that
# a rerun gives the same rows whatever the default; no trace, the two gpumem settings in alternating
# invocations, ROUNDS rounds (3) of STEPS steps (40), WARMUP of them untimed (6); then one run of each setting
# recorded with the GPU clock (RECORD=0: none). WL: the workloads. Run on the device from the repository root (OUT
# set, the simpy wheel in .whl/); the records come back as one tar, SCRATCH's content (default /tmp/we):
#   tar xzf $OUT/warmup-end.tgz -C reports/hil/warmup-end-h200-2026-12-02/run
# The second call (records in run/steady/): SCRATCH=/tmp/we2 WL=llama_varlen_train STEPS=48 WARMUP=12 ROUNDS=5
# RECORD=0, a 5-round check of steady steps only (the warm-up's end untimed).
SCRATCH=${SCRATCH:-/tmp/we} . "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-540}
WL=${WL:-llama_varlen_train,moe_train}
S=${STEPS:-40}
for r in $(seq 1 ${ROUNDS:-3}); do
  GPUMEM_WARMUP_GIVE_BACK=0 timeout $(left) python3 -m hil.probes.workloads live --workloads $WL --allocators gpumem,default --steps $S \
      --warmup ${WARMUP:-6} --timeout 200 --no-record --tag keep$r --out $SCRATCH/keep$r >> $SCRATCH/log.txt 2>&1 || echo "keep$r rc $?" >> $SCRATCH/log.txt
  GPUMEM_WARMUP_GIVE_BACK=1 timeout $(left) python3 -m hil.probes.workloads live --workloads $WL --allocators gpumem \
      --steps $S --warmup ${WARMUP:-6} --timeout 200 --no-record --tag give$r --out $SCRATCH/give$r >> $SCRATCH/log.txt 2>&1 || echo "give$r rc $?" >> $SCRATCH/log.txt
done
if [ "${RECORD:-1}" = 1 ]; then
  GPUMEM_WARMUP_GIVE_BACK=0 timeout $(left) python3 -m hil.probes.workloads live --workloads $WL --allocators gpumem --steps 24 --warmup 6 \
      --timeout 200 --gpumem-gpu-clock --tag keep-rec --out $SCRATCH/keep-rec >> $SCRATCH/log.txt 2>&1 || echo "keep-rec rc $?" >> $SCRATCH/log.txt
  GPUMEM_WARMUP_GIVE_BACK=1 timeout $(left) python3 -m hil.probes.workloads live --workloads $WL --allocators gpumem \
      --steps 24 --warmup 6 --timeout 200 --gpumem-gpu-clock --tag give-rec --out $SCRATCH/give-rec >> $SCRATCH/log.txt 2>&1 || echo "give-rec rc $?" >> $SCRATCH/log.txt
fi
echo "total $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
tar czf "$OUT/warmup-end.tgz" -C $SCRATCH .
cut -c1-170 $SCRATCH/log.txt | tail -n 24
