#!/usr/bin/env bash
# The whole layer's prefill on one GPU, table and acceptance checks in one run (from the repository root;
# optuna/sqlalchemy/platformdirs and the original `superlinear` wheel in .whl/ when the image lacks them):
#   bash benchmarks/prefill_acceptance.sh OUT_DIR
# 1. the prefill table (ours, cuDNN and flash SDPA, the original, the lower bound, the search alone, per-kernel times)
#    and the checks (anchor sets against the float64 search, O and gradients against the float64 layer, CUDA-graph
#    replay against eager): benchmarks/whole_layer.py --parts checks,targets --cases '^prefill'
# 2. compute-sanitizer memcheck of the prefill's kernels (span forward, both searches, spans, gate) at a small shape:
#    every covering configuration of their declared spaces
# 3. the first prefill call in a fresh process with a warm Triton cache (`superlinear-ops warmup` first), 32K and 1M keys
# 4. verify --require-all of the shipped file's prefill and layer-prefill entries
# Every step runs; the script exits 1 when any of them failed (and names it). The table's JSON: OUT_DIR/whole_layer_prefill.json.
set -uo pipefail
case "${1:-}" in -h|--help|"") sed -n '2,/^set /p' "$0" | grep "^#" | cut -c3-; exit 0;; esac  # this header is the help
out="$1"; mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
export HOME=/tmp/clean-home PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/acceptance-triton   # a clean user cache
mkdir -p "$HOME"
slops() { python3 -m superlinear_ops.cli "$@"; }
quiet() { grep -v "^\[W\|UserWarning\|warnings.warn\|_warn_once\|Warning\|return lambda\|if not covers" || true; }
workload=tuning/superlinear-exp-v0.1.yaml
step() { echo "## $(date +%T) $1"; }
failed=""
check() { [ "$1" -eq 0 ] || failed="$failed $2"; }  # check STATUS NAME
step "1. table and checks"
python3 benchmarks/whole_layer.py --parts checks,targets --cases '^prefill' --out "$out/whole_layer_prefill.json" 2>&1 | quiet
check "${PIPESTATUS[0]}" table
step "2. memcheck"
slops sanitize "$workload" --problems '^(layer )?prefill 8192 over 8192' --jobs "$(nproc)" --no-progress 2>&1 | quiet | tail -3
check "${PIPESTATUS[0]}" memcheck
step "3. first call"
rm -rf "$TRITON_CACHE_DIR"
slops warmup "$workload" --problems '^layer prefill (8192 over 65536|8192 over 1048576)$' 2>&1 | quiet | tail -1
check "${PIPESTATUS[0]}" warmup
for keys in 32768 1048576; do
    python3 benchmarks/first_call_latency.py --device cuda --queries 8192 --keys "$keys" 2>&1 | quiet
    check "${PIPESTATUS[0]}" "first-call-$keys"
done
step "4. verify"
slops verify "$workload" --problems '^(layer )?prefill ' --require-all 2>&1 | quiet | tail -20
check "${PIPESTATUS[0]}" verify
if [ -n "$failed" ]; then step "FAILED:$failed"; exit 1; fi
step done
