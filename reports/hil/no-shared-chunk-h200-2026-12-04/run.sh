# Issue 18, Note [No other stream on a deferred chunk] (gpumem/allocator/backing.py): a chunk taken without a host
# wait goes only under pages the new block covers whole. The fix touches the default policy (the ordered steal after
# a warm-up), so on the H200: the gpumem.torch tests, then live (40 steps, 12 untimed, no trace) the two traces whose
# replay moved (moe_train 1.25 -> 1.52 %, llama_varlen_train 0.75 -> 0.77 %) and GPT-2, under gpumem's default.
# Run on the device from the repository root (OUT set, the simpy wheel in .whl/); records in $OUT/nsc.tgz:
#   tar xzf $OUT/nsc.tgz -C reports/hil/no-shared-chunk-h200-2026-12-04/run
SCRATCH=${SCRATCH:-/tmp/nsc}
. "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-560}
. "$(dirname "$0")/../sos-nomarks-h200-2026-12-03/live.sh"
timeout $(left) python3 -m pytest -q tests/pytorch/test_torch_on_gpumem.py --gpumem-device cuda:0 -p no:cacheprovider \
    > $SCRATCH/pytest.txt 2>&1 || echo "pytest rc $?" >> $SCRATCH/log.txt
tail -3 $SCRATCH/pytest.txt >> $SCRATCH/log.txt
live default moe_train,llama_varlen_train,gpt2_train gpumem
echo "total $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
tar czf "$OUT/nsc.tgz" -C $SCRATCH .
for f in $SCRATCH/*/workloads-*.json; do
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[1].split('/')[-2], r['workload'], r['allocator'], round((r['peak_reserved_bytes']/r['peak_allocated_bytes']-1)*100,2), round(r['mean_step_ms'],2)) for r in d['runs']]" $f || true
done
cat $SCRATCH/log.txt | tail -20
