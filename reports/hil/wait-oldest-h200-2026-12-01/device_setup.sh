# The prelude each script here sources on the device: simpy from the wheel carried in .whl/, the engine built,
# the scratch folder $SCRATCH made, and left(): seconds of the script's budget ($BUDGET, default $1) still unspent.
# It stops with a message where OUT is unset or the wheel is missing.
set -e
: "${OUT:?set OUT to the folder whose files come back}"
ls .whl/simpy-*.whl >/dev/null 2>&1 || { echo "no simpy wheel in .whl/ (pip download simpy --no-deps -d .whl)" >&2; exit 1; }
pip install -q --target /tmp/site .whl/simpy-*.whl > /tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
mkdir -p "$SCRATCH"
START=$(date +%s)
DEFAULT_BUDGET=$1
# at least 1: `timeout 0` would mean no limit, a negative one is refused
left() { local s=$(( ${BUDGET:-$DEFAULT_BUDGET} - ($(date +%s) - START) )); echo $(( s > 1 ? s : 1 )); }
