#!/bin/bash
# Rank 0 of a torchrun job under Nsight Compute, the other ranks as they are:
#   NCU_ARGS="-k regex:combine --launch-count 1 ..." \
#   torchrun --standalone --nproc-per-node 2 --no-python bash tools/dev/ncu_rank0.sh SCRIPT.py [ARGS...]
# ncu replays the profiled kernel (4 passes for the pcsamp group, tools/dev/pcsamp_by_reason.py), and an
# LL kernel's peers send their flags once: the fused LL job stalled after the profiled kernel on 2 x H100
# (docs/results/2026-11-28-x2), so give it a time limit; the report was complete by then.
set -u
script=$1; shift
if [ "${LOCAL_RANK:-0}" = 0 ]; then
  # shellcheck disable=SC2086  # NCU_ARGS is a list of options
  exec ncu ${NCU_ARGS:-} python3 "$script" "$@"
fi
exec python3 "$script" "$@"
