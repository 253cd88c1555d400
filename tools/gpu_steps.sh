# Sourced by tools/gpu_acceptance.sh and tools/onegpu_acceptance.sh: their step runner. The caller sets
# OUTDIR and failed=0; each step runs bounded by `timeout`, logs to OUTDIR/NAME.log, appends its line and
# the pass counts it printed to OUTDIR/summary.txt, and counts a failure without stopping the run.
step() {   # step NAME TIMEOUT_S CMD...
    local name="$1" limit="$2"; shift 2
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
    local rc=$?
    printf '%-12s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" | tee -a "$OUTDIR/summary.txt"
    grep -E "[0-9]+ (passed|failed)|drills passed|ERROR SUMMARY|[Ee]rror" "$OUTDIR/$name.log" | tail -2 \
        | sed 's/^/             /' | tee -a "$OUTDIR/summary.txt"
    [[ $rc -eq 0 ]] || failed=$((failed + 1))
}
