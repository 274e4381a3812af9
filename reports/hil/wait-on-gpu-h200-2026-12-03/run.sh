# Issue 18: AllocatorPolicy.wait_on_gpu (Note [Wait on the GPU, not the host] in gpumem/allocator/backing.py) live,
# 40 steps, 12 untimed, no trace, records with timed_driver. Two rounds, settings in turn:
#   * multistream_infer (check): the default, PyTorch's allocator, GPUMEM_WAIT_ON_GPU=1, and that with
#     GPUMEM_BUSY_SLACK=0 (every busy steal waits on the GPU, none grows past);
#   * generate() (llama_generate, check): the default, GPUMEM_WAIT_ON_GPU=1 with GPUMEM_BUSY_SLACK=0.
# Run on the device from the repository root (OUT set, the simpy wheel in .whl/); records in $OUT/wog.tgz:
#   tar xzf $OUT/wog.tgz -C reports/hil/wait-on-gpu-h200-2026-12-03/run
SCRATCH=${SCRATCH:-/tmp/wog}  # a plain assignment: one before `.` would not outlive it
. "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-540}
. "$(dirname "$0")/../sos-nomarks-h200-2026-12-03/live.sh"
for r in 1 2; do
  live ms-default-$r multistream_infer gpumem,default
  GPUMEM_WAIT_ON_GPU=1 live ms-wog-$r multistream_infer gpumem
  GPUMEM_WAIT_ON_GPU=1 GPUMEM_BUSY_SLACK=0 live ms-wog0-$r multistream_infer gpumem
done
live gen-default llama_generate gpumem
GPUMEM_WAIT_ON_GPU=1 GPUMEM_BUSY_SLACK=0 live gen-wog0 llama_generate gpumem
echo "total $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
tar czf "$OUT/wog.tgz" -C $SCRATCH .
for f in $SCRATCH/*/workloads-*.json; do
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[1].split('/')[-2], r['workload'], r['allocator'], r.get('gpumem_env'), round((r['peak_reserved_bytes']/r['peak_allocated_bytes']-1)*100,2), round(r['mean_step_ms'],2), r.get('timed_driver')) for r in d['runs']]" $f || true
done
cat $SCRATCH/log.txt | tail -20
