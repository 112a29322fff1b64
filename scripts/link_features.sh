#!/usr/bin/env bash
# Hard-link the tap features of every data folder ($D/gen-*/features/SIG) into one feature cache
# ($D/features-all/SIG) that `dflash train --feature-cache $D/features-all` reads: no copies, and a
# long run with --refresh-data picks up records generated since (at its next epoch boundary).
# Usage: bash scripts/link_features.sh DATA_DIR [SIGNATURE]   (idempotent)
set -euo pipefail
D=$1
SIG=${2:-taps-1-8-14-20-27_top16}
mkdir -p "$D/features-all/$SIG"
for src in "$D"/gen-*/features/$SIG; do
  [ -d "$src" ] || continue
  (cd "$src" && find . -name "*.npz" -exec sh -c \
     'for f; do mkdir -p "$0/$(dirname "$f")"; ln -f "$f" "$0/$f"; done' "$D/features-all/$SIG" {} +)
done
