#!/usr/bin/env bash
# Set up and run the main job on the built-in pair: SmolLM2-135M-Instruct + its DFlash drafter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
${PYTHON:-python3} -m dflash generate --max-tokens 200 \
  --prompt "${1:-Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?}"
