"""`pyep bench`: the low-latency EP benchmark (`--mode normal`: the normal mode's, pyep/bench/normal.py).
Run one process per rank (torchrun or `pyep launch`); a plain `pyep bench` runs a single rank. More
ranks than GPUs share them: rank r on cuda:(r % GPUs), a gloo group, kernels side by side under the
CUDA MPS daemon (start it first: nvidia-cuda-mps-control -d; the output says when it is off).
Settings come from the flags, else from the PYEP_EP_* variables `pyep launch` exports, else the
defaults (T=128, H=7168, K=8, E=288, FP8 dispatch / BF16 combine).
Rank 0 prints the tables (120 columns) and writes bench.json, bench.txt and bench.png into --out.
Exit status: 0 all measured rows passed the correctness guard, 1 a row failed it or nothing could be
measured, 2 bad input."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..bench.config import BENCH_BACKENDS, DISPATCH_DTYPES, SWEEP_TOKENS, BenchConfig, RoutingSpec
from ..bench.normal import DEFAULT_SWEEP_SMS as NORMAL_SWEEP_SMS
from ..bench.normal import NormalBenchConfig
from . import CliError, check_output

log = logging.getLogger("pyep.bench")

# PYEP_* variable -> (flag dest, type): the launcher's EP settings, used where no flag is given.
ENV_DEFAULTS: Dict[str, Tuple[str, type]] = {
    "PYEP_EP_BACKEND": ("backend", str), "PYEP_EP_TRANSPORT": ("transport", str),
    "PYEP_EP_DIST_BACKEND": ("dist_backend", str), "PYEP_EP_NUM_EXPERTS": ("experts", int),
    "PYEP_EP_HIDDEN": ("hidden", int), "PYEP_EP_NUM_TOPK": ("topk", int),
    "PYEP_EP_MAX_DISPATCH_TOKENS": ("tokens", str), "PYEP_EP_TIMEOUT_US": ("timeout_us", int),
    "PYEP_VIRTUAL_NODE_SIZE": ("ranks_per_node", int),
}
BUILTIN_DEFAULTS = {"backend": "auto", "transport": "auto", "dist_backend": "auto", "experts": 288,
                    "hidden": 7168, "topk": 8, "tokens": "128", "timeout_us": 10_000_000,
                    "ranks_per_node": None}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("ll", "normal"), default="ll",
                   help="ll: low-latency dispatch/combine (default); normal: the high-throughput mode "
                        "(NormalBuffer; defaults N=4096 tokens per rank, H=7168, K=8, E=256)")
    g = p.add_argument_group("normal mode")
    g.add_argument("--num-sms", type=int, help="SMs of the dispatch/combine kernels (default NormalBuffer.num_sms)")
    g.add_argument("--sweep-sms", nargs="?", const=",".join(map(str, NORMAL_SWEEP_SMS)), metavar="LIST",
                   help=f"one row per SM count (default list {','.join(map(str, NORMAL_SWEEP_SMS))})")
    g.add_argument("--deepep", action="store_true",
                   help="also run DeepEP V1's own test (.anchors/deepep, tools/deepep_baseline.py) after ours and "
                        "show its figures; normal mode: its test_intranode.py on DeepEP and on pyep's shim")
    g.add_argument("--deepep-json", metavar="PATH", help="show DeepEP figures from an earlier "
                                                          "tools/deepep_baseline.py run instead")
    g.add_argument("--combine-input", choices=("fresh", "pool"), default="fresh",
                   help="the combine's input: a fresh tensor, as an expert GEMM returns it (push combine; "
                        "default), or one from NormalBuffer.get_combine_input (pull combine)")
    g.add_argument("--copy-mb", type=int, help="MB of the device's copy-rate measurement (default 256; 0 skips it)")
    g = p.add_argument_group("shape")
    g.add_argument("--tokens", help="max dispatch tokens per rank T, or a comma list (default 128; "
                                    "normal mode: tokens per rank, default 4096)")
    g.add_argument("--tokens-sweep", action="store_true",
                   help=f"T in {','.join(map(str, SWEEP_TOKENS))}, the buffer rebuilt for each")
    g.add_argument("--hidden", type=int, help="hidden size H, a multiple of 128 (default 7168)")
    g.add_argument("--topk", type=int, help="experts per token K (default 8)")
    g.add_argument("--experts", type=int, help="number of experts E, divisible by the ranks (default 288; "
                                                "normal mode 256)")
    g.add_argument("--dispatch-dtype", choices=DISPATCH_DTYPES, default="fp8")
    g = p.add_argument_group("routing")
    g.add_argument("--routing", default="uniform",
                   help="comma list of uniform, zipf[:S], hot[:FRACTION] (default uniform)")
    g.add_argument("--zipf-s", type=float, default=1.0, help="zipf exponent when not given inline")
    g.add_argument("--hot-fraction", type=float, default=0.25,
                   help="fraction of tokens that hit the hot expert, when not given inline")
    g.add_argument("--hot-expert", type=int, default=0, help="id of the hot expert (default 0)")
    g.add_argument("--drop-fraction", type=float, default=0.0,
                   help="fraction of (token, k) entries set to -1 (default 0)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("what to run")
    g.add_argument("--backend", choices=BENCH_BACKENDS,
                   help="auto: native and the reference beside it where native runs, else the reference")
    g.add_argument("--transport", help="native transport(s), comma list of auto, nvlink, ibgda, emulated, "
                                       "emulated-internode")
    g.add_argument("--ranks-per-node", type=int, help="virtual node size (default: detected)")
    g.add_argument("--iters", type=int, default=50)
    g.add_argument("--warmup", type=int, default=10)
    g.add_argument("--no-hook", action="store_true", help="skip the send/receive-half measurements")
    g.add_argument("--no-kineto", action="store_true", help="skip the profiled pass (no per-kernel times)")
    g.add_argument("--no-eager", action="store_true",
                   help="skip the eager pass (back-to-back dispatch+combine pairs, default arguments)")
    g.add_argument("--timeout-us", type=int, help="EpBuffer per-call timeout (default 10 s)")
    g.add_argument("--wait-timeout-s", type=float, default=120.0, help="bound of every benchmark wait")
    g = p.add_argument_group("environment and output")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    g.add_argument("--dist-backend", choices=("auto", "nccl", "gloo"))
    g.add_argument("--out", help="result directory (default $PYEP_RUN_DIR, else runs/bench-<time>)")
    g.add_argument("--no-plot", action="store_true")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="low-latency EP benchmark (dispatch/combine us and GB/s)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(p)
    p.set_defaults(func=run)


def _resolve(args: argparse.Namespace, environ: Mapping[str, str], notes: List[str]) -> Dict[str, object]:
    """Flag, else PYEP_* variable, else built-in default, for the settings a launcher may export."""
    out: Dict[str, object] = {}
    from_env = {dest: (var, typ) for var, (dest, typ) in ENV_DEFAULTS.items() if environ.get(var, "") != ""}
    for dest, default in BUILTIN_DEFAULTS.items():
        given = getattr(args, dest, None)
        if given is not None:
            out[dest] = given
        elif dest in from_env:
            var, typ = from_env[dest]
            raw = environ[var]
            try:
                out[dest] = typ(raw)
            except ValueError:
                raise CliError(f"environment variable {var}={raw!r} is not a valid {typ.__name__}") from None
            notes.append(f"{dest}={raw} from {var}")
        else:
            out[dest] = default
    return out


def _ints(text: str, what: str) -> Tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise CliError(f"{what} must be integers (comma-separated), got {text!r}") from None
    if not vals:
        raise CliError(f"{what} is empty")
    return vals


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> Tuple[BenchConfig, str, List[str]]:
    """(config, dist backend choice, notes); CliError on bad input."""
    notes: List[str] = []
    s = _resolve(args, environ, notes)
    if args.tokens_sweep and args.tokens is not None:
        raise CliError("--tokens and --tokens-sweep are exclusive")
    tokens = SWEEP_TOKENS if args.tokens_sweep else _ints(str(s["tokens"]), "--tokens")
    try:
        routings = tuple(RoutingSpec.parse(r, args.zipf_s, args.hot_fraction)
                         for r in str(args.routing).split(",") if r.strip())
        transports = tuple(t.strip() for t in str(s["transport"]).split(",") if t.strip())
        backend = str(s["backend"])
        cfg = BenchConfig(tokens=tokens, hidden=int(s["hidden"]), topk=int(s["topk"]),  # type: ignore[arg-type]
                          experts=int(s["experts"]), routings=routings, hot_expert=args.hot_expert,  # type: ignore[arg-type]
                          drop_fraction=args.drop_fraction, dispatch_dtype=args.dispatch_dtype,
                          transports=transports, backend=backend, iters=args.iters, warmup=args.warmup,
                          hook=not args.no_hook, kineto=not args.no_kineto, seed=args.seed,
                          eager=not getattr(args, "no_eager", False),
                          timeout_us=int(s["timeout_us"]), wait_timeout_s=args.wait_timeout_s,  # type: ignore[arg-type]
                          ranks_per_node=s["ranks_per_node"], plot=not args.no_plot)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise CliError(str(exc)) from None
    dist_backend = str(s["dist_backend"])
    if dist_backend not in ("auto", "nccl", "gloo"):
        raise CliError(f"dist backend must be auto, nccl or gloo, got {dist_backend!r}")
    return cfg, dist_backend, notes


def _device_choice(device: str, dist_backend: str, backends: Tuple[str, ...]) -> str:
    """A gloo run of the reference backend alone stays on the CPU (gloo's reference works on host
    tensors); everything else keeps --device."""
    if device == "auto" and dist_backend == "gloo" and set(backends) == {"reference"}:
        return "cpu"
    return device


def _init_distributed(device: str, dist_backend: str, timeout_s: float,
                      environ: Mapping[str, str]) -> Tuple[Any, Any, bool]:
    """pyep.bench.dist.init_distributed with bad flags or variables as CliError."""
    from ..bench.dist import plan_distributed, start_distributed
    try:
        plan = plan_distributed(device, dist_backend, environ)
        return start_distributed(plan, timeout_s, device)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def run(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> int:
    env = os.environ if environ is None else environ
    if args.out:
        check_output(args.out, "--out", directory=True)
    if args.deepep_json and not os.path.isfile(args.deepep_json):
        raise CliError(f"--deepep-json {args.deepep_json!r} is not a file")
    if getattr(args, "mode", "ll") == "normal":
        return _run_normal(args, env)
    for flag, given in (("--num-sms", args.num_sms), ("--sweep-sms", args.sweep_sms),
                        ("--deepep-json", args.deepep_json), ("--copy-mb", args.copy_mb),
                        ("--combine-input", None if args.combine_input == "fresh" else args.combine_input)):
        if given is not None:
            raise CliError(f"{flag} is a normal-mode option: add --mode normal")
    cfg, dist_backend, notes = config_from_args(args, env)
    group, device, owned = _init_distributed(_device_choice(args.device, dist_backend, (cfg.backend,)),
                                             dist_backend, cfg.wait_timeout_s, env)
    try:
        return _run(cfg, args, env, group, device, notes)
    finally:
        if owned:
            import torch.distributed as dist
            dist.destroy_process_group()


def _run(cfg: BenchConfig, args: argparse.Namespace, environ: Mapping[str, str], group, device,  # type: ignore[no-untyped-def]
         notes: List[str]) -> int:
    from ..bench import plot as plotting
    from ..bench import report
    from ..bench.dist import progress
    from ..bench.suite import Suite
    from ..bench.tables import console as new_console
    try:
        suite = Suite(cfg, group, device, progress=progress)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    rows = suite.run()
    gate = suite.sync.gate_note()
    if suite.rank != 0:
        return _exit_code(rows)
    notes = notes + suite.notes + ([gate] if gate else [])
    env_info = report.environment(suite.sharing.device_names, suite.dist_backend, suite.sharing)
    out_dir = args.out or environ.get("PYEP_RUN_DIR") or os.path.join(
        "runs", "bench-" + time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    console = new_console()
    deepep_doc, deepep_note = (_deepep_ll_run(cfg, suite.world_size, out_dir, device, suite.sharing.shared_gpu)
                               if args.deepep else (None, ""))
    deepep_pair = report.deepep_eager_pair(deepep_doc)
    report.render(console, cfg, env_info, rows, notes, deepep_pair)
    doc = report.bench_document(cfg, env_info, rows, notes)
    if args.deepep:
        _deepep_ll_print(console, cfg, deepep_doc, deepep_note)
        doc["deepep_measured"] = deepep_doc
        doc["deepep_eager_pair_us"] = deepep_pair
    json_path = os.path.join(out_dir, "bench.json")
    png: Optional[str] = None
    if cfg.plot:
        png = plotting.plot(os.path.join(out_dir, "bench.png"), cfg, rows, suite.world_size,
                            suite.sharing.device_names[0], deepep_doc, env_info["where"])
    doc["files"] = {"json": "bench.json", "text": "bench.txt", "plot": os.path.basename(png) if png else None}
    report.write_json(json_path, doc)
    _results_line(console, json_path, png, cfg.plot)
    console.save_text(os.path.join(out_dir, "bench.txt"))
    return _exit_code(rows)


def _results_line(console: Any, json_path: str, png: Optional[str], wanted: bool) -> None:
    """The files, one a line and never broken (a path is copied from here)."""
    from ..bench.plot import NO_MATPLOTLIB, pyplot
    console.print(f"results: {json_path}", markup=False, highlight=False, soft_wrap=True)
    if png:
        console.print(f"plot: {png}", markup=False, highlight=False, soft_wrap=True)
    elif wanted and pyplot(json_path) is None:
        console.print(NO_MATPLOTLIB, markup=False, highlight=False)


def _run_normal(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """`pyep bench --mode normal` on this rank."""
    import torch

    from ..bench.normal_report import config_from_args as normal_config
    cuda = args.device != "cpu" and torch.cuda.is_available()
    try:
        cfg, notes = normal_config(args, cuda)
    except (ValueError, TypeError) as exc:
        raise CliError(str(exc)) from None
    dist_backend = args.dist_backend or "auto"
    group, device, owned = _init_distributed(_device_choice(args.device, dist_backend, cfg.backends),
                                             dist_backend, cfg.wait_timeout_s, environ)
    try:
        return _run_normal_rank(cfg, args, environ, group, device, notes)
    finally:
        if owned:
            import torch.distributed as dist
            dist.destroy_process_group()


def _run_normal_rank(cfg: NormalBenchConfig, args: argparse.Namespace, environ: Mapping[str, str], group: Any,
                     device: Any, notes: List[str]) -> int:
    from ..bench.dist import progress
    from ..bench.normal import NormalSuite, exit_code
    from ..bench.normal_plot import plot
    from ..bench.normal_report import document, render
    from ..bench.report import environment, write_json
    from ..bench.tables import console as new_console
    try:
        suite = NormalSuite(cfg, group, device, progress=progress)
    except (ValueError, ImportError) as exc:
        raise CliError(str(exc)) from None
    rows = suite.run()
    gate = suite.sync.gate_note()
    code = exit_code(rows)
    if suite.rank != 0:
        return code   # the other ranks are done: rank 0 alone runs DeepEP (the GPUs are free now)
    out_dir = args.out or environ.get("PYEP_RUN_DIR") or os.path.join("runs", "bench-normal-" + time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    sharing = suite.sharing
    deepep, shim = _deepep_normal_run(cfg, args, suite.world_size, out_dir, device, notes, sharing)
    if deepep is not None and deepep.get("mps_started") and sharing.time_sliced:
        notes.append("DeepEP ran under MPS (deepep_v1.sh started the daemon) while pyep's rows were time-sliced: "
                     "not the same conditions; start the MPS daemon before the benchmark")
    notes = notes + suite.notes + ([gate] if gate else [])
    env_info = environment(sharing.device_names, suite.dist_backend, sharing)
    console = new_console()
    render(console, cfg, env_info, rows, notes, deepep, suite.copy, shim)
    doc = document(cfg, env_info, rows, notes, deepep, suite.copy, shim)
    internode = None
    if suite.ranks_per_node is not None:
        from ..bench.normal_internode_report import attach
        internode = attach(console, doc, cfg, rows, suite.world_size, suite.ranks_per_node,
                           {b: suite.transport(b) for b in cfg.backends})
    png = None
    if cfg.plot:
        nodes = "" if internode is None else f" in {internode['num_nodes']} nodes"
        png = plot(os.path.join(out_dir, "bench_normal.png"), rows, deepep,
                   f"pyep normal mode: N={cfg.tokens} H={cfg.hidden} K={cfg.topk} E={cfg.experts}, "
                   f"{env_info['where']}{nodes}", internode, shim)
    doc["files"] = {"json": "bench_normal.json", "text": "bench_normal.txt", "plot": os.path.basename(png) if png else None}
    json_path = os.path.join(out_dir, "bench_normal.json")
    write_json(json_path, doc)
    _results_line(console, json_path, png, cfg.plot)
    console.save_text(os.path.join(out_dir, "bench_normal.txt"))
    return code


def _deepep_normal_run(cfg: NormalBenchConfig, args: argparse.Namespace, world: int, out_dir: str, device: Any,
                       notes: List[str], sharing: Any = None) -> Tuple[Optional[dict], Optional[dict]]:
    """(DeepEP's document, pyep's shim under DeepEP's harness): DeepEP's test_intranode.py on both
    libraries, after our ranks left the GPUs; --deepep-json loads DeepEP's from a file instead."""
    from ..bench.deepep_run import DEEPEP_TEST_SMS, deepep_b2b_sms, deepep_figures
    if not (args.deepep or args.deepep_json):
        return None, None
    if args.deepep and not args.deepep_json and device.type != "cuda":
        notes.append("--deepep: DeepEP runs on GPUs only; not run")
        return None, None
    if device.type == "cuda":
        import torch
        torch.cuda.empty_cache()
    extra = ["--num-tokens", str(cfg.tokens), "--hidden", str(cfg.hidden), "--num-topk", str(cfg.topk),
             "--num-experts", str(cfg.experts)]
    b2b = None if args.deepep_json or sharing is None else deepep_b2b_sms(sharing, cfg.num_sms)
    if b2b:
        notes.append(f"DeepEP's test_intranode.py runs {DEEPEP_TEST_SMS} SMs per rank, which do not fit "
                     f"{sharing.ranks_per_device} ranks on one GPU of {sharing.sms} SMs: DeepEP and pyep's shim ran "
                     f"DeepEP's bench() loop at {b2b} SMs instead (tools/dev/normal_b2b_probe.py, the same inputs "
                     f"and byte counts)")
    deepep, note = deepep_figures("intranode", world, extra, out_dir, args.deepep_json, b2b_sms=b2b)
    notes.append(note)
    shim = None
    if args.deepep and deepep is not None and device.type == "cuda":
        shim, note = deepep_figures("intranode", world, extra, out_dir, on="pyep", b2b_sms=b2b)
        notes.append(note)
    return deepep, shim


def _deepep_ll_run(cfg: BenchConfig, world_size: int, out_dir: str, device, shared: bool) -> Tuple[Optional[dict], str]:  # type: ignore[no-untyped-def]
    """DeepEP's LL test on the same GPUs (rank 0, after the other ranks left): (document, note); a
    missing DeepEP is a note. Run before our tables are printed, so its eager pair sits beside ours."""
    from ..bench.deepep_run import deepep_figures
    if device.type != "cuda":
        return None, "--deepep: DeepEP runs on GPUs only; not run"
    if shared:
        return None, ("--deepep: DeepEP's low-latency mode cannot run ranks that share a GPU (NVSHMEM finds no "
                      "path between them and its kernel faults); not run")
    import torch
    torch.cuda.empty_cache()
    extra = ["--num-tokens", str(cfg.tokens[0]), "--hidden", str(cfg.hidden), "--num-topk", str(cfg.topk),
             "--num-experts", str(cfg.experts)]
    return deepep_figures("ll", world_size, extra, out_dir)


def _deepep_ll_print(console, cfg: BenchConfig, doc: Optional[dict], note: str) -> Optional[dict]:  # type: ignore[no-untyped-def]
    """DeepEP's figures, printed below ours."""
    from rich.markup import escape
    console.print(f"note: {escape(note)}")
    figs = (doc or {}).get("figures") or {}
    k, dc, hk = figs.get("kernels"), figs.get("dispatch_combine"), figs.get("hooks")
    if k:
        console.print(escape(f"DeepEP LL (same machine, T={cfg.tokens[0]}): dispatch {k['dispatch_us']:.1f} us, "
                             f"combine {k['combine_us']:.1f} us (kineto)"
                             + (f"; eager pair (d+c) {dc['avg_us']:.1f} us ({dc['gbps']:.0f} GB/s)" if dc else "")
                             + (f"; halves {hk['dispatch_send_us']:.1f} + {hk['dispatch_recv_us']:.1f} / "
                                f"{hk['combine_send_us']:.1f} + {hk['combine_recv_us']:.1f} us" if hk else "")))
    return doc


def _exit_code(rows) -> int:  # type: ignore[no-untyped-def]
    measured = [r for r in rows if not r.skipped]
    if not measured:
        log.error("no benchmark row could be measured")
        return 1
    return 1 if any(r.check is not None and not r.check.passed for r in measured) else 0


def main(argv: Optional[List[str]] = None) -> int:
    """Stand-alone entry (`python tools/bench_ep.py`), the same as `python -m pyep bench`."""
    p = argparse.ArgumentParser(prog="pyep bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="count", default=0)
    configure(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except CliError as exc:
        print(f"pyep bench: error: {exc}", file=sys.stderr)
        return 2
