"""tools/side_by_side.py on CPU: the alternating runs (the shim's settings set for its runs only), the
best-of-runs table and its ratios, from DeepEP test logs of docs/results/2026-11-27b-x4 fed through
tools/deepep_baseline.py's parsers in place of the GPU runs."""
from __future__ import annotations

import importlib.util
import json
import os
from typing import Any, Dict, List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results", "2026-11-27b-x4")


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _text(name: str) -> str:
    with open(os.path.join(RESULTS, name)) as fh:
        return fh.read()


def test_intranode_table_and_env(tmp_path: Any, monkeypatch: Any) -> None:
    sbs, base = _load("side_by_side"), _load("deepep_baseline")
    logs = {"deepep": _text("run5-deepep_intranode_4.log"), "pyep": _text("run3-pyep_intranode_4-direct0.log")}
    monkeypatch.delenv("PYEP_NORMAL_TMA", raising=False)
    seen: List[Any] = []

    def runner(mode: str, n: int, extra: Any, out_dir: str, on: str) -> Dict[str, Any]:
        seen.append((on, n, os.environ.get("PYEP_NORMAL_TMA")))
        return {"ok": True, "rc": 0, "figures": base.parse_intranode(logs[on])}
    runs = sbs.run_all("intranode", [4], 2, [], str(tmp_path), {"PYEP_NORMAL_TMA": "0/peer"}, runner=runner)
    assert seen == [("deepep", 4, None), ("pyep", 4, "0/peer")] * 2
    assert os.environ.get("PYEP_NORMAL_TMA") is None           # restored after the shim's runs
    rows = {r["figure"]: r for r in sbs.summarize("intranode", runs)}
    assert rows["fp8"]["deepep"] == pytest.approx(254.89) and rows["combine"]["deepep"] == pytest.approx(355.75)
    pyep = base.parse_intranode(logs["pyep"])
    assert rows["bf16"]["pyep"] == pytest.approx(pyep["dispatch_bf16"]["gbps"])
    assert rows["combine"]["ratio"] == pytest.approx(pyep["combine"]["gbps"] / 355.75)
    text = sbs.table("intranode", list(rows.values()))
    assert "combine GB/s" in text and f"{rows['combine']['ratio']:.2f}x" in text
    assert max(len(line) for line in text.splitlines()) <= 120


def test_ll_times_ratio_is_deepep_over_pyep(tmp_path: Any) -> None:
    sbs, base = _load("side_by_side"), _load("deepep_baseline")
    logs = {"deepep": _text("run4-ll_deepep_2.txt"), "pyep": _text("run4-ll_pyep_2.txt")}
    runs = sbs.run_all("ll", [2], 1, [], str(tmp_path), {},
                       runner=lambda mode, n, extra, out, on: {"ok": True, "rc": 0,
                                                               "figures": base.parse_ll(logs[on])})
    rows = {r["figure"]: r for r in sbs.summarize("ll", runs)}
    assert rows["dispatch"]["deepep"] == pytest.approx(30.69) and rows["dispatch"]["pyep"] == pytest.approx(36.79)
    assert rows["dispatch"]["ratio"] == pytest.approx(30.69 / 36.79)      # below 1: pyep slower
    assert rows["c_recv"]["pyep"] == pytest.approx(18.93) and rows["d+c"]["deepep"] == pytest.approx(71.88)


def test_a_failed_run_leaves_its_figures_out(tmp_path: Any) -> None:
    sbs, base = _load("side_by_side"), _load("deepep_baseline")
    text = _text("run5-deepep_intranode_4.log")

    def runner(mode: str, n: int, extra: Any, out: str, on: str) -> Dict[str, Any]:
        if on == "pyep":
            return {"ok": False, "rc": 1, "figures": {}}
        return {"ok": True, "rc": 0, "figures": base.parse_intranode(text)}
    runs = sbs.run_all("intranode", [4], 1, [], str(tmp_path), {}, runner=runner)
    rows = sbs.summarize("intranode", runs)
    assert all(r["pyep"] is None and r["ratio"] is None for r in rows)
    assert "-" in sbs.table("intranode", rows)
    json.dumps({"runs": runs, "rows": rows})      # the document is JSON as written
