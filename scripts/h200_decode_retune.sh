#!/usr/bin/env bash
# Re-tune the model-M decode problems on an H200 (every registered decode variant), verify and bench
# the result, then run the side-by-side decode comparison and the eager host-overhead profile
# against that tuned cache.
# Run from the repository root with optuna/sqlalchemy wheels in .whl/: OUT=dir bash scripts/h200_decode_retune.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HOME=/tmp/clean-home; mkdir -p $HOME
S="python3 -m superlinear_ops.cli"; W=tuning/superlinear-exp-v0.1.yaml
quiet() { grep -v "^\[W\|UserWarning\|warnings.warn\|_warn_once"; }
$S tune $W --problems decode --trials 16 --timeout 20 --storage $OUT/decode-studies.log --cache $OUT/decode.sqlite --no-progress 2>&1 | quiet
$S verify $W --problems decode --cache $OUT/decode.sqlite --require-all 2>&1 | tail -8
$S bench $W --problems decode --cache $OUT/decode.sqlite -o $OUT/bench-decode.json 2>&1 | tail -8
SUPERLINEAR_OPS_CACHE=$OUT/decode.sqlite python3 scripts/decode_compare.py --out $OUT/decode-compare.json 2>&1 | quiet | cut -c1-300
SUPERLINEAR_OPS_CACHE=$OUT/decode.sqlite python3 scripts/eager_overhead.py 2>&1 | quiet | head -24 | cut -c1-200
