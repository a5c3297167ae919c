#!/usr/bin/env bash
# On an H200 (run from the repository root; optuna/sqlalchemy wheels in .whl/ when the image lacks them):
#   bash scripts/h200_tune.sh OUT_DIR [tune|check|sweep REGEX SECONDS]
# tune:  tune model M's workload, export cache/nvidia-h200.yaml, explain every problem with a clean user cache
# check: verify the shipped file and bench the workload (JSON + PNG)
# sweep: exhaustive sweep of the sweep-model-m problems matching REGEX, at most SECONDS each
set -euo pipefail
out="$1"; step="${2:-tune}"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
export HOME=/tmp/clean-home PYTHONUNBUFFERED=1   # a clean user cache: only the shipped file can answer
mkdir -p "$HOME"
slops() { python3 -m superlinear_ops.cli "$@"; }
workload=tuning/superlinear-exp-v0.1.yaml
case "$step" in
tune)
    slops tune "$workload" --trials 24 --timeout 12 --storage "$out/studies.log" --cache "$out/h200.sqlite" --no-progress
    slops cache export --cache "$out/h200.sqlite" -o cache/nvidia-h200.yaml
    cp cache/nvidia-h200.yaml "$out/"
    slops explain --workload "$workload" > "$out/explain.txt"
    grep -c "source: shipped" "$out/explain.txt"
    ;;
check)
    slops verify "$workload" --require-all
    slops bench "$workload" -o "$out/bench.json" --plot "$out/bench.png"
    ;;
sweep)
    slops tune tuning/sweep-model-m.yaml --sampler exhaustive --trials 0 --timeout "$4" --problems "$3" \
        --storage "$out/sweep.log" --cache "$out/sweep-cache.sqlite" --no-progress
    ;;
esac
