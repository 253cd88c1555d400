"""CPU tests of tools/dev/normal_b2b_probe.py's trace arithmetic (the GPU runs are in
docs/results/2026-11-26c-h200x1/probe/): per-kernel statistics and the stream's idle time per call."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "dev", "normal_b2b_probe.py")


def _tool() -> Any:
    spec = importlib.util.spec_from_file_location("normal_b2b_probe", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernel_split_counts_busy_and_idle_time(tmp_path: Any) -> None:
    ev = []
    t = 1000.0
    for _ in range(3):   # per call: gate 10 us, gap 5, dispatch 100 us, gap 15
        ev.append({"ph": "X", "cat": "kernel", "name": "notify_kernel(a)", "ts": t, "dur": 10.0})
        ev.append({"ph": "X", "cat": "kernel", "name": "dispatch(b)", "ts": t + 15, "dur": 100.0})
        t += 130
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 0.0, "dur": 1e6})   # not a kernel
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    out = _tool()._kernel_split(str(path), 3)
    assert out["kernels"]["dispatch(b)"]["count"] == 3
    assert out["kernels"]["dispatch(b)"]["median_us"] == 100.0
    assert out["busy_us_per_call"] == 110.0
    # span: first start to last end = 2 * 130 + 115; idle = span - busy, per call
    assert abs(out["idle_us_per_call"] - ((2 * 130 + 115) - 330) / 3) < 1e-9


def test_main_kernel_adds_a_one_copy_dispatch_s_two_kernels() -> None:
    tool = _tool()
    stat = lambda us: {"count": 3, "mean_us": us, "median_us": us, "min_us": us - 1, "max_us": us + 1}  # noqa: E731
    one_copy = {"kernels": {"ns::dispatch_one_copy(S, A)": stat(90.0), "ns::dispatch(S, A)": stat(3.0),
                            "ns::notify_kernel(S)": stat(10.0), "sleep": stat(300.0)}}
    m = tool.main_kernel(one_copy)
    assert m["median_us"] == 93.0 and m["min_us"] == 91.0 and m["count"] == 3
    ring = {"kernels": {"ns::dispatch(S, A)": stat(120.0), "ns::notify_kernel(S)": stat(10.0)}}
    assert tool.main_kernel(ring)["median_us"] == 120.0
    assert tool.main_kernel({"kernels": {"sleep": stat(300.0)}}) is None


def test_help_runs_without_a_gpu() -> None:
    r = subprocess.run([sys.executable, TOOL, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--modes" in r.stdout and "combine" in r.stdout
