#!/usr/bin/env bash
# Adapt a published drafter to a fine-tuned target, shown on a real fine-tune of the built-in
# target (SmolLM2-135M-Instruct, float32) and the built-in drafter, in six resumable stages:
#
#   finetune    mlx-lm's own LoRA trainer (`mlx_lm.lora --train`, rank 8, batch 4) on one domain,
#               GSM8K's reference answers (its training split less the last 200 questions), then
#               `mlx_lm.fuse` into a float model folder; the tokenizer is checked to be the base's
#   tau-before  the built-in drafter's whole-block τ at block 16 on 100 held-out GSM8K questions
#               (the last 100 of the training split: never seen by the fine-tune nor the drafter)
#               with the base target and with the fine-tune: the τ the fine-tune costs
#   data        the fine-tune's own answers to training questions (`dflash datagen`: greedy,
#               tap features and top-k stored in the same pass)
#   adapt       `dflash train --init-from <drafter> --target <fine-tune>` on those records: the
#               learning rate annealed over 3,600 CPU-s (exported as drafter-1h), then resumed
#               to 7,200 CPU-s (drafter-2h)
#   tau-after   τ of drafter-1h and drafter-2h with the fine-tune on the held-out questions
#   report      $ADAPT_DIR/report.md and tau.json: base τ, fine-tune τ before / after 1 h / 2 h,
#               recovered fraction (after - before) / (base - before), keep or not
#
# Usage: bash recipes/smollm2/adapt.sh [STAGE...]     (default: all six, in order)
#   Every stage skips itself when its output exists; rerun the same command after an
#   interruption (`adapt` resumes the training run from its last checkpoint).
#   env: DFLASH_HOME (~/.cache/dflash), ADAPT_DIR ($DFLASH_HOME/adapt), GSM8K (the GSM8K train
#        split, ../shared/datasets/gsm8k-train.jsonl), BASE (the target fine-tuned: the built-in
#        one), DRAFT (the drafter adapted: the built-in one), LORA_ITERS (60), LORA_LR (2e-4),
#        DATA_N (records to generate, 300), GEN_WORKERS (2), LR (6e-4), EVAL_EVERY (250),
#        TAU_TOKENS (128), TAU_LIMIT (the first 40 of the 100 held-out
#        questions: ~15 CPU-s a question)
# Walk-through and the numbers measured with it: docs/adapting.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export DFLASH_HOME=${DFLASH_HOME:-$HOME/.cache/dflash}
A=${ADAPT_DIR:-$DFLASH_HOME/adapt}
GSM8K=${GSM8K:-../shared/datasets/gsm8k-train.jsonl}
BASE=${BASE:-$($PY -c 'from dflash.default_pair import default_target_path as p; print(p())')}
DRAFT=${DRAFT:-$($PY -c 'from dflash.default_pair import default_draft_path as p; print(p())')}
FT=$A/smollm2-gsm8k            # the fused fine-tune (float)
RUN=$A/run                     # the adaptation run (dflash train --out)
HELDOUT=$A/gsm8k/heldout.jsonl # the evaluation prompts
LORA_ITERS=${LORA_ITERS:-60}
LORA_LR=${LORA_LR:-2e-4}
DATA_N=${DATA_N:-300}
TAU_ARGS=(--tau --block-size 16 --max-tokens "${TAU_TOKENS:-128}" --limit "${TAU_LIMIT:-40}"
          --prompts "$HELDOUT")
TRAIN_ARGS=(--block-size 16 --batch-seqs 4 --anchors 48 --lr "${LR:-6e-4}" --loss mix
            --soft-weight 0.5 --soft-topk 16 --steps 50000 --lr-schedule cpu
            --checkpoint-every 50 --eval-every "${EVAL_EVERY:-250}" --eval-n 4
            --eval-block-sizes 16 --eval-prompts "$HELDOUT" --seed 0)
STAGES=()
for arg in "$@"; do
  case $arg in
    finetune|tau-before|data|adapt|tau-after|report) STAGES+=("$arg") ;;
    *) echo "adapt.sh: unknown argument $arg (see the header of $0)" >&2; exit 2 ;;
  esac
