#!/bin/bash
# Normal-mode kernels before and after: tools/dev/normal_b2b_probe.py -- DeepEP's tuning calls (cached FP8
# dispatch with column-major and with dense scales, cached BF16 dispatch, combine) on pyep's DeepEP shim --
# on a baseline tree and on this checkout, in one run, configuration by configuration (RANKS:SMS), base
# and new alternating, ranks sharing the GPUs there are (under MPS when they share one).
#
#   bash tools/normal_ab.sh prepare REV             # here (needs git): the baseline's tree in .baseline/REV
#   bash tools/normal_ab.sh run REV [R:S ...]       # on the GPU machine (carry .baseline); default 2:24 2:6
#                                                   # 4:24 4:6. NORMAL_AB_REPEAT=N runs each N times,
#                                                   # NORMAL_AB_LABEL=name labels this tree,
#                                                   # NORMAL_AB_VARIANTS="bf16 combine" picks the calls
#
# Shape: DeepEP's test_intranode.py (N=4096, H=7168, K=8, E=256, its routing), Config(S, 8, 256), or a
# 64-row ring at 8 or more ranks (the default there, docs/normal_mode.md). Writes OUT/normal_ab/
# {base,new}/r<R>s<S>/run<k>/ (the probe's output and JSON) and OUT/normal_ab/normal_ab.{txt,json,png}
# through tools/normal_ab_report.py. The probe's "gap" figures are the GPU's time (each call queued
# behind a device sleep); its back-to-back GB/s are what DeepEP's bench() loop sees, host pace included.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/tools/ab_trees.sh"
ab_entry normal_ab "R:S" "$root" "$@"; rev=$2; shift 2   # prepare exits there
configs=("$@"); [ ${#configs[@]} -eq 0 ] && configs=(2:24 2:6 4:24 4:6)
for cfg in "${configs[@]}"; do
  [[ $cfg =~ ^[1-9][0-9]*:[1-9][0-9]*$ ]] || { echo "a configuration is RANKS:SMS (e.g. 4:24), got '$cfg'"; exit 2; }
done
repeat=$(ab_repeat NORMAL_AB_REPEAT) || exit 2
read -r -a variants <<< "${NORMAL_AB_VARIANTS:-fp8_colmajor fp8_dense bf16 combine}"
ab_build "$ab_out" "$ab_base" "$root" || exit 1
# DeepEP's import name, bound to whichever tree's pyep the path names first.
shim=$(mktemp -d); mkdir -p "$shim/deep_ep"
printf 'from pyep.compat.deep_ep import *  # noqa\nimport pyep.compat.deep_ep as _m\nBuffer = _m.Buffer\n' \
  > "$shim/deep_ep/__init__.py"
most=0
for cfg in "${configs[@]}"; do [ "${cfg%:*}" -gt "$most" ] && most=${cfg%:*}; done
where=$(ab_mps_if_shared "$most")
for cfg in "${configs[@]}"; do
  r=${cfg%:*}; s=${cfg#*:}; ring=256; [ "$r" -ge 8 ] && ring=64
  for k in $(seq 1 "$repeat"); do
    for side in base new; do
      tree=$root; [ $side = base ] && tree=$ab_base
      dir=$ab_out/$side/r${r}s$s/run$k
      mkdir -p "$dir"
      PYTHONPATH=$shim:$tree timeout 300 python3 "$root/tools/dev/normal_b2b_probe.py" --ranks "$r" --sms "$s" \
        --ring "$ring" --variants "${variants[@]}" --modes gap b2b --warmup 20 --iters 30 \
        --trace-dir "$dir/traces" --json "$dir/probe.json" > "$dir/run.txt" 2>&1
      echo "$r ranks, $s SMs, $side run $k: rc $?"
      rm -rf "$dir/traces"   # kineto traces: tens of MB a run, summarised in probe.json
    done
  done
done
label=$(ab_label "$root" "${NORMAL_AB_LABEL:-}")
python3 "$root/tools/normal_ab_report.py" "$ab_out" --baseline "$rev" --current "$label" --where "$where"
