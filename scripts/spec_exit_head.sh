#!/usr/bin/env bash
# SpecExit end to end on the shipped reasoning target (docs/spec_exit.md,
# docs/reasoning_target.md): train-split prompts -> the target's own greedy reasoning ->
# confidence labels (forced answers: settled = the trace's own final answer) -> draft
# vocabulary -> an EAGLE-3 head with exit channels, trained online -> eval-reasoning on
# held-out items: plain, EAGLE-3, and EAGLE-3 with SpecExit (think length, accuracy), all
# items at once, then one at a time on a subset (latency).
#
#   scripts/spec_exit_head.sh                    # every stage, in order
#   scripts/spec_exit_head.sh train eval         # some stages
#   SMOKE=1 scripts/spec_exit_head.sh            # a tiny CPU run of the whole chain (minutes)
#
# Every stage resumes: rerun the same command after a kill and it continues (finished
# shards are kept, training restarts from its newest checkpoint, eval reports are
# rewritten). Settings are environment variables, defaults below.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-smollm2-135m-reasoning}
DATA=${DATA:-data/spec-exit}
RUN=${RUN:-runs/spec-exit}
PER_TASK=${PER_TASK:-1000}            # train-split prompts per task (10 tasks): ~2.8M answer tokens
EVAL_TRACES=${EVAL_TRACES:-}          # held-out items (default: the prompts stage's eval split)
EVAL_PER_TASK=${EVAL_PER_TASK:-50}
MAX_TOKENS=${MAX_TOKENS:-1024}        # per answer: the traces think ~150-350 tokens
MAX_NUM_SEQS=${MAX_NUM_SEQS:-256}
DRAFT_VOCAB=${DRAFT_VOCAB:-1024}      # the traces' answers use ~430 distinct tokens
LABEL_TARGET=${LABEL_TARGET:-final}   # exit-labels --target: final (own answer) | correct
LATENCY_PER_TASK=${LATENCY_PER_TASK:-5}  # latency stage: items per task, one at a time
STEPS=${STEPS:-1000}               # x 16k tokens: ~6 epochs of the answers, ~4.5 min on an H200
TIME_LIMIT=${TIME_LIMIT:-}            # seconds: stop with a checkpoint and the head
SIGNALS=${SIGNALS:-[confidence,progress,remaining]}
SPEC_EXIT=${SPEC_EXIT:-}              # SpecExitParams for the evals (default: the offline
                                      # stage's choice, else {}: the defaults)
MAX_CHANGED=${MAX_CHANGED:-0.02}      # offline: the most answers a chosen setting changes
EXTRA_TRAIN=${EXTRA_TRAIN:-}          # more train-draft overrides, e.g. "optim.lr=2e-4"
OFFLINE_SETTINGS=('{}' '{"confidence_above": 0.9}' '{"confidence_above": 0.7}'
    '{"confidence_above": 0.6}' '{"smoothing": "window", "window": 2}'
    '{"smoothing": "window", "window": 4}' '{"smoothing": "window", "window": 8}'
    '{"alpha": 0.3}' '{"alpha": 0.5}' '{"progress_above": null, "remaining_below": null}'
    '{"smoothing": "window", "window": 4, "progress_above": null, "remaining_below": null}'
    '{"smoothing": "window", "window": 4, "confidence_above": 0.9}')
HELD_OUT=${HELD_OUT:-256}             # = data.eval_records of the train config
DEVICE_ARGS=()
REPLAY_ARGS=()

if [ "${SMOKE:-0}" = 1 ]; then  # the whole chain on CPU, tiny: checks the recipe runs
    DATA=${DATA%/}-smoke RUN=${RUN%/}-smoke
    PER_TASK=1 EVAL_PER_TASK=1 LATENCY_PER_TASK=1 MAX_TOKENS=400 MAX_NUM_SEQS=16 STEPS=4
    EXTRA_TRAIN="data.max_tokens=2048 data.eval_records=2 optim.warmup_steps=1 run.save_every=2 run.eval_every=2 run.log_every=1 run.wandb=disabled ${EXTRA_TRAIN}"
    DEVICE_ARGS=(--device cpu --dtype float32)
    REPLAY_ARGS=(--device cpu)
    HELD_OUT=2
    export TRITON_INTERPRET=1
fi
EVAL_TRACES=${EVAL_TRACES:-$DATA/eval.jsonl}

stage_prompts() {
    # Train-split questions for the target to answer, and the held-out eval split (the
    # splits share neither a seed nor a question; docs/reasoning_target.md).
    specdec data-gen reasoning-traces --split train --num-per-task "$PER_TASK" \
        --out "$DATA/prompts.jsonl"
    specdec data-gen reasoning-traces --split eval --num-per-task "$EVAL_PER_TASK" \
        --out "$DATA/eval.jsonl"
}

