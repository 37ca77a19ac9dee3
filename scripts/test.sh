#!/usr/bin/env bash
# All set-up, then the whole CPU test suite (Triton kernels under the interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export TRITON_INTERPRET=1
python3 -m pytest -q -p no:cacheprovider "$@"
