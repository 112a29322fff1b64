#!/usr/bin/env bash
# The verify policy's headline numbers (issue 13), on a quiet machine, in three steps:
#   1. the auto policy on the held-out mix (GSM8K, chat, HumanEval) against mlx-lm;
#   2. a drafter that never agrees (random weights): speculation must step aside (>= 0.97x);
#   3. the engine's cycle against z-lab's MLX loop (PyPI dflash 0.1.0) at a fixed 16-row chain.
# Outputs under ${OUT:-$DFLASH_HOME/bench/policy}; step 3 needs PyPI once (pip install --target).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-${DFLASH_HOME:-$HOME/.cache/dflash}/bench/policy}
ZLAB=${ZLAB:-${DFLASH_HOME:-$HOME/.cache/dflash}/zlab}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
# The auto policy decides with the cached cost model: measure it now, on this quiet machine (one
# measured under load prices multi-row passes too high).
$PY -m dflash calibrate --refresh
[ -f "$OUT/random-drafter/config.json" ] || $PY scripts/make_random_drafter.py "$OUT/random-drafter"
$PY -m dflash calibrate --refresh --draft "$OUT/random-drafter"
$PY -m dflash bench --prompts docs/bench/heldout-mix.jsonl --block-size 16 --max-tokens 96 \
  --repeats 2 --out "$OUT/heldout-auto"
$PY -m dflash bench --draft "$OUT/random-drafter" --prompts docs/bench/heldout-mix.jsonl \
  --limit 4 --block-size 16 --max-tokens 96 --repeats 2 --out "$OUT/random-drafter-bench"
[ -f "$ZLAB/dflash/model_mlx.py" ] || $PY -m pip install --target "$ZLAB" --no-deps dflash==0.1.0
$PY scripts/bench_zlab_cycle.py --zlab "$ZLAB" --limit 6 --repeats 2 --max-tokens 96 \
  | tee "$OUT/zlab-cycle.txt"
