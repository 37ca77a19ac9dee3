#!/usr/bin/env bash
# All set-up, then the whole CPU test suite (Triton kernels under the interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export TRITON_INTERPRET=1
# One pytest-xdist worker per core, at most 4 (SPECDEC_TEST_WORKERS overrides; 0 runs in
# this process), each taking whole test files (--dist loadgroup with a group per file,
# tests/conftest.py; the modules that run vLLM form one group) so a module's fixtures
# (a converted model, a bench run, a server) are built once. --durations: the slowest
# tests in every CI log, to keep the suite near 20 minutes.
workers=${SPECDEC_TEST_WORKERS:-$(python3 -c "import os; print(min(4, os.cpu_count() or 1))")}
python3 -m pytest -q -p no:cacheprovider -n "$workers" --dist loadgroup --durations=15 "$@"
