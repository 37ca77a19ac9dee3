#!/usr/bin/env bash
# The recipe of the default EAGLE-3 head for SmolLM2-135M-Instruct (docs/default_head.md):
# prompts -> the target's own answers -> draft vocabulary -> EAGLE-3 training (online: the
# target runs inside the training loop, no hidden-state dumps) -> the head -> benchmark.
#
#   scripts/default_head.sh                 # every stage, in order
#   scripts/default_head.sh train bench     # some stages
#   SMOKE=1 scripts/default_head.sh         # a tiny CPU run of the whole chain (minutes)
#   DRAFTER=block scripts/default_head.sh vocab train bench
#                                           # a block drafter on the same data, benched
#                                           # against the shipped head
#   PROMPT_SOURCES="mix writing code" CODE_PROMPTS=10000 scripts/default_head.sh prompts
#                                           # with programming requests (CODE_PROMPTS, 0 by default)
#   PROMPT_SOURCES="mix writing code math" CODE_PROMPTS=15000 MATH_PROMPTS=8000 ...  # and word problems
#   PROMPT_SOURCES="mix academic" ACADEMIC_PAPERS=1500 scripts/default_head.sh prompts regenerate \
#       documents docregen train   # research papers, then long requests around them
#
# Every stage resumes: rerun the same command after a kill (or a time limit) and it
# continues where it stopped (finished shards are kept, training restarts from its newest
# checkpoint). Settings are environment variables, defaults below.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-smollm2-135m-instruct}
# eagle3: the EAGLE-3 head (configs/train/smollm2.yaml); block: a DFlash-style block drafter
# (configs/train/smollm2-block.yaml) on the same data, benchmarked with --draft dflash.
DRAFTER=${DRAFTER:-eagle3}
DATA=${DATA:-data/smollm2}
RUN=${RUN:-runs/smollm2-$DRAFTER}
NUM_PROMPTS=${NUM_PROMPTS:-70000}     # the recipe wants at least 50,000 answered prompts
PROMPTS=${PROMPTS:-}                  # what regenerate answers (default $DATA/prompts), or a JSONL
# data-gen prompts --source values (space-separated); the default is the general mix plus
# long-form writing (docs/default_head.md)
PROMPT_SOURCES=${PROMPT_SOURCES:-mix writing}
# The mix's defaults (100 per BIG-bench task and per reasoning-gym generator) gave 37,161
# prompts after deduplication and decontamination; larger caps let it reach NUM_PROMPTS
# (the prompts stage prints the manifest's record count: check it).
BIGBENCH_PER_TASK=${BIGBENCH_PER_TASK:-300}
RG_PER_GENERATOR=${RG_PER_GENERATOR:-200}
WRITING_PROMPTS=${WRITING_PROMPTS:-20000} # long-form requests (~21% of the prompts after sampling)
# Programming requests (data_gen/coding.py); they count only with `code` in PROMPT_SOURCES,
# e.g. PROMPT_SOURCES="mix writing code" CODE_PROMPTS=10000. 0 leaves them out.
CODE_PROMPTS=${CODE_PROMPTS:-0}
# Arithmetic word problems (data_gen/word_problems.py); they count only with `math` in
# PROMPT_SOURCES, e.g. PROMPT_SOURCES="mix writing code math" MATH_PROMPTS=8000.
MATH_PROMPTS=${MATH_PROMPTS:-0}
# Research papers (data_gen/academic.py): six section requests and a short task each; they
# count only with `academic` in PROMPT_SOURCES. The documents stage joins each paper's
# answered sections into a document and asks DOCS_PER_PAPER long requests around it.
ACADEMIC_PAPERS=${ACADEMIC_PAPERS:-0}
DOCS_PER_PAPER=${DOCS_PER_PAPER:-2}
DOC_MAX_MODEL_LEN=${DOC_MAX_MODEL_LEN:-8192}  # a document is 2-4k tokens, its answer MAX_TOKENS
# Training reads the documents' answers too once the docregen stage has written them; a
# sequence longer than MAX_SEQ_LEN is skipped (counted), so it follows DOC_MAX_MODEL_LEN then.
MAX_SEQ_LEN=${MAX_SEQ_LEN:-}
PROMPT_SEED=${PROMPT_SEED:-0}         # the prompts' shuffle and composed requests
MAX_TOKENS=${MAX_TOKENS:-512}         # per answer
TEMPERATURE=${TEMPERATURE:-0.7}       # answers sampled like real traffic (EAGLE-3 uses 0.7-1)
SEED=${SEED:-0}                       # sampling seed: another seed answers the same prompts anew
MAX_NUM_SEQS=${MAX_NUM_SEQS:-256}     # regeneration batch
DRAFT_VOCAB=${DRAFT_VOCAB:-16384}    # the smallest size covering 99% of answer tokens (docs)
STEPS=${STEPS:-20000}
TIME_LIMIT=${TIME_LIMIT:-}            # seconds: stop with a checkpoint and the head; rerun continues
ATTENTION=${ATTENTION:-auto}          # training attention: auto | flex | reference
BENCH_PROMPTS=${BENCH_PROMPTS:-80}
BENCH_MAX_TOKENS=${BENCH_MAX_TOKENS:-256}
EXTRA_TRAIN=${EXTRA_TRAIN:-}          # more train-draft overrides, e.g. "optim.lr=2e-4"
INIT_HEAD=${INIT_HEAD:-}              # continue from this head (and its draft vocabulary), e.g.
                                      # specdec/heads/smollm2-135m-instruct (the shipped head);
                                      # with DRAFTER=block, a block drafter's head (fp32 or bf16)
