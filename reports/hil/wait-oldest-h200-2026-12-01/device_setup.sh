# The prelude each script here sources on the device: simpy from the wheel carried in .whl/, the engine built,
# the scratch folder $SCRATCH made, and left(): seconds of the script's budget ($BUDGET, default $1) still unspent.
set -e
pip install -q --target /tmp/site .whl/simpy-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
mkdir -p "$SCRATCH"
START=$(date +%s)
DEFAULT_BUDGET=$1
left() { echo $(( ${BUDGET:-$DEFAULT_BUDGET} - ($(date +%s) - START) )); }
