"""CPU tests of what `pyep bench --mode normal` reports: the tables (within 120 columns) and JSON with
the SM sweep beside DeepEP's harness and pyep's shim under it, the copy rate and its share (ranks on
one device only), the PNG's ratio panel, and tools/deepep_baseline.py running either library and
reading its full log. Rows come from tests/test_bench_normal.py's helpers."""
from __future__ import annotations

import json
import math
import os
from typing import Any, List

import pytest
import torch
from rich.console import Console
from test_bench_normal import INTRANODE_LOG, _row

from pyep.bench import deepep_run as dr
from pyep.bench import normal_report as nr
from pyep.bench.guard import CheckResult
from pyep.bench.normal import NormalBenchConfig, NormalRow
from pyep.bench.report import write_json


def test_baseline_reads_the_full_log_of_either_library(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A stand-in deepep_v1.sh that behaves like the real one: full log in $OUT/<on>_<mode>_<n>.log,
    stdout grepped down to the Best lines, the MPS line when it starts the daemon. The sweeps and the
    layout time come from the full log; DEEPEP_ON reaches the script."""
    tool = dr.load_baseline_tool()
    (tmp_path / ".anchors" / "deepep" / "csrc").mkdir(parents=True)
    (tmp_path / "log.txt").write_text(INTRANODE_LOG)
    (tmp_path / ".anchors" / "deepep_v1.sh").write_text(
        'echo "(ranks share 1 GPU(s); MPS daemon started)"\n'
        f'cp {tmp_path / "log.txt"} "$OUT/${{DEEPEP_ON}}_$1_$2.log"\n'
        f'grep Best {tmp_path / "log.txt"}\n')
    for on in ("deepep", "pyep"):
        doc = tool.run("intranode", 2, root=str(tmp_path), out_dir=str(tmp_path / on), on=on)
        assert doc["ok"] and doc["rc"] == 0 and doc["on"] == on and doc["mps_started"]
        assert doc["log"] == str(tmp_path / on / f"{on}_intranode_2.log")
        f = doc["figures"]
        assert len(f["sweeps"]["dispatch_fp8"]) == 3 and f["layout_us"] == pytest.approx(52.0)
        assert ("shim" in doc["source"]) == (on == "pyep")
    with pytest.raises(ValueError, match="on must be one of"):
        tool.run("intranode", 2, root=str(tmp_path), on="nccl")


def test_baseline_refuses_visible_gpus_its_runner_would_not_share(  # type: ignore[no-untyped-def]
        tmp_path, monkeypatch) -> None:
    """CUDA_VISIBLE_DEVICES=0 on a 2-GPU machine, 2 ranks: a runner that counts nvidia-smi's GPUs would
    give rank 1 a GPU it cannot see; the tool says so before running. A runner that follows the variable,
    enough visible GPUs, or a machine with no more GPUs than visible ones: it runs."""
    import pyep.config.host as host
    tool = dr.load_baseline_tool()
    (tmp_path / ".anchors" / "deepep" / "csrc").mkdir(parents=True)
    (tmp_path / "log.txt").write_text(INTRANODE_LOG)
    script = tmp_path / ".anchors" / "deepep_v1.sh"
    body = f'cp {tmp_path / "log.txt"} "$OUT/${{DEEPEP_ON}}_$1_$2.log"\n'
    script.write_text('ngpu=$(nvidia-smi -L | wc -l)\n' + body)
    monkeypatch.setattr(host, "count_gpus", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(tool.DeepEpUnavailable, match=r"CUDA_VISIBLE_DEVICES=0 leaves 1 of this machine's 2 GPUs"):
        tool.run("intranode", 2, root=str(tmp_path), out_dir=str(tmp_path / "a"))
    assert tool.run("intranode", 1, root=str(tmp_path), out_dir=str(tmp_path / "b"))["ok"]
    monkeypatch.setattr(host, "count_gpus", lambda: 1)
    assert tool.run("intranode", 2, root=str(tmp_path), out_dir=str(tmp_path / "c"))["ok"]
    monkeypatch.setattr(host, "count_gpus", lambda: 2)
    script.write_text('[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && ngpu=1\n' + body)
    assert tool.run("intranode", 2, root=str(tmp_path), out_dir=str(tmp_path / "d"))["ok"]


# ---------------------------------------------------------------------- tables, JSON and the plot
def _shared_env(world: int, mps: bool = True) -> dict:
    from pyep.bench.sharing import MpsStatus, Sharing
    sh = Sharing(True, ["NVIDIA H100 80GB HBM3"] * world, ["host/GPU-0"] * world, 132, MpsStatus(mps, "fake"),
                 "the benchmark's collectives go over gloo, CUDA tensors staged through host memory")
    return {"world_size": world, "device_names": sh.device_names, "dist_backend": "gloo", "where": sh.where(),
            "sharing": sh.as_dict(), "sharing_notes": sh.header_notes()}


def test_render_and_document(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from test_bench_report import assert_fits

    from pyep.bench.copy_rate import CopyRate
    cfg = NormalBenchConfig(num_sms=(20, 24))
    env = _shared_env(2)
    rows = [_row({"cached_bf16": 200.0}, [8000, 8000]),
            NormalRow("native", 24, 4096, 7168, "uniform", check=CheckResult(False, "recv_x [bad]"),
                      recv_tokens=[8000, 8000], kernel_source="not timed (guard failed)"),
            NormalRow("reference", 24, 4096, 7168, "uniform", skipped="BackendUnavailable: no")]
    tool = dr.load_baseline_tool()
    deepep = {"ok": True, "figures": tool.parse_intranode(INTRANODE_LOG)}
    shim = {"ok": True, "figures": tool.parse_intranode(INTRANODE_LOG.replace("340.00 GB/s", "510.00 GB/s"))}
    copy = CopyRate("cuda", "device-to-device copy in GPU memory", 256 << 20, 10, 3000.0, 2900.0)
    console = Console(record=True, width=120, file=open(os.devnull, "w"))
    nr.render(console, cfg, env, rows, ["a note"], deepep, copy, shim)
    text = console.export_text()
    assert_fits(text)
    flat = " ".join(text.split())
    assert "PASS" in text and "FAIL" in text and "not timed" in text and "skipped: reference 24 SMs: Backend" in flat
    assert "recv_x [bad]" in text                     # markup in details is escaped, not eaten
    assert "1093.4 / 247" in text and "1764.7 / 289" in text and "DeepEP default cfg" in text
    assert "best NVL chunks: dispatch_fp8 c20, dispatch_bf16 c8, combine c7" in flat
    assert "200.0 / 573" in text                      # 8000 x 14336 B in 200 us
    assert "2 ranks sharing one NVIDIA H100 80GB HBM3 (MPS)" in flat and "a proxy for NVLink" in flat
    assert "copy rate: 3000 GB/s (best of 10; median 2900)" in flat
    # The sweep: 573 GB/s BF16 over DeepEP's best 340 (1.69x); x 2 ranks x 2 / 3000 GB/s (76%).
    sweep_line = next(ln for ln in text.splitlines() if ln.startswith("pyep native"))
    assert "/ 573 /" in sweep_line and "1.69x" in sweep_line and "76%" in sweep_line
    shim_line = next(ln for ln in text.splitlines() if ln.startswith("pyep via DeepEP's test"))
    assert "/ 510 /" in shim_line and "1.50x" in shim_line and "68%" in shim_line
    doc = nr.document(cfg, env, rows, ["a note"], deepep, copy, shim)
    path = tmp_path / "b.json"
    write_json(str(path), doc)
    back = json.loads(path.read_text())
    assert back["schema"] == "pyep-bench-normal/2" and back["config"]["routing"] == "uniform"
    r0 = back["rows"][0]
    assert r0["bytes_per_rank"]["cached_bf16"] == [8000 * 14336] * 2
    assert r0["gbps"]["wall"]["cached_bf16"] == pytest.approx(8000 * 14336 / 200e-6 / 1e9)
    assert r0["wall_us"]["cached_bf16"]["mean"] == 200.0 and r0["check"]["status"] == "PASS"
    assert back["rows"][1]["check"]["status"] == "FAIL" and back["rows"][2]["skipped"].startswith("Backend")
    assert back["deepep"]["figures"]["dispatch_fp8"]["gbps"] == 247.12
    assert back["copy_rate"]["best_gbps"] == 3000.0 and "2 x copied bytes" in back["copy_rate"]["counting"]
    assert back["environment"]["sharing"]["mps"]["on"] is True and back["environment"]["sharing"]["shared_gpu"]
    pyep_e, shim_e, deepep_e = back["sweep"]["entries"]
    assert pyep_e["num_sms"] == 24 and pyep_e["vs_deepep"]["dispatch_bf16"] == pytest.approx(573.44 / 340, rel=1e-3)
    assert pyep_e["of_copy_rate"]["dispatch_bf16"] == pytest.approx(573.44 * 2 * 2 / 3000, rel=1e-3)
    assert shim_e["label"] == "pyep via DeepEP's test" and deepep_e["vs_deepep"]["combine"] == 1.0
    assert back["deepep_harness_on_pyep"]["figures"]["dispatch_bf16"]["gbps"] == 510.0


def test_copy_fraction_only_for_ranks_on_one_device() -> None:
    from pyep.bench import copy_rate
    from pyep.bench.sharing import Sharing
    rate = copy_rate.CopyRate("cuda", "x", 1 << 20, 3, 2000.0, 1900.0)
    assert copy_rate.fraction(400.0, 2, rate) == pytest.approx(0.8)
    assert math.isnan(copy_rate.fraction(math.nan, 2, rate)) and math.isnan(copy_rate.fraction(1.0, 2, None))
    rows = [_row({"cached_bf16": 200.0}, [8000, 8000])]
    (one,) = nr.sweep(rows, 2, copy=rate, one_device=True)
    (two,) = nr.sweep(rows, 2, copy=rate, one_device=False)
    assert one["of_copy_rate"]["dispatch_bf16"] > 0 and math.isnan(two["of_copy_rate"]["dispatch_bf16"])
    nvlink = Sharing(True, ["NVIDIA H200"] * 2, ["h/a", "h/b"], 132)
    env = {"world_size": 2, "device_names": nvlink.device_names, "dist_backend": "nccl", "where": nvlink.where(),
           "sharing": nvlink.as_dict()}
    console = Console(record=True, width=120, file=open(os.devnull, "w"))
    nr.render(console, NormalBenchConfig(), env, rows, [], None, rate)
    flat = " ".join(console.export_text().split())
    assert "2 ranks on 2 NVIDIA H200" in flat and "only for ranks on one device" in flat
    assert "x DeepEP best" not in flat                 # no DeepEP figures: no ratio column


def test_measured_copy_rate_on_the_cpu() -> None:
    from pyep.bench import copy_rate
    waits: List[str] = []
    rate = copy_rate.measure(torch.device("cpu"), 2, waits.append, reps=3, warmup=1)
    assert rate.device == "cpu" and rate.bytes == 2 << 20 and rate.reps == 3
    assert rate.best_gbps >= rate.median_gbps > 0 and "host memory" in rate.what and waits
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="copy size"):
            copy_rate.measure(torch.device("cpu"), bad, waits.append)   # type: ignore[arg-type]


def test_normal_plot_has_a_ratio_panel_beside_deepep(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    from pyep.bench import normal_plot
    rows = [_row({"cached_bf16": 200.0}, [8000, 8000])]
    for n, r in zip((4, 24), (rows[0], _row({"cached_bf16": 150.0}, [8000, 8000]))):
        r.num_sms = n
        if r is not rows[0]:
            rows.append(r)
    deepep = {"figures": dr.load_baseline_tool().parse_intranode(INTRANODE_LOG)}
    drawn: List[Any] = []
    real = normal_plot._ratio_panel
    normal_plot._ratio_panel = lambda ax, rs, figs: (drawn.append((rs, figs)), real(ax, rs, figs))  # type: ignore
    try:
        path = normal_plot.plot(str(tmp_path / "n.png"), rows, deepep, "t")
        assert path and (tmp_path / "n.png").stat().st_size > 5000 and len(drawn) == 1
        assert normal_plot.plot(str(tmp_path / "m.png"), rows, None, "t") and len(drawn) == 1   # no DeepEP: no panel
    finally:
        normal_plot._ratio_panel = real   # type: ignore[assignment]
