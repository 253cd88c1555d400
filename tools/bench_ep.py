#!/usr/bin/env python3
"""`python tools/bench_ep.py ARGS` is `python -m pyep bench ARGS`, runnable from a checkout that was
not installed (torchrun --nproc-per-node 8 tools/bench_ep.py ...)."""
from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from pyep.cli.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
