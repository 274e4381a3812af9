# The H200 runs of section 5 of reports/hil/where-replays-part-2026-11-30.md, from the repository root on the device
# (a study, not part of the library). The device has no simpy: a simpy wheel goes in .whl/ (ignored by git), which
# the device call carries. The first device call ran B in "16 12" with the patch without its fence-query part
# (the "a" runs), the second "16 20" with this patch (the "b" runs).
set -e
pip install -q --target /tmp/site .whl/simpy-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
python3 reports/hil/where-replays-part-2026-11-30/patch_calltime.py
python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
for B in 16 20; do
  GPUMEM_CALL_LOG=/tmp/calls-b$B.txt timeout 200 python3 -m hil.probes.decode_progress --allocator gpumem --attention sdpa \
      --batch $B --prompt 4096 --new-tokens 48 --window 8 --json $OUT/ct-b$B.json --record $OUT/ct-b$B.gmt.gz --gpu-clock \
      > $OUT/ct-b$B.log 2>&1 || tail -20 $OUT/ct-b$B.log
  awk '$1!="cuEventCreate" && $1!="cuEventDestroy"' /tmp/calls-b$B.txt | gzip -c > $OUT/calls-b$B.txt.gz
done
