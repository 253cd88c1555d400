#!/usr/bin/env python3
"""DeepEP V1's own tests on DeepEP and, unchanged, on pyep's shim, alternately in one run, with a table
of both libraries' figures and their ratios: the comparison docs/results/2026-11-27b-x4 made by hand.

    python3 tools/side_by_side.py intranode 2 4 [--repeat 2] [--env PYEP_NORMAL_TMA=0/peer] [--out DIR]
    python3 tools/side_by_side.py ll 2 [--repeat 2] [-- --num-tokens 32]

Each rank count runs DeepEP, then the shim, `--repeat` times (alternating, so that both see the same
machine state), through tools/deepep_baseline.py (`.anchors/deepep_v1.sh`: one rank a GPU where there
are enough GPUs, else the ranks share them under MPS). `--env NAME=VALUE` (repeatable) is set for the
shim's runs only: pyep settings such as PYEP_NORMAL_TMA. Prints, per rank count, the best of the
repeats for each figure (highest GB/s, lowest us) and the spread, shim / DeepEP; writes
side_by_side_<mode>.json (every run's figures) under --out. Exit status: the number of runs that
failed or printed no figures.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (key, label, figure path in deepep_baseline's figures, higher is better)
INTRANODE = (("fp8", "dispatch FP8 GB/s", ("dispatch_fp8", "gbps"), True),
             ("bf16", "dispatch BF16 GB/s", ("dispatch_bf16", "gbps"), True),
             ("combine", "combine GB/s", ("combine", "gbps"), True))
LL = (("dispatch", "dispatch us", ("kernels", "dispatch_us"), False),
      ("combine", "combine us", ("kernels", "combine_us"), False),
      ("d+c", "d+c back to back us", ("dispatch_combine", "avg_us"), False),
      ("d_recv", "dispatch recv half us", ("hooks", "dispatch_recv_us"), False),
      ("c_recv", "combine recv half us", ("hooks", "combine_recv_us"), False))


def _baseline() -> Any:
    spec = importlib.util.spec_from_file_location("deepep_baseline", os.path.join(ROOT, "tools", "deepep_baseline.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def figure(figures: Dict[str, Any], path: Tuple[str, str]) -> Optional[float]:
    v = figures.get(path[0])
    return float(v[path[1]]) if isinstance(v, dict) and path[1] in v else None


def summarize(mode: str, runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rows per (ranks, figure): each library's best over its runs, the range, and shim / DeepEP."""
    spec = INTRANODE if mode == "intranode" else LL
    rows: List[Dict[str, Any]] = []
    for n in sorted({r["num_ranks"] for r in runs}):
        for key, label, path, higher in spec:
            vals: Dict[str, List[float]] = {"deepep": [], "pyep": []}
            for r in runs:
                v = figure(r["figures"], path) if r["num_ranks"] == n and r["ok"] else None
                if v is not None:
                    vals[r["on"]].append(v)
            best = {on: (max(v) if higher else min(v)) if v else None for on, v in vals.items()}
            ratio = None
            if best["deepep"] and best["pyep"]:
                ratio = best["pyep"] / best["deepep"] if higher else best["deepep"] / best["pyep"]
            rows.append({"ranks": n, "figure": key, "label": label, "higher_is_better": higher,
                         "deepep": best["deepep"], "pyep": best["pyep"], "ratio": ratio,
                         "deepep_range": [min(vals["deepep"]), max(vals["deepep"])] if vals["deepep"] else None,
                         "pyep_range": [min(vals["pyep"]), max(vals["pyep"])] if vals["pyep"] else None})
    return rows


def table(mode: str, rows: List[Dict[str, Any]]) -> str:
    """ratio: how many times faster pyep is (GB/s pyep / DeepEP; for times DeepEP / pyep)."""
    def num(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.1f}"

    def rng(v: Optional[List[float]]) -> str:
        return "-" if v is None else f"{v[0]:.1f}-{v[1]:.1f}"
    head = f"{'ranks':>5}  {'figure':24} {'DeepEP':>9} {'pyep':>9} {'speed-up':>8}  {'DeepEP runs':>15} {'pyep runs':>15}"
    out = [f"DeepEP V1's {'test_intranode.py' if mode == 'intranode' else 'test_low_latency.py'} on DeepEP "
           f"and on pyep's shim, best of each library's runs", head, "-" * len(head)]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        out.append(f"{r['ranks']:>5}  {r['label']:24} {num(r['deepep']):>9} {num(r['pyep']):>9} {ratio:>8}  "
                   f"{rng(r['deepep_range']):>15} {rng(r['pyep_range']):>15}")
    out.append("speed-up: pyep's GB/s over DeepEP's, or DeepEP's time over pyep's (above 1: pyep is faster)")
    return "\n".join(out)


def run_all(mode: str, ranks: Sequence[int], repeat: int, extra: Sequence[str], out_dir: str,
            shim_env: Dict[str, str], runner: Optional[Callable[..., Dict[str, Any]]] = None) -> List[Dict[str, Any]]:
    run = runner if runner is not None else _baseline().run
    runs: List[Dict[str, Any]] = []
    for n in ranks:
        for i in range(repeat):
            for on in ("deepep", "pyep"):
                saved = {k: os.environ.get(k) for k in shim_env}
                if on == "pyep":
                    os.environ.update(shim_env)
                try:
                    doc = run(mode, n, extra, os.path.join(out_dir, f"{mode}_{n}_{on}_{i}"), on=on)
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                runs.append({"num_ranks": n, "on": on, "repeat": i, "ok": bool(doc.get("ok")), "rc": doc.get("rc"),
                             "figures": doc.get("figures", {}), "env": shim_env if on == "pyep" else {}})
                print(f"{mode} {n} ranks, {on} run {i + 1}/{repeat}: rc={doc.get('rc')} "
                      f"{'ok' if doc.get('ok') else 'NO FIGURES'}", flush=True)
    return runs


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("intranode", "ll"))
    ap.add_argument("ranks", type=int, nargs="+")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="set for the shim's runs only (e.g. PYEP_NORMAL_TMA=0/peer)")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "side-by-side-" + time.strftime("%Y%m%d-%H%M%S")))
    ap.add_argument("extra", nargs="*", help="arguments for DeepEP's test script (after --)")
    a = ap.parse_args(argv)
    if a.repeat < 1 or any(n < 1 for n in a.ranks):
        ap.error("--repeat and the rank counts must be >= 1")
    shim_env: Dict[str, str] = {}
    for item in a.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            ap.error(f"--env takes NAME=VALUE, got {item!r}")
        shim_env[name] = value
    os.makedirs(a.out, exist_ok=True)
    runs = run_all(a.mode, a.ranks, a.repeat, a.extra, a.out, shim_env)
    rows = summarize(a.mode, runs)
    text = table(a.mode, rows)
    print(text)
    path = os.path.join(a.out, f"side_by_side_{a.mode}.json")
    with open(path, "w") as fh:
        json.dump({"mode": a.mode, "ranks": a.ranks, "repeat": a.repeat, "shim_env": shim_env,
                   "extra": a.extra, "runs": runs, "rows": rows, "table": text}, fh, indent=1)
    print(f"side_by_side: {path}")
    return sum(1 for r in runs if not r["ok"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
