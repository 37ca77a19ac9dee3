#!/usr/bin/env bash
# The speculative step's speed on the H200, in one device call (~4-5 min): plain decoding
# against EAGLE-3 with the pipelined step (chains K=2 and 3, the t8-d5-n32 tree) at batch
# 1 and 16, per mode of the head inside its graphs (eager, regions: its layer and logits
# compiled, compiled: the whole draft side one compiled region). On the GPU machine, from
# the repository root:
#
#   source benchmarks/h200_setup.sh > /tmp/setup.log 2>&1     # SmolLM2's GGUF joined
#   HEAD=specdec/heads/smollm2-135m-instruct PROMPTS=.gpu/bench_sets \
#       bash benchmarks/h200_spec_speed.sh
#
# PROMPTS holds the sets' JSONLs (made where the data packages are: `specdec bench
# --export-prompts DIR`); SETS picks them (default humaneval gsm_symbolic), MODES the head's
# modes (eager, regions, compiled; default eager compiled), CHAINS the chain lengths
# (default 2,3); EXTRA_ARGS is added to every bench command (e.g.
# "--triton-gemm-max-tokens 0"). Reports go to $OUT (spec_speed_<mode>.*).
set -uo pipefail
: "${HEAD:?HEAD=<EAGLE-3 head dir>}" "${PROMPTS:?PROMPTS=<dir with the bench set JSONLs>}"
OUT=${OUT:-/tmp/spec_speed}
mkdir -p "$OUT"
prompts=()
for set in ${SETS:-humaneval gsm_symbolic}; do prompts+=(--prompts "$PROMPTS/$set.jsonl"); done
for mode in ${MODES:-eager compiled}; do
    # eager: the head runs eagerly inside its graphs; regions: its layer and logits are
    # compiled; compiled: the whole draft side is one compiled region (the default).
    case $mode in
        eager) flags=(--spec-compile-head off) ;;
        regions) flags=(--spec-compile-head on --spec-compile-growth off) ;;
        compiled) flags=(--spec-compile-head on --spec-compile-growth on) ;;
        *) echo "unknown mode $mode: eager, regions or compiled" >&2; exit 2 ;;
    esac
    timeout "${BENCH_S:-270}" specdec bench --model smollm2-135m-instruct --draft eagle3 \
        --draft-model "$HEAD" "${prompts[@]}" --num-prompts "${NP:-16}" --max-tokens 256 \
        --batch-sizes 1,16 --dtype bfloat16 --sweep-chain "${CHAINS:-2,3}" --sweep-top-k 8 \
        --sweep-depth 5 --sweep-total-tokens 32 --spec-pipelined on \
        "${flags[@]}" --repeats 1 --no-progress ${EXTRA_ARGS:-} \
        --json "$OUT/spec_speed_$mode.json" > "$OUT/spec_speed_$mode.txt" 2>&1
    echo "$mode: rc=$?"
    grep "^|" "$OUT/spec_speed_$mode.txt" | head -20
done
