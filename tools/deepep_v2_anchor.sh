#!/bin/bash
# DeepEP V2's own tests/elastic/test_ep.py, unchanged, against pyep's shim (pyep.compat.deep_ep.ElasticBuffer).
#
#   bash tools/deepep_v2_anchor.sh prepare DEEPEP_GIT_DIR [REV]   # on a machine with a DeepEP git copy
#   bash tools/deepep_v2_anchor.sh run NRANKS [test_ep.py args]   # on the GPU machine (carry .anchors)
#   bash tools/deepep_v2_anchor.sh run-cpu NRANKS [args]          # the same file on the CPU (reference backend)
#
# prepare extracts, with `git archive` (DeepEP is only run, never copied into the project), the test file
# and DeepEP's test helpers (deep_ep/utils: math, gate, envs, refs, testing) into .anchors/deepep_v2/, and
# writes the files that make them import pyep instead of DeepEP's extension: deep_ep/__init__.py (the
# package is pyep.compat.deep_ep), deep_ep/_C.py (the names the helpers take from the extension), and
# site/sitecustomize.py (DeepEP's reference all-to-all of bf16 / fp8 rows over a gloo group, as bytes).
# run starts the test with NRANKS ranks; more ranks than GPUs share them through .anchors/onegpu (gloo
# group, cuda:<rank> -> rank % GPUs; copy ../shared/anchors/onegpu there) with the CUDA MPS daemon up,
# as .anchors/deepep_v1.sh does; run-cpu maps the test's CUDA tensors to the CPU and its NCCL group to
# gloo (pyep then runs its reference backend; PYEP_VIRTUAL_NODE_SIZE=2 makes virtual nodes). A case that
# fails aborts the file, so "cases started" = the cases passed (+1 on failure). --skip-perf-test is
# added: the perf part times DeepEP's kernels by name (dispatch_impl, ...), which pyep's kernels do not
# carry. Logs go to $OUT (or /tmp); PYEP_ANCHOR_TIMEOUT_S bounds the run (600 s).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=$root/.anchors/deepep_v2
cmd=${1:?usage: deepep_v2_anchor.sh prepare DEEPEP_GIT_DIR [REV] | run NRANKS [test args]}; shift
case $cmd in
  prepare)
    git_dir=${1:?DeepEP git directory}; rev=${2:-HEAD}
    rm -rf "$dest"; mkdir -p "$dest"
    git -C "$git_dir" archive "$rev" tests/elastic/test_ep.py deep_ep/utils | tar x -C "$dest"
    cat > "$dest/deep_ep/__init__.py" <<'EOF'
# Written by pyep's tools/deepep_v2_anchor.sh: `import deep_ep` is pyep's shim; deep_ep.utils is DeepEP's.
from pyep.compat.deep_ep import *  # noqa: F401,F403
from pyep.compat.deep_ep import (Buffer, Config, ElasticBuffer, EPHandle, EventHandle,  # noqa: F401
                                 EventOverlap, topk_idx_t)
EOF
    cat > "$dest/deep_ep/_C.py" <<'EOF'
# Written by pyep's tools/deepep_v2_anchor.sh: what DeepEP's utils import from its extension at import time.
from pyep.compat.deep_ep import Config, EventHandle, topk_idx_t  # noqa: F401
EOF
    mkdir -p "$dest/site"
    cat > "$dest/site/sitecustomize.py" <<'EOF'
# Written by pyep's tools/deepep_v2_anchor.sh. DeepEP's reference (deep_ep/utils/refs.py) moves bf16 / fp8
# rows with dist.all_to_all_single, which a gloo group (ranks sharing a GPU, or the CPU) does not carry:
# move them as bytes, through host memory. Loads .anchors/onegpu's sitecustomize first when given.
# PYEP_ANCHOR_CPU=1 (run-cpu): the test's CUDA tensors and NCCL group become CPU tensors and a gloo group.
import os
_onegpu = os.environ.get("PYEP_ONEGPU_SITE", "")
if _onegpu and os.path.isfile(_onegpu):
    exec(compile(open(_onegpu).read(), _onegpu, "exec"))
