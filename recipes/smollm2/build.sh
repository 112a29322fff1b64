#!/usr/bin/env bash
# Rebuild the SmolLM2-135M-Instruct drafter from its token records, in five resumable stages:
#
#   records   the token records (datasets/smollm2/*.jsonl.gz, checked against MANIFEST.json) put
#             back under $DFLASH_HOME/data/smollm2, where `dflash datagen` skips them; with
#             --regenerate the target writes them again (GSM8K, magpie chat turns, stdlib code)
#   features  the target's tap features and top-16 of every record, in one feature cache
#   train     `dflash train` with the drafter's recipe; rerun to resume from $DFLASH_HOME/runs/
#   convert   the uniform 6-bit / group-64 MLX drafter (the format dflash/assets/ ships)
#   compare   held-out τ of the built-in drafter, the float run and its 6-bit conversion, per
#             domain (`dflash bench --tau`)
#
# Usage: bash recipes/smollm2/build.sh [--smoke] [--regenerate] [--restore-checkpoint] [STAGE...]
#   STAGE...              run only these stages (default: all five, in order)
#   --smoke               every stage on a tiny slice (4 records a domain, 4 training steps, 2
#                         prompts of 8 tokens) in a scratch folder ($SMOKE_DIR, default
#                         $DFLASH_HOME/recipe-smoke): checks that each stage runs and that the
#                         drafter it writes loads and keeps the target's output (CI runs it)
#   --regenerate          write the records with the target instead of restoring the kept ones
#                         (needs GSM8K=path/to/gsm8k-train.jsonl; batched float32 decoding can flip
#                         a near-tie token, so a few responses may differ from the kept ones)
#   --restore-checkpoint  before training, restore final-v4's float checkpoint at step 5,250 from
#                         git history (datasets/smollm2/MANIFEST.json) and continue from it
#
# What each stage costs on a 2-core x86-64 machine without a GPU: docs/training.md#the-built-in-drafters-recipe-recipessmollm2buildsh.
set -euo pipefail
cd "$(dirname "$0")/../.."

# The drafter this recipe builds: final-v4 (2,600 records, 12 CPU-hours of training) or smol-l2
# (the earlier drafter: 1,423 GSM8K + 528 code records, 1,700 steps; its records are not kept, so
# it implies --regenerate).
DRAFTER=${DRAFTER:-final-v4}

PY=${PYTHON:-python3}
export DFLASH_HOME=${DFLASH_HOME:-$HOME/.cache/dflash}
SMOKE=0; REGENERATE=0; RESTORE=0; STAGES=()
for arg in "$@"; do
  case $arg in
    --smoke) SMOKE=1 ;;
    --regenerate) REGENERATE=1 ;;
    --restore-checkpoint) RESTORE=1 ;;
    records|features|train|convert|compare) STAGES+=("$arg") ;;
    *) echo "build.sh: unknown argument $arg (see the header of $0)" >&2; exit 2 ;;
  esac
done
[ ${#STAGES[@]} -gt 0 ] || STAGES=(records features train convert compare)

case $DRAFTER in
  final-v4)
    DOMAINS=(math chat code)
    TRAIN_ARGS=(--layers 2 --block-size 16 --batch-seqs 4 --anchors 48 --lr 6e-4 --loss mix
                --soft-weight 0.5 --soft-topk 16 --steps 50000 --cpu-budget 43200
                --lr-schedule cpu --checkpoint-every 50 --eval-every 250 --eval-n 4
                --eval-block-sizes 16 --refresh-data --seed 0)
    LIMITS=(math:1600 chat:1000000 code:300); GEN_BATCH=64 ;;
  smol-l2)
    REGENERATE=1
    DOMAINS=(math code)
    TRAIN_ARGS=(--layers 2 --block-size 16 --batch-seqs 4 --anchors 48 --lr 6e-4
                --soft-weight 0.5 --soft-topk 16 --steps 1700 --checkpoint-every 50
                --eval-every 250 --eval-n 4 --eval-block-sizes 16,8 --seed 0)
    LIMITS=(math:1423 code:528); GEN_BATCH=16 ;;
  *) echo "build.sh: DRAFTER=$DRAFTER: expected final-v4 or smol-l2" >&2; exit 2 ;;
esac

D=$DFLASH_HOME/data/smollm2
OUT=$DFLASH_HOME/runs/$DRAFTER
SIXBIT=$DFLASH_HOME/drafts/$DRAFTER-6bit
FEATURE_ARGS=(--feature-workers 2)
COMPARE_ARGS=(--prompts heldout-mix --block-size 16 --max-tokens 96)
RESTORE_LIMIT=()
if [ "$SMOKE" = 1 ]; then
  [ "$REGENERATE" = 0 ] || { echo "build.sh: --smoke restores the kept records" >&2; exit 2; }
  SCRATCH=${SMOKE_DIR:-$DFLASH_HOME/recipe-smoke}  # emptied first
  rm -rf "$SCRATCH"
  D=$SCRATCH/data; OUT=$SCRATCH/runs/$DRAFTER; SIXBIT=$SCRATCH/drafts/$DRAFTER-6bit
  RESTORE_LIMIT=(--limit 4)
  FEATURE_ARGS=(--feature-workers 1 --max-len 160)
  TRAIN_ARGS=(--layers 2 --block-size 16 --batch-seqs 2 --anchors 4 --steps 4
              --checkpoint-every 2 --eval-every 0 --max-len 160 --seed 0)
  COMPARE_ARGS=(--prompts heldout-mix --limit 2 --block-size 16 --max-tokens 8)
