#!/usr/bin/env bash
# What a GPU lease carries, made here (the GPU machine has no network and no data
# packages), into git-ignored folders; idempotent, ~2 minutes on 2 cores:
#   .whl/                          gguf (the GPU machine lacks it; benchmarks/h200_setup.sh
#                                  installs .whl/*.whl), ~0.1 MB
#   .gpu/gguf/gguf.xz.part0{0,1,2} SmolLM2's GGUF, xz-compressed, in 33 MB parts: one or two
#                                  per call (64 MiB per call with the code);
#                                  h200_setup.sh joins them once part00 and part01 arrived
#   .gpu/bench_sets/*.jsonl        the bench sets' prompts (`specdec bench --export-prompts`)
# Prompts for data generation come from `scripts/default_head.sh prompts` and travel as
# .gpu/<name>/prompts.tar.xz (benchmarks/h200_default_head.sh unpacks them).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl .gpu/gguf
compgen -G ".whl/gguf-*.whl" >/dev/null || python3 -m pip download -q --no-deps -d .whl gguf==0.19.0
if ! compgen -G ".gpu/gguf/gguf.xz.part*" >/dev/null; then
    gguf=$(python3 -c "from specdec.models.aliases import ALIASES; \
print(ALIASES['smollm2-135m-instruct'].locate())")
    xz -6 -T0 -c "$gguf" | split -b 33000000 -d - .gpu/gguf/gguf.xz.part
fi
[ -f .gpu/bench_sets/writingbench.jsonl ] || specdec bench --export-prompts .gpu/bench_sets
ls -la .whl .gpu/gguf .gpu/bench_sets
