set -e
pip install -q --target /tmp/site .whl/simpy-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
python3 .whl/patch_calltime.py
python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
for B in 16 20; do
  GPUMEM_CALL_LOG=/tmp/calls-b$B.txt timeout 200 python3 -m hil.probes.decode_progress --allocator gpumem --attention sdpa --batch $B --prompt 4096 --new-tokens 48 --window 8 --json $OUT/ct-b$B.json --record $OUT/ct-b$B.gmt.gz --gpu-clock > $OUT/ct-b$B.log 2>&1 || tail -20 $OUT/ct-b$B.log
  wc -l /tmp/calls-b$B.txt; awk '{print $1}' /tmp/calls-b$B.txt | sort | uniq -c; awk '$1!="cuEventCreate" && $1!="cuEventDestroy"' /tmp/calls-b$B.txt | gzip -c > $OUT/calls-b$B.txt.gz; tail -2 $OUT/ct-b$B.log
done
ls -la $OUT
