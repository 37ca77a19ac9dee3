#!/usr/bin/env bash
# What a remote GPU machine without network needs, packed here into git-ignored folders so
# that it travels with the working tree under a per-call upload limit (~64 MiB):
#
#   .whl/model/*.whl       packages the machine lacks (Python 3.12, manylinux x86_64) to
#                          load the model: gguf (120 kB; the call that carries the GGUF's
#                          last folder and a head has room for this folder only)
#   .whl/serve/*.whl       the server's stack (uvloop and httptools included), aiohttp
#                          for bench-serve, httpx for the benchmarks' scripts (~12 MB)
#   .whl/extra/*.whl       `wheels PKG==VER ...`
#   .gpu/gguf/N/gguf.xz.partNN
#                          SmolLM2-135M-Instruct's GGUF, xz-compressed, split into parts of
#                          at most PART_MB (31) MB, grouped two parts a folder: carry one
#                          folder per call (.gpu/gguf/1, then .gpu/gguf/2 ...)
#   .gpu/heads/specdec/{heads,targets}/NAME/
#                          the shipped weights, to carry while the tree travels without
#                          them (`stash`)
#   .gpu/bench_sets/*.jsonl
#                          the bench sets' prompts (`specdec bench --export-prompts`)
#   .gpu/shape/            the target's config and tokenizer, no weights (3 MB): carried
#                          alone, the machine makes random weights of that shape
#                          ($SMOLLM2_SHAPE), so plain-path timings (kernels, prefill steps,
#                          deterministic mode's cost, with --ignore-eos) take one call
#                          instead of waiting for the GGUF's folders; τ needs the GGUF
#   .gpu/dev.sh            sourced on the machine (below)
#
#   scripts/gpu_pack.sh                      # all of the above; idempotent
#   scripts/gpu_pack.sh wheels PKG==VER ...  # more wheels into .whl/extra/
#   scripts/gpu_pack.sh code NAME [REV]      # the code at REV (default: the working tree)
#                                            # as .gpu/code/NAME.tar.xz, for A/B runs
#   scripts/gpu_pack.sh stash | unstash      # move the shipped heads' and adapters'
#                                            # weights out of the tree (to /tmp/gpu_stash)
#                                            # and back: a call carrying GGUF parts stays
#                                            # under the upload limit
#
# On the machine, from the repository root, at the start of every command:
#
#   source .gpu/dev.sh       # wheels into /tmp/site, the GGUF joined once all parts came,
#                            # heads carried in .gpu/heads put in place,
#                            # SPECDEC_SMOLLM2_135M_INSTRUCT, SPECDEC_CACHE, PYTHONPATH,
#                            # and a `specdec` command where none is installed
#   use NAME                 # optional: run .gpu/code/NAME.tar.xz's code (cd /tmp/code/NAME)
#
# /tmp survives between calls while the machine stays warm, so parts, wheels and weights
# carried in one call serve the next. A package without a cp312 wheel on PyPI must be built
# with a local Python 3.12 (`python3.12 -m pip wheel --no-deps -w .whl PKG==VER`).
set -euo pipefail
cd "$(dirname "$0")/.."
GPU=${GPU_DIR:-.gpu} WHL=${WHL_DIR:-.whl} PART_MB=${PART_MB:-31}
MODEL=smollm2-135m-instruct
# --no-deps: the machine has torch, numpy, transformers and their dependencies.
MODEL_WHEELS=(gguf)
SERVE_WHEELS=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection
    typing-extensions anyio sniffio idna uvicorn click h11 httpx httpcore certifi
    prometheus-client opentelemetry-api importlib-metadata zipp
    aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl
    uvloop httptools)

download() {  # DIR PKG[==VER]...: wheels for the machine's Python and platform into DIR
    local dir=$1
    shift
    mkdir -p "$dir"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 -d "$dir" "$@"
}

pinned() {  # PKG...: at the versions installed here, so both machines run the same code
    python3 - "$@" <<'PY'
import importlib.metadata as md
import sys

for name in sys.argv[1:]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(name)
PY
}

