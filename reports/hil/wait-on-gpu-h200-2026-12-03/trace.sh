# Issue 18: multistream_infer under gpumem.torch with its trace and GPU clock recorded (gpumem's .gmt, the live
# reserve after each allocation), the default and GPUMEM_WAIT_ON_GPU=1, 40 steps, 12 untimed: what the replay
# (--gpu-timing trace, --compare-live; gpu-clock refuses four streams) predicts for the very run. Records in $OUT/wogt.tgz:
#   tar xzf $OUT/wogt.tgz -C reports/hil/wait-on-gpu-h200-2026-12-03/trace
SCRATCH=${SCRATCH:-/tmp/wogt}  # a plain assignment: one before `.` would not outlive it
. "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-200}
rec() {
  timeout $(left) python3 -m hil.probes.workloads live --workloads multistream_infer --allocators gpumem --steps 40 \
      --warmup 12 --gpumem-gpu-clock --timeout 150 --tag $1 --out $SCRATCH/$1 >> $SCRATCH/log.txt 2>&1 || echo "$1 rc $?" >> $SCRATCH/log.txt
}
rec ms-default
GPUMEM_WAIT_ON_GPU=1 rec ms-wog
tar czf "$OUT/wogt.tgz" -C $SCRATCH .
ls -la $SCRATCH/*; tail -5 $SCRATCH/log.txt