done
[ ${#STAGES[@]} -gt 0 ] || STAGES=(finetune tau-before data adapt tau-after report)
mkdir -p "$A"
say() { echo "== adapt $(date -u +%H:%M:%S): $*" >&2; }
need_ft() { [ -f "$FT/config.json" ] || { echo "adapt.sh: no fine-tune at $FT: run the finetune stage" >&2; exit 2; }; }
# mlx-lm's own commands, after dflash.backend.configure() (MLX's CPU backend on OpenBLAS: the
# Linux wheel's reference BLAS is ~25x slower)
mlx_lm() {
  local mod=$1; shift
  $PY -c "import sys, dflash.backend as b; b.configure(); from mlx_lm.$mod import main; \
sys.argv = ['mlx_lm.$mod'] + sys.argv[1:]; main()" "$@"
}

stage_finetune() {
  local G=$A/gsm8k
  mkdir -p "$G"
  if [ ! -f "$HELDOUT" ]; then
    say "finetune: GSM8K splits into $G"
    [ -f "$GSM8K" ] || { echo "adapt.sh: GSM8K=$GSM8K: no such file" >&2; exit 2; }
    $PY - "$GSM8K" "$G" <<'EOF'
import json, sys
from pathlib import Path
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
out = Path(sys.argv[2])
def write(name, items):
    tmp = out / (name + ".tmp")
    tmp.write_text("".join(json.dumps(x) + "\n" for x in items))
    tmp.replace(out / name)
chat = lambda r: {"messages": [{"role": "user", "content": r["question"]},
                               {"role": "assistant", "content": r["answer"]}]}
train, valid, held = rows[:-200], rows[-200:-100], rows[-100:]
# mlx-lm's chat data (train.jsonl / valid.jsonl); the last 200 questions are never trained on,
# by the fine-tune or by the built-in drafter (build.sh holds out the same 200)
write("train.jsonl", [chat(r) for r in train])
write("valid.jsonl", [chat(r) for r in valid])
# datagen's prompts: the training questions (the fine-tune answers them itself)
write("questions.jsonl", [{"id": f"gsm8k-train-{i}", "question": r["question"]}
                          for i, r in enumerate(train)])
# the evaluation prompts, in the format `dflash bench --prompts` reads (written last: the marker)
write("heldout.jsonl", [{"id": f"gsm8k-heldout-{len(rows) - 100 + i}", "prompt": r["question"]}
                        for i, r in enumerate(held)])
EOF
  fi
  if [ ! -f "$A/lora/adapters.safetensors" ]; then
    say "finetune: mlx_lm.lora, $LORA_ITERS iterations of batch 4, rank 8"
    printf 'lora_parameters:\n  rank: 8\n  dropout: 0.0\n  scale: 20.0\n' > "$A/lora.yaml"
    mlx_lm lora --model "$BASE" --train --data "$G" -c "$A/lora.yaml" --batch-size 4 \
        --iters "$LORA_ITERS" --learning-rate "$LORA_LR" --num-layers 16 --mask-prompt \
        --max-seq-length 512 --steps-per-report 10 --steps-per-eval "$LORA_ITERS" \
        --val-batches 2 --save-every 20 --adapter-path "$A/lora.tmp" --seed 0
    rm -rf "$A/lora"; mv "$A/lora.tmp" "$A/lora"
  fi
  if [ ! -f "$FT/config.json" ]; then
    say "finetune: mlx_lm.fuse into $FT"
    rm -rf "$FT.tmp"
    mlx_lm fuse --model "$BASE" --adapter-path "$A/lora" --save-path "$FT.tmp"
    mv "$FT.tmp" "$FT"
  fi
  # The drafter reads the target's token ids: the fine-tune must keep the base's tokenizer.
  $PY - "$BASE" "$FT" "$DRAFT" <<'EOF'
import json, sys
from pathlib import Path
from transformers import AutoTokenizer
base, ft, draft = sys.argv[1:]
a, b = AutoTokenizer.from_pretrained(base), AutoTokenizer.from_pretrained(ft)
text = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72 <|im_end|>"
same = (a.get_vocab() == b.get_vocab() and a.all_special_tokens == b.all_special_tokens
        and a.chat_template == b.chat_template and a.encode(text) == b.encode(text))
dcfg = json.loads((Path(draft) / "config.json").read_text())
vocab = json.loads((Path(ft) / "config.json").read_text())["vocab_size"]
print(f"tokenizer: fine-tune {'==' if same else '!='} base; vocab_size {vocab}, drafter's "
      f"{dcfg['vocab_size']}", file=sys.stderr)
sys.exit(0 if same and vocab == dcfg["vocab_size"] else
         "adapt.sh: the fine-tune's tokenizer differs from the base's: the drafter's token ids "
         "would mean other tokens")
EOF
}

tau() {  # tau OUT TARGET DRAFT
  if [ -f "$1/tau.json" ]; then say "tau: $1 exists"; return; fi
  say "tau: $(basename "$1") (target $2, drafter $3)"
  $PY -m dflash bench "${TAU_ARGS[@]}" --model "$2" --draft "$3" --out "$1.tmp"
  rm -rf "$1"; mv "$1.tmp" "$1"
}

stage_tau-before() {
  tau "$A/tau-base" "$BASE" "$DRAFT"
  need_ft
  tau "$A/tau-before" "$FT" "$DRAFT"
}

stage_data() {
  need_ft
  local have=0
  have=$(cat "$A"/data/gen-*.jsonl 2>/dev/null | grep -c '"response_ids"' || true)
  if [ "$have" -ge "$DATA_N" ]; then say "data: $have records in $A/data"; return; fi
  say "data: the fine-tune's answers to $DATA_N training questions ($have done)"
  $PY -m dflash datagen --target "$FT" --prompts "$A/gsm8k/questions.jsonl" --out "$A/data" \
      --domain math --limit "$DATA_N" --max-tokens 384 --batch-size 32 \
      --workers "${GEN_WORKERS:-2}" --no-progress
}

export_copy() {  # the run's exported drafter (weights + config) as it is now
  rm -rf "$1.tmp"; mkdir -p "$1.tmp"
  cp "$RUN/config.json" "$RUN/model.safetensors" "$1.tmp/"
  rm -rf "$1"; mv "$1.tmp" "$1"
}

train_to() {  # train_to CPU_SECONDS
  local init=(--init-from "$DRAFT")
  [ -d "$RUN/train" ] && init=(--resume)
  say "adapt: $RUN to $1 CPU-s ${init[*]}"
  $PY -m dflash train --target "$FT" --data "$A/data" --out "$RUN" "${init[@]}" \
      --feature-cache "$A/data/features" --no-progress --cpu-budget "$1" "${TRAIN_ARGS[@]}"
}

stage_adapt() {
  need_ft
  [ -f "$A/drafter-1h/config.json" ] || { train_to 3600; export_copy "$A/drafter-1h"; }
  [ -f "$A/drafter-2h/config.json" ] || { train_to 7200; export_copy "$A/drafter-2h"; }
  say "adapt: drafter-1h and drafter-2h exported"
}

stage_tau-after() {
  need_ft
  local h
  for h in 1h 2h; do
    if [ -f "$A/drafter-$h/config.json" ]; then tau "$A/tau-after-$h" "$FT" "$A/drafter-$h"
    else say "tau-after: no drafter-$h yet (the adapt stage)"; fi
  done
}

stage_report() {
  $PY - "$A" <<'EOF'
import json, sys
from pathlib import Path
a = Path(sys.argv[1])
runs = {}
def tau(name):
    p = a / name / "tau.json"
    if not p.is_file():
        return None
    runs[name] = r = json.loads(p.read_text())
    return next(iter(r["drafters"].values()))["all"]
def cpu(name):  # the CPU-s the exported drafter had trained for
    p = a / name / "config.json"
    return json.loads(p.read_text()).get("dflash_training", {}) if p.is_file() else {}
res = {"base_target": tau("tau-base"), "finetune_before": tau("tau-before"),
       "finetune_after_1h": tau("tau-after-1h"), "finetune_after_2h": tau("tau-after-2h")}
b, f = res["base_target"], res["finetune_before"]
for h in ("1h", "2h"):
    t = res[f"finetune_after_{h}"]
    res[f"recovered_{h}"] = (None if None in (b, f, t) or b == f else (t - f) / (b - f))
    res[f"steps_{h}"] = cpu(f"drafter-{h}").get("step")
best = res["finetune_after_2h"] or res["finetune_after_1h"]
# keep the adapted drafter for the fine-tune when it beats the published one on it (paired: the
# same prompts and the same greedy outputs) by more than 0.05
res["verdict"] = (None if best is None or f is None else
                  "keep" if best - f > 0.05 else "not")
(a / "tau.json").write_text(json.dumps(res, indent=2) + "\n")
fmt = lambda x: "—" if x is None else f"{x:.3f}"
first = next(iter(runs.values()), {"max_tokens": "?", "domains": {}})
res["prompts"] = sum(first["domains"].values())
lines = ["# Adapting the built-in drafter to a GSM8K fine-tune of its target", "",
         f"Whole-block τ at block 16 (`dflash bench --tau`, greedy, {first['max_tokens']} tokens) "
         f"on the first {res['prompts']} of the 100 held-out GSM8K questions "
         "(`gsm8k/heldout.jsonl`); `bash recipes/smollm2/adapt.sh` wrote every number.", "",
         "| target | drafter | τ |", "|---|---|---:|",
         f"| base (built-in SmolLM2-135M-Instruct f32) | built-in | {fmt(b)} |",
         f"| fine-tune (LoRA on GSM8K, fused) | built-in | {fmt(f)} |",
         f"| fine-tune | adapted, 1 CPU-h (step {res['steps_1h'] or '—'}) | {fmt(res['finetune_after_1h'])} |",
         f"| fine-tune | adapted, 2 CPU-h (step {res['steps_2h'] or '—'}) | {fmt(res['finetune_after_2h'])} |",
         "", f"recovered fraction (after − before) / (base − before): 1 h "
         f"{fmt(res['recovered_1h'])}, 2 h {fmt(res['recovered_2h'])}",
         "", f"verdict: {res['verdict'] or 'pending (stages still to run)'}", ""]
(a / "report.md").write_text("\n".join(lines))
print("\n".join(lines))
EOF
}

for stage in "${STAGES[@]}"; do "stage_$stage"; done
say "done: ${STAGES[*]}"
