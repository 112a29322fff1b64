#!/usr/bin/env bash
# Reproduce final-v4, the built-in SmolLM2-135M-Instruct drafter's trained successor (kept in
# datasets/smollm2/drafters/final-v4-6bit/, not shipped yet: docs/bench/final-v4/README.md):
#   token records -> target features -> train (12 CPU-hours) -> compare -> 6-bit / group-64.
# (scripts/reproduce_default_drafter.sh reproduces the shipped drafter, smol-l2.)
#
# What produced it (seed 0, sessions 11-14, 2-core x86-64, no GPU, mlx[cpu] + OpenBLAS, float32
# target):
# - data: 2,600 token records, 835k tokens, each response written by the target itself (greedy,
#   chat template, <= 384 tokens): 1,600 GSM8K answers (prompts 1..1600 of the first 7,273
#   training questions; the last 200 are held out), 700 general chat answers to user turns the
#   target wrote itself from its chat template's user header (`dflash magpie`, filtered; 668 of
#   their prompts are kept in datasets/smollm2/chat-prompts.jsonl.gz, 32 came from a later magpie
#   batch whose prompt file was not kept), 300 code answers to CPython-stdlib prompts
#   (scripts/make_code_prompts.py; HumanEval stays held out). The records themselves are kept in
#   datasets/smollm2/{math,chat,code}.jsonl.gz.
# - training: scripts/train_builtin_drafter.sh — 2 layers, block 16, 4 sequences x 48 anchors a
#   step, loss mix (soft-target weight 0.5, top-16), AdamW 6e-4, warm-up and cosine over the
#   12 CPU-hour budget of the process's own CPU time (--lr-schedule cpu): 5,638 steps at 7.4-8.1
#   CPU-s each, resumed across four sessions (twice on a new machine, from its packed checkpoint).
# - measured (scripts/compare_drafters.py, 16 held-out prompts, block 16, whole blocks verified):
#   held-out τ math 2.313 / chat 1.367 / code 1.384 (all 1.623) against the built-in
#   drafter's 2.081 / 1.147 / 1.239 (1.412); its 6-bit / group-64 conversion
#   2.332 / 1.360 / 1.379 (-0.1 %). More in docs/training.md#the-built-in-drafter.
#
# CPU cost of each stage on that 2-core machine (CPU-hours = wall hours x busy cores):
#   1. records: 0 with --from-records; regenerated, ~3.4 CPU-h (magpie turns ~0.5, datagen ~1.7
#      per 1,000 records of <= 384 tokens at batch 64, tap features included)
#   2. features: ~1.7 CPU-h from kept records (52 min of both cores for 2,600 records, 835k tokens,
#      session 14); ~0 after regeneration (datagen already wrote them: linked, not recomputed)
#   3. training: 12.0 CPU-h (the budget; ~7 h wall on both cores)
#   4. comparison: ~0.15 CPU-h (5.5 min wall)
#   5. conversion: seconds
#   6. bench: ~0.2 CPU-h (6 min wall)
#
# Usage: bash scripts/reproduce_final_v4.sh [--from-records] [WORK_DIR]   (default ./data-repro)
#   --from-records  train on the kept token records (final-v4's exact data): ~50 min of
#                   features on both cores, then the 12 CPU-h run.
#   otherwise       regenerate the records first with the target (datagen writes each response's
#                   tap features and top-16 from the passes that generate it: ~1.7 CPU-h per
#                   1,000 records at batch 64), then train. Batched float32 decoding can flip a
#                   near-tie token, so a few responses may differ from the kept ones.
# Every stage resumes: rerun the same command after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
FROM_RECORDS=0
if [ "${1:-}" = "--from-records" ]; then FROM_RECORDS=1; shift; fi
WORK=$(mkdir -p "${1:-data-repro}" && cd "${1:-data-repro}" && pwd)
export DFLASH_HOME=$WORK  # the converted target, the data and the run all live under WORK
D=$WORK/data/smollm2
OUT=$WORK/runs/smollm2-drafter
GSM8K=${GSM8K:-../shared/datasets/gsm8k-train.jsonl}   # GSM8K train split, 7,473 questions
mkdir -p "$D"
[ -f "$D/gsm8k-train-part.jsonl" ] || head -n 7273 "$GSM8K" > "$D/gsm8k-train-part.jsonl"
[ -f "$D/gsm8k-heldout.jsonl" ] || tail -n 200 "$GSM8K" > "$D/gsm8k-heldout.jsonl"

# 1. Token records.
if [ "$FROM_RECORDS" = 1 ]; then
  ls "$D"/gen-*/gen-*.jsonl >/dev/null 2>&1 || $PY scripts/snapshot_training_data.py "$D" --restore
else
  [ -f "$D/code-prompts.jsonl" ] || \
    $PY scripts/make_code_prompts.py "$D/code-prompts.jsonl" --seed 0
  [ -f "$D/chat-prompts.jsonl" ] || \
    gunzip -c datasets/smollm2/chat-prompts.jsonl.gz > "$D/chat-prompts.jsonl"
  gen() {  # gen PROMPTS OUT DOMAIN LIMIT (skips the ids already written)
    $PY -m dflash datagen --prompts "$1" --out "$2" --domain "$3" --limit "$4" \
        --max-tokens 384 --batch-size 64 --no-progress
  }
  gen "$D/gsm8k-train-part.jsonl" "$D/gen-math" math 1600
  gen "$D/chat-prompts.jsonl" "$D/gen-chat" chat 1000000
  gen "$D/code-prompts.jsonl" "$D/gen-code" code 300
fi

# 2. Target features of every record (taps 1,8,14,20,27 as float16 + the target's top-16), in one
#    cache; records whose features datagen already wrote are linked, not recomputed.
bash scripts/link_features.sh "$D"
$PY -m dflash train --data "$D/gen-math,$D/gen-chat,$D/gen-code" --feature-cache "$D/features-all" \
    --features-only --feature-workers 2 --no-progress

# 3. Train until 12 CPU-hours of the process's own CPU time (rerun to resume).
OUT=$OUT NICE=${NICE:-0} bash scripts/train_builtin_drafter.sh

# 4. Held-out τ per domain (math, chat, code) of the built-in drafter, this run and its 6-bit
#    conversion, side by side.
$PY scripts/compare_drafters.py --drafts "builtin,$OUT" --quantize --work "$OUT-compare" \
    --out "$OUT-compare/compare.json"

# 5. The uniform 6-bit / group-64 MLX drafter (the format dflash/assets/ ships).
$PY -m dflash convert --hf-path "$OUT" --mlx-path "$WORK/drafts/smollm2-135m-dflash-6bit" \
    --quantize --q-bits 6 --q-group-size 64 --force

# 6. Speed against mlx-lm on the held-out mix (the README's table).
$PY -m dflash bench --draft "$WORK/drafts/smollm2-135m-dflash-6bit" \
    --prompts docs/bench/heldout-mix.jsonl --block-size 16 --max-tokens 96 --repeats 2
