#!/usr/bin/env bash
# Set up, then the first run on the built-in pair (SmolLM2-135M-Instruct + its DFlash drafter):
# one prompt answered, the same prompt decoded by mlx-lm alone, the speed-up this run measured and
# what a verify pass costs on this machine (scripts/first_run.py; an argument replaces the prompt).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec ${PYTHON:-python3} scripts/first_run.py "$@"
