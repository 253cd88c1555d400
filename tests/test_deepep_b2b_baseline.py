"""DeepEP's bench() loop as the normal-mode baseline where DeepEP's own test cannot run (issue 23: its 24
SMs per rank do not fit 8 ranks on one GPU): tools/deepep_baseline.py run_b2b and figures_from_probe,
and pyep bench's choice of the SM count (pyep/bench/deepep_run.py deepep_b2b_sms). CPU only: the probe itself runs
on the GPU (docs/results/2026-11-26c-h200x1/probe/)."""
from __future__ import annotations

import json
import os
import subprocess
from typing import Any, List

import pytest

from pyep.bench import deepep_run as dr
from pyep.bench.deepep_run import deepep_b2b_sms
from pyep.bench.sharing import MpsStatus, Sharing


def _probe_doc(recv_rows: int = 14000, hidden: int = 7168) -> dict:
    variants = {"fp8_colmajor": {"b2b": {"event_us_mean": 500.0, "gbps": 105.0}},
                "bf16": {"b2b": {"event_us_mean": 1000.0, "gbps": 200.0}},
                "combine": {"b2b": {"event_us_mean": 800.0, "gbps": 250.0}}}
    return {"library": "DeepEP", "args": {"num_tokens": 4096, "hidden": hidden, "num_topk": 8},
            "ranks": [{"rank": 1, "recv_rows": 1, "variants": {}},
                      {"rank": 0, "recv_rows": recv_rows, "variants": variants}]}


def test_figures_from_probe_take_rank_zeros_figures() -> None:
    tool = dr.load_baseline_tool()
    f = tool.figures_from_probe(_probe_doc(), 16, 8)
    assert f["dispatch_fp8"] == {"num_sms": 16, "nvl_chunk": 8, "gbps": 105.0, "t_us": 500.0}
    assert (f["dispatch_bf16"]["gbps"], f["combine"]["t_us"]) == (200.0, 800.0)
    assert tool.has_figures("intranode", f)
    doc = _probe_doc()
    del doc["ranks"][1]["variants"]["combine"]          # rank 0's entry (the list's second)
    assert not tool.has_figures("intranode", tool.figures_from_probe(doc, 16, 8))   # a kind missing: no figures


def test_run_b2b_runs_the_probe_on_the_shim(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = dr.load_baseline_tool()
    root = tmp_path / "root"
    (root / ".anchors" / "deepep" / "csrc").mkdir(parents=True)
    (root / ".anchors" / "deepep_v1.sh").write_text("#!/bin/bash\n")
    seen: List[Any] = []

    def fake_run(cmd: List[str], **kw: Any) -> Any:
        seen.append((cmd, kw["env"]))
        js = cmd[cmd.index("--json") + 1]
        with open(js, "w") as fh:
            json.dump(_probe_doc(), fh)
        return subprocess.CompletedProcess(cmd, 0, "GB/s per rank ...", "")
    monkeypatch.setattr(tool.subprocess, "run", fake_run)
    doc = tool.run_b2b(8, 16, ["--num-tokens", "4096", "--hidden", "7168"], str(tmp_path / "out"), root=str(root),
                       on="pyep")
    assert doc["ok"] and doc["harness"] == "b2b" and doc["label"] == "pyep shim (DeepEP's bench() loop)"
    cmd, env = seen[0]                                  # no DeepEP build for the shim
    assert cmd[cmd.index("--ranks") + 1] == "8" and cmd[cmd.index("--sms") + 1] == "16"
    assert env["ONEGPU"] == "1" and env["PYTHONPATH"].split(os.pathsep)[0].endswith(os.path.join(".anchors", "onegpu"))
    shim = tmp_path / "out" / "shim" / "deep_ep" / "__init__.py"
    assert "pyep.compat.deep_ep" in shim.read_text()
    assert doc["figures"]["dispatch_fp8"]["num_sms"] == 16


def test_b2b_sms_only_where_deepeps_test_does_not_fit() -> None:
    def sharing(ranks: int, gpus: int = 1, sms: int = 132, cuda: bool = True) -> Sharing:
        return Sharing(cuda, ["GPU"] * ranks, [f"h/gpu{r % gpus}" for r in range(ranks)], sms, MpsStatus(True, "fake"))
    sweep = (4, 6, 8, 12, 16, 24)
    assert deepep_b2b_sms(sharing(8), sweep) == 16          # 8 x 24 = 192 > 132: the largest that fits
    assert deepep_b2b_sms(sharing(4), sweep) is None        # 4 x 24 = 96 fits: DeepEP's own test runs
    assert deepep_b2b_sms(sharing(8, gpus=8), sweep) is None  # one rank per GPU
    assert deepep_b2b_sms(sharing(8, cuda=False), sweep) is None
    assert deepep_b2b_sms(sharing(8), (24,)) is None        # nothing of the sweep fits
