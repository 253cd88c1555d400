"""What rank 0 shows and writes: the result tables (rich), the buffer size hint, and the JSON file."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import time
from typing import Any, Dict, List, Optional, Sequence

from . import reference_numbers as refnum
from .config import BenchConfig
from .metrics import Stat
from .suite import CaseRow

SCHEMA = "pyep-bench/1"
GB = 1e9


def git_commit(path: str) -> Optional[Dict[str, Any]]:
    """HEAD of the checkout that holds `path`, and whether it has local changes; None outside git."""
    try:
        head = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.TimeoutExpired):
        return None


def environment(device_names: List[str], dist_backend: str) -> Dict[str, Any]:
    import torch

    from .._native import availability
    from .._version import __version__
    pkg_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {"world_size": len(device_names), "device_names": device_names, "dist_backend": dist_backend,
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "host": platform.node(), "pyep": __version__, "pyep_build": availability().describe(),
            "git": git_commit(pkg_dir), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _clean(obj: Any) -> Any:
    """JSON has no NaN: write null instead."""
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else obj
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def bench_document(cfg: BenchConfig, env: Dict[str, Any], rows: Sequence[CaseRow],
                   notes: Sequence[str]) -> Dict[str, Any]:
    config = dataclasses.asdict(cfg)
    config["routings"] = [r.label for r in cfg.routings]
    gpu = env["device_names"][0] if env["device_names"] else ""
    deepep = [{"tokens": t, **dataclasses.asdict(r)} for t in cfg.tokens
              if (r := refnum.deepep_row(env["world_size"], gpu, t, cfg.hidden, cfg.topk, cfg.experts,
                                         cfg.use_fp8)) is not None]
    return _clean({
        "schema": SCHEMA, "config": config, "environment": env, "notes": list(notes),
        "units": {"time": "microseconds", "bandwidth": "GB/s (1e9 bytes/s), per rank",
                  "stats": "mean/p50/p99 over iterations, each the maximum over ranks",
                  "gbps": "mean bytes per rank / (max over ranks of the mean time)"},
        "byte_model": {"dispatch_message": "16 + (H + H/128*4 if fp8 else 2H)", "combine_message": "2H",
                       "count": "valid (token, k) entries of the rank, remote and local"},
        "rows": [r.as_dict() for r in rows],
        "deepep_reference": {"label": refnum.LABEL, "source": refnum.SOURCE, "rows": deepep},
    })


def write_json(path: str, doc: Dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1, allow_nan=False)
        fh.write("\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------- tables
def _us(s: Optional[Stat]) -> str:
    if s is None or math.isnan(s.mean):
        return "-"
    return f"{s.mean:.1f} ({s.p99:.1f})"


def _half(a: Optional[Stat], b: Optional[Stat]) -> str:
    if a is None or b is None or math.isnan(a.mean) or math.isnan(b.mean):
        return "-"
    return f"{a.mean:.1f} + {b.mean:.1f}"


def _g(v: Optional[float]) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{v:.0f}" if v >= 10 else f"{v:.3g}"


def size_hint_line(cfg: BenchConfig, world_size: int, tokens: int, hint: Optional[int]) -> str:
    shape = f"T={tokens}, H={cfg.hidden}, E={cfg.experts}, K={cfg.topk}, R={world_size}"
    if hint is None:
        return f"buffer size hint ({shape}): unavailable (see the warnings above)"
    line = f"buffer size hint ({shape}): {hint} bytes = {hint / GB:.3f} GB"
    deepep = refnum.deepep_buffer_bytes(tokens, cfg.hidden, cfg.experts)
    if deepep is not None:
        line += f" (DeepEP low-latency buffer for this shape: {deepep / GB:.3f} GB)"
    return line


def outlier_lines(r: CaseRow, ratio: float = 1.1) -> List[str]:
    """A note for each per-kernel mean that a few slow iterations pulled well above the median."""
    out = []
    for m, st in r.kernel.items():
        if st is None or math.isnan(st.mean) or math.isnan(st.p50) or st.p50 <= 0:
            continue
        if st.mean > ratio * st.p50:
            out.append(f"note: {r.backend}/{r.transport} {r.routing} T={r.tokens} {m}: per-kernel mean "
                       f"{st.mean:.1f} us is pulled up by outliers (median {st.p50:.1f} us, p99 {st.p99:.1f} us)")
    return out


def host_line(r: CaseRow) -> str:
    """CPU time spent inside each call (mean, max over ranks): the eager-mode launch cost."""
    parts = [f"{m} {_us(r.host.get(m))}" for m in ("dispatch", "combine", "d_send", "d_recv", "c_send", "c_recv")
             if r.host.get(m) is not None and not math.isnan(r.host[m].mean)]
    return (f"host time inside the call, us ({r.backend}/{r.transport} {r.routing} T={r.tokens}): "
            + ", ".join(parts))


def deepep_eager_pair(deepep_doc: Optional[Dict[str, Any]]) -> Optional[float]:
    """DeepEP's eager pair from a tools/deepep_baseline.py `ll` document: its test's "Dispatch + combine"
    avg_t, which its bench() measures exactly as our eager pass (CUDA events around back-to-back
    dispatch+combine pairs, default arguments)."""
    figs = (deepep_doc or {}).get("figures") or {}
    dc = figs.get("dispatch_combine")
    val = dc.get("avg_us") if isinstance(dc, dict) else None
    return float(val) if isinstance(val, (int, float)) else None


def render_eager(console: Any, cfg: BenchConfig, env: Dict[str, Any], rows: Sequence[CaseRow],
                 deepep_pair_us: Optional[float] = None) -> None:
    """The eager table: the pair time of back-to-back dispatch+combine (default arguments, CUDA
    events around each pair), the host time per call inside that loop, the pair against the sum of
    the two kernels, and DeepEP's eager pair from the same run where it was measured."""
    from rich.markup import escape
    from rich.table import Table
    measured = [r for r in rows if not r.skipped and r.eager]
    if not measured:
        return
    fmt = "FP8" if cfg.use_fp8 else "BF16"
    t = Table(title=f"pyep bench: eager loop (back-to-back dispatch+combine, default arguments, one stream), "
                    f"{fmt} dispatch, {env['world_size']} ranks",
              caption="us = mean (p99) over pairs, max over ranks; host = CPU time inside each call; "
                      "vs kernels = pair / (dispatch kernel + combine kernel)")
    for col in ("backend", "transport", "routing", "T"):
        t.add_column(col, no_wrap=True)
    for col in ("pair us", "host dispatch us", "host combine us", "kernels d + c us", "vs kernels",
                "DeepEP pair us", "vs DeepEP"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in measured:
        pair = r.eager.get("pair")
        d, c = r.kernel.get("dispatch"), r.kernel.get("combine")
        ksum = "-" if d is None or c is None or math.isnan(d.mean + c.mean) else f"{d.mean:.1f} + {c.mean:.1f}"
        ratio = r.eager_vs_kernels()
        native = r.backend == "native"
        dp = deepep_pair_us if native and deepep_pair_us and r.tokens == cfg.tokens[0] else None   # DeepEP ran T[0]
        t.add_row(r.backend, escape(r.transport), r.routing, str(r.tokens), _us(pair),
                  _us(r.eager.get("host_dispatch")), _us(r.eager.get("host_combine")), ksum,
                  "-" if math.isnan(ratio) else f"{ratio:.2f}x",
                  f"{dp:.1f}" if dp else "-",
                  f"{pair.mean / dp:.2f}x" if dp and pair is not None and not math.isnan(pair.mean) else "-")
    console.print(t)


def render(console: Any, cfg: BenchConfig, env: Dict[str, Any], rows: Sequence[CaseRow],
           notes: Sequence[str], deepep_pair_us: Optional[float] = None) -> None:
    from rich.markup import escape
    from rich.table import Table
    world, gpu = env["world_size"], (env["device_names"][0] if env["device_names"] else "")
    measured = [r for r in rows if not r.skipped]
    on_cpu = bool(measured) and all(r.kernel_source.startswith("wall") for r in measured)
    kinds = ["wall"] if on_cpu else ["kernel", "wall"]   # on CPU a kernel table would repeat the wall one
    fmt = "FP8" if cfg.use_fp8 else "BF16"
    for kind in kinds:
        title = ("per-kernel GPU time (kineto)" if kind == "kernel" else
                 "wall time of the whole call (" + ("host clock, CPU run" if on_cpu else "CUDA events") + ")")
        t = Table(title=f"pyep bench: {title}, {fmt} dispatch / BF16 combine, H={cfg.hidden} K={cfg.topk} "
                        f"E={cfg.experts}, {world} ranks on {gpu}",
                  caption="us = mean (p99) over iterations, max over ranks; GB/s per rank; "
                          "halves = send + receive (recv hook)")
        for col in ("backend", "transport", "routing", "T", "check"):
            t.add_column(col, no_wrap=True)
        for col in ("dispatch us", "combine us", "d+c us", "GB/s d / c / d+c", "dispatch halves",
                    "combine halves"):
            t.add_column(col, justify="right", no_wrap=True)
        for r in rows:
            if r.skipped:
                t.add_row(r.backend, escape(r.transport), r.routing, str(r.tokens), "skipped",
                          escape(r.skipped[:60]), "", "", "", "", "")
                continue
            st = r.kernel if kind == "kernel" else r.wall
            g = r.gbps(kind)
            assert r.check is not None
            t.add_row(r.backend, escape(r.transport + (f" ({r.transport_detail})" if r.transport_detail else "")),
                      r.routing, str(r.tokens),
                      "[green]PASS[/green]" if r.check.passed else "[bold red]FAIL[/bold red]",
                      _us(st.get("dispatch")), _us(st.get("combine")), _us(st.get("dc")),
                      f"{_g(g.get('dispatch'))} / {_g(g.get('combine'))} / {_g(g.get('dc'))}",
                      _half(st.get("d_send"), st.get("d_recv")), _half(st.get("c_send"), st.get("c_recv")))
        for tokens in cfg.tokens:
            ref = refnum.deepep_row(world, gpu, tokens, cfg.hidden, cfg.topk, cfg.experts, cfg.use_fp8)
            if ref is None:
                continue
            # DeepEP's per-kernel ranges belong in the kernel table; its d+c figure is a wall time.
            d = refnum.fmt_range(ref.dispatch_us) if kind == "kernel" else "-"
            c = refnum.fmt_range(ref.combine_us) if kind == "kernel" else "-"
            halves_d = (f"{refnum.fmt_range(ref.dispatch_send_us)} + {refnum.fmt_range(ref.dispatch_recv_us)}"
                        if kind == "kernel" else "-")
            halves_c = (f"{refnum.fmt_range(ref.combine_send_us)} + {refnum.fmt_range(ref.combine_recv_us)}"
                        if kind == "kernel" else "-")
            t.add_row(f"[italic]{refnum.LABEL}[/italic]", "nvlink (NVSHMEM)", "uniform", str(tokens), "n/a",
                      d, c, f"{ref.dispatch_combine_us:g}", f"- / - / {ref.dispatch_combine_gbps:g}",
                      halves_d, halves_c)
        console.print(t)
    render_eager(console, cfg, env, rows, deepep_pair_us)
    failed = [r for r in measured if r.check is not None and not r.check.passed]
    for r in failed:
        assert r.check is not None
        console.print(f"[bold red]correctness FAIL[/bold red] {r.backend}/{r.transport} {r.routing} "
                      f"T={r.tokens}: {escape(r.check.detail)}")
    for r in measured:
        if not on_cpu and r.host:
            console.print(escape(host_line(r)))
        for line in outlier_lines(r):
            console.print(escape(line))
    for tokens in cfg.tokens:
        hint = next((r.size_hint_bytes for r in rows if r.tokens == tokens), None)
        console.print(escape(size_hint_line(cfg, world, tokens, hint)))
    for n in notes:
        console.print(f"note: {escape(n)}")
