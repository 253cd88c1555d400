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
from .sharing import Sharing
from .suite import CaseRow
from .tables import count, emit, gbps, table, us

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


def environment(device_names: List[str], dist_backend: str, sharing: Optional[Sharing] = None) -> Dict[str, Any]:
    """The run's environment for the JSON; with `sharing`, how the ranks sat on devices (the words of
    the table titles, MPS on or off) too."""
    import torch

    from .._native import availability
    from .._version import __version__
    pkg_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"world_size": len(device_names), "device_names": device_names, "dist_backend": dist_backend,
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "host": platform.node(), "pyep": __version__, "pyep_build": availability().describe(),
           "git": git_commit(pkg_dir), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if sharing is not None:
        env.update({"device": "cuda" if sharing.cuda else "cpu", "where": sharing.where(),
                    "sharing": sharing.as_dict(), "sharing_notes": sharing.header_notes()})
    return env


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
def _mean(s: Optional[Stat]) -> str:
    return us(None if s is None else s.mean)


def _us(s: Optional[Stat]) -> str:
    if s is None or math.isnan(s.mean):
        return "-"
    return f"{us(s.mean)} ({us(s.p99)})"


def _half(a: Optional[Stat], b: Optional[Stat]) -> str:
    if a is None or b is None or math.isnan(a.mean) or math.isnan(b.mean):
        return "-"
    return f"{us(a.mean)} + {us(b.mean)}"


def where(env: Dict[str, Any]) -> str:
    """'2 ranks sharing one NVIDIA H100 (MPS)', '1 rank on the CPU (x86_64)': sharing.Sharing.where() when
    the run recorded it, else from the device names."""
    if env.get("where"):
        return str(env["where"])
    names = env.get("device_names") or ["?"]
    return f"{count(int(env['world_size']), 'rank')} on {names[0]}"


def run_lines(console: Any, env: Dict[str, Any]) -> None:
    """How the ranks shared devices (MPS on or off), above the tables."""
    from rich.text import Text
    for line in env.get("sharing_notes") or []:
        console.print(Text(line))


def row_key(r: CaseRow) -> str:
    return f"{r.backend}/{r.transport}"


def size_hint_line(cfg: BenchConfig, world_size: int, tokens: int, hint: Optional[int]) -> str:
    shape = f"T={tokens} H={cfg.hidden} E={cfg.experts} K={cfg.topk} R={world_size}"
    if hint is None:
        return f"buffer size hint, {shape}: unavailable (see the warnings above)"
    line = f"buffer size hint, {shape}: {hint} bytes = {hint / GB:.3f} GB"
    deepep = refnum.deepep_buffer_bytes(tokens, cfg.hidden, cfg.experts)
    if deepep is not None:
        line += f" (DeepEP's LL buffer: {deepep / GB:.3f} GB)"
    return line


