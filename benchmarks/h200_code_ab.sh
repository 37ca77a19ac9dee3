#!/usr/bin/env bash
# One bench command on the checkout's code and on an older commit's, in the same lease:
# an engine change measured against the code before it (session 30: arrivals joining the
# pipelined step, against the drain and two synchronous steps per arrival). The older
# code travels as an archive of its package, made here:
#
#   mkdir -p .gpu/old_code && git archive -o .gpu/old_code/specdec.tar <commit> specdec \
#       ':!specdec/heads' ':!specdec/targets'
#
# On the GPU machine, from the repository root, after `source benchmarks/h200_setup.sh`:
#
#   HEAD_DIR=specdec/heads/smollm2-135m-instruct PROMPTS=.gpu/bench_sets \
#       bash benchmarks/h200_code_ab.sh
#
# The old package is unpacked to /tmp/old_code and put first on PYTHONPATH for its run
# (the model and the head are the same files). LABELS names the two in the reports and the
# table (default "new old"; e.g. OLD_TAR=.gpu/cand_code/specdec.tar LABELS="main candidate"
# for a candidate branch's code against the checkout's). Defaults: batch 16 with --waves 4
# (requests arrive as others finish), the head's recorded bands (SPEC_ARGS replaces them,
# e.g. "--num-speculative-tokens 3 --num-speculative-tokens-by-batch-size none"), SETS
# "humaneval writingbench"; RUN_S caps each bench command (default 240: on a fresh machine
# the first converts the GGUF, ~27 s, and compiles the head, ~60 s; session 30's two runs
# at 95 s each ended before their first set). Reports in $OUT: <TAG>_<label>.json and the
# tables, then a short table last (set, in flight plain/spec, speedup, τ, launches).
set -uo pipefail
: "${HEAD_DIR:?HEAD_DIR=<head dir>}" "${PROMPTS:?PROMPTS=<bench set JSONLs>}"
OUT=${OUT:-/tmp/code_ab} TAG=${TAG:-code_ab} OLD_TAR=${OLD_TAR:-.gpu/old_code/specdec.tar}
read -r NEW OLD <<< "${LABELS:-new old}"
rm -rf /tmp/old_code && mkdir -p "$OUT" /tmp/old_code
tar xf "$OLD_TAR" -C /tmp/old_code
# shellcheck disable=SC2206  # SPEC_ARGS: flags, split on purpose
args=(--model smollm2-135m-instruct --draft eagle3 --draft-model "$HEAD_DIR" --num-prompts 16
    --max-tokens 256 --dtype bfloat16 --spec-pipelined on --repeats "${REPEATS:-1}" --no-progress
    ${SPEC_ARGS:-} --batch-sizes "${BATCH:-16}" --waves "${WAVES:-4}")
for set in ${SETS:-humaneval writingbench}; do args+=(--prompts "$PROMPTS/$set.jsonl"); done
for code in "$NEW" "$OLD"; do
    path=${PYTHONPATH:-}
    [ "$code" = "$OLD" ] && path=/tmp/old_code${PYTHONPATH:+:$PYTHONPATH}
    t0=$(date +%s)
    PYTHONPATH=$path timeout "${RUN_S:-240}" specdec bench "${args[@]}" \
        --json "$OUT/${TAG}_$code.json" --markdown "$OUT/${TAG}_$code.md" > "$OUT/${TAG}_$code.log" 2>&1
    echo "$code: rc=$? $(($(date +%s) - t0)) s"
done
python3 - "$OUT" "$TAG" "$NEW" "$OLD" <<'EOF'
import json, sys
from pathlib import Path
out, tag = Path(sys.argv[1]), sys.argv[2]
print("| code | set | in flight plain/spec | speedup | τ | steps | pipelined launches |")
for code in sys.argv[3:]:
    path = out / f"{tag}_{code}.json"
    if not path.exists():
        print(f"| {code} | (no report) |")
        continue
    for r in json.loads(path.read_text())["rows"]:
        p, s = r["plain"], r["spec"]
        print(f"| {code} | {r['set']} | {p['mean_in_flight']:.1f}/{s['mean_in_flight']:.1f} "
              f"| {r['speedup']:.2f} | {r['tau']:.2f} | {s['engine_steps']} "
              f"| {r.get('pipelined_launches')} |")
EOF
(cd "$OUT" && tar czf "${TAG}_tables_logs.tgz" "${TAG}"_*.md "${TAG}"_*.log && rm -f "${TAG}"_*.md "${TAG}"_*.log)
