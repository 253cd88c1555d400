#!/usr/bin/env bash
# The install check (run by scripts/test.sh, so by CI): pyep installs and runs as a user gets it.
#
#  1. `setup.py sdist`, then `pip wheel` from that sdist: an isolated build, so pyproject's build
#     requirements and MANIFEST.in are what is tested (not this checkout's environment).
#  2. The wheel into a fresh virtual environment that sees this interpreter's packages (a .pth file
#     naming its site-packages, which works when PYTHON is itself a venv, unlike --system-site-packages):
#     pip resolves the declared dependencies against the torch already installed, so nothing is
#     downloaded again. Then, from a directory outside the checkout:
#     `pyep info`, `pyep softnic selftest`, `pyep launch cpu_reference` and
#     `pyep launch configs/cpu_reference.yaml` (the shipped configs found by name).
#  3. `pip install -e .` of a copy of the checkout into another fresh environment, run the same way.
#  4. Every other supported CPython found on PATH (PYEP_CHECK_PYTHONS, default python3.10 ... python3.13):
#     the wheel built and installed without torch (a CUDA build is several GB), `pyep info` and
#     `pyep softnic selftest` pass, and `pyep launch cpu_reference` says torch is missing (exit 1).
#
# Environment: PYTHON (default python3), PYEP_CHECK_PYTHONS (space-separated; "" checks only PYTHON).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OTHERS="${PYEP_CHECK_PYTHONS-python3.10 python3.11 python3.12 python3.13}"
WORK="$(mktemp -d /tmp/pyep-install-check.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
T0=$SECONDS

_log() { echo "[pyep install-check $((SECONDS - T0))s] $*"; }
_fail() { echo "[pyep install-check] FAILED: $*" >&2; exit 1; }

# Runs a command from $WORK/outside (never the checkout), output kept in a log shown on failure.
_run() {
    local name="$1"; shift
    local log="$WORK/$name.log"
    if ! (cd "$WORK/outside" && "$@") >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        _fail "$name: $*"
    fi
    _log "ok: $name"
}

