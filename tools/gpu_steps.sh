# Sourced by tools/gpu_acceptance.sh and tools/onegpu_acceptance.sh from the checkout root, after they set
# OUTDIR: the environment every GPU command runs with (no NVLink multicast anywhere; this checkout on the
# path), PY, and the step runner. Each step runs bounded by `timeout`, logs to OUTDIR/NAME.log, appends its
# line and the pass counts it printed to OUTDIR/summary.txt, and counts a failure in `failed` without
# stopping the run.
mkdir -p "$OUTDIR"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
failed=0

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
