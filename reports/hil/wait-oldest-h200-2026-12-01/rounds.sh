# the Done-when's step time at today's head: GPT-2 fp32 and ResNet-50, rounds against PyTorch's allocator, nothing set
SCRATCH=/tmp/st . "$(dirname "$0")/device_setup.sh" 500
timeout $(left) python3 -m hil.probes.workloads live --workloads gpt2_train --rounds 4 --no-record --steps 40 --warmup 10 \
    --timeout 100 --tag gpt2-rounds --out /tmp/st > $OUT/log-gpt2.txt 2>&1 || echo "rc $?" >> $OUT/log-gpt2.txt
timeout $(left) python3 -m hil.probes.workloads live --workloads resnet50_train --rounds 3 --no-record --steps 40 --warmup 10 \
    --timeout 100 --tag resnet-rounds --out /tmp/st > $OUT/log-resnet.txt 2>&1 || echo "rc $?" >> $OUT/log-resnet.txt
echo "total $(( $(date +%s) - START )) s" >> $OUT/log-resnet.txt
cd /tmp/st && tar czf $OUT/st.tgz .
