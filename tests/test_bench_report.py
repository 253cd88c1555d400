"""What rank 0 shows: tables (with the DeepEP row only where it applies), the size hint line, the JSON
document and the plot, from synthetic results."""
from __future__ import annotations

import json
import math

import pytest
from rich.console import Console

from pyep.bench import report
from pyep.bench.config import BenchConfig, RoutingSpec
from pyep.bench.guard import CheckResult
from pyep.bench.metrics import summarize
from pyep.bench.runner import METRICS
from pyep.bench.suite import CaseRow

TIMES = {"dispatch": 30.0, "combine": 60.0, "dc": 100.0, "d_send": 24.0, "d_recv": 6.0, "c_send": 50.0,
         "c_recv": 9.0}


def _row(backend: str, tokens: int, passed: bool = True, scale: float = 1.0) -> CaseRow:
    # Two iterations per rank: t and 1.2 t, so mean = 1.1 t and p99 = 1.198 t.
    samples = {m: [[TIMES[m] * scale, TIMES[m] * scale * 1.2]] * 8 for m in METRICS}
    valid = tokens * 8
    return CaseRow(backend, "nvlink" if backend == "native" else "nccl", "uniform", tokens,
                   transport_detail="local x1, nvlink x7", check=CheckResult(passed, "detail [x]"),
                   num_valid=[valid] * 8, dispatch_bytes=[valid * 7408] * 8, combine_bytes=[valid * 14336] * 8,
                   wall={m: summarize(s) for m, s in samples.items()},
                   kernel={m: summarize(s) for m, s in samples.items()},
                   samples={"wall": samples, "kernel": samples}, kernel_source="kineto",
                   size_hint_bytes=1_234_567_890)


def _env(world: int, gpu: str) -> dict:
    return {"world_size": world, "device_names": [gpu] * world, "dist_backend": "nccl"}


def _render(cfg: BenchConfig, env: dict, rows) -> str:  # type: ignore[no-untyped-def]
    console = Console(record=True, width=260, file=open("/dev/null", "w"))
    report.render(console, cfg, env, rows, ["a note"])
    return console.export_text()


def test_tables_deepep_row_and_size_hint() -> None:
    cfg = BenchConfig()
    rows = [_row("native", 128), _row("reference", 128, scale=5.0)]
    text = _render(cfg, _env(8, "NVIDIA H200"), rows)
    assert "per-kernel GPU time (kineto)" in text and "CUDA events" in text
    assert text.count("DeepEP (measured separately, REFERENCE.md)") == 2     # kernel and wall tables
    assert "36-41" in text and "66-68" in text and "110.5" in text and "28-30 + 8" in text
    assert "33.0 (35.9)" in text and "26.4 + 6.6" in text
    assert "nvlink (local x1, nvlink x7)" in text                    # brackets are not markup
    assert "1234567890 bytes = 1.235 GB" in text and "DeepEP low-latency buffer for this shape: 2.147 GB" in text
    # GB/s of dispatch: 1024 entries * 7408 B / 33 us
    assert f"{1024 * 7408 / 33e-6 / 1e9:.0f} /" in text
    assert "note: a note" in text
    other = _render(cfg, _env(4, "NVIDIA H200"), rows)
    assert "DeepEP (measured" not in other
    h100 = _render(cfg, _env(8, "NVIDIA H100 80GB HBM3"), rows)
    assert "DeepEP (measured" not in h100


def test_failed_check_and_skipped_rows_are_visible() -> None:
    cfg = BenchConfig()
    rows = [_row("native", 128, passed=False),
            CaseRow("native", "ibgda", "uniform", 128, skipped="RuntimeError: no RDMA device [mlx5_0]")]
    text = _render(cfg, _env(2, "NVIDIA H200"), rows)
    assert "FAIL" in text and "correctness FAIL native/nvlink uniform T=128: detail [x]" in text
    assert "skipped" in text and "no RDMA device [mlx5_0]" in text


