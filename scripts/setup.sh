#!/usr/bin/env bash
# Prepares a fresh checkout: system packages, Python dependencies, the native engine.
# Sourced by scripts/test.sh and scripts/run.sh; can also be run on its own. Idempotent: whatever is
# already present is left alone, so a machine without network (the GPU hosts) works once it has the
# dependencies.
#
# Environment: PYTHON (interpreter, default python3), PYEP_SKIP_SETUP=1 (skip everything),
# PYEP_SKIP_APT=1 (no system packages), PYEP_TORCH_SPEC (default torch==2.13.0, used only when no torch
# is importable).
set -euo pipefail

PYEP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"

_log() { echo "[pyep setup] $*"; }
_warn() { echo "[pyep setup] WARNING: $*" >&2; }

_setup_apt() {
    # rdma-core headers let the engine static-assert its PRM layouts against mlx5dv.h and let the
    # oracle tests run; pyverbs is used for NIC discovery. A C/C++ compiler builds the engine.
    local pkgs=(libibverbs-dev rdma-core python3-pyverbs) missing=() p
    command -v c++ >/dev/null 2>&1 || pkgs+=(g++)
    command -v cc >/dev/null 2>&1 || pkgs+=(gcc)
    if ! command -v dpkg-query >/dev/null 2>&1; then
        _warn "not a Debian/Ubuntu system; install rdma-core headers (libibverbs-dev) yourself"
        return 0
    fi
    for p in "${pkgs[@]}"; do
        if [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" != "install ok installed" ]]; then
            missing+=("$p")
        fi
    done
    if [[ ${#missing[@]} -eq 0 ]]; then
        _log "system packages present"
        return 0
    fi
    local sudo=()
    if [[ "$(id -u)" -ne 0 ]]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo=(sudo -n)
        else
            _warn "not root and no password-less sudo: cannot install ${missing[*]}; tests that need them will skip"
            return 0
        fi
    fi
    _log "installing ${missing[*]}"
    # A host without network (or without these packages in its archive) still builds the host-only
    # engine; the tests that need them say so when they skip.
    if ! "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq ||
       ! "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
           "${missing[@]}"; then
        _warn "apt-get could not install ${missing[*]}; continuing without them"
    fi
}

_missing_modules() {
    # Prints "module=pip-spec" for every listed module that cannot be imported.
    "$PYTHON" - "$@" <<'PY'
import importlib.util, sys
for item in sys.argv[1:]:
    module, _, spec = item.partition("=")
    if importlib.util.find_spec(module) is None:
        print(spec)
PY
}

_setup_pip() {
    local torch_spec="${PYEP_TORCH_SPEC:-torch==2.13.0}" out need=()
    # torch: any importable build is kept (the GPU hosts ship a CUDA build of their own).
    out="$(_missing_modules "setuptools=setuptools" "wheel=wheel" "pybind11=pybind11" "numpy=numpy" \
        "yaml=pyyaml" "rich=rich" "pytest=pytest" "pytest_timeout=pytest-timeout" "torch=$torch_spec")"
    [[ -z "$out" ]] || mapfile -t need <<<"$out"
    if [[ ${#need[@]} -gt 0 ]]; then
        _log "pip install ${need[*]}"
        "$PYTHON" -m pip install --quiet "${need[@]}"
    else
        _log "python packages present"
    fi
    # matplotlib only draws the bench's PNG (pyproject's "plots" extra): a host without it still works.
    if [[ -n "$(_missing_modules "matplotlib=matplotlib")" ]]; then
        _log "pip install matplotlib (plots)"
        "$PYTHON" -m pip install --quiet matplotlib ||
            _warn "could not install matplotlib; benchmarks will write their tables and JSON but no PNG"
    fi
    # ninja makes the CUDA build parallel; without it torch falls back to a slow serial build.
    if [[ -n "$(_missing_modules "ninja=ninja")" ]] &&
       "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
        "$PYTHON" -m pip install --quiet ninja || _warn "could not install ninja; the CUDA build will be serial"
    fi
}

_setup_build() {
    local log so force=()
    # setuptools only compares .cpp/.cu files with the module; the engine is mostly headers, so a newer
    # header (or build script) than the built module forces a full rebuild rather than a stale one.
    so="$(ls -t "$PYEP_ROOT"/pyep/_engine*.so 2>/dev/null | head -n 1 || true)"
    if [[ -n "$so" ]] && [[ -n "$(find "$PYEP_ROOT/engine" "$PYEP_ROOT/setup.py" -newer "$so" -type f \
            \( -name '*.h' -o -name '*.cuh' -o -name 'setup.py' \) -print -quit)" ]]; then
        force=(--force)
    fi
    _log "building pyep._engine (python setup.py build_ext --inplace ${force[*]})"
    log="$(mktemp /tmp/pyep-build.XXXXXX.log)"
    if ! (cd "$PYEP_ROOT" && "$PYTHON" setup.py build_ext --inplace "${force[@]}" >"$log" 2>&1); then
        tail -n 60 "$log" >&2
        echo "[pyep setup] ERROR: building the native engine failed (full log: $log)" >&2
        return 1
    fi
    rm -f "$log"
    # A shared object links even with undefined symbols; importing it is the real check.
    if ! (cd "$PYEP_ROOT" && "$PYTHON" -c 'import pyep._engine'); then
        echo "[pyep setup] ERROR: pyep._engine was built but does not import (see the error above)" >&2
        return 1
    fi
    _check_private_libstdcxx
    (cd "$PYEP_ROOT" && "$PYTHON" -c 'import pyep; print("[pyep setup] pyep:", pyep.availability().describe())')
}

_check_private_libstdcxx() {
    # Some images put a compiler wrapper first in CXX whose library path holds only libstdc++.a: the
    # module then carries a private copy of libstdc++ beside the process's libstdc++.so, and strings or
    # streams crossing the two crash (seen: free(): invalid pointer, segfaults in ostream on the
    # softnic thread). Detect it and rebuild with the system compiler.
    local so
    so="$(ls -t "$PYEP_ROOT"/pyep/_engine*.so 2>/dev/null | head -n 1 || true)"
    [[ -n "$so" ]] && command -v nm >/dev/null 2>&1 || return 0
    if nm -C --defined-only "$so" 2>/dev/null | grep -q 'std::basic_ostream<char, std::char_traits<char> >::_M_insert'; then
        if [[ -x /usr/bin/g++ && "${CXX:-}" != /usr/bin/g++ ]]; then
            _warn "pyep._engine linked a private libstdc++ (CXX=${CXX:-c++}); rebuilding with /usr/bin/g++"
            (cd "$PYEP_ROOT" && CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++ \
                "$PYTHON" setup.py build_ext --inplace --force >/dev/null 2>&1) ||
                { echo "[pyep setup] ERROR: rebuild with /usr/bin/g++ failed" >&2; return 1; }
        else
            _warn "pyep._engine carries a private libstdc++; set CXX to a compiler that links libstdc++.so"
        fi
    fi
}

pyep_timed() {
    # pyep_timed LABEL COMMAND...: runs COMMAND, then says how long it took (and adds it to PYEP_TIMES).
    # No `|| ...` around COMMAND: that would switch `set -e` off inside it; a failure ends the script.
    local label="$1" t0=$SECONDS
    shift
    "$@"
    PYEP_TIMES="${PYEP_TIMES:-}${PYEP_TIMES:+, }$label $((SECONDS - t0)) s"
    echo "[pyep] $label: $((SECONDS - t0)) s"
}

pyep_setup() {
    if [[ "${PYEP_SKIP_SETUP:-0}" == "1" ]]; then
        _log "PYEP_SKIP_SETUP=1: using the environment as it is"
        return 0
    fi
    command -v "$PYTHON" >/dev/null 2>&1 || { echo "[pyep setup] ERROR: no '$PYTHON' interpreter" >&2; return 1; }
    if [[ "${PYEP_SKIP_APT:-0}" != "1" ]]; then _setup_apt; fi
    _setup_pip
    _setup_build
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    pyep_setup
fi
