#!/usr/bin/env bash
# Why a speculative step costs more on long prompts (session 29: writing's spec step is
# 1.51x its plain step at batch 16, code's 1.25x; at batch 1 the tree's step is 0.22 ms
# dearer on writing than on code, plain decoding's 0.06 ms). One device call, ~6 min:
#
# 1. The verify attention alone (bench_tree_kernel.py) at the shapes the shipped bands
#    launch: the t8-d6-n32 tree (q = 33) at batch 1, the chain of 3 (q = 4) and the head's
#    7-column catch-up (q = 7) at batch 16, at 512 and 4,096 tokens of context, every tile
#    and split configuration against the heuristic's (`*`), the decode kernel's knobs too.
#    The heuristic runs 16-row tiles whenever the grid leaves SMs idle, so 33 tree tokens
#    take 7 query tiles, each re-reading the whole context's K/V; one 128-row tile split 32
#    ways reads it once.
# 2. Where the step's device time goes (profile_spec_trace.py): writingbench against
#    humaneval, plain decoding, the tree and the chain of 3 at batches 1 and 16 (the head
#    eager: no compile time in the call; the question is what grows with the context).
#
# On the GPU machine, from the repository root, after `source benchmarks/h200_setup.sh`:
#   HEAD=/tmp/head PROMPTS=.gpu/bench_sets bash benchmarks/h200_long_context.sh
# PARTS picks the parts (default "kernel profile"): the kernel sweep needs no model (random
# caches), so it fits the lease's first call, before the GGUF's parts have all arrived;
# the profile takes ~2 min a set.
# CONTEXTS (default 512,4096): session 30 found 128-key tiles with 3 stages 20% faster at
# batch 1 and 4,096 tokens and 15% slower at 512; `CONTEXTS=1024,2048 BATCH_SIZES=1`
# finds where a rule by context length should switch (~45 s for two contexts).
# Q (default 4,7,33): the verify lengths (session 31 records a chain of 5 up to batch 16:
# q = 6). BOUND: the max_seq_len the heuristic sees, as the engine's CUDA graphs capture it
# (the context limit, e.g. 8192; default each launch's real one), so "auto" splits are the
# graph's: `BOUND=8192 Q=6 BATCH_SIZES=16 CONTEXTS=512,1024,2048,4096` asks which tile a
# batch-16 chain-of-5 graph should capture for the contexts it will meet.
# Reports in $OUT (tree_kernel.json and the printed tables in long_context.log).
set -uo pipefail
PARTS=" ${PARTS:-kernel profile} "
OUT=${OUT:-/tmp/long_context}
mkdir -p "$OUT"
log=$OUT/long_context.log
{
    if [[ $PARTS == *" kernel "* ]]; then
        echo "== verify attention (bench_tree_kernel.py)"
        timeout "${KERNEL_S:-200}" python3 benchmarks/bench_tree_kernel.py --batch-sizes "${BATCH_SIZES:-1,16}" \
            --contexts "${CONTEXTS:-512,4096}" --q "${Q:-4,7,33}" ${BOUND:+--bound "$BOUND"} \
            --json "$OUT/tree_kernel.json" \
            | grep -v "^| " || echo "kernel sweep: rc=$?"
    fi
    if [[ $PARTS == *" profile "* ]]; then
        : "${HEAD:?HEAD=<EAGLE-3 head dir>}" "${PROMPTS:?PROMPTS=<dir with the bench set JSONLs>}"
        for set in writingbench humaneval; do
            echo "== step profile: $set"
            timeout "${PROFILE_S:-120}" python3 benchmarks/profile_spec_trace.py --head "$HEAD" \
                --prompts "$PROMPTS/$set.jsonl" --shapes plain,tree,chain3 --batch 1,16 \
                --max-tokens 128 --max-model-len 8192 || echo "profile $set: rc=$?"
        done
    fi
} > "$log" 2>&1
tail -n 30 "$log"
[[ $PARTS == *" kernel "* ]] || exit 0
# The short table last: per (batch, context, q) the heuristic's time and the best config's.
python3 - "$OUT/tree_kernel.json" <<'EOF'
import json, sys
from collections import defaultdict
try:
    rows = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no kernel sweep: {e}")
groups = defaultdict(list)
for r in rows:
    if r["q"] > 1:
        groups[r["batch"], r["context"], r["q"]].append(r)
print("| batch | context | q | heuristic | µs | best | µs | × decode (best) |")
print("|---:|---:|---:|---|---:|---|---:|---:|")
for (b, c, q), rs in sorted(groups.items()):
    default = next(r for r in rs if r["config"].endswith("*"))
    best = min(rs, key=lambda r: r["us"])
    print(f"| {b} | {c} | {q} | {default['config']} | {default['us']:.1f} | {best['config']} "
          f"| {best['us']:.1f} | {best['vs_decode']:.2f} |")
EOF
