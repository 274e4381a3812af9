# wait_own_stream (the oldest fence) off against on, gpumem.torch only, alternating; one PyTorch reference round
SCRATCH=/tmp/wl . "$(dirname "$0")/device_setup.sh" 540
g() {  # setting round allocators
  [ $(left) -gt 40 ] || return 0
  GPUMEM_WAIT_OWN_STREAM=$1 timeout $(left) python3 -m hil.probes.workloads live --workloads gpt2_train_bf16 \
    --allocators $3 --steps 40 --warmup 10 --timeout 120 --gpumem-step-marks off --no-record --tag g-w$1-r$2 --out /tmp/wl \
    >> $OUT/log.txt 2>&1 || echo "g w$1 r$2 rc $?" >> $OUT/log.txt
}
w() {
  [ $(left) -gt 60 ] || return 0
  GPUMEM_WAIT_OWN_STREAM=$1 timeout $(left) python3 -m hil.probes.workloads live --workloads llama_varlen_train,moe_train \
    --allocators $3 --steps 40 --warmup 10 --timeout 120 --no-record --tag w-w$1-r$2 --out /tmp/wl \
    >> $OUT/log.txt 2>&1 || echo "w w$1 r$2 rc $?" >> $OUT/log.txt
  [ $(left) -gt 30 ] || return 0
  GPUMEM_WAIT_OWN_STREAM=$1 timeout $(left) python3 -m hil.probes.workloads live --workloads llama_generate \
    --allocators $3 --steps 12 --warmup 4 --timeout 120 --no-record --tag i-w$1-r$2 --out /tmp/wl \
    >> $OUT/log.txt 2>&1 || echo "i w$1 r$2 rc $?" >> $OUT/log.txt
}
g 0 1 default,gpumem; g 1 1 gpumem; w 0 1 default,gpumem; w 1 1 gpumem
g 1 2 gpumem; g 0 2 gpumem; w 1 2 gpumem; w 0 2 gpumem
g 0 3 gpumem; g 1 3 gpumem; w 0 3 gpumem; w 1 3 gpumem
echo "total $(( $(date +%s) - START )) s" >> $OUT/log.txt
cd /tmp/wl && tar czf $OUT/wl.tgz .