_fresh_env() {
    # $1: where. A new virtual environment that also sees $PYTHON's installed packages, after its own.
    "$PYTHON" -m venv "$1"
    local own
    own="$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
    "$PYTHON" -c 'import site, sysconfig
paths = dict.fromkeys(site.getsitepackages() + [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
print("\n".join(paths))' >"$own/_pyep_check_reuse.pth"
}

_check_env() {
    # $1: label, $2: the environment's bin directory, $3: where pyep must be imported from.
    local label="$1" bin="$2" expect="$3" where
    where="$(cd "$WORK/outside" && "$bin/python" -c 'import pyep, os; print(os.path.dirname(pyep.__file__))')"
    [[ "$where" == "$expect"* ]] || _fail "$label: pyep was imported from $where, not from $expect"
    _log "$label: pyep imported from $where"
    _run "$label-info" "$bin/pyep" info
    _run "$label-selftest" "$bin/pyep" softnic selftest
    _run "$label-launch-name" "$bin/pyep" launch cpu_reference --quiet --run-dir "$WORK/runs/$label-name"
    _run "$label-launch-path" "$bin/pyep" launch configs/cpu_reference.yaml --quiet \
        --run-dir "$WORK/runs/$label-path"
    [[ -f "$WORK/runs/$label-name/demo-result.json" ]] || _fail "$label: the launch wrote no demo-result.json"
}

mkdir -p "$WORK/outside" "$WORK/runs"
_log "sdist"
(cd "$ROOT" && "$PYTHON" setup.py -q sdist -d "$WORK/sdist") >"$WORK/sdist.log" 2>&1 ||
    { tail -n 40 "$WORK/sdist.log" >&2; _fail "setup.py sdist"; }
SDIST="$(ls "$WORK"/sdist/pyep-*.tar.gz)"

_log "wheel from the sdist (isolated build) with $PYTHON"
"$PYTHON" -m pip wheel --quiet --no-deps -w "$WORK/wheel" "$SDIST" >"$WORK/wheel.log" 2>&1 ||
    { tail -n 60 "$WORK/wheel.log" >&2; _fail "pip wheel"; }
WHEEL="$(ls "$WORK"/wheel/pyep-*.whl)"
"$PYTHON" -m zipfile -l "$WHEEL" >"$WORK/wheel-files.txt"
grep -q 'pyep/configs/cpu_reference.yaml' "$WORK/wheel-files.txt" || _fail "the wheel ships no configs"

_log "wheel into a fresh environment (installed torch reused)"
_fresh_env "$WORK/venv"
"$WORK/venv/bin/python" -m pip install --quiet "$WHEEL" >"$WORK/install.log" 2>&1 ||
    { tail -n 40 "$WORK/install.log" >&2; _fail "pip install of the wheel"; }
_check_env wheel "$WORK/venv/bin" "$WORK/venv/"

_log "pip install -e . (a copy of the checkout) into a fresh environment"
mkdir -p "$WORK/src"
tar -xzf "$SDIST" -C "$WORK/src" --strip-components=1
_fresh_env "$WORK/venv-e"
"$WORK/venv-e/bin/python" -m pip install --quiet -e "$WORK/src" >"$WORK/install-e.log" 2>&1 ||
    { tail -n 40 "$WORK/install-e.log" >&2; _fail "pip install -e"; }
_check_env editable "$WORK/venv-e/bin" "$WORK/src/"

_interpreter() {
    # The interpreter for $1 (a command or a path): itself when it runs, else pyenv's build of that
    # version (pyenv's shims run only the versions `pyenv global` names). Prints nothing if none runs.
    local py="$1" root cand
    if "$py" -c '' >/dev/null 2>&1; then command -v "$py"; return 0; fi
    command -v pyenv >/dev/null 2>&1 || return 0
    root="$(pyenv root 2>/dev/null)" || return 0
    for cand in "$root"/versions/"${py#python}".*/bin/"$py"; do
        if [[ -x "$cand" ]] && "$cand" -c '' >/dev/null 2>&1; then echo "$cand"; return 0; fi
    done
}

main_version="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
for name in $OTHERS; do
    py="$(_interpreter "$name")"
    [[ -n "$py" ]] || { _log "NOT TESTED: no $name on this machine"; continue; }
    version="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    [[ "$version" != "$main_version" ]] || continue
    label="py$version"
    _log "$label: wheel, fresh environment without torch"
    "$py" -m pip wheel --quiet --no-deps -w "$WORK/wheel-$label" "$SDIST" >"$WORK/wheel-$label.log" 2>&1 ||
        { tail -n 60 "$WORK/wheel-$label.log" >&2; _fail "$label: pip wheel"; }
    "$py" -m venv "$WORK/venv-$label"
    bin="$WORK/venv-$label/bin"
    # The wheel's dependencies less torch: the torch-free commands must work without it.
    "$bin/python" -m pip install --quiet --no-deps "$WORK"/wheel-"$label"/pyep-*.whl >"$WORK/install-$label.log" 2>&1 &&
        "$bin/python" -m pip install --quiet numpy pyyaml rich >>"$WORK/install-$label.log" 2>&1 ||
        { tail -n 40 "$WORK/install-$label.log" >&2; _fail "$label: pip install"; }
    _run "$label-info" "$bin/pyep" info
    _run "$label-selftest" "$bin/pyep" softnic selftest
    set +e
    (cd "$WORK/outside" && "$bin/pyep" launch cpu_reference) >"$WORK/$label-notorch.log" 2>&1
    rc=$?
    set -e
    if [[ $rc -ne 1 ]] || ! grep -q "needs PyTorch" "$WORK/$label-notorch.log" ||
       grep -q "Traceback" "$WORK/$label-notorch.log"; then
        cat "$WORK/$label-notorch.log" >&2
        _fail "$label: pyep launch without torch: expected exit 1 and 'needs PyTorch', got exit $rc"
    fi
    _log "ok: $label-launch-without-torch (exit 1, names PyTorch)"
done
_log "PASS"
