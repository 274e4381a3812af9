# GPT-2 fp32 training without step marks (no plan): wait_own_stream on (the oldest fence), then off, rounds against PyTorch
SCRATCH=/tmp/st . "$(dirname "$0")/device_setup.sh" 400
for w in 1 0; do
  [ $(left) -gt 60 ] || break
  GPUMEM_WAIT_OWN_STREAM=$w timeout $(left) python3 -m hil.probes.workloads live --workloads gpt2_train --rounds 3 --no-record \
    --steps 40 --warmup 10 --timeout 100 --gpumem-step-marks off --tag gpt2-nomarks-w$w --out /tmp/st \
    > $OUT/log-w$w.txt 2>&1 || echo "rc $?" >> $OUT/log-w$w.txt
done
echo "total $(( $(date +%s) - START )) s" >> $OUT/log-w0.txt
cd /tmp/st && tar czf $OUT/st.tgz .
