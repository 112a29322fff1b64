#!/usr/bin/env bash
# Set up, then run the test suite: the fast tier (`pytest -m "not slow"`), then the slow tier,
# with the wall time of each. Arguments, if any, go to a single pytest run instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ "${DFLASH_SETUP_DONE:-0}" = 1 ] || bash scripts/setup.sh
if [ $# -gt 0 ]; then
  exec $PY -m pytest -q "$@"
fi
start=$SECONDS
$PY -m pytest -q -m "not slow" -n 2
fast=$((SECONDS - start))
echo "test.sh: fast tier (pytest -m \"not slow\" -n 2) passed in ${fast} s"
start=$SECONDS
$PY -m pytest -q -m slow
echo "test.sh: fast tier ${fast} s, slow tier $((SECONDS - start)) s"
