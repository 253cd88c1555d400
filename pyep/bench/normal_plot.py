"""The PNG of `pyep bench --mode normal` (matplotlib, when installed): GB/s per SM count for FP8 and
BF16 dispatch and combine, DeepEP's best of the same run (and pyep's shim under DeepEP's harness) as
lines, and -- where DeepEP ran -- a ratio panel, pyep / DeepEP per SM count. Across nodes also the RDMA
GB/s, the real-NIC model's expectation and DeepEP's published band."""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, Optional, Sequence

from .normal import NormalRow
from .normal_report import DEEPEP_COLUMNS, SWEEP_KIND
from .plot import pyplot

log = logging.getLogger("pyep.bench")
TITLES = {"cached_fp8": "dispatch FP8", "cached_bf16": "dispatch BF16", "combine": "combine BF16"}


def plot(path: str, rows: Sequence[NormalRow], deepep: Optional[Dict[str, Any]], title: str,
         internode: Optional[Dict[str, Any]] = None, shim: Optional[Dict[str, Any]] = None) -> Optional[str]:
    """Writes the PNG and returns its path; None without matplotlib (pyplot() says so once) or rows."""
    plt = pyplot(path)
    if plt is None:
        return None
    measured = [r for r in rows if not r.skipped and r.stats]
    if not measured:
        log.info("no plot: no row was measured")
        return None
    figs = (deepep or {}).get("figures") or {}
    shim_figs = (shim or {}).get("figures") or {}
    with_ratio = any(figs.get(k) for _, k in DEEPEP_COLUMNS)
    panels = len(DEEPEP_COLUMNS) + (1 if with_ratio else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.5))
    # On the CPU the "kernel" times are the wall times: one line each.
    kinds = (("wall", "s--"),) if all(r.kernel_source.startswith("wall") for r in measured) else \
        (("kernel", "o-"), ("wall", "s--"))
    sms = sorted({r.num_sms for r in measured})
    for ax, (phase, key) in zip(axes, DEEPEP_COLUMNS):
        ax.set_xticks(sms)
        for backend in sorted({r.backend for r in measured}):
            rs = sorted((r for r in measured if r.backend == backend), key=lambda r: r.num_sms)
            for kind, style in kinds:
                ys = [r.gbps(kind).get(phase, math.nan) for r in rs]
                if all(math.isnan(y) for y in ys):
                    continue
                ax.plot([r.num_sms for r in rs], ys, style, label=f"pyep {backend} ({kind})")
                if internode is not None:
                    ys = [r.gbps(kind, rdma=True).get(phase, math.nan) for r in rs]
                    if not all(math.isnan(y) for y in ys):
                        ax.plot([r.num_sms for r in rs], ys, style[0] + ":", label=f"pyep {backend} RDMA ({kind})")
        if internode is not None:
            exp = internode["model_expectation"]["phases"][phase]
            ax.axhline(exp["rdma_gbps"], color="g", linestyle="-.", label="model RDMA (real NIC)")
            lo, hi = internode["deepep_published"]["rdma_gbps"]
            ax.axhspan(lo, hi, color="g", alpha=0.1, label="DeepEP internode RDMA, published")
        for f, color, name in ((figs.get(key), "k", "DeepEP best"), (shim_figs.get(key), "m", "pyep shim best")):
            if f:
                how = "its bench() loop" if (deepep or {}).get("harness") == "b2b" else "its test"
                ax.axhline(f["gbps"], color=color, linestyle=":", label=f"{name} ({f['num_sms']} SMs, {how})")
        ax.set_title(TITLES[phase])
        ax.set_xlabel("SMs")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("GB/s per rank (NVLink bytes, DeepEP's count)" if internode is None else
                       "GB/s per rank (NVL and RDMA bytes, test_internode.py's counts)")
    if with_ratio:
        axes[-1].set_xticks(sms)
        _ratio_panel(axes[-1], measured, figs)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _ratio_panel(ax: Any, rows: Sequence[NormalRow], figs: Dict[str, Any]) -> None:
    """pyep's GB/s (wall, as DeepEP's bench() times) over DeepEP's best of the same run, per SM count."""
    for backend in sorted({r.backend for r in rows}):
        rs = sorted((r for r in rows if r.backend == backend), key=lambda r: r.num_sms)
        for phase, key in DEEPEP_COLUMNS:
            if not figs.get(key):
                continue
            ys = [r.gbps(SWEEP_KIND).get(phase, math.nan) / figs[key]["gbps"] for r in rs]
            ax.plot([r.num_sms for r in rs], ys, "o-", label=f"{TITLES[phase]} ({backend})")
    ax.axhline(1.0, color="k", linestyle=":", label="DeepEP best = 1")
    ax.set_title("pyep / DeepEP (same run)")
    ax.set_xlabel("SMs")
    ax.set_ylabel(f"GB/s ratio ({SWEEP_KIND} time)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
