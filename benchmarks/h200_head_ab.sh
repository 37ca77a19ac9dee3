#!/usr/bin/env bash
# A new head against the shipped one on the bench sets, both in the shipped bands as one
# config (a chain of 3, the t8-d6-n32 tree at batch 1 on CUDA, chains of 5 up to batch 4):
# batch 1 for both heads, batch 16 for the new one; bf16, 16 prompts, 256 tokens, the
# pipelined step. On the GPU machine, from the repository root, after
# `source benchmarks/h200_setup.sh` (sessions 27 and 28):
#
#   NEW=/tmp/default-head-run/head OLD=/tmp/head PROMPTS=.gpu/bench_sets \
#       bash benchmarks/h200_head_ab.sh
#
# Reports in $OUT (<TAG>_{new_b1,old_b1,new_b16}.{json,md}, one archive of the logs: seven
# files, under the device's eight); RUN_S caps each bench command (default 200 s).
set -uo pipefail
: "${NEW:?NEW=<new head dir>}" "${OLD:?OLD=<shipped head dir>}" "${PROMPTS:?PROMPTS=<bench set JSONLs>}"
OUT=${OUT:-/tmp/head_ab} TAG=${TAG:-ab}
mkdir -p "$OUT"
common=(--model smollm2-135m-instruct --draft eagle3 --num-prompts 16 --max-tokens 256
    --dtype bfloat16 --spec-pipelined on --repeats 1 --no-progress
    --num-speculative-tokens 3 --num-speculative-tokens-by-batch-size 1:t8-d6-n32@cuda,4:5)
for set in humaneval gsm_symbolic writingbench; do common+=(--prompts "$PROMPTS/$set.jsonl"); done
for run in new_b1 old_b1 new_b16; do
    case $run in
        new_b1) args=(--draft-model "$NEW" --batch-sizes 1) ;;
        old_b1) args=(--draft-model "$OLD" --batch-sizes 1) ;;
        new_b16) args=(--draft-model "$NEW" --batch-sizes 16) ;;
    esac
    t0=$(date +%s)
    timeout "${RUN_S:-200}" specdec bench "${common[@]}" "${args[@]}" \
        --json "$OUT/${TAG}_$run.json" > "$OUT/${TAG}_$run.log" 2>&1
    echo "$run: rc=$? $(($(date +%s) - t0)) s"
done
tar czf "$OUT/${TAG}_logs.tgz" -C "$OUT" "${TAG}_new_b1.log" "${TAG}_old_b1.log" "${TAG}_new_b16.log" \
    && rm -f "$OUT/${TAG}"_*.log
# The short table last: set, batch, speedup, τ per run.
for run in new_b1 old_b1 new_b16; do
    echo "== $run"
    grep "^| [hgw]" "$OUT/${TAG}_$run.md" 2>/dev/null | cut -d'|' -f2,4,7,8
done
