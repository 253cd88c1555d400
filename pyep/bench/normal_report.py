"""What rank 0 of `pyep bench --mode normal` shows and writes: the tables (rich, 120 columns), the SM
sweep beside DeepEP's own harness of the same run and the memory copy rate, bench_normal.json; plus
the flags -> NormalBenchConfig translation (ValueError on bad input). The command (`pyep bench --mode
normal`) drives the run and prints what these return; normal_plot.py draws the PNG."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import copy_rate
from .normal import DEFAULT_SWEEP_SMS, PHASES, NormalBenchConfig, NormalRow
from .report import _clean, run_lines, where
from .tables import emit, gbps, num, percent, ratio, table

SCHEMA = "pyep-bench-normal/2"
DEEPEP_LABEL = "DeepEP V1 (same machine, its test_intranode.py)"
# (our phase, DeepEP's figure) pairs shown side by side.
DEEPEP_COLUMNS = (("cached_fp8", "dispatch_fp8"), ("cached_bf16", "dispatch_bf16"), ("combine", "combine"))
# What the sweep compares: wall time (CUDA events around each call), as DeepEP's bench() times its calls.
SWEEP_KIND = "wall"


# ---------------------------------------------------------------------- the sweep's figures
def _best(doc: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    return (doc or {}).get("figures") or {}


def sweep(rows: Sequence[NormalRow], world: int, deepep: Optional[Dict[str, Any]] = None,
          shim: Optional[Dict[str, Any]] = None, copy: Optional[copy_rate.CopyRate] = None,
          one_device: bool = False) -> List[Dict[str, Any]]:
    """One entry per measured row, then DeepEP's best and pyep's shim's best under DeepEP's harness
    (where they ran): GB/s of FP8 / BF16 dispatch and combine (wall time), the ratio to DeepEP's best
    of the same run, and the share of the copy rate (ranks on one device only)."""
    figs = _best(deepep)
    out: List[Dict[str, Any]] = []

    def entry(label: str, sms: Any, gbps: Dict[str, float]) -> Dict[str, Any]:
        vs = {k: (gbps[k] / figs[k]["gbps"] if figs.get(k) and not math.isnan(gbps[k]) else math.nan)
              for _, k in DEEPEP_COLUMNS}
        of = {k: (copy_rate.fraction(gbps[k], world, copy) if one_device else math.nan) for _, k in DEEPEP_COLUMNS}
        return {"label": label, "num_sms": sms, "gbps": gbps, "vs_deepep": vs, "of_copy_rate": of}
    for r in rows:
        if r.skipped or not r.stats:
            continue
        g = r.gbps(SWEEP_KIND)
        out.append(entry(f"pyep {r.backend}", r.num_sms, {k: g.get(p, math.nan) for p, k in DEEPEP_COLUMNS}))
    for label, doc in (("pyep via DeepEP's test", shim), ("DeepEP", deepep)):
        label = (doc or {}).get("label") or label      # DeepEP's bench() loop where its test did not fit
        f = _best(doc)
        if all(f.get(k) for _, k in DEEPEP_COLUMNS):
            sms = sorted({f[k]["num_sms"] for _, k in DEEPEP_COLUMNS})
            out.append(entry(label, "/".join(map(str, sms)), {k: float(f[k]["gbps"]) for _, k in DEEPEP_COLUMNS}))
    return out


# ---------------------------------------------------------------------- tables
def _split(r: NormalRow, phase: str) -> str:
    """Kernel table: main + aux (notify) where the phase launched aux kernels."""
    main = r.stats.get("kernel", {}).get(phase)
    aux = r.stats.get("aux", {}).get(phase)
    m = main.mean if main is not None else math.nan
    a = aux.mean if aux is not None else math.nan
    return num(m) if math.isnan(a) else f"{num(m)} + {num(a)}"


def _cell(r: NormalRow, kind: str, phase: str, g: Dict[str, float]) -> str:
    return f"{num(r.time_us(kind, phase))} / {gbps(g.get(phase))}"


def render(console: Any, cfg: NormalBenchConfig, env: Dict[str, Any], rows: Sequence[NormalRow],
           notes: Sequence[str], deepep: Optional[Dict[str, Any]] = None,
           copy: Optional[copy_rate.CopyRate] = None, shim: Optional[Dict[str, Any]] = None) -> None:
    from rich.markup import escape
    measured = [r for r in rows if not r.skipped and r.stats]
    on_cpu = bool(measured) and all(r.kernel_source.startswith("wall") for r in measured)
    figs = _best(deepep)
    shape = f"N={cfg.tokens} H={cfg.hidden} K={cfg.topk} E={cfg.experts} {cfg.routing.label}, {where(env)}"
    if cfg.combine_input == "pool":
        shape += "; combine input from get_combine_input (pull)"
    run_lines(console, env)
    for kind in (["wall"] if on_cpu else ["kernel", "wall"]):
        what = ("per-kernel GPU time (kineto; main + notify/layout kernels)" if kind == "kernel" else
                "wall time per call (" + ("host clock" if on_cpu else "CUDA events") + ")")
        t = table()
        for col in ("backend", "SMs", "check", "recv\nrows"):
            t.add_column(col)
        disp = "dispatch FP8\nmain + notify us" if kind == "kernel" else "dispatch\nFP8 us"
        for col in ("layout\nus", disp, "FP8 cached\nus / GB/s", "BF16 cached\nus / GB/s", "combine\nus / GB/s",
                    "eager l+d+c\nus / GB/s"):
            t.add_column(col, justify="right")
        for r in rows:
            if r.skipped:
                t.add_row(r.backend, str(r.num_sms), "skipped", "", "", "", "", "", "", "")
                continue
            assert r.check is not None
            check = "[green]PASS[/green]" if r.check.passed else "[bold red]FAIL[/bold red]"
            recv = str(max(r.recv_tokens)) if r.recv_tokens else "-"
            if not r.stats:
                t.add_row(r.backend, str(r.num_sms), check, recv, "not timed", "", "", "", "", "")
                continue
            g = r.gbps(kind)
            d = _split(r, "dispatch") if kind == "kernel" else num(r.time_us(kind, "dispatch"))
            t.add_row(r.backend, str(r.num_sms), check, recv, num(r.time_us(kind, "layout")), d,
                      *(_cell(r, kind, p, g) for p in ("cached_fp8", "cached_bf16", "combine", "eager")))
        for label, source in (("best", figs), ("default cfg", figs.get("default") or {})):
            if kind != "wall" or not any(source.get(k) for _, k in DEEPEP_COLUMNS):
                continue
            cells = ["-" if not source.get(k) else f"{source[k]['t_us']:.1f} / {source[k]['gbps']:.0f}"
                     for _, k in DEEPEP_COLUMNS]
            sms = sorted({source[k]["num_sms"] for _, k in DEEPEP_COLUMNS if source.get(k)})
            layout = num(figs.get("layout_us", math.nan)) if label == "best" else "-"
            t.add_row(f"[italic]DeepEP {label}[/italic]", "/".join(map(str, sms)), "n/a", "-", layout, "-",
                      *cells, "-")
        emit(console, f"pyep bench --mode normal: {what}\n{shape}", t,
             "us / GB/s: mean over iterations, max over ranks; GB/s per rank as DeepEP's test_intranode.py counts "
             "bytes (received rows x 2H; FP8 x (1+4/128)/2); cached = dispatch with the handle")
    for r in rows:
        if r.skipped:
            console.print(escape(f"skipped: {r.backend} {r.num_sms} SMs: {r.skipped}"))
    render_sweep(console, cfg, env, rows, deepep, copy, shim)
    for r in rows:
        if r.check is not None and not r.check.passed:
            console.print(f"[bold red]correctness FAIL[/bold red] {r.backend} {r.num_sms} SMs (not timed): "
                          f"{escape(r.check.detail)}")
    if figs:
        chunks = ", ".join(f"{k} c{figs[k]['nvl_chunk']}" for _, k in DEEPEP_COLUMNS if figs.get(k))
        console.print(escape(f"{DEEPEP_LABEL}: CUDA events around back-to-back calls (its bench()), so it "
                             f"compares with the wall figures; its best NVL chunks: {chunks}"))
    for n in notes:
        console.print(f"note: {escape(n)}")


def render_sweep(console: Any, cfg: NormalBenchConfig, env: Dict[str, Any], rows: Sequence[NormalRow],
                 deepep: Optional[Dict[str, Any]], copy: Optional[copy_rate.CopyRate],
                 shim: Optional[Dict[str, Any]]) -> None:
    """The SM sweep in one table: GB/s, x DeepEP's best of this run, share of the copy rate."""
    from rich.text import Text
    world = int(env["world_size"])
    one = one_device(env)
    measured = [r for r in rows if not r.skipped and r.stats]
    clock = "host clock" if measured and all(r.kernel_source.startswith("wall") for r in measured) else "CUDA events"
    entries = sweep(rows, world, deepep, shim, copy, one)
    if not entries:
        return
    if copy is not None:
        console.print(Text(f"copy rate: {copy.best_gbps:.0f} GB/s (best of {copy.reps}; median "
                           f"{copy.median_gbps:.0f}), {copy.what}, {copy.bytes >> 20} MB, {copy_rate.COUNTING}"))
    ks = [k for _, k in DEEPEP_COLUMNS]
    with_deepep = any(not math.isnan(e["vs_deepep"][k]) for e in entries for k in ks)
    t = table()
    for col in ("row", "SMs"):
        t.add_column(col)
    cols = [("GB/s per rank\nFP8 / BF16 / combine", lambda e: " / ".join(gbps(e["gbps"][k]) for k in ks))]
    if with_deepep:
        cols.append(("x DeepEP best\nFP8 / BF16 / combine", lambda e: " / ".join(ratio(e["vs_deepep"][k]) for k in ks)))
    if copy is not None:
        cols.append(("of copy rate\nFP8 / BF16 / combine",
                     lambda e: " / ".join(percent(e["of_copy_rate"][k]) for k in ks)))
    for name, _fn in cols:
        t.add_column(name, justify="right")
    for e in entries:
        t.add_row(e["label"], str(e["num_sms"]), *(fn(e) for _name, fn in cols))
    caption = []
    if with_deepep:
        caption.append("x DeepEP best = GB/s over DeepEP's best (its SMs, its chunk sweep) in this run")
    if copy is not None:
        caption.append("of copy rate = GB/s x ranks x 2 / copy rate" if one else
                       "of copy rate: only for ranks on one device (separate GPUs are bound by NVLink)")
    beside = " beside DeepEP's harness of the same run" if with_deepep else ""
    emit(console, f"SM sweep: GB/s per rank from the wall time ({clock}){beside}\n{where(env)}", t,
         "; ".join(caption))


def one_device(env: Dict[str, Any]) -> bool:
    return (env.get("sharing") or {}).get("devices_in_use") == 1


# ---------------------------------------------------------------------- JSON
def document(cfg: NormalBenchConfig, env: Dict[str, Any], rows: Sequence[NormalRow], notes: Sequence[str],
             deepep: Optional[Dict[str, Any]] = None, copy: Optional[copy_rate.CopyRate] = None,
             shim: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
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
        "copy_rate": copy.as_dict() if copy is not None else None,
        "sweep": {"time": SWEEP_KIND, "copy_fraction": "per-rank GB/s x ranks x 2 / copy_rate.best_gbps (ranks on "
                                                       "one device only)",
                  "entries": sweep(rows, int(env["world_size"]), deepep, shim, copy, one_device(env))},
        "deepep": deepep, "deepep_harness_on_pyep": shim})


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
        wait_timeout_s=args.wait_timeout_s, plot=not args.no_plot,
        copy_mb=NormalBenchConfig.copy_mb if args.copy_mb is None else args.copy_mb,
        combine_input=args.combine_input)
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


__all__ = ["render", "document", "sweep", "config_from_args", "DEFAULT_SWEEP_SMS"]
