# wait_own_stream (the oldest fence) off and on, each in rounds against PyTorch's allocator (adjacent runs)
SCRATCH=/tmp/wl . "$(dirname "$0")/device_setup.sh" 540
g() {
  [ $(left) -gt 60 ] || return 0
  GPUMEM_WAIT_OWN_STREAM=$1 timeout $(left) python3 -m hil.probes.workloads live --workloads gpt2_train_bf16 \
    --allocators default,gpumem --rounds 3 --steps 40 --warmup 10 --timeout 120 --gpumem-step-marks off --no-record \
    --tag g2-w$1 --out /tmp/wl >> $OUT/log.txt 2>&1 || echo "g w$1 rc $?" >> $OUT/log.txt
}
w() {
  [ $(left) -gt 60 ] || return 0
  GPUMEM_WAIT_OWN_STREAM=$1 timeout $(left) python3 -m hil.probes.workloads live --workloads llama_varlen_train,moe_train \
    --allocators default,gpumem --rounds 2 --steps 40 --warmup 10 --timeout 120 --no-record \
    --tag w2-w$1 --out /tmp/wl >> $OUT/log.txt 2>&1 || echo "w w$1 rc $?" >> $OUT/log.txt
}
g 1; g 0; w 0; w 1
echo "total $(( $(date +%s) - START )) s" >> $OUT/log.txt
cd /tmp/wl && tar czf $OUT/wl.tgz .
