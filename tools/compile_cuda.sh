#!/usr/bin/env bash
# Compiles every CUDA source of the checkout for sm_90a (Hopper) with the flags setup.py uses, so GPU
# code that does not compile is caught on CPU-only CI machines. Objects go to a temporary directory
# and are thrown away: this is a compile check, not the build.
#
#   tools/compile_cuda.sh [FILE.cu ...]     (default: every .cu in the checkout)
# Environment: NVCC (compiler), PYEP_CUDA_ARCH (default 90a), PYEP_CUDA_JOBS (parallel jobs, default 2).
# Exit status: 0 all compiled (or no nvcc: skipped with a note), 1 a file failed, 2 bad usage.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ARCH="${PYEP_CUDA_ARCH:-90a}"
JOBS="${PYEP_CUDA_JOBS:-2}"
if ! [[ "$JOBS" =~ ^[1-9][0-9]*$ ]]; then
    echo "compile_cuda: PYEP_CUDA_JOBS must be a positive integer, got '$JOBS'" >&2
    exit 2
fi
if ! [[ "$ARCH" =~ ^[0-9]+[a-z]?$ ]]; then
    echo "compile_cuda: PYEP_CUDA_ARCH must look like 90a, got '$ARCH'" >&2
    exit 2
fi

NVCC="${NVCC:-}"
if [[ -z "$NVCC" ]]; then
    for cand in "$(command -v nvcc || true)" "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
        if [[ -n "$cand" && -x "$cand" ]]; then NVCC="$cand"; break; fi
    done
fi
if [[ -z "$NVCC" ]]; then
    echo "compile_cuda: nvcc not found (set NVCC or CUDA_HOME); skipping the CUDA compile check"
    exit 0
fi

if [[ $# -gt 0 ]]; then
    FILES=("$@")
    for f in "${FILES[@]}"; do
        [[ "$f" == *.cu && -f "$f" ]] || { echo "compile_cuda: not a .cu file: $f" >&2; exit 2; }
    done
elif git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    # Tracked and new (not ignored) sources: build outputs and scratch copies stay out.
    mapfile -t FILES < <(git ls-files --cached --others --exclude-standard -- '*.cu' | sort -u)
else
    mapfile -t FILES < <(find . -name '*.cu' -not -path './build/*' -not -path './.git/*' | sed 's|^\./||' | sort)
fi
if [[ ${#FILES[@]} -eq 0 ]]; then
    echo "compile_cuda: no .cu files"
    exit 0
fi

OUT="$(mktemp -d /tmp/pyep-cuda-check.XXXXXX)"
trap 'rm -rf "$OUT"' EXIT
FLAGS=(-std=c++17 "-gencode=arch=compute_${ARCH},code=sm_${ARCH}" -I engine -Xcompiler -fPIC
       --expt-relaxed-constexpr -DPYEP_WITH_CUDA=1 -c)
if [[ -f /usr/include/infiniband/mlx5dv.h ]]; then FLAGS+=(-DPYEP_HAVE_RDMA_CORE=1); fi
export NVCC OUT
FLAGS_STR="${FLAGS[*]}"
export FLAGS_STR

echo "compile_cuda: ${#FILES[@]} file(s) with $NVCC for sm_${ARCH}, $JOBS at a time"
# Each job prints one status line and keeps the compiler's messages with it; the log files let the
# summary below name every failure even when output interleaves.
printf '%s\0' "${FILES[@]}" | xargs -0 -P "$JOBS" -I{} bash -c '
    f="$1"; obj="$OUT/$(echo "$f" | tr "/" "_").o"; log="$obj.log"
    start=$(date +%s)
    # shellcheck disable=SC2086
    if "$NVCC" $FLAGS_STR "$f" -o "$obj" >"$log" 2>&1; then
        echo "  ok    $f ($(( $(date +%s) - start ))s)"
    else
        echo "  FAIL  $f"; sed "s/^/        /" "$log"; touch "$obj.failed"
    fi' _ {}

failed=$(find "$OUT" -name '*.failed' | wc -l)
if [[ "$failed" -ne 0 ]]; then
    echo "compile_cuda: $failed of ${#FILES[@]} file(s) failed to compile" >&2
    exit 1
fi
echo "compile_cuda: all ${#FILES[@]} file(s) compiled"
