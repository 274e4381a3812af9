# Issue 18: the stream-ordered steal as the default? Workloads where no step plan forms (WL), under PyTorch's
# allocator, gpumem.torch's default (GPUMEM_STREAM_ORDERED_STEAL=0, set explicitly so that a rerun gives the same
# rows whatever the default) and gpumem.torch with GPUMEM_STREAM_ORDERED_STEAL=1, ROUNDS rounds (3) of STEPS steps
# (40), WARMUP (12) untimed so that the memory-first warm-up's end (8th mark) is not timed; no trace (step time as
# a program runs); the two gpumem settings in alternating invocations. Then, RECORD=1, one run of each gpumem
# setting recorded with the GPU clock, for the replays. Run on the device from the repository root (OUT set, the
# simpy wheel in .whl/); the records come back as one tar, SCRATCH's content (default /tmp/sos):
#   tar xzf $OUT/sos.tgz -C reports/hil/sos-default-h200-2026-12-03/run
SCRATCH=${SCRATCH:-/tmp/sos}  # a plain assignment: one before `.` would not outlive it
. "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-560}
WL=${WL:-llama_varlen_train,moe_train}
S=${STEPS:-40}
off() { GPUMEM_STREAM_ORDERED_STEAL=0 timeout $(left) python3 -m hil.probes.workloads live --workloads $WL --allocators gpumem,default \
      --steps $S --warmup ${WARMUP:-12} --timeout 200 --no-record --tag off$1 --out $SCRATCH/off$1 >> $SCRATCH/log.txt 2>&1 || echo "off$1 rc $?" >> $SCRATCH/log.txt; }
on() { GPUMEM_STREAM_ORDERED_STEAL=1 timeout $(left) python3 -m hil.probes.workloads live --workloads $WL --allocators gpumem \
      --steps $S --warmup ${WARMUP:-12} --timeout 200 --no-record --tag on$1 --out $SCRATCH/on$1 >> $SCRATCH/log.txt 2>&1 || echo "on$1 rc $?" >> $SCRATCH/log.txt; }
# ORDER=on-first runs the knob's invocation first in each round (the order's own effect: a later invocation may
# meet a warmer or a busier host)
for r in $(seq 1 ${ROUNDS:-3}); do
  if [ "${ORDER:-off-first}" = on-first ]; then on $r; off $r; else off $r; on $r; fi
done
if [ "${RECORD:-0}" = 1 ]; then
  for v in 0 1; do
    GPUMEM_STREAM_ORDERED_STEAL=$v timeout $(left) python3 -m hil.probes.workloads live --workloads $WL --allocators gpumem --steps 24 \
        --warmup 6 --timeout 200 --gpumem-gpu-clock --tag rec$v --out $SCRATCH/rec$v >> $SCRATCH/log.txt 2>&1 || echo "rec$v rc $?" >> $SCRATCH/log.txt
  done
fi
echo "total $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
tar czf "$OUT/sos.tgz" -C $SCRATCH .
cut -c1-150 $SCRATCH/log.txt | grep -v "^|" | tail -n 40
grep "^|" $SCRATCH/log.txt | tail -n 30
