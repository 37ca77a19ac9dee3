# Sourced by the lease scripts (h200_default_head.sh, h200_spec_exit.sh): one call's time
# budget, and a recipe's stages run under it. Set RECIPE (the stage script) and OUT first;
# BUDGET_S is the call's seconds (default 570, under the device's 10-minute limit).
deadline=$(($(date +%s) + ${BUDGET_S:-570}))
left() { echo $((deadline - $(date +%s))); }

run_stage() {  # stage [extra env...]: "$RECIPE stage" under the call's remaining time
    local stage=$1 t
    t=$(left)
    if [ "$t" -lt 45 ]; then echo "--- $stage: not started (${t}s left)"; return 1; fi
    echo "--- $stage: ${t}s left ($(date -u +%H:%M:%S))"
    shift
    env "$@" timeout "$t" "$RECIPE" "$stage" > "$OUT/$stage.log" 2>&1
    local rc=$?
    echo "--- $stage: rc=$rc, $(($(left)))s left"
    # The log's last lines without progress bars.
    grep -v "it/s\]\|rec/s\]\|conv/s\|item/s\]\|s/it\]\|step/s\]" "$OUT/$stage.log" | tail -8
    return $rc
}
