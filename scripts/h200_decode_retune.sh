#!/usr/bin/env bash
# Re-tune model M decode problems on an H200 with the fused_search variant registered, verify and bench them.
# Run from the repository root with optuna/sqlalchemy wheels in .whl/: OUT=dir bash scripts/h200_decode_retune.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HOME=/tmp/clean-home; mkdir -p $HOME
S="python3 -m superlinear_ops.cli"; W=tuning/superlinear-exp-v0.1.yaml
$S tune $W --problems decode --trials 12 --timeout 15 --storage $OUT/decode-studies.sqlite --cache $OUT/decode.sqlite --no-progress 2>&1 | grep -v "^\[W\|UserWarning"
$S verify $W --problems decode --cache $OUT/decode.sqlite --require-all 2>&1 | tail -7
$S bench $W --problems decode --cache $OUT/decode.sqlite -o $OUT/bench-decode.json 2>&1 | tail -7