def outlier_lines(r: CaseRow, ratio: float = 1.1) -> List[str]:
    """A note for each per-kernel mean (the call's, on a CPU run) that a few slow iterations pulled well
    above the median."""
    what = "call" if r.kernel_source.startswith("wall") else "per-kernel"
    out = []
    for m, st in r.kernel.items():
        if st is None or math.isnan(st.mean) or math.isnan(st.p50) or st.p50 <= 0:
            continue
        if st.mean > ratio * st.p50:
            out.append(f"note: {r.backend}/{r.transport} {r.routing} T={r.tokens} {m}: {what} mean "
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


def _shape(cfg: BenchConfig, env: Dict[str, Any]) -> str:
    fmt = "FP8" if cfg.use_fp8 else "BF16"
    return f"{fmt} dispatch / BF16 combine, H={cfg.hidden} K={cfg.topk} E={cfg.experts}; {where(env)}"


def _on_cpu(rows: Sequence[CaseRow]) -> bool:
    measured = [r for r in rows if not r.skipped]
    return bool(measured) and all(r.kernel_source.startswith("wall") for r in measured)


def render_eager(console: Any, cfg: BenchConfig, env: Dict[str, Any], rows: Sequence[CaseRow],
                 deepep_pair_us: Optional[float] = None) -> None:
    """The eager table: the pair time of back-to-back dispatch+combine (default arguments, CUDA
    events around each pair; the host clock on a CPU run), the host time per call inside that loop,
    the pair against the sum of the two calls' device time, and DeepEP's eager pair from the same run
    where it was measured."""
    measured = [r for r in rows if not r.skipped and r.eager]
    if not measured:
        return
    on_cpu = _on_cpu(measured)
    unit = "calls" if on_cpu else "kernels"
    t = table()
    for col in ("row", "routing", "T"):
        t.add_column(col, no_wrap=True)
    for col in ("pair us", "host us\nd / c", f"{unit} us\nd + c", f"pair /\n{unit}", "DeepEP\npair us",
                "pyep /\nDeepEP"):
        t.add_column(col, justify="right")
    for r in measured:
        pair = r.eager.get("pair")
        d, c = r.kernel.get("dispatch"), r.kernel.get("combine")
        ksum = "-" if d is None or c is None or math.isnan(d.mean + c.mean) else f"{us(d.mean)} + {us(c.mean)}"
        ratio = r.eager_vs_kernels()
        native = r.backend == "native"
        dp = deepep_pair_us if native and deepep_pair_us and r.tokens == cfg.tokens[0] else None   # DeepEP ran T[0]
        t.add_row(row_key(r), r.routing, str(r.tokens), _us(pair),
                  f"{_mean(r.eager.get('host_dispatch'))} / {_mean(r.eager.get('host_combine'))}", ksum,
                  "-" if math.isnan(ratio) else f"{ratio:.2f}x",
                  f"{dp:.1f}" if dp else "-",
                  f"{pair.mean / dp:.2f}x" if dp and pair is not None and not math.isnan(pair.mean) else "-")
    clock = "host clock" if on_cpu else "CUDA events around each pair"
    emit(console, "pyep bench: eager loop (back-to-back dispatch+combine, default arguments, one stream)\n"
                  + _shape(cfg, env), t,
         f"pair us = mean (p99) over pairs ({clock}), max over ranks; host = CPU time inside each call; "
         f"pair / {unit} = pair over the dispatch + combine {'call' if on_cpu else 'kernel'} times")


def render_halves(console: Any, cfg: BenchConfig, env: Dict[str, Any], rows: Sequence[CaseRow]) -> None:
    """The recv-hook halves: send and receive half of each call, per kernel (GPU) and wall."""
    measured = [r for r in rows if not r.skipped]
    if not cfg.hook or not measured:
        return
    on_cpu = _on_cpu(measured)
    kinds = ["wall"] if on_cpu else ["kernel", "wall"]
    t = table()
    for col in ("row", "routing", "T"):
        t.add_column(col, no_wrap=True)
    for kind in kinds:
        for call in ("dispatch", "combine"):
            t.add_column(f"{kind} us\n{call} send + recv", justify="right")
    for r in measured:
        cells = []
        for kind in kinds:
            st = r.kernel if kind == "kernel" else r.wall
            cells += [_half(st.get("d_send"), st.get("d_recv")), _half(st.get("c_send"), st.get("c_recv"))]
        t.add_row(row_key(r), r.routing, str(r.tokens), *cells)
    world, gpu = env["world_size"], (env["device_names"][0] if env["device_names"] else "")
    for tokens in cfg.tokens:
        ref = refnum.deepep_row(world, gpu, tokens, cfg.hidden, cfg.topk, cfg.experts, cfg.use_fp8)
        if ref is not None and "kernel" in kinds:
            t.add_row("[italic]DeepEP (ref)[/italic]", "uniform", str(tokens),
                      f"{refnum.fmt_range(ref.dispatch_send_us)} + {refnum.fmt_range(ref.dispatch_recv_us)}",
                      f"{refnum.fmt_range(ref.combine_send_us)} + {refnum.fmt_range(ref.combine_recv_us)}", "-", "-")
    emit(console, "pyep bench: the two halves of each call (recv hook: send, then receive)\n" + _shape(cfg, env), t,
         "us = mean over iterations, max over ranks" + ("" if on_cpu else "; kernel = per-kernel GPU time (kineto)"))


def render(console: Any, cfg: BenchConfig, env: Dict[str, Any], rows: Sequence[CaseRow],
           notes: Sequence[str], deepep_pair_us: Optional[float] = None) -> None:
    from rich.markup import escape
    world, gpu = env["world_size"], (env["device_names"][0] if env["device_names"] else "")
    measured = [r for r in rows if not r.skipped]
    on_cpu = _on_cpu(rows)
    kinds = ["wall"] if on_cpu else ["kernel", "wall"]   # on CPU a kernel table would repeat the wall one
    run_lines(console, env)
    for kind in kinds:
        what = ("per-kernel GPU time (kineto)" if kind == "kernel" else
                "wall time per call (" + ("host clock" if on_cpu else "CUDA events") + ")")
        t = table()
        for col in ("row", "routing", "T", "check"):
            t.add_column(col, no_wrap=True)
        for col in ("dispatch\nus", "combine\nus", "d+c\nus", "GB/s per rank\nd / c / d+c"):
            t.add_column(col, justify="right")
        for r in rows:
            if r.skipped:
                t.add_row(row_key(r), r.routing, str(r.tokens), "skipped", "", "", "", "")
                continue
            st = r.kernel if kind == "kernel" else r.wall
            g = r.gbps(kind)
            assert r.check is not None
            t.add_row(row_key(r), r.routing, str(r.tokens),
                      "[green]PASS[/green]" if r.check.passed else "[bold red]FAIL[/bold red]",
                      _mean(st.get("dispatch")), _mean(st.get("combine")), _mean(st.get("dc")),
                      f"{gbps(g.get('dispatch'))} / {gbps(g.get('combine'))} / {gbps(g.get('dc'))}")
        reference_row = False
        for tokens in cfg.tokens:
            ref = refnum.deepep_row(world, gpu, tokens, cfg.hidden, cfg.topk, cfg.experts, cfg.use_fp8)
            if ref is None:
                continue
            reference_row = True
            # DeepEP's per-kernel ranges belong in the kernel table; its d+c figure is a wall time.
            d = refnum.fmt_range(ref.dispatch_us) if kind == "kernel" else "-"
            c = refnum.fmt_range(ref.combine_us) if kind == "kernel" else "-"
            t.add_row("[italic]DeepEP (ref)[/italic]", "uniform", str(tokens), "n/a",
                      d, c, f"{ref.dispatch_combine_us:g}", f"- / - / {ref.dispatch_combine_gbps:g}")
        caption = "us = mean over iterations, max over ranks (p50 / p99 in bench.json)"
        if reference_row:
            caption += f"; DeepEP (ref) = {refnum.LABEL}, NVSHMEM over NVLink"
        emit(console, f"pyep bench: {what}\n{_shape(cfg, env)}", t, caption)
    skips: Dict[str, List[str]] = {}
    for r in rows:
        if r.skipped:
            skips.setdefault(f"{row_key(r)}: {r.skipped}", []).append(f"{r.routing} T={r.tokens}")
    for why, where_ in skips.items():
        console.print(escape(f"skipped ({', '.join(where_)}) {why}"))
    details = sorted({f"{row_key(r)}: {r.transport_detail}" for r in measured if r.transport_detail})
    if details:
        console.print(escape("peers reached by " + "; ".join(details)))
    render_halves(console, cfg, env, rows)
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
