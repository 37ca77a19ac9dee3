#!/usr/bin/env bash
# The skinny Triton GEMM judged with its weights in HBM, in one device call (~4 min; no
# draft head needed): the kernel tests on CUDA, a tile grid timed cold
# (`skinny_gemm.py --cold --tune`, the best tile per projection written to a JSON), then
# plain decoding with cuBLAS and with the Triton GEMM on those tiles, same process
# (`host_gap.py`, `$SPECDEC_GEMM_TILES`). Session 20 timed it warm (each weight kept in
# L2 between calls): faster than cuBLAS there, slower in the engine. On the GPU machine,
# from the repository root:
#
#   source benchmarks/h200_setup.sh > /tmp/setup.log 2>&1     # SmolLM2's GGUF joined
#   PROMPTS=.gpu/bench_sets bash benchmarks/h200_gemm_cold.sh
#
# ROWS the row counts timed (default 1,6,16), TUNE_ROWS those tuned (default 6), MAX_ROWS
# the engine's triton_gemm_max_tokens for the Triton run (default 16). Reports go to $OUT;
# the tiles to $OUT/tiles.json (carry them back as the kernel's new defaults if they win).
set -uo pipefail
: "${PROMPTS:?PROMPTS=<dir with the bench set JSONLs>}"
OUT=${OUT:-/tmp/gemm_cold}
mkdir -p "$OUT"
timeout "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider tests/test_skinny_gemm.py \
    > "$OUT/tests.txt" 2>&1
echo "tests: rc=$? $(tail -1 "$OUT/tests.txt")"
timeout "${TUNE_S:-200}" python3 benchmarks/skinny_gemm.py --cold --rows "${ROWS:-1,6,16}" \
    --tune --tune-rows "${TUNE_ROWS:-6}" --repeats 5 --write-tiles "$OUT/tiles.json" \
    --json "$OUT/skinny_gemm_cold.json" > "$OUT/skinny_gemm_cold.txt" 2>&1
echo "tune: rc=$?"
grep "^|" "$OUT/skinny_gemm_cold.txt"
SPECDEC_GEMM_TILES="$OUT/tiles.json" timeout "${ENGINE_S:-150}" python3 benchmarks/host_gap.py \
    --prompts "$PROMPTS/humaneval.jsonl" --num-prompts 8 --shapes plain --batch 1,16 \
    --max-tokens 256 --json "$OUT/host_gap.json" \
    --variants "triton_gemm_max_tokens=0;triton_gemm_max_tokens=${MAX_ROWS:-16}" \
    > "$OUT/host_gap.txt" 2>&1
echo "engine: rc=$?"
tail -5 "$OUT/host_gap.txt"
