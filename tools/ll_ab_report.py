"""Table, JSON and plot of tools/ll_ab.sh's runs: DeepEP's test_low_latency.py on pyep's shim, baseline
tree against this one, T by T.

Reads OUT/{base,new}/T<t>/run<k>/pyep_ll_2.log (one folder per repeat, LL_AB_REPEAT; an older run's
OUT/{base,new}/T<t>/pyep_ll_2.log too), the lines DeepEP's test prints per rank:
  [rank r] Dispatch + combine bandwidth: B GB/s, avg_t=X us, ...        (CUDA events, back to back)
  [rank r] Dispatch bandwidth: B GB/s, avg_t=X us | Combine bandwidth: B GB/s, avg_t=Y us   (kineto)
  [rank r] Dispatch send/recv time: S + R us | Combine send/recv time: S + R us   (hook halves, kineto)
Per side and T: the least over ranks and repeats of each figure (every run's values are in the JSON;
ranks print without a lock, so two ranks' lines may share one line of the log). A kernel spins
until its peers' data arrive, so a rank that launched ahead of a late peer counts the peer's lateness as
its own kernel time (one such run: rank 1 304 us, rank 0 34.7 us): the rank that waited least is the
closest to the kernel's own time; both trees get the same statistic. Ratio = current / baseline: below
1 is faster. A missing or unparsable log is named in the table, never guessed."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

_spec = importlib.util.spec_from_file_location("ab_report", Path(__file__).resolve().parent / "ab_report.py")
ab_report = importlib.util.module_from_spec(_spec)
assert _spec.loader is not None
_spec.loader.exec_module(ab_report)

EAGER = re.compile(r"\[rank (\d+)\] Dispatch \+ combine bandwidth: [\d.]+ GB/s, avg_t=([\d.]+) us")
KERNELS = re.compile(r"\[rank (\d+)\] Dispatch bandwidth: [\d.]+ GB/s, avg_t=([\d.]+) us \| "
                     r"Combine bandwidth: [\d.]+ GB/s, avg_t=([\d.]+) us")
HALVES_LINE = re.compile(r"\[rank (\d+)\] Dispatch send/recv time: ([\d.]+) \+ ([\d.]+) us \| "
                         r"Combine send/recv time: ([\d.]+) \+ ([\d.]+) us")
FIGURES = ("dispatch_us", "combine_us", "eager_us")
HALVES = ("dispatch_send_us", "dispatch_recv_us", "combine_send_us", "combine_recv_us")   # optional


def parse_log(text: str) -> Dict[str, Dict[int, float]]:
    """{figure: {rank: microseconds}} from one test_low_latency.py log."""
    got: Dict[str, Dict[int, float]] = {f: {} for f in FIGURES + HALVES}
    for line in text.splitlines():
        for m in HALVES_LINE.finditer(line):
            for i, f in enumerate(HALVES):
                got[f][int(m.group(1))] = float(m.group(i + 2))
        for m in EAGER.finditer(line):
            got["eager_us"][int(m.group(1))] = float(m.group(2))
        for m in KERNELS.finditer(line):
            got["dispatch_us"][int(m.group(1))] = float(m.group(2))
            got["combine_us"][int(m.group(1))] = float(m.group(3))
    return got


def side_runs(folder: Path) -> List[Dict[str, Dict[int, float]]]:
    """Every complete run of one side at one T: folder/pyep_ll_2.log and folder/run<k>/pyep_ll_2.log."""
    logs = [folder / "pyep_ll_2.log"] + sorted(folder.glob("run*/pyep_ll_2.log"))
    runs = [parse_log(p.read_text(errors="replace")) for p in logs if p.is_file()]
    return [r for r in runs if all(r[f] for f in FIGURES)]


def merge(runs: List[Dict[str, Dict[int, float]]]) -> Optional[Dict[str, Dict[int, float]]]:
    """Per figure and rank, the least over runs (None without a complete run)."""
    if not runs:
        return None
    out: Dict[str, Dict[int, float]] = {f: {} for f in FIGURES + HALVES}
    for run in runs:
        for f, per_rank in run.items():
            for rank, v in per_rank.items():
                out[f][rank] = min(v, out[f].get(rank, v))
    return out


def least(values: Dict[int, float]) -> float:
    return min(values.values())


def eager_range(row: dict, side: str) -> str:
    """'least - most' of the eager loop over every rank of every run of one side."""
    vals = [v for run in row[f"{side}_runs"] for v in run.get("eager_us", {}).values()]
    return f"{min(vals):.1f} - {max(vals):.1f}" if vals else "-"


def collect(out: Path) -> List[dict]:
    tokens = sorted({int(p.name[1:]) for side in ("base", "new") for p in (out / side).glob("T*")
                     if p.name[1:].isdigit()})
    rows = []
    for t in tokens:
        row: dict = {"tokens": t}
        for side in ("base", "new"):
            runs = side_runs(out / side / f"T{t}")
            row[side] = merge(runs)
            row[f"{side}_runs"] = runs
        rows.append(row)
    return rows


def table(rows: List[dict], baseline: str, current: str, where: str = "2 ranks on one GPU") -> str:
    head = (f"DeepEP test_low_latency.py on pyep's shim, {where}: baseline {baseline} vs {current}\n"
            f"{'T':>4}  {'dispatch us base/new':>22}  {'ratio':>5}  {'combine us base/new':>21}  {'ratio':>5}  "
            f"{'d+c eager us base/new':>23}  {'ratio':>5}")
    lines = [head, "-" * len(head.splitlines()[1])]
    halves = []
    for r in rows:
        if r["base"] is None or r["new"] is None:
            missing = " and ".join(s for s in ("base", "new") if r[s] is None)
            lines.append(f"{r['tokens']:>4}  no figures from {missing} (see its run.txt / pyep_ll_2.log)")
            continue
        cells = []
        for f in FIGURES:
            b, n = least(r["base"][f]), least(r["new"][f])
            cells.append(f"{b:>10.1f} / {n:<9.1f}  {n / b:>5.2f}")
        lines.append(f"{r['tokens']:>4}  " + "  ".join(cells))
        if all(r[s].get(f) for s in ("base", "new") for f in HALVES):
            halves.append(f"{r['tokens']:>4}  " + "  ".join(
                f"{least(r['base'][f]):>6.1f} / {least(r['new'][f]):<6.1f} {least(r['new'][f]) / least(r['base'][f]):>4.2f}"
                for f in HALVES))
    counts = sorted({len(r[f"{s}_runs"]) for r in rows for s in ("base", "new") if r.get(f"{s}_runs")})
    runs_note = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}" if counts else "0"
    lines.append(f"us: least over ranks and {runs_note} run(s) per cell (DeepEP's kineto kernel times; eager = CUDA\n"
                 "events around back-to-back dispatch + combine); ratio = new / base")
    spread = [f"{r['tokens']:>4}  {eager_range(r, 'base'):>17}  {eager_range(r, 'new'):>17}" for r in rows
              if r["base"] and r["new"]]
    if spread:
        # The least hides how far the eager loop moves between samples: with ranks sharing a GPU it is
        # paced by the processes' launches as much as by the kernels (docs/results/2026-11-27d-onegpu).
        sub = f"{'T':>4}  {'base':>17}  {'new':>17}"
        lines += ["", "d+c eager us, every sample (ranks x runs), least - most:", sub, "-" * len(sub)] + spread
    if halves:
        sub = (f"{'T':>4}  {'dispatch send':>20}  {'dispatch recv':>20}  {'combine send':>20}  {'combine recv':>20}")
        lines += ["", "hook halves (send and receive launched apart), us base / new and ratio:", sub,
                  "-" * len(sub)] + halves
    return "\n".join(lines)


def plot(rows: List[dict], path: Path) -> Optional[str]:
    plt = ab_report.pyplot()
    if plt is None:
        return ab_report.NO_MATPLOTLIB
    ok = [r for r in rows if r["base"] and r["new"]]
    if not ok:
        return "no complete T: no plot"
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ts = [r["tokens"] for r in ok]
    for f in FIGURES:
        ax[0].plot(ts, [least(r["base"][f]) for r in ok], "--o", label=f"{f} base")
        ax[0].plot(ts, [least(r["new"][f]) for r in ok], "-o", label=f"{f} new")
        ax[1].plot(ts, [least(r["new"][f]) / least(r["base"][f]) for r in ok], "-o", label=f)
    ax[0].set(xscale="log", xlabel="T (tokens per rank)", ylabel="us", title="time")
    ax[1].axhline(0.8, color="gray", ls=":", label="0.8")
    ax[1].set(xscale="log", xlabel="T", ylabel="new / base", title="ratio")
    for a in ax:
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def _rows_json(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    def figures(d: Dict[str, Any]) -> Dict[str, Any]:
        return {f: {str(k): v for k, v in d[f].items()} for f in FIGURES + HALVES}
    return [{"tokens": r["tokens"], **{s: figures(r[s]) if r[s] else None for s in ("base", "new")},
             **{f"{s}_runs": [figures(run) for run in r[f"{s}_runs"]] for s in ("base", "new")}} for r in rows]


def main(argv: Optional[List[str]] = None) -> int:
    return ab_report.run(argv, __doc__.splitlines()[0], "ll_ab.sh", "2 ranks on one GPU", "ll_ab", "T<t>", collect,
                         table, _rows_json, plot)

if __name__ == "__main__":
    sys.exit(main())