pack_gguf() {
    compgen -G "$GPU/gguf/*/gguf.xz.part*" >/dev/null && return
    local gguf xz size parts
    gguf=$(python3 -c "import specdec.models.aliases as a; print(a.ALIASES['$MODEL'].locate())")
    mkdir -p "$GPU/gguf"
    xz=$(mktemp "$GPU/gguf/tmp.XXXXXX")
    xz -6 -T0 -c "$gguf" > "$xz"
    size=$(stat -c %s "$xz")
    parts=$(((size + PART_MB * 1000000 - 1) / (PART_MB * 1000000)))
    split -d -n "$parts" "$xz" "$GPU/gguf/gguf.xz.part"
    rm -f "$xz"
    local i=0 part
    for part in "$GPU"/gguf/gguf.xz.part*; do  # two parts (~60 MB) a carried folder
        mkdir -p "$GPU/gguf/$((i / 2 + 1))" && mv "$part" "$GPU/gguf/$((i / 2 + 1))/"
        i=$((i + 1))
    done
    basename "$gguf" > "$GPU/gguf/name"
}

pack_shape() {  # the converted target's files but its weights
    local dir
    dir=$(python3 -c "
from specdec.models.aliases import ALIASES
from specdec.models.gguf import gguf_to_hf_dir
print(gguf_to_hf_dir(ALIASES['$MODEL'].locate()))")
    mkdir -p "$GPU/shape"
    find "$dir" -maxdepth 1 -type f ! -name '*.safetensors' ! -name 'specdec_source.json' \
        -exec cp {} "$GPU/shape/" \;
}

WEIGHTS=(specdec/heads/*/ specdec/targets/*/)

stash() {  # the shipped weights out of the tree: copies in .gpu/heads to carry, originals
    local d  # kept in /tmp/gpu_stash until unstash
    for d in "${WEIGHTS[@]}"; do
        compgen -G "$d*.safetensors" >/dev/null || continue
        mkdir -p "$GPU/heads/$d" "/tmp/gpu_stash/$d"
        cp "$d"*.safetensors "$GPU/heads/$d" && mv "$d"*.safetensors "/tmp/gpu_stash/$d"
    done
}

unstash() {
    local d
    for d in "${WEIGHTS[@]}"; do
        compgen -G "/tmp/gpu_stash/$d*.safetensors" >/dev/null \
            && mv "/tmp/gpu_stash/$d"*.safetensors "$d"
    done
    git status --short -- specdec/heads specdec/targets
}

write_dev_sh() {
    local name parts
    name=$(cat "$GPU/gguf/name" 2>/dev/null || echo SmolLM2-135M-Instruct.Q4_1.gguf)
    parts=$(shopt -s nullglob; p=("$GPU"/gguf/*/gguf.xz.part*); echo ${#p[@]})
    sed -e "s/@NAME@/$name/" -e "s/@PARTS@/$parts/" > "$GPU/dev.sh" <<'SH'
# Source from the repository root on the GPU machine (written by scripts/gpu_pack.sh).
mkdir -p /tmp/site /tmp/gguf /tmp/weights /tmp/code
# Wheels: the folders of .whl/ this call carried, installed once per set.
whl_set=$(ls .whl/*/*.whl 2>/dev/null | xargs -r -n1 basename | md5sum | cut -c1-12)
if compgen -G ".whl/*/*.whl" >/dev/null \
    && [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$whl_set" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        .whl/*/*.whl && echo "$whl_set" > /tmp/site/.wheels
fi
# GGUF: its @PARTS@ parts arrive over several calls; joined once all are here.
cp .gpu/gguf/*/gguf.xz.part* /tmp/gguf/ 2>/dev/null
export SMOLLM2_GGUF=/tmp/gguf/@NAME@
if [ ! -f "$SMOLLM2_GGUF" ] && [ @PARTS@ -gt 0 ] \
    && [ "$(ls /tmp/gguf/gguf.xz.part* 2>/dev/null | wc -l)" -ge @PARTS@ ]; then
    cat /tmp/gguf/gguf.xz.part* | xz -d -T0 > "$SMOLLM2_GGUF.tmp" \
        && mv "$SMOLLM2_GGUF.tmp" "$SMOLLM2_GGUF"
fi
[ -f "$SMOLLM2_GGUF" ] && export SPECDEC_SMOLLM2_135M_INSTRUCT=$SMOLLM2_GGUF
# Random bf16 weights of the target's shape, once per machine, where .gpu/shape came: a
# step's time does not depend on the weights' values (greedy runs need --ignore-eos).
if [ -f .gpu/shape/config.json ] && [ ! -f /tmp/shape/model.safetensors ]; then
    mkdir -p /tmp/shape && cp .gpu/shape/* /tmp/shape/ && python3 - <<'PY'
import torch
from transformers import AutoConfig, AutoModelForCausalLM

torch.manual_seed(0)
config = AutoConfig.from_pretrained("/tmp/shape")
AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained("/tmp/shape")
PY
fi
[ -f /tmp/shape/model.safetensors ] && export SMOLLM2_SHAPE=/tmp/shape
# Heads and adapters: kept in /tmp when a call carries them (in the tree or in
# .gpu/heads), put back when the tree travels without them (to leave room for the GGUF's
# parts).
for d in .gpu/heads/specdec/*/*/; do
    [ -d "$d" ] && t=${d#.gpu/heads/} && mkdir -p "$t" && cp "$d"*.safetensors "$t"
done
for d in specdec/heads/*/ specdec/targets/*/; do
    compgen -G "$d*.safetensors" >/dev/null \
        && mkdir -p "/tmp/weights/$d" && cp -r "$d". "/tmp/weights/$d"
done
for d in /tmp/weights/specdec/*/*/; do
    [ -d "$d" ] || continue
    t=${d#/tmp/weights/}
    compgen -G "$t*.safetensors" >/dev/null || { mkdir -p "$t" && cp -r "$d". "$t"; }
done
# train/, data_gen/ and serve/ import as specdec.* through an install's package-dir
# mapping; without an install, links inside specdec/ do the same.
link_packages() { for p in serve train data_gen; do ln -sfn "../$p" "$1/specdec/$p"; done; }
python3 -c "import specdec.train" 2>/dev/null || link_packages "$PWD"
for archive in .gpu/code/*.tar.xz; do  # code variants (scripts/gpu_pack.sh code NAME)
    [ -f "$archive" ] || continue
    v=/tmp/code/$(basename "$archive" .tar.xz)
    rm -rf "$v" && mkdir -p "$v" && tar xJf "$archive" -C "$v" && link_packages "$v"
    [ -d /tmp/weights/specdec ] && cp -r /tmp/weights/specdec "$v/"
done
use() { export PYTHONPATH=/tmp/site:/tmp/code/${1:?use NAME}; cd "/tmp/code/$1" || return; }
# The console script where specdec is not installed (the machine runs it from the tree).
if ! command -v specdec >/dev/null; then
    specdec() { python3 -m specdec.cli "$@"; }
    export -f specdec
fi
export PYTHONPATH=/tmp/site:$PWD SPECDEC_CACHE=/tmp/specdec_cache PYTHONUNBUFFERED=1
SH
}

pack_code() {  # NAME [REV]
    local name=${1:?code NAME [REV]}
    local paths=(specdec serve train data_gen configs benchmarks tests pyproject.toml)
    mkdir -p "$GPU/code"
    if [ -n "${2:-}" ]; then
        git archive "$2" -- "${paths[@]}" ':!*.safetensors' ':!benchmarks/results' \
            | xz -6 -T0 > "$GPU/code/$name.tar.xz"
    else
        tar cJf "$GPU/code/$name.tar.xz" --exclude='*.safetensors' --exclude=__pycache__ \
            --exclude=benchmarks/results "${paths[@]}"
    fi
}

case ${1:-all} in
    all)
        rm -f "$WHL"/*.whl  # the flat layout of earlier packs
        mapfile -t specs < <(pinned "${MODEL_WHEELS[@]}")
        download "$WHL/model" "${specs[@]}"
        mapfile -t specs < <(pinned "${SERVE_WHEELS[@]}")
        download "$WHL/serve" "${specs[@]}"
        pack_gguf
        pack_shape
        [ -f "$GPU/bench_sets/writingbench.jsonl" ] \
            || specdec bench --export-prompts "$GPU/bench_sets"
        write_dev_sh ;;
    wheels) shift; download "$WHL/extra" "$@" ;;
    code) shift; pack_code "$@"; [ -f "$GPU/dev.sh" ] || write_dev_sh ;;
    stash) stash ;;
    unstash) unstash; exit ;;
    *) echo "usage: $0 [all | wheels PKG==VER... | code NAME [REV] | stash | unstash]" >&2
        exit 2 ;;
esac
du -sh "$WHL" "$GPU"/* 2>/dev/null || true
