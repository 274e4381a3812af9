# Issue 18, Note [One stream needs no whole pages] (gpumem/allocator/backing.py): while every block is of one stream a
# chunk taken without a host wait may go under a block's partial pages again; a second stream's first memory waits
# for the deferred mappings. On the H200: the gpumem.torch tests, then live (40 steps, 12 untimed, no trace) under
# gpumem's default the workloads the rule before moved (MoE, Llama with variable lengths), GPT-2 and multistream_infer
# (three streams: the whole-page rule from its first steps), then generate() with steal_before_warmup twice.
# Run on the device from the repository root (OUT set, the simpy wheel in .whl/); records in $OUT/one.tgz:
#   tar xzf $OUT/one.tgz -C reports/hil/one-stream-h200-2026-12-04/run
SCRATCH=${SCRATCH:-/tmp/one}
. "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-560}
. "$(dirname "$0")/../sos-nomarks-h200-2026-12-03/live.sh"
timeout $(left) python3 -m pytest -q tests/pytorch/test_torch_on_gpumem.py --gpumem-device cuda:0 -p no:cacheprovider \
    > $SCRATCH/pytest.txt 2>&1 || echo "pytest rc $?" >> $SCRATCH/log.txt
tail -3 $SCRATCH/pytest.txt >> $SCRATCH/log.txt
live default moe_train,llama_varlen_train,gpt2_train,multistream_infer gpumem
GPUMEM_STEAL_BEFORE_WARMUP=1 live sbw1 llama_generate gpumem
GPUMEM_STEAL_BEFORE_WARMUP=1 live sbw2 llama_generate gpumem
echo "total $(( $(date +%s) - START )) s" >> $SCRATCH/log.txt
tar czf "$OUT/one.tgz" -C $SCRATCH .
for f in $SCRATCH/*/workloads-*.json; do
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[1].split('/')[-2], r['workload'], r['allocator'], round((r['peak_reserved_bytes']/r['peak_allocated_bytes']-1)*100,2), round(r['mean_step_ms'],2), r.get('timed_driver')) for r in d['runs']]" $f || true
done
tail -12 $SCRATCH/log.txt
