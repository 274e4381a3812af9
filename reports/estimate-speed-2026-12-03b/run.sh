# gpumem estimate's policies replayed side by side (Note [Policies replayed apart]), timed on the H200's host
# (16 CPUs; no GPU work): the benchmark alternating --jobs 1,2,3, then the command, one process against three.
# Run on the device from the repository root (OUT set, the simpy wheel in .whl/); output in $OUT/est_jobs.txt.
SCRATCH=/tmp/ej . "$(dirname "$0")/../hil/wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-500}
R=$OUT/est_jobs.txt
nproc > $R
timeout $(left) python3 -m benchmarks.estimate_speed --estimate-jobs 1,2,3 --new-tokens ${TOKENS:-2000,4000,16000} \
    --rounds 2 >> $R 2>&1 || echo "benchmark rc $?" >> $R
SHAPE="--hidden-size 4096 --intermediate-size 11008 --layers 32 --vocab-size 32000 --heads 32 --prompt-len 2048"
for n in 4000 16000; do
  for j in 1 3 1 3; do
    /usr/bin/time -f "CLI estimate $n --jobs $j: %e s wall" -a -o $R timeout $(left) python3 -m gpumem estimate $SHAPE \
        --new-tokens $n --jobs $j --json > $SCRATCH/est-$n-$j.json 2>> $R || echo "CLI rc $?" >> $R
  done
  cmp $SCRATCH/est-$n-1.json $SCRATCH/est-$n-3.json >> $R && echo "CLI $n: the same JSON with --jobs 1 and 3" >> $R
done
echo "total $(( $(date +%s) - START )) s" >> $R
cat $R