NEW_VOCAB=${NEW_VOCAB:-0}             # 1: continue INIT_HEAD under the vocab stage's vocabulary
                                      # (rows of shared tokens carried, new ones from the target;
                                      # not for a drafter on the target's lm_head)
DEVICE_ARGS=()

if [ "${SMOKE:-0}" = 1 ]; then  # the whole chain on CPU, tiny: checks the recipe runs
    DATA=${DATA%/}-smoke RUN=${RUN%/}-smoke
    NUM_PROMPTS=16 MAX_TOKENS=16 PROMPT_SOURCES=chatterbot MAX_NUM_SEQS=16 DRAFT_VOCAB=2048 STEPS=4 BENCH_PROMPTS=2 BENCH_MAX_TOKENS=16
    EXTRA_TRAIN="data.max_tokens=1024 data.eval_records=4 optim.warmup_steps=1 run.save_every=2 run.eval_every=2 run.log_every=1 run.wandb=disabled ${EXTRA_TRAIN}"
    DEVICE_ARGS=(--device cpu --dtype float32)
    export TRITON_INTERPRET=1
    # A block drafter's CPU attention is dense: a few anchors keep its mask small.
    [ "$DRAFTER" = block ] && EXTRA_TRAIN="block.anchors=16 ${EXTRA_TRAIN}"
fi

stage_prompts() {
    # BIG-bench inputs, reasoning-gym (not gsm_symbolic), chatterbot dialogs: deduplicated
    # and decontaminated against the bench sets (HumanEval, WritingBench, gsm_symbolic).
    local sources=()
    for s in $PROMPT_SOURCES; do sources+=(--source "$s"); done
    specdec data-gen prompts -o "$DATA/prompts" --max-records "$NUM_PROMPTS" "${sources[@]}" \
        --bigbench-per-task "$BIGBENCH_PER_TASK" --reasoning-gym-per-generator "$RG_PER_GENERATOR" \
        --writing-prompts "$WRITING_PROMPTS" --code-prompts "$CODE_PROMPTS" \
        --math-prompts "$MATH_PROMPTS" --academic-papers "$ACADEMIC_PAPERS" --seed "$PROMPT_SEED"
}

stage_regenerate() {
    # The target answers every prompt on specdec's engine (CUDA graphs, continuous batching).
    specdec data-gen regenerate -i "${PROMPTS:-$DATA/prompts}" -o "$DATA/regen" --model "$MODEL" \
        --max-tokens "$MAX_TOKENS" --temperature "$TEMPERATURE" --seed "$SEED" \
        --max-num-seqs "$MAX_NUM_SEQS" "${DEVICE_ARGS[@]}"
}

