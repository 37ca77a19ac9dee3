#!/usr/bin/env bash
# A new head against the shipped one on the bench sets, both in the shipped bands as one
# config (session 31: the t8-d6-n32 tree at batch 1 on CUDA, a chain of 5 up to batch 16;
# BANDS replaces them): batch 1 and batch 16 for each head; bf16, 16 prompts, 256 tokens,
# the pipelined step. The chain of 3 (#8's τ bar) runs as <head>_c3: batch 16, no bands.
# Batch 16 runs WAVES (default 4) batches' worth of requests, the 16 prompts cycled, so
# the batch stays full for all but the last wave (`specdec bench --waves`; session 29
# found one drained batch of 16 measures the tail as much as batch 16). On the GPU
# machine, from the repository root, after `source benchmarks/h200_setup.sh`:
#
#   NEW=/tmp/default-head-run/head OLD=/tmp/head PROMPTS=.gpu/bench_sets \
#       bash benchmarks/h200_head_ab.sh
#
# Reports in $OUT: <TAG>_<run>.json per run and one archive of the tables and logs (at
# most five files, under the device's eight). RUNS picks the runs (default "new_b1 old_b1
# new_b16 old_b16"; not by default: new_c3 and old_c3, the chain of 3 at batch 16, and
# old_b16_shapes, the shipped head at batch 16 in chains of 3 and 4 and four small trees,
# one engine each, ~3 min); RUN_S caps each bench command (default 200 s); REPEATS its
# timed rounds (default 1).
set -uo pipefail
: "${NEW:?NEW=<new head dir>}" "${OLD:?OLD=<shipped head dir>}" "${PROMPTS:?PROMPTS=<bench set JSONLs>}"
OUT=${OUT:-/tmp/head_ab} TAG=${TAG:-ab} RUNS=${RUNS:-new_b1 old_b1 new_b16 old_b16}
mkdir -p "$OUT"
# shellcheck disable=SC2206  # BANDS: flags, split on purpose
common=(--model smollm2-135m-instruct --draft eagle3 --num-prompts 16 --max-tokens 256
    --dtype bfloat16 --spec-pipelined on --repeats "${REPEATS:-1}" --no-progress
    ${BANDS:---num-speculative-tokens 5 --num-speculative-tokens-by-batch-size 1:t8-d6-n32@cuda})
for set in humaneval gsm_symbolic writingbench; do common+=(--prompts "$PROMPTS/$set.jsonl"); done
for run in $RUNS; do
    case $run in
        new_*) args=(--draft-model "$NEW") ;;
        old_*) args=(--draft-model "$OLD") ;;
        *) echo "unknown run '$run': new_b1 old_b1 new_b16 old_b16 new_c3 old_c3 old_b16_shapes"
           continue ;;
    esac
    case $run in
        *_b1) args+=(--batch-sizes 1) ;;
        *_b16) args+=(--batch-sizes 16 --waves "${WAVES:-4}") ;;
        *_c3) args+=(--batch-sizes 16 --waves "${WAVES:-4}" --num-speculative-tokens 3
            --num-speculative-tokens-by-batch-size none) ;;
        *_b16_shapes) args+=(--batch-sizes 16 --waves "${WAVES:-4}" --sweep-chain 3,4
            --sweep-top-k 2,4 --sweep-depth 3,4 --sweep-total-tokens 8) ;;
    esac
    t0=$(date +%s)
    timeout "${RUN_S:-200}" specdec bench "${common[@]}" "${args[@]}" \
        --json "$OUT/${TAG}_$run.json" --markdown "$OUT/${TAG}_$run.md" > "$OUT/${TAG}_$run.log" 2>&1
    echo "$run: rc=$? $(($(date +%s) - t0)) s"
done
# The short table last (set, batch, requests, in flight plain/spec, speedup, τ per run),
# then the archive.
for run in $RUNS; do
    echo "== $run"
    grep "^| [hgw]" "$OUT/${TAG}_$run.md" 2>/dev/null | cut -d'|' -f2,4,5,6,9,10
done
(cd "$OUT" && tar czf "${TAG}_tables_logs.tgz" "${TAG}"_*.md "${TAG}"_*.log && rm -f "${TAG}"_*.md "${TAG}"_*.log)