def test_json_document_is_strict_json() -> None:
    cfg = BenchConfig(routings=(RoutingSpec("uniform"), RoutingSpec("zipf", 1.2)))
    row = _row("native", 128)
    row.wall["d_send"] = summarize([[math.nan]])
    env = {**_env(8, "NVIDIA H200"), "git": None}
    doc = report.bench_document(cfg, env, [row, CaseRow("reference", "nccl", "zipf:1.2", 128, skipped="x")],
                                ["n"])
    text = json.dumps(doc, allow_nan=False)
    back = json.loads(text)
    assert back["config"]["routings"] == ["uniform", "zipf:1.2"]
    assert back["rows"][0]["wall_us"]["d_send"]["mean"] is None
    assert back["rows"][0]["gbps"]["kernel"]["dispatch"] == pytest.approx(1024 * 7408 / 33e-6 / 1e9, rel=1e-5)
    assert back["rows"][1]["skipped"] == "x"
    (ref,) = back["deepep_reference"]["rows"]
    assert ref["tokens"] == 128 and ref["dispatch_us"] == [36.0, 41.0]


def test_size_hint_line_without_layout() -> None:
    line = report.size_hint_line(BenchConfig(experts=256), 8, 128, None)
    assert "unavailable" in line
    line = report.size_hint_line(BenchConfig(experts=256), 8, 128, 10**9)
    assert "1.000 GB" in line and "1.908 GB" in line


@pytest.mark.parametrize("sweep", [False, True])
def test_plot(tmp_path, sweep: bool) -> None:  # type: ignore[no-untyped-def]
    matplotlib = pytest.importorskip("matplotlib")
    assert matplotlib is not None
    from pyep.bench import plot
    tokens = (1, 32, 128, 256) if sweep else (128,)
    cfg = BenchConfig(tokens=tokens)
    rows = [_row(b, t, scale=t / 128) for t in tokens for b in ("native", "reference")]
    path = plot.plot(str(tmp_path / "bench.png"), cfg, rows, 8, "NVIDIA H200")
    assert path is not None and (tmp_path / "bench.png").stat().st_size > 5000


def test_plot_without_matplotlib(tmp_path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    import builtins
    real_import = builtins.__import__

    def no_mpl(name, *a, **kw):  # type: ignore[no-untyped-def]
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_mpl)
    from pyep.bench import plot
    assert plot.plot(str(tmp_path / "b.png"), BenchConfig(), [_row("native", 128)], 8, "H200") is None
    assert not (tmp_path / "b.png").exists()
    assert "matplotlib is not importable" in caplog.text


def test_outlier_note_when_the_mean_is_far_above_the_median() -> None:
    row = _row("native", 128)
    assert report.outlier_lines(row) == []            # mean 1.1 t vs median: not above 1.1x
    slow = [[50.0] * 28 + [235.0, 236.0]] * 4         # a few profiled iterations where a rank started late
    row.kernel["combine"] = summarize(slow)
    lines = report.outlier_lines(row)
    assert len(lines) == 1 and "combine" in lines[0] and "median 50.0 us" in lines[0]
    assert "pulled up by outliers" in _render(BenchConfig(), _env(4, "NVIDIA H200"), [row])


def test_eager_table_and_deepep_pair() -> None:
    """The eager table shows the pair, the host time per call, the pair against the kernels and
    DeepEP's eager pair (its "Dispatch + combine" avg_t) beside native rows of the T DeepEP ran."""
    from pyep.bench.metrics import Stat
    cfg = BenchConfig()
    row = _row("native", 128)

    def st(v: float) -> Stat:
        return Stat(mean=v, p50=v, p99=v, min=v, per_rank_mean=[v])
    row.eager = {"pair": st(80.0), "host_dispatch": st(12.0), "host_combine": st(9.0)}
    row.kernel = {**row.kernel, "dispatch": st(30.0), "combine": st(40.0)}
    assert row.eager_vs_kernels() == pytest.approx(80.0 / 70.0)
    doc = {"figures": {"dispatch_combine": {"avg_us": 71.8, "gbps": 100.0}}}
    assert report.deepep_eager_pair(doc) == 71.8 and report.deepep_eager_pair(None) is None
    console = Console(record=True, width=250)
    report.render(console, cfg, _env(2, "NVIDIA H200"), [row], [], report.deepep_eager_pair(doc))
    text = console.export_text()
    assert "eager loop" in text and "71.8" in text and "1.14x" in text and "1.11x" in text
    assert row.as_dict()["eager_us"]["pair"]["mean"] == 80.0
