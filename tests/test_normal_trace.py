"""The combine trace's host side (pyep/ep/normal/trace.py) and tools/dev/normal_combine_trace.py's
report, on made-up trace words; the kernel side runs in the CPU simulation (test_normal_sim.py,
case combine_trace)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
from typing import Any, List

import pytest

from pyep.ep.normal import trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
U64 = (1 << 64) - 1


def _words(role: int, start: int, end: int, wait: int, work: int, sync: int, items: int, warps: int) -> List[int]:
    # As the kernel leaves them in an int64 tensor: the start complemented (then read as signed).
    comp = U64 - start
    return [comp - (1 << 64) if comp >= 1 << 63 else comp, end, wait, work, sync, items, warps, role]


def test_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(trace.ENV, raising=False)
    assert trace.trace_enabled() is False
    monkeypatch.setenv(trace.ENV, "1")
    assert trace.trace_enabled() is True
    for bad in ("2", "yes", ""):
        monkeypatch.setenv(trace.ENV, bad)
        with pytest.raises(ValueError, match=trace.ENV):
            trace.trace_enabled()


def test_decode_and_summarize() -> None:
    rows = [_words(1, 1_000, 5_000, 8_000, 4_000, 4_000, 40, 4),
            _words(2, 1_100, 6_000, 2_000, 15_000, 3_000, 30, 4),
            [0] * trace.TRACE_WORDS,                            # a block that recorded nothing
            _words(2, 900, 4_900, 1_000, 12_000, 3_000, 20, 4)]
    blocks = trace.decode(rows, 4)
    assert [(b.block, b.role) for b in blocks] == [(0, "send"), (1, "reduce"), (3, "reduce")]
    assert blocks[0].start_ns == 1_000 and blocks[0].duration_ns == 4_000
    s = trace.summarize(blocks)
    assert s["send"]["blocks"] == 1 and s["send"]["wait"] == pytest.approx(0.5)
    assert s["reduce"]["items"] == 50 and s["reduce"]["mean_us"] == pytest.approx(4.45)
    assert s["reduce"]["work"] == pytest.approx(27_000 / 36_000)
    with pytest.raises(ValueError, match="trace words"):
        trace.decode([[1, 2, 3]], 1)


def test_tool_report(tmp_path: Any, capsys: pytest.CaptureFixture) -> None:
    spec = importlib.util.spec_from_file_location("normal_combine_trace",
                                                  os.path.join(ROOT, "tools", "dev", "normal_combine_trace.py"))
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    def call(offset: int) -> List[dict]:
        return [vars(b) for b in trace.decode([_words(1, offset, offset + 300_000, 900_000, 200_000, 100_000, 50, 4),
                                               _words(2, offset + 10, offset + 310_000, 100_000, 1_000_000, 100_000,
                                                      60, 4)], 2)]
    ranks = [{"rank": r, "recv_rows": 100, "calls": [call(1_000 * r), call(1_000 * r + 5)]} for r in range(2)]
    args = argparse.Namespace(num_tokens=4096, hidden=7168, num_topk=8, num_experts=256, sms=24, chunk=8, ring=256,
                              calls=2, json=str(tmp_path / "t.json"))
    tool._report(ranks, args)
    out = capsys.readouterr().out
    assert "start skew between the ranks' kernels: median 1.0 us" in out
    assert max(len(line) for line in out.splitlines()) <= 120, out
    assert "   1 reduce       1     310.0    310.0     310.0      60     8%    83%     8%" in out, out
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["ranks"][1]["roles"]["send"]["wait"] == pytest.approx(0.75)
