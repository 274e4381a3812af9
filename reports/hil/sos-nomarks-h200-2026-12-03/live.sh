# Sourced by run.sh and confirm.sh after device_setup.sh: live TAG WORKLOADS ALLOCATORS runs the workloads probe
# (STEPS steps, default 40, the first WARMUP, default 12, untimed; no trace) with the environment its caller sets,
# into $SCRATCH/TAG, its output appended to $SCRATCH/log.txt.
S=${STEPS:-40}
live() {
  timeout $(left) python3 -m hil.probes.workloads live --workloads $2 --allocators $3 --steps $S --warmup ${WARMUP:-12} \
      --timeout 200 --no-record --tag $1 --out $SCRATCH/$1 >> $SCRATCH/log.txt 2>&1 || echo "$1 rc $?" >> $SCRATCH/log.txt
}
