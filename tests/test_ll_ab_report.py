"""tools/ll_ab_report.py: the figures it reads from DeepEP's test_low_latency.py logs, and what it says
when a side is missing."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ll_ab_report", ROOT / "tools" / "ll_ab_report.py")
report = importlib.util.module_from_spec(spec)
assert spec.loader is not None
spec.loader.exec_module(report)


def _log(d_us: float, c_us: float, e_us: float) -> str:
    return "\n".join([
        "Allocating buffer size: 179.3 MB ...",
        f"[rank 0] Dispatch + combine bandwidth: 264.67 GB/s, avg_t={e_us} us, min_t=1.0 us, max_t=2.0 us",
        f"[rank 1] Dispatch + combine bandwidth: 265.02 GB/s, avg_t={e_us + 2} us, min_t=1.0 us, max_t=2.0 us",
        f"[rank 0] Dispatch bandwidth: 216.82 GB/s, avg_t={d_us} us | Combine bandwidth: 436.21 GB/s, avg_t={c_us} us",
        f"[rank 1] Dispatch bandwidth: 216.82 GB/s, avg_t={d_us + 2} us | Combine bandwidth: 4.2 GB/s, avg_t={c_us} us",
        "[rank 0] Dispatch send/recv time: 37.38 + 29.43 us | Combine send/recv time: 27.63 + 31.71 us",
    ])


def test_parse_and_ratio(tmp_path: Path) -> None:
    for side, scale in (("base", 1.0), ("new", 0.5)):
        p = tmp_path / side / "T128"
        p.mkdir(parents=True)
        (p / "pyep_ll_2.log").write_text(_log(40 * scale, 30 * scale, 80 * scale))
    (tmp_path / "base" / "T1").mkdir()
    assert report.main([str(tmp_path), "--baseline", "b0", "--current", "c1"]) == 1   # T=1 incomplete
    doc = json.loads((tmp_path / "ll_ab.json").read_text())
    row = [r for r in doc["rows"] if r["tokens"] == 128][0]
    assert row["base"]["dispatch_us"] == {"0": 40.0, "1": 42.0}
    assert row["new"]["combine_us"] == {"0": 15.0, "1": 15.0}
    assert row["new"]["eager_us"] == {"0": 40.0, "1": 42.0}
    text = (tmp_path / "ll_ab.txt").read_text()
    assert "no figures from base and new" in text
    t128 = [line for line in text.splitlines() if line.strip().startswith("128")][0]
    assert "40.0 / 20.0" in t128 and "0.50" in t128       # least over ranks; ratio new / base


def test_a_log_without_kernel_lines_is_not_a_figure(tmp_path: Path) -> None:
    for side in ("base", "new"):
        p = tmp_path / side / "T32"
        p.mkdir(parents=True)
        (p / "pyep_ll_2.log").write_text(_log(10, 10, 20) if side == "base" else "Traceback: boom\n")
    assert report.main([str(tmp_path)]) == 1
    assert "no figures from new" in (tmp_path / "ll_ab.txt").read_text()


def test_hook_halves_table_and_placement(tmp_path: Path) -> None:
    """The hook halves (send / receive launched apart) get their own table, least over ranks, and the
    title says where the ranks ran; a log without the halves line still gives the main table."""
    halves = {"base": "[rank 0] Dispatch send/recv time: 24.0 + 16.0 us | Combine send/recv time: 28.0 + 20.0 us",
              "new": "[rank 0] Dispatch send/recv time: 24.0 + 8.0 us | Combine send/recv time: 28.0 + 10.0 us"}
    for side in ("base", "new"):
        p = tmp_path / side / "T128"
        p.mkdir(parents=True)
        body = "\n".join(line for line in _log(40, 30, 80).splitlines() if "send/recv" not in line)
        (p / "pyep_ll_2.log").write_text(body + "\n" + halves[side] + "\n")
    assert report.main([str(tmp_path), "--where", "2 ranks, one a GPU"]) == 0
    text = (tmp_path / "ll_ab.txt").read_text()
    assert "2 ranks, one a GPU" in text.splitlines()[0]
    sub = text.split("hook halves", 1)[1]
    row = [line for line in sub.splitlines() if line.strip().startswith("128")][0]
    assert "16.0 / 8.0" in row and "20.0 / 10.0" in row and "0.50" in row
    assert max(len(line) for line in text.splitlines()) <= 120
    doc = json.loads((tmp_path / "ll_ab.json").read_text())
    assert doc["where"] == "2 ranks, one a GPU" and doc["rows"][0]["new"]["dispatch_recv_us"] == {"0": 8.0}
    (tmp_path / "base" / "T128" / "pyep_ll_2.log").write_text(_log(40, 30, 80).split("\n[rank 0] Dispatch send")[0])
    assert report.main([str(tmp_path)]) == 0
    assert "hook halves" not in (tmp_path / "ll_ab.txt").read_text()


def test_repeats_keep_the_least_and_every_run(tmp_path: Path) -> None:
    """LL_AB_REPEAT: run<k> folders per side and T; each cell is the least over ranks and runs (a run
    whose kernels doubled while the ranks waited for each other does not set it), a failed run is
    skipped, every complete run is in the JSON, and two ranks' lines sharing one line both count."""
    runs = {"base": [(40, 30, 80), (42, 31, 85)], "new": [(60, 50, 90), (20, 15, 40), None]}
    for side, figs in runs.items():
        for k, f in enumerate(figs, 1):
            p = tmp_path / side / "T32" / f"run{k}"
            p.mkdir(parents=True)
            (p / "pyep_ll_2.log").write_text(_log(*f) if f else "Traceback: boom\n")
    assert report.main([str(tmp_path)]) == 0
    text = (tmp_path / "ll_ab.txt").read_text()
    row = [line for line in text.splitlines() if line.strip().startswith("32")][0]
    assert "40.0 / 20.0" in row and "30.0 / 15.0" in row and "0.50" in row
    assert "2-2 run(s)" not in text and "2 run(s) per cell" in text
    doc = json.loads((tmp_path / "ll_ab.json").read_text())
    assert len(doc["rows"][0]["new_runs"]) == 2 and doc["rows"][0]["new"]["dispatch_us"] == {"0": 20.0, "1": 22.0}
    spread = text.split("every sample", 1)[1]
    row = [line for line in spread.splitlines() if line.strip().startswith("32")][0]
    assert "80.0 - 87.0" in row and "40.0 - 92.0" in row        # base (80, 82, 85, 87), new (90, 92, 40, 42)
    assert max(len(line) for line in text.splitlines()) <= 120
    joined = report.parse_log("[rank 1] Dispatch + combine bandwidth: 1.0 GB/s, avg_t=84.35 us, min_t=1 us"
                              "[rank 0] Dispatch + combine bandwidth: 1.0 GB/s, avg_t=83.06 us, min_t=1 us\n")
    assert joined["eager_us"] == {1: 84.35, 0: 83.06}
