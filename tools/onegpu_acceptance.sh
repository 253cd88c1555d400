#!/usr/bin/env bash
# The GPU acceptance run on ONE GPU, ranks sharing it, in parts that each fit a 10-minute command (the
# lent machines' per-call bound). Builds pyep in place once per machine and engine source. Logs, JSON
# and a summary go to OUTDIR; each step is bounded by `timeout` and a failed step does not stop the rest.
#
#   tools/onegpu_acceptance.sh OUTDIR PART
#
# PART (times measured on one H200, 2026-11-26; docs/results/2026-11-26b-h200x1/):
#   suites      compat, normal call tags, normal internode native (2x8 included)          ~6 min
#   more        LL native, GDA + softnic, normal intranode + order + mask, relay          ~9 min
#   anchors     DeepEP V1's test_intranode / test_low_latency / test_internode (16 ranks)
#               and V2's test_ep.py (sync and no-sync) on the shims (carry .anchors)      ~8 min
#   drills-mps  pyep drill, MPS on: softnic and NVLink 20 each at 2 ranks, 4 each at 4    ~7 min
#   drills-nv   pyep drill, MPS off: NVLink 20 at 2 ranks, then one drill under memcheck  ~4 min
#   drills-em   pyep drill, MPS off: softnic 20 at 2 ranks                                ~5 min
#   drills-normal  pyep drill --mode normal --backend native, MPS on: NVLink 20 at 2 ranks, 8 at 4
#               (H100, 2026-11-26d: 252 s + 109 s); softnic, one rank per virtual node, 20 at 2
#               (H100, 2026-11-26e: 330 s)                                                 ~12 min
#   bench       pyep bench --mode normal --sweep-sms --deepep at 2 and 4 ranks, MPS on
#               (carry .anchors; builds DeepEP, ~1 min)                                   ~8 min
# Every command exports NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
# Exit status: the number of failed steps.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUTDIR="${1:?usage: tools/onegpu_acceptance.sh OUTDIR PART}"
PART="${2:?PART: suites, more, anchors, drills-mps, drills-nv, drills-em, drills-normal or bench}"
source tools/gpu_steps.sh   # environment, OUTDIR, PY, the step runner (after the cd to the root)
build() {   # once per machine and engine source: keyed by a hash of engine/ and setup.py
    local h; h=$(find engine setup.py -type f | sort | xargs cat | sha1sum | cut -c1-16)
    if [[ "$(cat .gpu_build/hash 2>/dev/null)" == "$h" ]] && "$PY" -c "import pyep._engine as e; assert e.has_cuda" 2>/dev/null; then
        return 0
    fi
    step build 600 env CXX="${CXX:-g++}" CC="${CC:-gcc}" CUDAHOSTCXX="${CUDAHOSTCXX:-g++}" MAX_JOBS="${MAX_JOBS:-16}" \
        "$PY" setup.py build_ext --inplace || return 1
    mkdir -p .gpu_build && echo "$h" > .gpu_build/hash
}
mps_on() { pgrep -f nvidia-cuda-mps-control > /dev/null || nvidia-cuda-mps-control -d; sleep 1; }
mps_off() { echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; }
drill() {   # drill NAME TIMEOUT_S TRANSPORT WORLD DRILLS [extra args]
    local name="$1" limit="$2" transport="$3" world="$4" drills="$5"; shift 5
    local t=200000; [[ "$transport" == nvlink ]] && t=50000
    step "$name" "$limit" "$PY" -m pyep drill --backend native --transport "$transport" --world "$world" \
        --drills "$drills" --timeout-us "$t" --json "$OUTDIR/$name.json" "$@"
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUTDIR/summary.txt"
build || exit 1
case "$PART" in
  suites)
    step compat 150 "$PY" -m pytest -q -m gpu -rfE tests/test_compat_gpu.py
    step ntags 200 "$PY" -m pytest -q -m gpu -rfE tests/test_normal_gpu_tags.py
    step inter 330 "$PY" -m pytest -q -m gpu -rfE tests/test_normal_internode_native_gpu.py ;;
  more)
    step ll 150 "$PY" -m pytest -q -m gpu -rfE tests/test_ep_native_gpu.py
    step gda 60 "$PY" -m pytest -q -m gpu -rfE tests/test_gda_gpu.py tests/test_softnic_gpu.py
    step normal 90 "$PY" -m pytest -q -m gpu -rfE tests/test_normal_gpu.py tests/test_normal_internode_order_gpu.py
    step nelastic 60 "$PY" -m pytest -q -m gpu -rfE tests/test_normal_elastic_gpu.py
    step relay 270 "$PY" -m pytest -q -m gpu -rfE tests/test_normal_internode_gpu.py ;;
  anchors)
    step v1_intra 150 env DEEPEP_ON=pyep OUT="$OUTDIR" bash .anchors/deepep_v1.sh intranode 2
    step v1_ll 120 env DEEPEP_ON=pyep OUT="$OUTDIR" bash .anchors/deepep_v1.sh ll 2
    step v1_inter 200 env DEEPEP_ON=pyep OUT="$OUTDIR" bash .anchors/deepep_v1.sh internode 16 \
        --num-tokens 512 --hidden 2048 --num-topk 4 --num-experts 64
    step v2 100 env OUT="$OUTDIR" bash tools/deepep_v2_anchor.sh run 2 --num-tokens 512 --hidden 2048 --num-topk 4 \
        --num-experts 64
    mkdir -p "$OUTDIR/nosync"
    step v2_nosync 100 env OUT="$OUTDIR/nosync" bash tools/deepep_v2_anchor.sh run 2 --num-tokens 512 --hidden 2048 \
        --num-topk 4 --num-experts 64 --do-cpu-sync 0 ;;
  drills-mps)
    mps_on
    drill em_on 330 emulated 2 20
    drill nv_on 260 nvlink 2 20
    drill em4_on 120 emulated 4 4
    drill nv4_on 100 nvlink 4 4
    mps_off ;;
  drills-nv)
    mps_off
    drill nv_off 340 nvlink 2 20 --rounds-after 200
    step memcheck 200 compute-sanitizer --tool memcheck --target-processes all --log-file "$OUTDIR/memcheck_%p.txt" \
        "$PY" -m pyep drill --backend native --transport nvlink --world 2 --drills 1 --phases combine --rounds-after 20 \
        --timeout-us 20000000 --slack-ms 100000 --max-slowdown 1000 --join-timeout-s 180
    grep -h "ERROR SUMMARY" "$OUTDIR"/memcheck_*.txt | tee -a "$OUTDIR/summary.txt" ;;
  drills-normal)
    # The normal mode on the native kernels: SIGKILL in the count exchange, dispatch, combine, between;
    # restart and rejoin (store-based NormalBuffer), MPS on.
    mps_on
    drill nn_on 330 nvlink 2 20 --mode normal
    drill nn4_on 200 nvlink 4 8 --mode normal
    drill nem_on 400 emulated 2 20 --mode normal
    mps_off ;;
  drills-em)
    mps_off
    drill em_off 400 emulated 2 20 --rounds-after 200 ;;
  bench)
    mps_off; mps_on
    step deepep_build 200 env DEEPEP_BUILD_ONLY=1 OUT="$OUTDIR" bash .anchors/deepep_v1.sh intranode 2
    step n2 180 torchrun --standalone --nproc-per-node 2 -m pyep bench --mode normal --sweep-sms --deepep \
        --iters 20 --warmup 5 --out "$OUTDIR/n-2on1"
    step n4 290 torchrun --standalone --nproc-per-node 4 -m pyep bench --mode normal --sweep-sms --deepep \
        --iters 20 --warmup 5 --out "$OUTDIR/n-4on1"
    mps_off ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
exit "$failed"
