"""What rank 0 shows: tables (with the DeepEP row only where it applies), the size hint line, the JSON
document and the plot, from synthetic results."""
from __future__ import annotations

import json
import math

import pytest

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


def assert_fits(text: str) -> None:
    """Every printed line within 120 columns, and nothing cut short to get there (rich's ellipsis)."""
    from pyep.bench.tables import WIDTH
    wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not wide, f"{len(wide)} line(s) wider than {WIDTH} columns, e.g.\n{wide[0]}"
    assert "\u2026" not in text, "a cell was cut short (ellipsis):\n" + text


def _render(cfg: BenchConfig, env: dict, rows, pair=None) -> str:  # type: ignore[no-untyped-def]
    from pyep.bench.tables import console
    con = console(file=open("/dev/null", "w"))
    report.render(con, cfg, env, rows, ["a note"], pair)
    text = con.export_text()
    assert_fits(text)
    return text


def test_tables_deepep_row_and_size_hint() -> None:
    cfg = BenchConfig()
    rows = [_row("native", 128), _row("reference", 128, scale=5.0)]
    text = _render(cfg, _env(8, "NVIDIA H200"), rows)
    assert "per-kernel GPU time (kineto)" in text and "CUDA events" in text and "8 ranks on NVIDIA H200" in text
    flat = " ".join(text.split())
    assert flat.count("DeepEP (measured separately, REFERENCE.md)") == 2     # kernel and wall tables' captions
    assert text.count("DeepEP (ref)") >= 5          # kernel, wall and halves tables, and the captions
    assert "36-41" in text and "66-68" in text and "110.5" in text and "28-30 + 8" in text
    assert " 33.0 " in text and "26.4 + 6.6" in text                 # means in the table; p99 in the JSON
    assert "native/nvlink: local x1, nvlink x7" in text              # brackets are not markup
    assert "1234567890 bytes = 1.235 GB (DeepEP's LL buffer: 2.147 GB)" in text
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
    assert "skipped (uniform T=128) native/ibgda: RuntimeError: no RDMA device [mlx5_0]" in text


def test_widest_rows_fit_120_columns() -> None:
    """The longest transport name, reference-backend milliseconds, a DeepEP row, the eager table with
    DeepEP's pair, a skip reason and a sweep of T: every line within 120 columns, nothing cut."""
    from pyep.bench.metrics import Stat
    cfg = BenchConfig(tokens=(128, 256), routings=(RoutingSpec("uniform"), RoutingSpec("zipf", 1.25)))
    rows = []
    for t in cfg.tokens:
        for routing in ("uniform", "zipf:1.25"):
            native = _row("native", t)
            native.transport, native.routing = "emulated-internode", routing
            ref = _row("reference", t, scale=400.0)
            ref.routing = routing
            for r in (native, ref):
                v = r.wall["dc"].mean
                r.eager = {m: Stat(mean=v, p50=v, p99=2 * v, min=v, per_rank_mean=[v]) for m in
                           ("pair", "host_dispatch", "host_combine")}
            rows += [native, ref]
    rows.append(CaseRow("native", "ibgda", "uniform", 128, skipped="BackendUnavailable: " + "x" * 200))
    text = _render(cfg, _env(8, "NVIDIA H200"), rows, 71.8)
    assert "native/emulated-internode" in text and "DeepEP (ref)" in text and "eager loop" in text


def test_words_fit_the_device() -> None:
    """A CPU run: no kernel table, no GPU words, '1 rank'; a shared GPU names MPS, on or off."""
    from pyep.bench.metrics import Stat
    from pyep.bench.sharing import MpsStatus, Sharing
    row = _row("reference", 8)
    row.kernel_source = "wall (no GPU)"
    row.eager = {m: Stat(mean=5.0, p50=5.0, p99=6.0, min=5.0, per_rank_mean=[5.0])
                 for m in ("pair", "host_dispatch", "host_combine")}
    cpu = Sharing(False, ["CPU (x86_64)"], ["h/cpu"])
    env = {**_env(1, "CPU (x86_64)"), "where": cpu.where(), "sharing_notes": cpu.header_notes()}
    text = _render(BenchConfig(tokens=(8,)), env, [row])
    assert "1 rank on the CPU (x86_64)" in text and "1 ranks" not in text
    for gpu_word in ("kernel", "kineto", "CUDA", "GPU"):
        assert gpu_word not in text, gpu_word
    assert "calls us" in text and "host clock" in text
    for on, word in ((True, "(MPS)"), (False, "(no MPS: time-sliced)")):
        gpu = Sharing(True, ["NVIDIA H100"] * 2, ["h/u0"] * 2, 132, MpsStatus(on, "fake"), "gloo, staged")
        env = {**_env(2, "NVIDIA H100"), "where": gpu.where(), "sharing_notes": gpu.header_notes()}
        text = _render(BenchConfig(), env, [_row("native", 128)])
        assert f"2 ranks sharing one NVIDIA H100 {word}" in " ".join(text.split())
        assert ("MPS OFF" in text) != on and "a proxy for NVLink" in text


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


def test_plot_with_deepep_of_this_run_has_a_ratio_panel(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    from pyep.bench import plot
    doc = {"figures": {"kernels": {"dispatch_us": 36.0, "combine_us": 72.0}, "dispatch_combine": {"avg_us": 110.0}}}
    assert plot.measured_deepep(doc) == [36.0, 72.0, 110.0]
    assert plot.measured_deepep({"figures": {"kernels": {"dispatch_us": 1.0}}}) is None
    made = []
    real = plot._ratio_bars
    plot._ratio_bars = lambda *a: (made.append(a), real(*a))   # type: ignore[assignment]
    try:
        path = plot.plot(str(tmp_path / "b.png"), BenchConfig(), [_row("native", 128)], 2, "NVIDIA H100", doc)
    finally:
        plot._ratio_bars = real   # type: ignore[assignment]
    assert path is not None and (tmp_path / "b.png").stat().st_size > 5000 and len(made) == 1
    _ax, rows, values, deepep, _names = made[0]
    assert deepep == [36.0, 72.0, 110.0] and values[0][0] == pytest.approx(33.0)


def test_plot_without_matplotlib(tmp_path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """No PNG and no warning: the results line says it once (tests/test_bench_run.py checks that)."""
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
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


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
    text = _render(cfg, _env(2, "NVIDIA H200"), [row], report.deepep_eager_pair(doc))
    assert "eager loop" in text and "71.8" in text and "1.14x" in text and "1.11x" in text
    assert row.as_dict()["eager_us"]["pair"]["mean"] == 80.0
