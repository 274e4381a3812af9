# the Done-when's step time at today's head: GPT-2 fp32 and ResNet-50, rounds against PyTorch's allocator, nothing set
set -e
pip install -q --target /tmp/site .whl/simpy-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
mkdir -p /tmp/st
START=$(date +%s)
left() { echo $(( ${BUDGET:-500} - ($(date +%s) - START) )); }
timeout $(left) python3 -m hil.probes.workloads live --workloads gpt2_train --rounds 4 --no-record --steps 40 --warmup 10 \
    --timeout 100 --tag gpt2-rounds --out /tmp/st > $OUT/log-gpt2.txt 2>&1 || echo "rc $?" >> $OUT/log-gpt2.txt
timeout $(left) python3 -m hil.probes.workloads live --workloads resnet50_train --rounds 3 --no-record --steps 40 --warmup 10 \
    --timeout 100 --tag resnet-rounds --out /tmp/st > $OUT/log-resnet.txt 2>&1 || echo "rc $?" >> $OUT/log-resnet.txt
echo "total $(( $(date +%s) - START )) s" >> $OUT/log-resnet.txt
cd /tmp/st && tar czf $OUT/st.tgz .
