#!/usr/bin/env bash
# The two ways to train the built-in drafter on the new records:
#
#   continue  from final-v4 (its float checkpoint at step 5,250, kept in git history; its
#             vocabulary grown by what the new records use)
#   fresh     a new drafter with final-v4's recipe
#
# Both read the same records (the sealed shards in datasets/smollm2/shards and the records kept
# before shards). Where the target features come from (FEATURES):
#
#   stream  (default) every record, in one shuffled order; STREAM_WORKERS more processes (1)
#           compute the features of the next steps' records beside training
#           (`--stream-features N`; 0 leaves a core to the records job), the training process
#           those they have not reached; all cached under
#           $DFLASH_HOME/data/smollm2/features-all, their CPU counted in the run's
#   cached  only the records whose features are cached (`--only-cached --refresh-data`: a
#           `--features-only` job may keep filling the cache beside them; the run picks the new
#           ones up at its epoch boundaries)
#
# τ on the five-domain held-out set (`heldout-domains`: math, chat, code, agent turns, long
# contexts) every EVAL_EVERY steps lands in RUN/train/metrics.jsonl; `python -m
# dflash.training.curve` plots τ against CPU-hours.
#
# Usage: bash recipes/smollm2/arms.sh continue|fresh     (rerun to resume)
#   env: LR (peak, 6e-4), CPU_BUDGET (7200 CPU-s: what the learning rate anneals over),
#        FEATURES (stream|cached), STREAM_WORKERS (1), EVAL_EVERY (250),
#        RUN (the run's folder name, arm-ARM), START (continue: the drafter folder to start
#        from instead of final-v4, e.g. an earlier run's folder), LAYERS (fresh: the drafter's
#        depth, 2), SEED_LAYERS (fresh: which target layers seed it, `--init`: spread, first, last,
#        aligned or ids; none), LOSS (mix, kl or ce; mix), GROW (continue: layers appended to
#        the drafter it starts from, `--grow-layers`: copies of its last layer with zeroed output
#        projections, so the run starts at that drafter's τ; 0)
#
# The depth probe (3, 4, 5 layers seeded from the target's layers, forward KL, 2 CPU-h each):
#   LAYERS=4 SEED_LAYERS=spread LOSS=kl RUN=probe-l4 bash recipes/smollm2/arms.sh fresh
# Depth without starting over (final-v4 grown to 4 layers):
#   GROW=2 LR=3e-4 RUN=grow-l4 bash recipes/smollm2/arms.sh continue
# Needs: bash recipes/smollm2/build.sh records (the old records under $DFLASH_HOME/data/smollm2).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export DFLASH_HOME=${DFLASH_HOME:-$HOME/.cache/dflash}
ARM=${1:-}
D=$DFLASH_HOME/data/smollm2
OUT=$DFLASH_HOME/runs/${RUN:-arm-$ARM}
DATA=datasets/smollm2/shards,$D/gen-math,$D/gen-chat,$D/gen-code
ARGS=(--layers "${LAYERS:-2}" --block-size 16 --batch-seqs 4 --anchors 48 --lr "${LR:-6e-4}"
      --loss "${LOSS:-mix}"
      --soft-weight 0.5 --soft-topk 16 --steps 50000 --cpu-budget "${CPU_BUDGET:-7200}"
      --lr-schedule cpu --checkpoint-every 50 --eval-every "${EVAL_EVERY:-250}" --eval-n 4
      --eval-block-sizes 16 --eval-prompts heldout-domains --seed 0)
case ${FEATURES:-stream} in
  stream) FEAT=(--stream-features "${STREAM_WORKERS:-1}") ;;
  cached) FEAT=(--only-cached --refresh-data) ;;
  *) echo "arms.sh: FEATURES is stream or cached, got '$FEATURES'" >&2; exit 2 ;;
esac
for d in gen-math gen-chat gen-code; do
  [ -d "$D/$d" ] || { echo "arms.sh: $D/$d missing: run bash recipes/smollm2/build.sh records" >&2; exit 2; }
done
case $ARM in
  continue)
    START=${START:-$DFLASH_HOME/drafts/final-v4-5250}
    if [ ! -f "$START/config.json" ] && [ "$START" = "$DFLASH_HOME/drafts/final-v4-5250" ]; then
      if [ -d "$DFLASH_HOME/runs/final-v4/train" ]; then
        $PY recipes/smollm2/carry_checkpoint.py "$DFLASH_HOME/runs/final-v4" --export "$START"
      else
        $PY recipes/smollm2/carry_checkpoint.py "$DFLASH_HOME/runs/final-v4" --restore \
            --from-commit --export "$START"
      fi
    fi
    [ -f "$START/config.json" ] || { echo "arms.sh: START=$START has no config.json" >&2; exit 2; }
    INIT=(--init-from "$START")
    [ "${GROW:-0}" = 0 ] || INIT+=(--grow-layers "$GROW") ;;
  fresh) INIT=(--taps 1,8,14,20,27)
         [ "${SEED_LAYERS:-none}" = none ] || INIT+=(--init "$SEED_LAYERS") ;;
  *) echo "arms.sh: expected continue or fresh, got '$ARM'" >&2; exit 2 ;;
esac
resume=()
if [ -d "$OUT/train" ]; then resume=(--resume); INIT=(); fi
$PY -m dflash train --data "$DATA" --out "$OUT" "${resume[@]}" "${INIT[@]}" \
    --feature-cache "$D/features-all" "${FEAT[@]}" --no-progress "${ARGS[@]}"
