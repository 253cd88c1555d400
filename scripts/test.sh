#!/usr/bin/env bash
# The test command (README, .ci/run): set up a fresh checkout, check that every CUDA source compiles
# for sm_90a, then run the test suite. Extra arguments go to pytest (e.g. `-m gpu` on a GPU machine).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
pyep_setup

tools/compile_cuda.sh

# A per-test bound (pytest-timeout) so that a hung test fails CI with a traceback instead of stalling it.
export PYTEST_TIMEOUT="${PYTEST_TIMEOUT:-900}"
exec "$PYTHON" -m pytest -q "$@"
