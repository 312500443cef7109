#!/usr/bin/env bash
# The device commands for issue 6, rerunnable on any machine with a CUDA GPU and 16 cores.
# The lent GPU machine has torch but no simpy: a wheel in .whl/ is installed first if present.
#   bash experiments/gpu_run.sh gpu [--stages 2]  # CUDA profiles + executor grid on cuda:0
#   bash experiments/gpu_run.sh cpu16   # multi-process executor, 4 and 8 pinned stages
#   bash experiments/gpu_run.sh bench   # in-process executor vs the unpipelined model on cuda:0
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import simpy" 2>/dev/null && ls .whl/simpy-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
OUT_DIR="${OUT:-experiments/results/gpu}"
what="${1:-gpu}"
shift || true
case "$what" in
    gpu)   python3 experiments/gpu_validate.py --out "$OUT_DIR" "$@" ;;
    bench) python3 experiments/bench_executor_cuda.py "$@" ;;
    cpu16) for n in 4 8; do
               python3 experiments/validate.py --stages "$n" --pin --subdir gpu --iterations 3 "$@"
           done ;;
esac