stage_documents() {
    # Long requests (abstract, introduction, outline, review, ...) around documents joined
    # from the target's own answers to the academic source's section requests.
    specdec data-gen documents -i "$DATA/regen" -o "$DATA/documents" \
        --tasks-per-paper "$DOCS_PER_PAPER" --seed "$SEED"
}

stage_docregen() {
    # The target answers them; the context holds the whole document.
    specdec data-gen regenerate -i "$DATA/documents" -o "$DATA/documents-regen" --model "$MODEL" \
        --max-tokens "$MAX_TOKENS" --temperature "$TEMPERATURE" --seed "$SEED" \
        --max-num-seqs "$MAX_NUM_SEQS" --max-model-len "$DOC_MAX_MODEL_LEN" "${DEVICE_ARGS[@]}"
}

stage_vocab() {
    # d2t / t2d: the DRAFT_VOCAB most frequent target tokens among the answers' loss tokens,
    # the documents' answers counted too once the docregen stage has written them.
    local inputs=(-i "$DATA/regen")
    [ -f "$DATA/documents-regen/manifest.json" ] && inputs+=(-i "$DATA/documents-regen")
    specdec data-gen vocab "${inputs[@]}" -o "$DATA/vocab" --draft-vocab-size "$DRAFT_VOCAB" \
        --model "$MODEL"
}

stage_train() {
    # A head (or block drafter) to continue brings its own draft vocabulary (its lm_head
    # rows are tied to it), unless NEW_VOCAB=1 moves its rows to the vocab stage's one by
    # target token; its block size, mask token and layers come with it.
    local vocab=(model.vocab="$DATA/vocab/vocab.safetensors")
    if [ -n "$INIT_HEAD" ]; then
        [ "$NEW_VOCAB" = 1 ] || vocab=()
        vocab+=(model.init_head="$INIT_HEAD")
    fi
    local paths="$DATA/regen" seq_len=${MAX_SEQ_LEN:-2048}
    if [ -f "$DATA/documents-regen/manifest.json" ]; then
        paths="[$DATA/regen,$DATA/documents-regen]" seq_len=${MAX_SEQ_LEN:-$DOC_MAX_MODEL_LEN}
    fi
    local config=configs/train/smollm2.yaml attention=ttt.attention
    if [ "$DRAFTER" = block ]; then
        config=configs/train/smollm2-block.yaml attention=block.attention
    fi
    # shellcheck disable=SC2086  # EXTRA_TRAIN is a list of key=value overrides
    specdec train-draft --config "$config" \
        model.target="$MODEL" "${vocab[@]}" \
        data.mode=online data.path="$paths" data.max_seq_len="$seq_len" \
        optim.max_steps="$STEPS" run.output_dir="$RUN" "$attention=$ATTENTION" \
        ${TIME_LIMIT:+run.time_limit_s=$TIME_LIMIT} $EXTRA_TRAIN
}

stage_bench() {
    # τ and speedup on the three bench sets: chain K = 3 and the dynamic tree; a block
    # drafter beside the shipped EAGLE-3 head at the same shapes (one verify budget).
    local draft=(--draft eagle3 --draft-model "$RUN/head")
    if [ "$DRAFTER" = block ]; then
        draft=(--draft eagle3 --compare-drafters "dflash:$RUN/head")
    fi
    specdec bench --model "$MODEL" "${draft[@]}" \
        --num-prompts "$BENCH_PROMPTS" --max-tokens "$BENCH_MAX_TOKENS" --batch-sizes 1,16 \
        --sweep-chain 3 --sweep-top-k 8 --sweep-depth 5 --sweep-total-tokens 64 \
        --analysis --json "$RUN/bench.json" "${DEVICE_ARGS[@]}"
}

STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(prompts regenerate vocab train bench)
for stage in "${STAGES[@]}"; do
    case "$stage" in
        prompts | regenerate | documents | docregen | vocab | train | bench) ;;
        *) echo "unknown stage '$stage'; stages: prompts regenerate documents docregen vocab" \
               "train bench" >&2; exit 2 ;;
    esac
    echo "=== $stage ($(date -u +%H:%M:%S))"
    "stage_$stage"
done
