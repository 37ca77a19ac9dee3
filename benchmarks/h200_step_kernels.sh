#!/usr/bin/env bash
# Fewer kernels per step, checked and measured on the H200 in one device call (~6 min):
# RoPE inside the cache write (one kernel per layer fewer in every forward), the accepted
# K/V moved in one launch, and the pipelined step's lighter glue (count_step_ops.py counts
# it on the CPU). On the GPU machine, from the repository root:
#
#   source benchmarks/h200_setup.sh > /tmp/setup.log 2>&1     # SmolLM2's GGUF joined
#   HEAD=specdec/heads/smollm2-135m-instruct PROMPTS=.gpu/bench_sets \
#       bash benchmarks/h200_step_kernels.sh
#
# 1. The kernels compiled by the machine's Triton against their references (every kernel
#    test runs on CUDA when there is one), and the engine's graph paths against the fp32
#    reference (test_engine_gpu.py).
# 2. Plain decoding with and without the fused RoPE, same process (#2's batch-1 bar:
#    1,000 tok/s; 977.5 before, BENCHMARKS.md session 9).
# 3. Kernels and device time per pipelined step, chain of 3 and the t8-d5-n32 tree, head
#    compiled (session 12: 557 and 1,527 kernels; the tree's figure had regions recompiled
#    past dynamo's limit, fixed since).
# STEPS picks the parts (default "tests engine profile"); TESTS the test files of part 1,
# PYTEST_K a -k filter for them (e.g. a first call before the model and the head arrive).
# Reports go to $OUT.
set -uo pipefail
: "${HEAD:?HEAD=<EAGLE-3 head dir>}" "${PROMPTS:?PROMPTS=<dir with the bench set JSONLs>}"
OUT=${OUT:-/tmp/step_kernels}
mkdir -p "$OUT"
steps=" ${STEPS:-tests engine profile} "
if [[ $steps == *" tests "* ]]; then
    # shellcheck disable=SC2086  # TESTS is a list of files
    timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider \
        ${TESTS:-tests/test_kernels.py tests/test_tree_attention.py tests/test_engine_gpu.py} \
        ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/gpu_tests.txt" 2>&1
    echo "gpu tests: rc=$?"; grep -E "passed|failed|error" "$OUT/gpu_tests.txt" | tail -3
fi
[[ $steps == *" engine "* ]] && {
timeout "${ENGINE_S:-150}" python3 benchmarks/bench_engine.py --model smollm2-135m-instruct \
    --variants graphs+compile,graphs+compile+rope-unfused --batch-sizes 1,64 --repeats 5 \
    --json "$OUT/engine_rope.json" > "$OUT/engine_rope.txt" 2>&1
echo "engine: rc=$?"; grep "^|" "$OUT/engine_rope.txt" | tail -8
}
[[ $steps == *" profile "* ]] && {
timeout "${PROFILE_S:-150}" python3 benchmarks/profile_spec_trace.py --head "$HEAD" \
    --prompts "$PROMPTS/humaneval.jsonl" --shapes chain3,tree --batch 1 --max-tokens 128 \
    --compile-head on > "$OUT/profile_spec_trace.txt" 2>&1
echo "profile: rc=$?"; grep -A3 "^## " "$OUT/profile_spec_trace.txt" | head -24
}
true
