#!/usr/bin/env bash
# The GPU acceptance run of the engine, EP and launcher issues, in one go, for a machine with all its
# GPUs on one NVSwitch (written for 8x H200; any count >= 2 works). Assumes a built checkout
# (scripts/setup.sh, or `python3 setup.py build_ext --inplace`). Logs and results go to OUTDIR.
#
#   tools/gpu_acceptance.sh OUTDIR [quick]
#
# Steps (each bounded by `timeout`, each logged; a failed step does not stop the later ones):
#   engine   pytest -m gpu tests/test_gda_gpu.py tests/test_softnic_gpu.py   (worlds 2 and all GPUs)
#   bench    pyep launch configs/single_node.yaml        (the EP benchmark on all GPUs, NVLink)
#   vnodes   pyep launch configs/two_virtual_nodes.yaml  (NVLink inside two virtual nodes, softnic between)
#   tests    pyep launch configs/single_node.yaml workload.builtin=tests: the EP GPU suite
#            (tests/test_ep_native_gpu.py: nvlink, emulated and mixed, worlds 2, 4 and all GPUs) through
#            the launcher
#   normal   pytest -m gpu tests/test_normal_gpu.py  (normal mode: native vs reference, graphs, 1000 rounds)
#   nbench   torchrun (all GPUs) pyep bench --mode normal --sweep-sms --deepep: the normal-mode benchmark,
#            DeepEP's test_intranode.py figures of the same machine beside it (needs .anchors carried)
# Each launch keeps its run directory under OUTDIR. "quick" shortens the benchmark iterations.
# Expected duration on 4 H200s: about 6 minutes. Exit status: the number of failed steps.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUTDIR="${1:?usage: tools/gpu_acceptance.sh OUTDIR [quick]}"
QUICK="${2:-}"
iters=30; warm=5; viters=5
if [[ "$QUICK" == "quick" ]]; then iters=10; warm=2; viters=3; fi
source tools/gpu_steps.sh   # environment, OUTDIR, PY, the step runner (after the cd to the root)
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUTDIR/gpus.csv" 2>&1
step engine 300 "$PY" -m pytest -q -m gpu tests/test_gda_gpu.py tests/test_softnic_gpu.py -rA
step bench 400 "$PY" -m pyep launch configs/single_node.yaml --run-dir "$OUTDIR/run-bench" \
    "workload.args=[--iters,$iters,--warmup,$warm]"
step vnodes 400 "$PY" -m pyep launch configs/two_virtual_nodes.yaml --run-dir "$OUTDIR/run-vnodes" \
    "workload.args=[--iters,$viters,--warmup,2]"
step tests 600 "$PY" -m pyep launch configs/single_node.yaml --run-dir "$OUTDIR/run-tests" workload.builtin=tests \
    "workload.args=[-m,gpu,-q,-rA,tests/test_ep_native_gpu.py]"
step normal 420 "$PY" -m pytest -q -m gpu tests/test_normal_gpu.py -rA
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
step nbench 900 "$PY" -m torch.distributed.run --standalone --nproc-per-node "${ngpu:-2}" tools/bench_ep.py \
    --mode normal --sweep-sms --deepep --iters "$iters" --warmup "$warm" --out "$OUTDIR/bench-normal"
echo "failed steps: $failed" | tee -a "$OUTDIR/summary.txt"
exit "$failed"
