# Sourced by tools/ll_ab.sh and tools/normal_ab.sh: the baseline tree of an A/B (.baseline/REV, ignored
# through .git/info/exclude) and the builds of both trees on the GPU machine.

# ab_entry NAME ARGS ROOT CMD REV: what both scripts' command lines share. `prepare REV` makes the baseline's
# tree and exits; `run REV` checks that the tree is there, exports the one-GPU environment and sets
# ab_base (the tree) and ab_out (${OUT:-/tmp}/NAME, made); anything else prints the usage and exits.
ab_entry() {
  local name=$1 args=$2 root=$3 cmd=${4:-} rev=${5:-}
  local usage="usage: $name.sh prepare REV | run REV [$args ...]"
  [ -n "$rev" ] || { echo "$usage"; exit 2; }
  ab_base=$root/.baseline/$rev
  case $cmd in
    prepare) ab_prepare "$root" "$rev" || exit 1; exit 0 ;;
    run) [ -d "$ab_base/engine" ] || { echo "no baseline tree at $ab_base: run '$name.sh prepare $rev' first"; exit 2; } ;;
    *) echo "$usage"; exit 2 ;;
  esac
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  ab_out=${OUT:-/tmp}/$name
  mkdir -p "$ab_out"
}

# ab_repeat VAR: the value of environment variable VAR (default 1), a positive integer, else exits.
ab_repeat() {
  local v=${!1:-1}
  [[ $v =~ ^[1-9][0-9]*$ ]] || { echo "$1 must be a positive integer, got '$v'" >&2; exit 2; }
  echo "$v"
}

# ab_prepare ROOT REV: the files of commit REV in ROOT/.baseline/REV (here, where git is).
ab_prepare() {
  local root=$1 rev=$2
  local base=$root/.baseline/$rev
  rm -rf "$base" && mkdir -p "$base"
  git -C "$root" archive "$rev" | tar x -C "$base" || return 1
  grep -qx '/.baseline/' "$root/.git/info/exclude" 2>/dev/null || echo '/.baseline/' >> "$root/.git/info/exclude"
  echo "baseline $rev in $base ($(du -sh "$base" | cut -f1)); carry .baseline and .anchors to the GPU machine"
}

# ab_build LOGDIR TREE...: builds, side by side, every tree whose engine is not a CUDA build yet (MAX_JOBS,
# default 16, split between them); a failed build, or one still running after AB_BUILD_TIMEOUT_S (default
# 1800), names its log and returns 1.
ab_build() {
  local logs=$1; shift
  local todo=() pids=() tree i rc=0 t0=$SECONDS
  for tree in "$@"; do
    python3 -c "import sys; sys.path.insert(0, '$tree'); import pyep._engine as e; assert e.has_cuda" 2>/dev/null \
      || todo+=("$tree")
  done
  [ ${#todo[@]} -eq 0 ] && return 0
  local jobs=$(( ${MAX_JOBS:-16} / ${#todo[@]} )); [ "$jobs" -lt 1 ] && jobs=1
  for tree in "${todo[@]}"; do
    (cd "$tree" && CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++ MAX_JOBS=$jobs \
      timeout "${AB_BUILD_TIMEOUT_S:-1800}" python3 setup.py build_ext --inplace > "$logs/build_$(basename "$tree").log" 2>&1) &
    pids+=($!)
  done
  for i in "${!todo[@]}"; do
    wait "${pids[$i]}" || { echo "build of ${todo[$i]} failed or timed out: $logs/build_$(basename "${todo[$i]}").log"; rc=1; }
  done
  [ $rc -eq 0 ] && echo "built ${todo[*]} in $((SECONDS - t0)) s"
  return $rc
}

# ab_mps_if_shared RANKS: prints where the ranks run; when they share a GPU, starts the MPS daemon (kernels
# of different processes side by side) unless it runs.
ab_mps_if_shared() {
  local ranks=$1 ngpu
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if [ "${ngpu:-0}" -ge "$ranks" ]; then
    echo "$ranks ranks, one a GPU"
  else
    pgrep -f nvidia-cuda-mps-control >/dev/null || nvidia-cuda-mps-control -d >&2
    echo "$ranks ranks on ${ngpu:-0} GPU(s), MPS"
  fi
}

# ab_label ROOT GIVEN: the label of the checkout's tree: GIVEN when set (a GPU machine's copy of the
# checkout may carry git metadata older than its files), else git's, marked -dirty when the files differ.
ab_label() {
  if [ -n "$2" ]; then echo "$2"; else (cd "$1" && git describe --always --dirty 2>/dev/null || echo checkout); fi
}
