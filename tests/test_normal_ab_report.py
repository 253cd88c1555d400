"""tools/normal_ab_report.py: the figures it takes from normal_b2b_probe.py's JSON (least over ranks and
runs, the dispatch / combine kernel and not the gate's or the sleep's), and what it says when a side is
missing; tools/normal_ab.sh's argument checks."""
from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("normal_ab_report", ROOT / "tools" / "normal_ab_report.py")
report = importlib.util.module_from_spec(spec)
assert spec.loader is not None
spec.loader.exec_module(report)

DISPATCH = "pyep::normal::(anonymous namespace)::dispatch(pyep::normal::NormalStatic, pyep::normal::Di"
NOTIFY = "pyep::normal::(anonymous namespace)::normal_notify_kernel(pyep::normal::NormalStatic, pyep"
SLEEP = "at::cuda::(anonymous namespace)::spin_kernel(long)"


def _kernel(median: float, mean: float) -> Dict[str, float]:
    return {"count": 20, "mean_us": mean, "median_us": median, "min_us": median - 1, "max_us": median + 50}


def _rank(rank: int, event: float, kernel: float, gbps: float) -> dict:
    gap = {"event_us_mean": event, "event_us_min": event - 2, "gbps": 1.0, "host_us_mean": 90.0,
           "trace": {"kernels": {SLEEP: _kernel(258.0, 258.0), NOTIFY: _kernel(10.0, 900.0),
                                 DISPATCH: _kernel(kernel, kernel + 3)},
                     "busy_us_per_call": 1.0, "span_us_per_call": 1.0, "idle_us_per_call": 0.0}}
    b2b = {"event_us_mean": event + 40, "event_us_min": event, "gbps": gbps, "host_us_mean": 95.0,
           "trace": {"kernels": {}, "busy_us_per_call": 1.0, "span_us_per_call": 1.0, "idle_us_per_call": 0.0}}
    return {"rank": rank, "recv_rows": 8160, "variants": {"bf16": {"gap": gap, "b2b": b2b}}}


def _write(out: Path, side: str, cfg: str, run: int, ranks: list) -> None:
    d = out / side / cfg / f"run{run}"
    d.mkdir(parents=True)
    (d / "probe.json").write_text(json.dumps({"library": "pyep shim", "args": {}, "ranks": ranks}))


def test_least_over_ranks_and_runs_and_ratio(tmp_path: Path) -> None:
    _write(tmp_path, "base", "r2s24", 1, [_rank(0, 160.0, 146.0, 600.0), _rank(1, 161.0, 144.0, 590.0)])
    _write(tmp_path, "base", "r2s24", 2, [_rank(0, 158.0, 147.0, 610.0), _rank(1, 170.0, 150.0, 500.0)])
    _write(tmp_path, "new", "r2s24", 1, [_rank(0, 145.0, 129.0, 700.0), _rank(1, 144.0, 128.0, 720.0)])
    assert report.main([str(tmp_path), "--baseline", "b0", "--current", "c1"]) == 0
    doc = json.loads((tmp_path / "normal_ab.json").read_text())
    row = doc["rows"][0]
    assert (row["ranks"], row["sms"]) == (2, 24)
    # the dispatch kernel's median, not the notify kernel's (more total time) or the sleep's
    assert row["base"]["bf16"] == {"event_us": 158.0, "kernel_us": 144.0, "b2b_gbps": 610.0}
    assert row["new"]["bf16"] == {"event_us": 144.0, "kernel_us": 128.0, "b2b_gbps": 720.0}
    assert len(row["base_runs"]) == 2
    line = [x for x in (tmp_path / "normal_ab.txt").read_text().splitlines() if "bf16" in x][0]
    assert "158.0 / 144.0" in line and "0.91" in line and "144.0 / 128.0" in line and "1.18" in line
    assert max(len(x) for x in (tmp_path / "normal_ab.txt").read_text().splitlines()) <= 120


def test_a_missing_side_is_named_not_guessed(tmp_path: Path) -> None:
    _write(tmp_path, "base", "r4s6", 1, [_rank(0, 600.0, 580.0, 170.0)])
    (tmp_path / "new" / "r4s6" / "run1").mkdir(parents=True)
    (tmp_path / "new" / "r4s6" / "run1" / "probe.json").write_text("{\"ranks\": [")   # died mid-write
    assert report.main([str(tmp_path)]) == 1
    assert "no figures from new" in (tmp_path / "normal_ab.txt").read_text()


def test_no_configuration_folders(tmp_path: Path) -> None:
    assert report.main([str(tmp_path)]) == 2


def test_script_refuses_bad_arguments_before_running_anything() -> None:
    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(ROOT / "tools" / "normal_ab.sh"), *args], capture_output=True,
                              text=True, timeout=60, env={"PATH": "/usr/bin:/bin", **env})
    r = run("run", "no-such-rev-here")
    assert r.returncode == 2 and "normal_ab.sh prepare no-such-rev-here" in r.stdout
    r = run("frobnicate", "x")
    assert r.returncode == 2 and "usage" in r.stdout
