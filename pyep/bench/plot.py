"""The PNG plot of a benchmark run (matplotlib, when it is installed).

With several T values: dispatch and combine time against T per row group (log-log), DeepEP's measured
sweep points beside them where they apply. With one T: grouped bars of dispatch, combine and
dispatch+combine per row, and DeepEP's figures as a labelled bar group where they apply; when DeepEP
ran in the same job (--deepep), its bars and a ratio panel (pyep / DeepEP) beside them.
Without matplotlib there is no PNG and one line of the output says so (NO_MATPLOTLIB).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import reference_numbers as refnum
from .config import BenchConfig
from .suite import CaseRow

log = logging.getLogger("pyep.bench")
NO_MATPLOTLIB = "no PNG: matplotlib is not installed (pip install matplotlib)"


def pyplot(path: str) -> Any:
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not importable (the caller's
    results line says so, once: NO_MATPLOTLIB)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        log.debug("no plot for %s: %s", path, exc)
        return None
    return plt


def _time(row: CaseRow, metric: str) -> Tuple[float, str]:
    """The per-kernel mean where measured, else the wall mean; and which one it is."""
    k = row.kernel.get(metric)
    if k is not None and not math.isnan(k.mean) and not row.kernel_source.startswith("wall"):
        return k.mean, "kernel"
    w = row.wall.get(metric)
    return (w.mean if w is not None else math.nan), "wall"


def plot(path: str, cfg: BenchConfig, rows: Sequence[CaseRow], world_size: int, gpu: str,
         deepep: Optional[Dict[str, Any]] = None, where: str = "") -> Optional[str]:
    """Writes the PNG and returns its path, or returns None without matplotlib or measured rows.
    deepep: tools/deepep_baseline.py's LL document of this run (its figures beside ours)."""
    plt = pyplot(path)
    if plt is None:
        return None
    measured = [r for r in rows if not r.skipped]
    if not measured:
        log.info("no plot: no row was measured")
        return None
    fmt = "FP8" if cfg.use_fp8 else "BF16"
    title = (f"pyep low-latency EP: {fmt} dispatch / BF16 combine, H={cfg.hidden} K={cfg.topk} "
             f"E={cfg.experts}, {where or f'{world_size} ranks ({gpu})'}")
    if len(cfg.tokens) > 1:
        fig = _sweep(plt, cfg, measured, world_size, gpu)
    else:
        fig = _bars(plt, cfg, measured, world_size, gpu, measured_deepep(deepep))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def measured_deepep(doc: Optional[Dict[str, Any]]) -> Optional[List[float]]:
    """DeepEP's dispatch / combine kernel us and its back-to-back pair us from a deepep_baseline `ll`
    document, or None where it did not print them."""
    figs = (doc or {}).get("figures") or {}
    k, dc = figs.get("kernels"), figs.get("dispatch_combine")
    if not isinstance(k, dict) or not isinstance(dc, dict):
        return None
    try:
        return [float(k["dispatch_us"]), float(k["combine_us"]), float(dc["avg_us"])]
    except (KeyError, TypeError, ValueError):
        return None


def _sweep(plt, cfg: BenchConfig, rows: Sequence[CaseRow], world_size: int, gpu: str):  # type: ignore[no-untyped-def]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    groups: Dict[Tuple[str, str, str], List[CaseRow]] = {}
    for r in rows:
        groups.setdefault((r.backend, r.transport, r.routing), []).append(r)
    for ax, metric, name in ((axes[0], "dispatch", "dispatch"), (axes[1], "combine", "combine")):
        for (backend, transport, routing), rs in groups.items():
            rs = sorted(rs, key=lambda r: r.tokens)
            vals = [_time(r, metric) for r in rs]
            ax.plot([r.tokens for r in rs], [v for v, _ in vals], marker="o",
                    label=f"{backend}/{transport} {routing} ({vals[0][1]})")
        pts = _deepep_sweep(cfg, world_size, gpu, 0 if metric == "dispatch" else 1)
        if pts:
            ax.plot([t for t, _ in pts], [v for _, v in pts], "k*--", markersize=10, label=refnum.LABEL)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted({r.tokens for r in rows})
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks])
        ax.set_xlabel("tokens per rank (T)")
        ax.set_ylabel(f"{name} time, us")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def _deepep_sweep(cfg: BenchConfig, world_size: int, gpu: str, which: int) -> List[Tuple[int, float]]:
    ref = refnum.deepep_row(world_size, gpu, refnum.DEEPEP_LL_8XH200.tokens, cfg.hidden, cfg.topk,
                            cfg.experts, cfg.use_fp8)
    if ref is None:
        return []
    pts = {t: v[which] for t, v in refnum.DEEPEP_LL_SWEEP_8XH200.items()}
    pts[ref.tokens] = refnum.midpoint(ref.dispatch_us if which == 0 else ref.combine_us)
    lo, hi = min(cfg.tokens), max(cfg.tokens)
    return sorted((t, v) for t, v in pts.items() if lo <= t <= hi)


