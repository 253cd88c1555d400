#!/bin/bash
# LL kernels before and after: DeepEP V1's own tests/test_low_latency.py, unchanged, on pyep's shim as
# built from an earlier commit (the baseline) and from this checkout, in one run, T by T: on one GPU
# the 2 ranks share it under MPS; with two or more GPUs each rank has its own (NVLink).
#
#   bash tools/ll_ab.sh prepare REV            # here (needs git): the baseline's tree in .baseline/REV
#   bash tools/ll_ab.sh run REV [T ...]        # on the GPU machine (carry .anchors and .baseline;
#                                              # LL_AB_LABEL=name labels this tree in the report,
#                                              # LL_AB_REPEAT=N runs each T N times, base and new
#                                              # alternating; the report keeps the least of them)
#
# Why DeepEP's test and not `pyep bench`: it is the one harness both trees run unchanged (the bench and
# the package layout changed since the baselines of interest). It times the dispatch and combine kernels
# with kineto and the back-to-back dispatch + combine with CUDA events -- the kernel time and the eager
# loop a user sees. Each T runs the baseline, then this tree, so both see the same machine state.
# run builds the baseline's engine in place (same flags as ours), links .anchors into it (deepep_v1.sh
# finds pyep in the folder above its own), starts the MPS daemon on one GPU and writes
# OUT/ll_ab.{txt,json,png} through tools/ll_ab_report.py. T defaults to 1 32 128 256; other
# test_low_latency.py defaults stay (H=7168, K=8, E=288). .baseline/ is ignored (.git/info/exclude).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/tools/ab_trees.sh"
ab_entry ll_ab "T" "$root" "$@"; rev=$2; shift 2   # prepare exits there
[ -d "$root/.anchors/deepep" ] || { echo "no .anchors/deepep (see .anchors/deepep_v1.sh's header)"; exit 2; }
tokens=("$@"); [ ${#tokens[@]} -eq 0 ] && tokens=(1 32 128 256)
ab_build "$ab_out" "$ab_base" "$root" || exit 1
ln -sfn "$root/.anchors" "$ab_base/.anchors"
# One GPU: the 2 ranks share it, side by side under MPS. Two or more: one rank a GPU, as users run.
where=$(ab_mps_if_shared 2)
# One sample is the test's own average over its iterations; with two ranks on one GPU a kernel's
# time also holds any wait for the other rank, so a sample can double (docs/results/2026-11-27c-x2).
repeat=$(ab_repeat LL_AB_REPEAT) || exit 2
for t in "${tokens[@]}"; do
  for k in $(seq 1 "$repeat"); do
    for side in base new; do
      tree=$root; [ $side = base ] && tree=$ab_base
      dir=$ab_out/$side/T$t/run$k
      mkdir -p "$dir"
      OUT=$dir DEEPEP_ON=pyep bash "$tree/.anchors/deepep_v1.sh" ll 2 --num-tokens "$t" > "$dir/run.txt" 2>&1
      echo "T=$t $side run $k: rc $? ($(grep -c 'Dispatch bandwidth' "$dir/pyep_ll_2.log" 2>/dev/null || echo 0) rank lines)"
    done
  done
done
label=$(ab_label "$root" "${LL_AB_LABEL:-}")
python3 "$root/tools/ll_ab_report.py" "$ab_out" --baseline "$rev" --current "$label" --where "$where"
