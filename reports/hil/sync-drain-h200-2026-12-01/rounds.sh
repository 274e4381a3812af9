# The Done-when's step time at this head, nothing set: GPT-2 fp32 training, rounds against PyTorch's allocator
# (8 more, to narrow the interval of 2026-12-01's 4). Run as rule_time.sh (OUT set, the simpy wheel in .whl/).
SCRATCH=/tmp/st . "$(dirname "$0")/../wait-oldest-h200-2026-12-01/device_setup.sh" ${BUDGET:-540}
timeout $(left) python3 -m hil.probes.workloads live --workloads gpt2_train --rounds ${ROUNDS:-8} --no-record --steps 40 \
    --warmup 10 --timeout 100 --tag gpt2-rounds8 --out /tmp/st > $OUT/log-gpt2-rounds8.txt 2>&1 || echo "rc $?" >> $OUT/log-gpt2-rounds8.txt
echo "total $(( $(date +%s) - START )) s" >> $OUT/log-gpt2-rounds8.txt
cp /tmp/st/workloads-gpt2-rounds8.json $OUT/ 2>/dev/null || true
