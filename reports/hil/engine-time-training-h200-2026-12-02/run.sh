# The H200 runs of reports/hil/engine-time-training-h200-2026-12-02.md (a study, not part of the library): training
# workloads under gpumem.torch with the trace's GPU clock, every driver call and index walk of the engine timed by
# the study patch beside this file. Run on the device from the repository root (OUT set, the simpy wheel in .whl/);
# the records, traces and compact call logs come back as one tar:
#   tar xzf $OUT/engine-time.tgz -C reports/hil/engine-time-training-h200-2026-12-02/run
# It patches gpumem/_native/ in place (the device's copy is fresh at every call): elsewhere, run it in a throwaway
# clone, or `git checkout gpumem/_native` after it.
HERE=reports/hil/engine-time-training-h200-2026-12-02
: "${OUT:?set OUT to the folder whose files come back}"
ls .whl/simpy-*.whl >/dev/null 2>&1 || { echo "no simpy wheel in .whl/ (pip download simpy --no-deps -d .whl)" >&2; exit 1; }
python3 $HERE/patch_calltime.py
SCRATCH=/tmp/et . reports/hil/wait-oldest-h200-2026-12-01/device_setup.sh ${BUDGET:-480}
# NAME:WORKLOAD:MARKS; the step marks off (no step plans) make GPT-2, MoE and ResNet-50 steal pages every step
for spec in ${RUNS:-varlen:llama_varlen_train:default gpt2:gpt2_train:off moe:moe_train:off resnet:resnet50_train:off}; do
  IFS=: read -r name wl marks <<< "$spec"
  extra=""; [ "$marks" = off ] && extra="--gpumem-step-marks off"
  GPUMEM_CALL_LOG=/tmp/et/calls-$name.txt timeout $(left) python3 -m hil.probes.workloads live --workloads $wl \
      --allocators gpumem --steps ${STEPS:-24} --warmup 6 --timeout 200 --tag $name --gpumem-gpu-clock $extra \
      --out /tmp/et/$name >> /tmp/et/log.txt 2>&1 || echo "$name rc $?" >> /tmp/et/log.txt
  [ -f /tmp/et/calls-$name.txt ] && python3 $HERE/calls.py compact /tmp/et/calls-$name.txt /tmp/et/calls-$name.tsv.gz \
      && rm /tmp/et/calls-$name.txt
done
echo "total $(( $(date +%s) - START )) s" >> /tmp/et/log.txt
tar czf "$OUT/engine-time.tgz" -C /tmp/et .
tail -n 12 /tmp/et/log.txt
