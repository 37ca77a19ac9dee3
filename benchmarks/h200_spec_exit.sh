#!/usr/bin/env bash
# SpecExit (#10) on the H200 across the calls of one lease: the stages of
# scripts/spec_exit_head.sh, each started only while the call has time left, so a call
# never outruns its 10 minutes and the next call resumes where this one stopped (every
# stage resumes; training is given the time that is left as its own limit and stops with a
# checkpoint and the head). On the GPU machine, from the repository root:
#
#   source benchmarks/h200_setup.sh > /tmp/setup.log 2>&1     # wheels, GGUF joined
#   STAGES="regenerate labels vocab train" bash benchmarks/h200_spec_exit.sh
#   STAGES="train offline eval latency" bash benchmarks/h200_spec_exit.sh  # next call
#
# Prompts made here (`scripts/spec_exit_head.sh prompts`, gzipped: ~4 MB instead of 37)
# travel in .gpu/data/ and are unpacked once into $DATA. Data and the run stay in /tmp
# between calls (the machine is kept warm between back-to-back calls); the head, the
# training log and the eval reports are copied to $OUT at the end of every call.
# BUDGET_S: this call's seconds (default 570); EVAL_VARIANTS: more SpecExit settings,
# ';'-separated JSON objects, each evaluated after the three standard evals.
set -uo pipefail
export DATA=${DATA:-/tmp/spec-exit} RUN=${RUN:-/tmp/spec-exit-run}
OUT=${OUT:-/tmp/spec-exit-out}
mkdir -p "$DATA" "$OUT"
RECIPE=scripts/spec_exit_head.sh
source benchmarks/h200_budget.sh  # left, run_stage

for f in prompts eval; do
    if [ ! -s "$DATA/$f.jsonl" ] && [ -f ".gpu/data/$f.jsonl.gz" ]; then
        gunzip -c ".gpu/data/$f.jsonl.gz" > "$DATA/$f.jsonl"
    fi
done

for stage in ${STAGES:-regenerate labels vocab train offline eval latency}; do
    case $stage in
        train)
            # Leave 40 s for the trainer's final checkpoint and head export.
            run_stage train TIME_LIMIT=$(($(left) - 40)) || break ;;
        eval)
            run_stage eval || break
            IFS=';' read -ra variants <<< "${EVAL_VARIANTS:-}"
            n=0
            for v in "${variants[@]}"; do
                n=$((n + 1))
                [ "$(left)" -lt 60 ] && { echo "--- variant $n: not started"; break; }
                echo "--- variant $n: $v"
                timeout "$(left)" specdec eval-reasoning --model "${MODEL:-smollm2-135m-reasoning}" \
                    --traces "$DATA/eval.jsonl" --per-task "${EVAL_PER_TASK:-50}" \
                    --max-tokens "${MAX_TOKENS:-1024}" --draft eagle3 --draft-model "$RUN/head" \
                    --spec-exit "$v" --out "$RUN/eval-variant$n" > "$OUT/variant$n.log" 2>&1
                grep -F "**all**" "$RUN/eval-variant$n/report.md"
            done ;;
        *) run_stage "$stage" || break ;;
    esac
done

# What comes back (at most 8 files, two folders down): the head's files (shards <= 16 MB),
# and one archive of the stage logs, the training log, the eval reports and the manifests.
if [ -d "$RUN/head" ]; then mkdir -p "$OUT/head" && cp "$RUN"/head/* "$OUT/head/"; fi
tar czf "$OUT/reports.tgz" --ignore-failed-read "$OUT"/*.log "$RUN"/log.jsonl \
    "$RUN"/offline.json "$RUN"/spec_exit_chosen.json \
    "$RUN"/eval-*/report.json "$RUN"/eval-*/report.md "$RUN"/latency-*/report.json \
    "$DATA"/*/manifest.json 2>/dev/null
rm -f "$OUT"/*.log
ls -la "$OUT" "$OUT/head" 2>/dev/null
