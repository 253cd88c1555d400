"""What rank 0 of `pyep bench --mode normal` shows and writes: the tables (rich), DeepEP's figures of the
same run beside ours (tools/deepep_baseline.py), bench_normal.json and the PNG plot (matplotlib,
when installed); plus the flags -> NormalBenchConfig translation (ValueError on bad input). The
command (`pyep bench --mode normal`) drives the run and prints what these return."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .normal import DEFAULT_SWEEP_SMS, PHASES, NormalBenchConfig, NormalRow
from .report import _clean

log = logging.getLogger("pyep.bench")
SCHEMA = "pyep-bench-normal/1"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASELINE_TOOL = os.path.join(ROOT, "tools", "deepep_baseline.py")
DEEPEP_LABEL = "DeepEP V1 (same machine, its test_intranode.py)"
# (our phase, DeepEP's figure) pairs shown side by side.
DEEPEP_COLUMNS = (("cached_fp8", "dispatch_fp8"), ("cached_bf16", "dispatch_bf16"), ("combine", "combine"))


# ---------------------------------------------------------------------- DeepEP's figures
def load_baseline_tool() -> Any:
    """tools/deepep_baseline.py as a module (it lives beside the package in a checkout)."""
    if not os.path.isfile(BASELINE_TOOL):
        raise FileNotFoundError(f"{BASELINE_TOOL} is missing: --deepep needs a pyep checkout")
    spec = importlib.util.spec_from_file_location("pyep_deepep_baseline", BASELINE_TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def deepep_figures(mode: str, num_ranks: int, extra: Sequence[str], out_dir: str,
                   json_path: Optional[str] = None) -> Tuple[Optional[Dict[str, Any]], str]:
    """(DeepEP document, note). Loads json_path when given, else runs DeepEP now. Never raises for a
    missing DeepEP: the note says what happened and the table goes on without it."""
    try:
        if json_path:
            with open(json_path, encoding="utf-8") as fh:
                doc = json.load(fh)
            return doc, f"DeepEP figures from {json_path}"
        tool = load_baseline_tool()
        doc = tool.run(mode, num_ranks, list(extra), os.path.join(out_dir, "deepep"))
        tool.write(os.path.join(out_dir, f"deepep_{mode}.json"), doc)
    except (OSError, ValueError) as exc:
        return None, f"DeepEP figures unavailable: {exc}"
    except Exception as exc:  # noqa: BLE001 - DeepEpUnavailable and friends: a note, not a crash
        return None, f"DeepEP figures unavailable: {type(exc).__name__}: {exc}"
    if not doc.get("ok"):
        return doc, (f"DeepEP ran (rc={doc.get('rc')}) but printed no complete figures; see "
                     f"{doc.get('log') or 'its output'}")
    return doc, f"DeepEP {mode} measured in this run ({doc.get('seconds', '?')} s, log {doc.get('log')})"


# ---------------------------------------------------------------------- tables
def _us(v: float) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.1f}"


def _g(v: Optional[float]) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.0f}"


def _cell(r: NormalRow, kind: str, phase: str, g: Dict[str, float]) -> str:
    t = r.time_us(kind, phase)
    return f"{_us(t)} / {_g(g.get(phase))}"


def _split(r: NormalRow, phase: str) -> str:
    """Kernel table: main + aux (notify) where the phase launched aux kernels."""
    main = r.stats.get("kernel", {}).get(phase)
    aux = r.stats.get("aux", {}).get(phase)
    m = main.mean if main is not None else math.nan
    a = aux.mean if aux is not None else math.nan
    return _us(m) if math.isnan(a) else f"{_us(m)} + {_us(a)}"


def render(console: Any, cfg: NormalBenchConfig, env: Dict[str, Any], rows: Sequence[NormalRow],
           notes: Sequence[str], deepep: Optional[Dict[str, Any]] = None) -> None:
    from rich.markup import escape
    from rich.table import Table
    world, gpu = env["world_size"], (env["device_names"][0] if env["device_names"] else "")
    measured = [r for r in rows if not r.skipped and r.stats]
    on_cpu = bool(measured) and all(r.kernel_source.startswith("wall") for r in measured)
    figs = (deepep or {}).get("figures") or {}
    for kind in (["wall"] if on_cpu else ["kernel", "wall"]):
        what = ("per-kernel GPU time (kineto; main + notify/layout kernels)" if kind == "kernel" else
                "wall time of the call (" + ("host clock, CPU run" if on_cpu else "CUDA events") + ")")
        t = Table(title=f"pyep bench --mode normal: {what}; N={cfg.tokens} H={cfg.hidden} K={cfg.topk} "
                        f"E={cfg.experts} {cfg.routing.label}, {world} ranks on {gpu}",
                  caption="us / GB/s: mean over iterations, max over ranks; GB/s as test_intranode.py counts "
                          "NVLink bytes (received rows x 2H; FP8 x (1+4/128)/2); cached = dispatch with the handle")
        for col in ("backend", "SMs", "check", "recv rows"):
            t.add_column(col, no_wrap=True)
        for col in ("layout us", "dispatch FP8 us", "cached FP8 us / GB/s", "cached BF16 us / GB/s",
                    "combine us / GB/s", "eager l+d+c us / GB/s"):
            t.add_column(col, justify="right", no_wrap=True)
        for r in rows:
            if r.skipped:
                t.add_row(r.backend, str(r.num_sms), "skipped", escape(r.skipped[:60]), "", "", "", "", "", "")
                continue
            assert r.check is not None
            check = "[green]PASS[/green]" if r.check.passed else "[bold red]FAIL[/bold red]"
            recv = str(max(r.recv_tokens)) if r.recv_tokens else "-"
            if not r.stats:
                t.add_row(r.backend, str(r.num_sms), check, recv, "not timed", "", "", "", "", "")
                continue
            g = r.gbps(kind)
            disp = _split(r, "dispatch") if kind == "kernel" else _us(r.time_us(kind, "dispatch"))
            t.add_row(r.backend, str(r.num_sms), check, recv, _us(r.time_us(kind, "layout")), disp,
                      *(_cell(r, kind, p, g) for p in ("cached_fp8", "cached_bf16", "combine", "eager")))
        for label, source in (("best", figs), ("default cfg", figs.get("default") or {})):
            if not any(source.get(k) for _, k in DEEPEP_COLUMNS):
                continue
            cells = []
            for _ours, key in DEEPEP_COLUMNS:
                f = source.get(key)
                cells.append("-" if not f else f"{f['t_us']:.1f} / {f['gbps']:.0f} (c{f['nvl_chunk'] or 'dflt'})")
            sms = sorted({source[k]["num_sms"] for _, k in DEEPEP_COLUMNS if source.get(k)})
            layout = _us(figs.get("layout_us", math.nan)) if label == "best" else "-"
            t.add_row(f"[italic]DeepEP {label}[/italic]", "/".join(map(str, sms)), "n/a", "-", layout, "-",
                      *cells, "-")
        console.print(t)
    for r in rows:
        if r.check is not None and not r.check.passed:
            console.print(f"[bold red]correctness FAIL[/bold red] {r.backend} {r.num_sms} SMs (not timed): "
                          f"{escape(r.check.detail)}")
    if figs:
        console.print(escape(f"{DEEPEP_LABEL}: times are CUDA events around back-to-back calls (its bench()), "
                             f"so compare them with the wall table; (cN) = its NVL chunk"))
    for n in notes:
        console.print(f"note: {escape(n)}")


# ---------------------------------------------------------------------- JSON
def document(cfg: NormalBenchConfig, env: Dict[str, Any], rows: Sequence[NormalRow], notes: Sequence[str],
             deepep: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    config = dataclasses.asdict(cfg)
    config["routing"] = cfg.routing.label
    return _clean({
        "schema": SCHEMA, "config": config, "environment": env, "notes": list(notes),
        "phases": list(PHASES),
        "units": {"time": "microseconds", "bandwidth": "GB/s (1e9 bytes/s), per rank",
                  "stats": "mean/p50/p99 over iterations, each the maximum over ranks",
                  "gbps": "mean bytes per rank / (max over ranks of the mean time); kernel = main + aux kernels"},
        "byte_model": {"bf16": "received rows x 2H (dispatch BF16, combine)", "fp8": "bf16 x (1 + 4/128) / 2",
                       "eager": "fp8 + bf16", "source": "DeepEP tests/test_intranode.py"},
        "rows": [r.as_dict() for r in rows],
        "deepep": deepep})


# ---------------------------------------------------------------------- plot
def plot(path: str, cfg: NormalBenchConfig, rows: Sequence[NormalRow], deepep: Optional[Dict[str, Any]],
         title: str, internode: Optional[Dict[str, Any]] = None) -> Optional[str]:
    """GB/s per SM count; across nodes (internode: normal_internode_report.summary) also the RDMA GB/s,
    the model's expectation and DeepEP's published band."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        log.warning("no plot: matplotlib is not importable (%s); `pip install matplotlib` for %s", exc, path)
        return None
    measured = [r for r in rows if not r.skipped and r.stats]
    if not measured:
        log.warning("no plot: no row was measured")
        return None
    fig, axes = plt.subplots(1, len(DEEPEP_COLUMNS), figsize=(15, 4.5), sharey=True)
    figs = (deepep or {}).get("figures") or {}
    for ax, (phase, key) in zip(axes, DEEPEP_COLUMNS):
        for backend in sorted({r.backend for r in measured}):
            rs = sorted((r for r in measured if r.backend == backend), key=lambda r: r.num_sms)
            for kind, style in (("kernel", "o-"), ("wall", "s--")):
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
        if figs.get(key):
            f = figs[key]
            ax.axhline(f["gbps"], color="k", linestyle=":", label=f"DeepEP best ({f['num_sms']} SMs)")
        ax.set_title({"cached_fp8": "dispatch FP8", "cached_bf16": "dispatch BF16", "combine": "combine BF16"}[phase])
        ax.set_xlabel("SMs")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("GB/s per rank (NVLink bytes, DeepEP's count)" if internode is None else
                       "GB/s per rank (NVL and RDMA bytes, test_internode.py's counts)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------- command line
def config_from_args(args: Any, cuda: bool) -> Tuple[NormalBenchConfig, List[str]]:
    """NormalBenchConfig from `pyep bench --mode normal` flags; ValueError on bad input."""
    from .config import RoutingSpec
    notes: List[str] = []
    for flag, bad in (("--tokens-sweep", args.tokens_sweep), ("--no-hook", args.no_hook),
                      ("--ranks-per-node", args.ranks_per_node is not None)):
        if bad:
            raise ValueError(f"{flag} is a low-latency option; --mode normal does not take it")
    if args.num_sms is not None and args.sweep_sms is not None:
        raise ValueError("--num-sms and --sweep-sms are exclusive")
    if args.sweep_sms is not None:
        sms = tuple(int(v) for v in str(args.sweep_sms).split(",") if v.strip())
    else:
        sms = (args.num_sms if args.num_sms is not None else _default_num_sms(),)
    backend = args.backend or "auto"
    backends = {"auto": ("native",) if cuda else ("reference",), "native": ("native",),
                "reference": ("reference",), "both": ("native", "reference")}[backend]
    routings = [r for r in str(args.routing).split(",") if r.strip()]
    if len(routings) != 1:
        raise ValueError(f"--mode normal takes one routing, got {args.routing!r}")
    tokens = 4096 if args.tokens is None else int(str(args.tokens))
    cfg = NormalBenchConfig(
        tokens=tokens, hidden=7168 if args.hidden is None else args.hidden, topk=8 if args.topk is None else args.topk,
        experts=256 if args.experts is None else args.experts, num_sms=sms, backends=backends,
        routing=RoutingSpec.parse(routings[0], args.zipf_s, args.hot_fraction), hot_expert=args.hot_expert,
        drop_fraction=args.drop_fraction, iters=args.iters, warmup=args.warmup, kineto=not args.no_kineto,
        seed=args.seed, transport=args.transport or "auto",
        timeout_us=args.timeout_us if args.timeout_us is not None else 10_000_000,
        wait_timeout_s=args.wait_timeout_s, plot=not args.no_plot)
    if backend == "auto" and not cuda:
        notes.append("no CUDA device: measuring the reference backend only")
    return cfg, notes


def _default_num_sms() -> int:
    try:
        from ..ep.normal import NormalBuffer
        return int(NormalBuffer.num_sms)
    except (ImportError, AttributeError):
        from ..ep.normal.config import DEFAULT_NUM_SMS
        return DEFAULT_NUM_SMS


__all__ = ["render", "document", "plot", "config_from_args", "deepep_figures", "DEFAULT_SWEEP_SMS"]