stage_regenerate() {
    # The target's own reasoning, greedy: what the head drafts and SpecExit reads.
    specdec data-gen regenerate -i "$DATA/prompts.jsonl" -o "$DATA/regen" --model "$MODEL" \
        --max-tokens "$MAX_TOKENS" --temperature 0 --max-num-seqs "$MAX_NUM_SEQS" \
        "${DEVICE_ARGS[@]}"
}

stage_labels() {
    # Confidence: at the think span's start and every step boundary in it, an answer forced
    # there, settled when it is the trace's own final answer (LABEL_TARGET=correct: when
    # the task's verifier accepts it; `--items` gives each record its task, seed, params).
    specdec data-gen exit-labels -i "$DATA/regen" -o "$DATA/labels" --target "$LABEL_TARGET" \
        --items "$DATA/prompts.jsonl" --model "$MODEL" --max-num-seqs "$MAX_NUM_SEQS" \
        "${DEVICE_ARGS[@]}"
}

stage_vocab() {
    specdec data-gen vocab -i "$DATA/labels" -o "$DATA/vocab" --draft-vocab-size "$DRAFT_VOCAB" \
        --model "$MODEL"
}

stage_train() {
    # The head and its exit channels jointly, online on the labelled records.
    # shellcheck disable=SC2086  # EXTRA_TRAIN is a list of key=value overrides
    specdec train-draft --config configs/train/smollm2.yaml \
        model.target="$MODEL" model.vocab="$DATA/vocab/vocab.safetensors" \
        data.mode=online data.path="$DATA/labels" spec_exit.signals="$SIGNALS" \
        optim.max_steps="$STEPS" run.output_dir="$RUN" \
        ${TIME_LIMIT:+run.time_limit_s=$TIME_LIMIT} $EXTRA_TRAIN
}

stage_offline() {
    # Exit settings replayed over the records train-draft held out (data.eval_records in
    # configs/train/smollm2.yaml: 256, spread over every task): thinking kept and answers
    # changed per setting, without generating (docs/spec_exit.md, "Choosing thresholds").
    python benchmarks/spec_exit_offline.py --model "$MODEL" --head "$RUN/head" \
        --labels "$DATA/labels" --held-out "$HELD_OUT" --json "$RUN/offline.json" \
        --choose "$RUN/spec_exit_chosen.json" --max-changed "$MAX_CHANGED" \
        --settings "${OFFLINE_SETTINGS[@]}" "${REPLAY_ARGS[@]}"
}

eval_three() {  # OUT_PREFIX PER_TASK [eval-reasoning args...]: plain, EAGLE-3, SpecExit
    local prefix=$1 per_task=$2 spec_exit=$SPEC_EXIT
    shift 2
    if [ -z "$spec_exit" ]; then
        spec_exit='{}'
        [ -f "$RUN/spec_exit_chosen.json" ] && spec_exit=$(cat "$RUN/spec_exit_chosen.json")
    fi
    echo "SpecExit setting: $spec_exit"
    local common=(--model "$MODEL" --traces "$EVAL_TRACES" --per-task "$per_task"
        --max-tokens "$MAX_TOKENS" "${DEVICE_ARGS[@]}" "$@")
    specdec eval-reasoning "${common[@]}" --draft none --out "$RUN/$prefix-plain"
    specdec eval-reasoning "${common[@]}" --draft eagle3 --draft-model "$RUN/head" \
        --out "$RUN/$prefix-eagle3"
    specdec eval-reasoning "${common[@]}" --draft eagle3 --draft-model "$RUN/head" \
        --spec-exit "$spec_exit" --out "$RUN/$prefix-spec-exit"
    for v in plain eagle3 spec-exit; do
        echo "--- $v"; grep -F "**all**" "$RUN/$prefix-$v/report.md"
    done
}

stage_eval() {
    # The same held-out items three ways, all at once (think length, accuracy); SpecExit
    # is judged against the second.
    eval_three eval "$EVAL_PER_TASK"
}

stage_latency() {
    # End-to-end latency, one request at a time (in the evals above every item runs at
    # once and queueing dominates): the first LATENCY_PER_TASK items of each task.
    eval_three latency "$LATENCY_PER_TASK" --concurrency 1
}

STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(prompts regenerate labels vocab train offline eval latency)
for stage in "${STAGES[@]}"; do
    case "$stage" in
        prompts | regenerate | labels | vocab | train | offline | eval | latency) ;;
        *) echo "unknown stage '$stage'; stages: prompts regenerate labels vocab train" \
               "offline eval latency" >&2
           exit 2 ;;
    esac
    echo "=== $stage ($(date -u +%H:%M:%S))"
    "stage_$stage"
done
