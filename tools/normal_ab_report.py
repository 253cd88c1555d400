"""Table, JSON and plot of tools/normal_ab.sh's runs: the normal-mode kernels of a baseline tree against
this one, through tools/dev/normal_b2b_probe.py (DeepEP's tuning calls on pyep's shim), configuration by
configuration (ranks x SMs).

Reads OUT/{base,new}/r<R>s<S>/run<k>/probe.json, the probe's JSON (every rank's figures). Per side,
configuration and call (fp8_colmajor, fp8_dense, bf16, combine):
  event   CUDA events around the call queued behind a device sleep ("gap" mode): the gate and the kernel,
          the GPU's time and not the host's;
  kernel  the dispatch / combine kernel's median duration in the gap-mode kineto trace;
  b2b     GB/s per rank as DeepEP's test counts them, calls back to back as its bench() runs them (the
          host's pace where the host is slower than the GPU).
Each is the least time (the most GB/s) over ranks and runs: a kernel spins until its peers' rows arrive,
so the rank that waited least is the closest to the kernel's own time, and both trees get the same
statistic; every run's values are in the JSON. Ratio = new / base (below 1 is faster; for GB/s, above 1).
A missing or incomplete run is named in the table, never guessed."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


_TOOLS = Path(__file__).resolve().parent
probe = _load("normal_b2b_probe", _TOOLS / "dev" / "normal_b2b_probe.py")   # its main_kernel()
ab_report = _load("ab_report", _TOOLS / "ab_report.py")

CALLS = ("fp8_colmajor", "fp8_dense", "bf16", "combine")
FIGURES = ("event_us", "kernel_us", "b2b_gbps")   # b2b_gbps: more is better
CONFIG = re.compile(r"r(\d+)s(\d+)$")


def run_figures(doc: Dict[str, Any]) -> Dict[str, Dict[str, Optional[float]]]:
    """{call: {figure: value}} of one probe run: least over ranks (most for GB/s); None where absent."""
    out: Dict[str, Dict[str, Optional[float]]] = {}
    for call in CALLS:
        per: Dict[str, List[float]] = {f: [] for f in FIGURES}
        for r in doc.get("ranks", []):
            v = r.get("variants", {}).get(call)
            if not v:
                continue
            gap, b2b = v.get("gap"), v.get("b2b")
            if gap:
                per["event_us"].append(gap["event_us_mean"])
                m = probe.main_kernel(gap["trace"])
                if m:
                    per["kernel_us"].append(m["median_us"])
            if b2b:
                per["b2b_gbps"].append(b2b["gbps"])
        if any(per.values()):
            out[call] = {f: (max(vals) if f == "b2b_gbps" else min(vals)) if vals else None
                         for f, vals in per.items()}
    return out


def side_runs(folder: Path) -> List[Dict[str, Dict[str, Optional[float]]]]:
    runs = []
    for p in sorted(folder.glob("run*/probe.json")):
        try:
            runs.append(run_figures(json.loads(p.read_text())))
        except (ValueError, KeyError, TypeError):
            continue   # a probe that died mid-write: not a figure
    return [r for r in runs if r]


def merge(runs: List[Dict[str, Dict[str, Optional[float]]]]) -> Dict[str, Dict[str, Optional[float]]]:
    """Per call and figure, the best over runs (least time, most GB/s)."""
    out: Dict[str, Dict[str, Optional[float]]] = {}
    for run in runs:
        for call, figs in run.items():
            cur = out.setdefault(call, {f: None for f in FIGURES})
            for f, v in figs.items():
                if v is None:
                    continue
                old = cur[f]
                cur[f] = v if old is None else (max(old, v) if f == "b2b_gbps" else min(old, v))
    return out


def collect(out: Path) -> List[dict]:
    configs: List[Tuple[int, int]] = sorted({(int(m.group(1)), int(m.group(2)))
                                             for side in ("base", "new") for p in (out / side).glob("r*s*")
                                             for m in [CONFIG.match(p.name)] if m})
    rows = []
    for ranks, sms in configs:
        row: dict = {"ranks": ranks, "sms": sms}
        for side in ("base", "new"):
            runs = side_runs(out / side / f"r{ranks}s{sms}")
            row[f"{side}_runs"] = runs
            row[side] = merge(runs) if runs else None
        rows.append(row)
    return rows


def _cell(b: Optional[float], n: Optional[float]) -> str:
    if b is None or n is None:
        return f"{'-':>17}  {'':>5}"
    return f"{b:>8.1f} / {n:<6.1f}  {n / b:>5.2f}"


def table(rows: List[dict], baseline: str, current: str, where: str) -> str:
    head = (f"normal mode, DeepEP's tuning calls on pyep's shim, {where}: baseline {baseline} vs {current}\n"
            f"{'ranks':>5} {'SMs':>4}  {'call':<13} {'event us base/new':>17}  {'ratio':>5}  "
            f"{'kernel us base/new':>17}  {'ratio':>5}  {'b2b GB/s base/new':>17}  {'ratio':>5}")
    lines = [head, "-" * len(head.splitlines()[1])]
    for r in rows:
        lead = f"{r['ranks']:>5} {r['sms']:>4}  "
        if r["base"] is None or r["new"] is None:
            missing = " and ".join(s for s in ("base", "new") if r[s] is None)
            lines.append(f"{lead}no figures from {missing} (see its run.txt)")
            continue
        for call in CALLS:
            b, n = r["base"].get(call), r["new"].get(call)
            if b is None and n is None:
                continue
            b = b or {f: None for f in FIGURES}
            n = n or {f: None for f in FIGURES}
            lines.append(f"{lead}{call:<13} " + "  ".join(_cell(b[f], n[f]) for f in FIGURES))
    counts = sorted({len(r[f"{s}_runs"]) for r in rows for s in ("base", "new") if r[f"{s}_runs"]})
    runs_note = (f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}") if counts else "0"
    lines.append(f"least over ranks and {runs_note} run(s) per cell (b2b: most GB/s); event = CUDA events around "
                 "a call queued\nbehind a device sleep (gate + kernel), kernel = its kineto median, b2b = DeepEP's "
                 "bench() loop; ratio = new / base")
    return "\n".join(lines)


def plot(rows: List[dict], path: Path) -> Optional[str]:
    plt = ab_report.pyplot()
    if plt is None:
        return ab_report.NO_MATPLOTLIB
    bars = [(f"{r['ranks']}r {r['sms']}s {c}", r["base"][c], r["new"][c]) for r in rows if r["base"] and r["new"]
            for c in CALLS if c in r["base"] and c in r["new"]]
    if not bars:
        return "no complete configuration: no plot"
    fig, ax = plt.subplots(1, 2, figsize=(12, 0.3 * len(bars) + 1.5))
    y = list(range(len(bars)))
    for i, f in enumerate(("event_us", "kernel_us")):
        ratios = [n[f] / b[f] if b[f] and n[f] else 0.0 for _, b, n in bars]
        ax[i].barh(y, ratios, color=["tab:green" if v <= 1 else "tab:red" for v in ratios])
        ax[i].axvline(1.0, color="gray", ls=":")
        ax[i].set(yticks=y, yticklabels=[name for name, _, _ in bars] if i == 0 else [""] * len(y),
                  xlabel="new / base", title=f"{f} ratio")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def main(argv: Optional[List[str]] = None) -> int:
    return ab_report.run(argv, __doc__.splitlines()[0], "normal_ab.sh", "ranks sharing one GPU", "normal_ab",
                         "r<R>s<S>", collect, table,
                         lambda rows: [{k: r[k] for k in ("ranks", "sms", "base", "new", "base_runs", "new_runs")}
                                       for r in rows], plot)

if __name__ == "__main__":
    sys.exit(main())