fi
DATA=$(IFS=,; for d in "${DOMAINS[@]}"; do printf '%s\n' "$D/gen-$d"; done | paste -sd,)
mkdir -p "$D"
say() { echo "== recipe $DRAFTER: $*" >&2; }

stage_records() {
  GSM8K=${GSM8K:-../shared/datasets/gsm8k-train.jsonl}  # the GSM8K train split, 7,473 questions
  if [ "$REGENERATE" = 0 ]; then
    say "records: restoring the kept token records into $D"
    (cd datasets/smollm2 && $PY - <<'EOF'
import hashlib, json, pathlib, sys
files = json.loads(pathlib.Path("MANIFEST.json").read_text())["files"]
bad = [n for n, f in files.items() if n.endswith(".jsonl.gz")
       and hashlib.sha256(pathlib.Path(n).read_bytes()).hexdigest() != f["sha256"]]
sys.exit(f"datasets/smollm2: checksum mismatch: {', '.join(bad)}" if bad else 0)
EOF
    )
    ls "$D"/gen-*/gen-*.jsonl >/dev/null 2>&1 ||
      $PY recipes/smollm2/snapshot_training_data.py "$D" --restore "${RESTORE_LIMIT[@]}"
    return
  fi
  say "records: writing them with the target (resumable)"
  [ -f "$GSM8K" ] || { echo "build.sh: --regenerate needs GSM8K=path/to/gsm8k-train.jsonl" >&2; exit 2; }
  # Held out, never trained on: the last 200 GSM8K training questions (and HumanEval, chat-heldout).
  [ -f "$D/gsm8k-train-part.jsonl" ] || head -n 7273 "$GSM8K" > "$D/gsm8k-train-part.jsonl"
  [ -f "$D/code-prompts.jsonl" ] ||
    $PY recipes/smollm2/make_code_prompts.py "$D/code-prompts.jsonl" --seed 0
  [ -f "$D/chat-prompts.jsonl" ] || gunzip -c datasets/smollm2/chat-prompts.jsonl.gz > "$D/chat-prompts.jsonl"
  for entry in "${LIMITS[@]}"; do
    domain=${entry%%:*}; limit=${entry#*:}
    case $domain in math) prompts=$D/gsm8k-train-part.jsonl ;; chat) prompts=$D/chat-prompts.jsonl ;;
                    code) prompts=$D/code-prompts.jsonl ;; esac
    $PY -m dflash datagen --prompts "$prompts" --out "$D/gen-$domain" --domain "$domain" \
        --limit "$limit" --max-tokens 384 --batch-size "$GEN_BATCH" --no-progress
  done
}

stage_features() {
  say "features: tap features of every record into $D/features-all"
  # datagen writes features beside the records it generates: hard-link them into one cache.
  local sig=taps-1-8-14-20-27_top16
  mkdir -p "$D/features-all/$sig"
  for src in "$D"/gen-*/features/$sig; do
    [ -d "$src" ] || continue
    (cd "$src" && find . -name "*.npz" -exec sh -c \
       'for f; do mkdir -p "$0/$(dirname "$f")"; ln -f "$f" "$0/$f"; done' "$D/features-all/$sig" {} +)
  done
  $PY -m dflash train --data "$DATA" --feature-cache "$D/features-all" --features-only \
      --no-progress "${FEATURE_ARGS[@]}"
}

stage_train() {
  # Held-out math questions for the evaluations: the last 200 of the GSM8K train split, or,
  # without GSM8K at hand, the first 12 of them as shipped in the heldout-prompts set (the
  # evaluations read the first 4: the same questions either way).
  if [ ! -f "$D/gsm8k-heldout.jsonl" ] && [ "$SMOKE" = 0 ]; then
    if [ -f "${GSM8K:-../shared/datasets/gsm8k-train.jsonl}" ]; then
      tail -n 200 "${GSM8K:-../shared/datasets/gsm8k-train.jsonl}" > "$D/gsm8k-heldout.jsonl"
    else
      grep '"gsm8k-' dflash/assets/prompts/heldout-prompts.jsonl > "$D/gsm8k-heldout.jsonl"
    fi
  fi
  if [ "$RESTORE" = 1 ] && [ ! -d "$OUT/train" ]; then
    say "train: restoring final-v4's step-5,250 checkpoint from git history"
    $PY recipes/smollm2/carry_checkpoint.py "$OUT" --restore --from-commit
  fi
  local resume=() eval=()
  [ -d "$OUT/train" ] && resume=(--resume)
  [ "$SMOKE" = 1 ] || eval=(--eval-prompts "$D/gsm8k-heldout.jsonl")
  say "train: $OUT ${resume[*]}"
  $PY -m dflash train --data "$DATA" --out "$OUT" "${resume[@]}" --feature-cache "$D/features-all" \
      --only-cached --no-progress "${TRAIN_ARGS[@]}" "${eval[@]}"
}

stage_convert() {
  say "convert: $SIXBIT"
  $PY -m dflash convert --hf-path "$OUT" --mlx-path "$SIXBIT" --quantize --q-bits 6 \
      --q-group-size 64 --force
}

stage_compare() {
  say "compare: held-out τ, the built-in drafter against $OUT and $SIXBIT"
  $PY -m dflash bench --tau --draft "builtin,$OUT,$SIXBIT" "${COMPARE_ARGS[@]}" \
      --out "$(dirname "$OUT")/$DRAFTER-compare"
}

for stage in "${STAGES[@]}"; do "stage_$stage"; done
say "done: ${STAGES[*]}"
