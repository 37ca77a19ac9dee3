#!/usr/bin/env bash
# All set-up, then the whole CPU test suite (Triton kernels under the interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export TRITON_INTERPRET=1
# --durations: the slowest tests in every CI log, to keep the suite near 20 minutes.
python3 -m pytest -q -p no:cacheprovider --durations=15 "$@"
