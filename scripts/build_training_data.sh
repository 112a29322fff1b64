#!/usr/bin/env bash
# Training data for the built-in pair in three domains, every stage resumable: rerun the script
# after an interruption and each stage continues where it stopped (datagen skips ids already
# written; magpie continues its numbering). Long-job data lives under $DFLASH_HOME (default
# ~/.cache/dflash), outside the work tree; the token records (gen-*.jsonl, a few MB) are what
# to keep, the features can be recomputed from them.
#
# Usage: bash scripts/build_training_data.sh [ROUNDS]   (each round adds ~1,000 math, ~700 chat,
#        ~500 code records; default 3 rounds). Save the token records into the repository with
#        python scripts/snapshot_training_data.py "$DFLASH_HOME/data/smollm2"
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
HOME_DIR=${DFLASH_HOME:-$HOME/.cache/dflash}
D=$HOME_DIR/data/smollm2
ROUNDS=${1:-3}
GSM8K=${GSM8K:-../shared/datasets/gsm8k-train.jsonl}
BATCH=${BATCH:-64}  # measured best of 16 / 32 / 64 (scripts/bench_datagen.py: 149 / 170 / 196 record tok/s)
mkdir -p "$D"

# Held out, never read by training: the last 200 GSM8K training questions, HumanEval, and the
# chat turns whose id hashes into the held-out 5 % (magpie writes them to chat-heldout.jsonl).
[ -f "$D/gsm8k-train-part.jsonl" ] || head -n 7273 "$GSM8K" > "$D/gsm8k-train-part.jsonl"
[ -f "$D/gsm8k-heldout.jsonl" ] || tail -n 200 "$GSM8K" > "$D/gsm8k-heldout.jsonl"
[ -f "$D/code-prompts.jsonl" ] || $PY scripts/make_code_prompts.py "$D/code-prompts.jsonl" --seed 0
# On a new machine, start from the token records kept in the repository (datasets/smollm2/):
# datagen skips them; training recomputes their features (dflash train --features-only).
ls "$D"/gen-*/gen-*.jsonl >/dev/null 2>&1 || $PY scripts/snapshot_training_data.py "$D" --restore
# The magpie prompts too (the held-out chat turns among them): the same turns on every machine.
for f in chat-prompts chat-prompts-heldout; do
  [ -f "$D/$f.jsonl" ] || [ ! -f "datasets/smollm2/$f.jsonl.gz" ] || \
    gunzip -c "datasets/smollm2/$f.jsonl.gz" > "$D/$f.jsonl"
done

lines() { [ -f "$1" ] && wc -l < "$1" || echo 0; }
magpie_upto() {  # magpie_upto OUT TOTAL [ARGS...]: top the prompt file up to TOTAL turns (resumable)
  local out=$1 total=$2; shift 2
  local need=$((total - $(lines "$out")))
  [ "$need" -le 0 ] || $PY -m dflash magpie --out "$out" --n "$need" --batch-size "$BATCH" "$@"
}

gen() {  # gen PROMPTS OUT DOMAIN LIMIT
  $PY -m dflash datagen --prompts "$1" --out "$2" --domain "$3" --limit "$4" \
      --max-tokens 384 --batch-size "$BATCH" --no-progress
  bash scripts/link_features.sh "$D"  # a running final training picks them up (--refresh-data)
}

# Chat first: the drafter has seen no chat at all, and chat is where it loses to plain decoding.
for round in $(seq 1 "$ROUNDS"); do
  magpie_upto "$D/chat-prompts.jsonl" $((round * 700)) --seed "$round"
  gen "$D/chat-prompts.jsonl" "$D/gen-chat" chat 1000000
  gen "$D/gsm8k-train-part.jsonl" "$D/gen-math" math $((round * 1000))
  gen "$D/code-prompts.jsonl" "$D/gen-code" code $((round * 500))
  magpie_upto "$D/chat2-prompts.jsonl" $((round * 200)) --followups-of "$D/gen-chat" --seed "$round"
  gen "$D/chat2-prompts.jsonl" "$D/gen-chat" chat 1000000
done
