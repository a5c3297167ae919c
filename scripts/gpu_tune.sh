#!/usr/bin/env bash
# Tune, check or sweep model M on this machine's GPU (run from the repository root; optuna/sqlalchemy/platformdirs
# wheels in .whl/ when the image lacks them):
#   bash scripts/gpu_tune.sh OUT_DIR [tune [TRIALS SECONDS]|retune REGEX [TRIALS SECONDS]|check|sweep REGEX SECONDS]
# tune:  tune model M's workload (one worker per visible GPU, journal-file studies), export
#        cache/nvidia-<gpu>.yaml, explain every problem with a clean user cache
# retune: tune only the problems matching REGEX, starting from the shipped cache/nvidia-<gpu>.yaml (its
#        winners are the earlier winners a study keeps while they are faster), export the file back and
#        verify those problems with --require-all (e.g. after a new variant: '^(prefill|training [0-9]+ forward)')
# check: verify the shipped file, bench the workload (JSON + PNG), then the side-by-side comparisons:
#        prefill/training span attention (tensor-core and per-span kernels, dense SDPA, bounds, errors, per-kernel times)
#        and the decode variants
# sweep: exhaustive sweep of the sweep-model-m problems matching REGEX, at most SECONDS each
# <gpu> is the second word of the device's name in lower case (h100, h200); GPU=NAME overrides it.
set -euo pipefail
case "${1:-}" in -h|--help|"") sed -n '2,/^set /p' "$0" | grep "^#" | cut -c3-; exit 0;; esac  # this header is the help
out="$1"; step="${2:-tune}"
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
export HOME=/tmp/clean-home PYTHONUNBUFFERED=1   # a clean user cache: only the shipped file can answer
mkdir -p "$HOME"
slops() { python3 -m superlinear_ops.cli "$@"; }
quiet() { grep -v "^\[W\|UserWarning\|warnings.warn\|_warn_once" || true; }
workload=tuning/superlinear-exp-v0.1.yaml
gpus=$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")
gpu=${GPU:-$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")}
case "$step" in
tune)
    slops tune "$workload" --trials "${3:-20}" --timeout "${4:-120}" --workers "$gpus" --storage "$out/studies.log" \
        --cache "$out/$gpu.sqlite" --no-progress 2>&1 | quiet
    slops cache export --cache "$out/$gpu.sqlite" -o cache/nvidia-$gpu.yaml
    cp cache/nvidia-$gpu.yaml "$out/"
    slops explain --workload "$workload" > "$out/explain.txt"
    echo "problems served by the shipped file: $(grep -c 'source: shipped' "$out/explain.txt")"
    ;;
retune)
    slops cache import cache/nvidia-$gpu.yaml --cache "$out/$gpu.sqlite"
    slops tune "$workload" --problems "$3" --trials "${4:-12}" --timeout "${5:-120}" --workers "$gpus" \
        --storage "$out/studies.log" --cache "$out/$gpu.sqlite" --no-progress 2>&1 | quiet
    slops cache export --cache "$out/$gpu.sqlite" -o cache/nvidia-$gpu.yaml
    cp cache/nvidia-$gpu.yaml "$out/"
    slops verify "$workload" --problems "$3" --cache cache/nvidia-$gpu.yaml --require-all 2>&1 | quiet
    ;;
check)
    slops verify "$workload" --require-all 2>&1 | quiet
    slops bench "$workload" -o "$out/bench.json" --plot "$out/bench.png" 2>&1 | quiet
    python3 benchmarks/span_forward_tiles.py --out "$out/span_forward_tiles.json" 2>&1 | quiet
    python3 benchmarks/span_training.py --out "$out/span_training.json" 2>&1 | quiet
    python3 benchmarks/decode_variants.py --out "$out/decode_variants.json" 2>&1 | quiet | cut -c1-300
    ;;
sweep)
    slops tune tuning/sweep-model-m.yaml --sampler exhaustive --trials 0 --timeout "$4" --problems "$3" \
        --storage "$out/sweep.log" --cache "$out/sweep-cache.sqlite" --no-progress
    ;;
esac
