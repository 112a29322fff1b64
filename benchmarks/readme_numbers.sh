#!/usr/bin/env bash
# The numbers of the README's table and of docs/benchmarks.md, measured again on this machine.
# Run it on a quiet machine (nothing else running): speed-ups are wall-clock ratios.
#
#   1. the pass costs the auto policy decides with (`dflash calibrate --refresh`);
#   2. the built-in pair against mlx-lm on the held-out mix (GSM8K, chat, HumanEval), `auto`;
#   3. the same with the drafter alone (`--no-lookup`: no continuations from the context);
#   4. many clients: the batched engine against mlx-lm's batching at 4 and 8 clients;
#   5. held-out τ of the drafters, whole blocks verified (`--tau`).
#
# Usage: bash benchmarks/readme_numbers.sh [DRAFT]   (default: the built-in drafter)
# Results under ${OUT:-$DFLASH_HOME/bench/readme}: bench.md / bench.json per run, and the machine
# (CPU model, cores, OS, MLX version) in machine.txt, for docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export DFLASH_HOME=${DFLASH_HOME:-$HOME/.cache/dflash}
OUT=${OUT:-$DFLASH_HOME/bench/readme}
DRAFT=${1:-}
DRAFT_ARGS=(); [ -z "$DRAFT" ] || DRAFT_ARGS=(--draft "$DRAFT")
mkdir -p "$OUT"

{
  date -u +"%Y-%m-%d %H:%M UTC"
  (lscpu 2>/dev/null | grep -E "^(Model name|CPU\(s\)|Hypervisor vendor)" ) ||
    sysctl -n machdep.cpu.brand_string hw.ncpu 2>/dev/null || true
  uname -srm
  $PY -c "import platform, mlx.core as mx, importlib.metadata as m; \
print('python', platform.python_version(), '· mlx', m.version('mlx'), '· mlx-lm', \
m.version('mlx-lm'), '· device', mx.default_device())"
} | tee "$OUT/machine.txt"

$PY -m dflash calibrate --refresh "${DRAFT_ARGS[@]}" | tee "$OUT/calibration.txt"
$PY -m dflash bench "${DRAFT_ARGS[@]}" --prompts heldout-mix --block-size 16 --max-tokens 96 \
    --repeats 2 --out "$OUT/auto"
$PY -m dflash bench "${DRAFT_ARGS[@]}" --prompts heldout-mix --block-size 16 --max-tokens 96 \
    --no-lookup --out "$OUT/no-lookup"
for n in 4 8; do
  $PY -m dflash bench "${DRAFT_ARGS[@]}" --concurrency "$n" --limit $((2 * n)) \
      --prompts heldout-mix --max-tokens 96 --out "$OUT/concurrency"
done
$PY -m dflash bench --tau --draft "builtin${DRAFT:+,$DRAFT}" --prompts heldout-mix \
    --block-size 16 --max-tokens 96 --out "$OUT/tau"
