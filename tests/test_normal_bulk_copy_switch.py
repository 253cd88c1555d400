"""PYEP_NORMAL_TMA (native_state.bulk_copy_flags): which row copies of the intranode normal kernels go by
the SM's bulk copy engine. The flags must be those of normal_tma.cuh (kTmaLocal = 1, kTmaPeer = 2)."""
from __future__ import annotations

import os
import re
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_settings(monkeypatch: Any) -> None:
    from pyep.ep.normal.native_state import TMA_LOCAL, TMA_PEER, bulk_copy_flags
    monkeypatch.delenv("PYEP_NORMAL_TMA", raising=False)
    assert bulk_copy_flags() == TMA_LOCAL | TMA_PEER
    for value, want in (("1", TMA_LOCAL | TMA_PEER), ("0", 0), ("local", TMA_LOCAL), ("peer", TMA_PEER)):
        monkeypatch.setenv("PYEP_NORMAL_TMA", value)
        assert bulk_copy_flags() == want, value
    for bad in ("", "2", "yes", "Local", " 1"):
        monkeypatch.setenv("PYEP_NORMAL_TMA", bad)
        with pytest.raises(ValueError, match="PYEP_NORMAL_TMA must be one of"):
            bulk_copy_flags()


def test_flags_match_the_kernels() -> None:
    from pyep.ep.normal.native_state import TMA_LOCAL, TMA_PEER
    with open(os.path.join(ROOT, "engine", "kernels", "normal_tma.cuh")) as f:
        src = f.read()
    got = {m.group(1): int(m.group(2)) for m in re.finditer(r"constexpr int (kTma(?:Local|Peer)) = (\d+);", src)}
    assert got == {"kTmaLocal": TMA_LOCAL, "kTmaPeer": TMA_PEER}
