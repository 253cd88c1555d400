#!/usr/bin/env bash
# The main job (README): set up a fresh checkout, then run pyep's default job. With GPUs: the EP
# benchmark on all local GPUs (`pyep launch`). Without: the CPU reference backend through the same
# launcher, and the softnic self-test. Extra arguments go to `pyep launch` on GPU machines.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
pyep_timed set-up pyep_setup

# NVLink multicast (NVLS) stays off: the shared GPU hosts do not allow it, and NCCL / torch symmetric
# memory / NVSHMEM would otherwise try it and fail at start-up.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

gpus="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' \
        2>/dev/null || echo 0)"
if [[ "$gpus" =~ ^[1-9][0-9]*$ ]]; then
    echo "[pyep run] $gpus GPU(s): EP benchmark on all of them"
    pyep_timed "EP benchmark" "$PYTHON" -m pyep launch "$@"
    echo "[pyep run] done in $SECONDS s: $PYEP_TIMES"
    exit 0
fi
echo "[pyep run] no GPU: CPU reference backend and the softnic self-test"
pyep_timed "CPU reference job" "$PYTHON" -m pyep launch cpu_reference
pyep_timed "softnic self-test" "$PYTHON" -m pyep softnic selftest
echo "[pyep run] done in $SECONDS s: $PYEP_TIMES"
