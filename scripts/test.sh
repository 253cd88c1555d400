#!/usr/bin/env bash
# The test command (README, .ci/run): set up a fresh checkout, check that every CUDA source compiles
# for sm_90a, check the package as a user installs it (scripts/check_install.sh; PYEP_SKIP_INSTALL_CHECK=1
# skips it), then run the test suite. Extra arguments go to pytest (e.g. `-m gpu` on a GPU machine).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
pyep_timed set-up pyep_setup

pyep_timed "CUDA compile check" tools/compile_cuda.sh
if [[ "${PYEP_SKIP_INSTALL_CHECK:-0}" != "1" ]]; then
    pyep_timed "install check" env PYTHON="$PYTHON" scripts/check_install.sh
fi
echo "[pyep test] $PYEP_TIMES; now the test suite"

# A per-test bound (pytest-timeout) so that a hung test fails CI with a traceback instead of stalling it.
export PYTEST_TIMEOUT="${PYTEST_TIMEOUT:-900}"
exec "$PYTHON" -m pytest -q "$@"