def _bars(plt, cfg: BenchConfig, rows: Sequence[CaseRow], world_size: int, gpu: str,  # type: ignore[no-untyped-def]
          deepep: Optional[List[float]] = None):
    metrics = (("dispatch", "dispatch"), ("combine", "combine"), ("dc", "dispatch+combine (wall)"))
    labels: List[str] = []
    values: List[List[float]] = []
    for r in rows:
        labels.append(f"{r.backend}/{r.transport}\n{r.routing}"
                      + ("" if r.check is None or r.check.passed else "\nCHECK FAIL"))
        values.append([(r.wall["dc"].mean if m == "dc" else _time(r, m)[0]) for m, _ in metrics])
    ref = refnum.deepep_row(world_size, gpu, cfg.tokens[0], cfg.hidden, cfg.topk, cfg.experts, cfg.use_fp8)
    if ref is not None:
        labels.append("DeepEP (measured\nseparately; range\nmidpoints)")
        values.append([refnum.midpoint(ref.dispatch_us), refnum.midpoint(ref.combine_us),
                       ref.dispatch_combine_us])
    if deepep is not None:
        labels.append("DeepEP\n(this run)")
        values.append(list(deepep))
    if deepep is not None:
        fig, (ax, rax) = plt.subplots(1, 2, figsize=(max(9.0, 1.6 * len(labels) + 2) + 5, 5),
                                      gridspec_kw={"width_ratios": [max(2.0, len(labels)), 2.0]})
    else:
        fig, ax = plt.subplots(figsize=(max(9.0, 1.6 * len(labels) + 2), 5))
    width = 0.8 / len(metrics)
    for j, (_m, name) in enumerate(metrics):
        xs = [i + (j - (len(metrics) - 1) / 2) * width for i in range(len(labels))]
        ys = [v[j] for v in values]
        bars = ax.bar(xs, [0 if math.isnan(y) else y for y in ys], width, label=name)
        for b, y in zip(bars, ys):
            if not math.isnan(y):
                ax.annotate(f"{y:.0f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                            va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(f"time, us (T={cfg.tokens[0]}; per kernel where measured, else wall)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    if deepep is not None:
        _ratio_bars(rax, rows, values[:len(rows)], deepep, [name for _m, name in metrics])
    return fig


def _ratio_bars(ax, rows: Sequence[CaseRow], values: List[List[float]], deepep: List[float],  # type: ignore[no-untyped-def]
                names: List[str]) -> None:
    """DeepEP's time over pyep's per metric (above 1: pyep faster), the native rows only."""
    natives = [(r, v) for r, v in zip(rows, values) if r.backend == "native"]
    width = 0.8 / max(1, len(natives))
    for i, (r, v) in enumerate(natives):
        ys = [d / x if x and not math.isnan(x) else 0.0 for d, x in zip(deepep, v)]
        xs = [j + (i - (len(natives) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, ys, width, label=f"{r.transport} {r.routing}")
    ax.axhline(1.0, color="k", linestyle=":")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.replace(" (wall)", "") for n in names], fontsize=8)
    ax.set_ylabel("DeepEP time / pyep time (same run)")
    ax.set_title("speed-up over DeepEP", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