import torch
import torch.distributed as dist
_a2a = dist.all_to_all_single
_GLOO = (torch.uint8, torch.int32, torch.int64, torch.float32, torch.float64)


def _a2a_bytes(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    if async_op or dist.get_backend(group) != "gloo" or (output.dtype in _GLOO and not output.is_cuda):
        return _a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
    send = input.contiguous().view(torch.uint8).reshape(input.shape[0], -1).cpu()
    recv = torch.empty((output.shape[0], send.shape[1]), dtype=torch.uint8, device="cpu")
    _a2a(recv, send, output_split_sizes, input_split_sizes, group=group)
    output.view(torch.uint8).reshape(output.shape[0], -1).copy_(recv)


dist.all_to_all_single = _a2a_bytes

if os.environ.get("PYEP_ANCHOR_CPU") == "1":
    from torch.overrides import TorchFunctionMode

    def _cpu(d):
        if isinstance(d, str) and d.startswith("cuda") or isinstance(d, torch.device) and d.type == "cuda":
            return torch.device("cpu")
        return d

    class _CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = {k: (_cpu(v) if k == "device" else v) for k, v in (kwargs or {}).items()}
            if func is torch.Tensor.to:
                args = tuple(_cpu(a) for a in args)
            return func(*args, **kwargs)

    def _gloo(fn):
        def wrapped(*args, **kwargs):
            kwargs["backend"] = "gloo"
            kwargs.pop("device_id", None)
            return fn(*args, **kwargs)
        return wrapped

    torch.compile = lambda f=None, **kw: f if f is not None else (lambda g: g)
    torch.set_default_device = lambda d: None
    torch.cuda.set_device = lambda d: None
    torch.cuda.synchronize = lambda *a, **k: None
    dist.init_process_group = _gloo(dist.init_process_group)
    dist.new_group = _gloo(dist.new_group)
    _CudaToCpu().__enter__()
EOF
    git -C "$git_dir" log -1 --format='DeepEP %h %cs' "$rev" > "$dest/REVISION"
    echo "prepared $dest ($(cat "$dest/REVISION"))" ;;
  run|run-cpu)
    n=${1:?number of ranks}; shift
    [ -f "$dest/tests/elastic/test_ep.py" ] || { echo "no $dest: run 'prepare' first (and carry .anchors)"; exit 2; }
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
    log=${OUT:-/tmp}/pyep_v2_test_ep_${cmd}_$n.log
    if [ "$cmd" = run-cpu ]; then
      export PYEP_ANCHOR_CPU=1
    elif [ "$n" -gt "$(nvidia-smi -L 2>/dev/null | wc -l)" ]; then
      [ -d "$root/.anchors/onegpu" ] || { echo "more ranks than GPUs needs .anchors/onegpu"; exit 2; }
      export ONEGPU=1 PYEP_ONEGPU_SITE=$root/.anchors/onegpu/sitecustomize.py
      pgrep -f nvidia-cuda-mps-control >/dev/null || { nvidia-cuda-mps-control -d && echo "(MPS daemon started)"; }
    fi
    cd "$dest/tests/elastic"
    rc=0
    PYTHONPATH=$dest/site:$dest:$root timeout "${PYEP_ANCHOR_TIMEOUT_S:-600}" \
      python3 test_ep.py --num-processes "$n" --skip-perf-test "$@" > "$log" 2>&1 || rc=$?
    grep -E 'Ranks:|Tokens:' "$log" | head -2
    echo "cases started: $(grep -c 'Testing with' "$log"); exit status $rc (log: $log)"
    [ "$rc" -eq 0 ] || grep -E 'Error|assert' "$log" | tail -5
    exit "$rc" ;;
  *) echo "command must be prepare, run or run-cpu"; exit 2 ;;
esac
