"""`pyep qp loopback`: GPU-initiated RDMA write latency and bandwidth between two local endpoints, like
perftest's ib_write_lat / ib_write_bw but with every WQE posted by a GPU thread through qp.h.

    pyep qp loopback [--nic auto|softnic|devx] [--device mlx5_0[,mlx5_1]] [--gpus 0,1]
                     [--sizes 8,64,4K,1M] [--test lat|bw|both] [--iters N] [--window W] [--json]

The endpoints are joined by one RC QP each way on the softnic (default when this host has no usable
RDMA device) or on a real ConnectX through the DevX provider. `--poster cpu` posts from CPU threads
instead (softnic only): the same qp.h code, as a baseline and for machines without a GPU.
The loopback itself is pyep.transport.loopback; this module parses the flags and prints the report.
Exit status: 0 all cases passed (data verified), 1 a case failed, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

from . import CliError
from .qp import QpAction

if TYPE_CHECKING:
    from ..transport.loopback_config import LoopbackConfig

_SIZE = re.compile(r"([0-9]+)([kKmMgG]?)[bB]?")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
DEFAULT_SIZES = "8,64,512,4K,64K,1M"


def parse_sizes(text: str) -> Tuple[int, ...]:
    """'8,64,4K,1M' -> (8, 64, 4096, 1048576); K/M/G are powers of 1024."""
    out = []
    for part in text.split(","):
        m = _SIZE.fullmatch(part.strip())
        if not m:
            raise CliError(f"--sizes: {part.strip()!r} is not a size (digits with an optional K, M or G)")
        n = int(m.group(1)) * _UNITS[m.group(2).lower()]
        if not 1 <= n <= 1 << 30:
            raise CliError(f"--sizes: {part.strip()} is outside 1 B .. 1 G")
        out.append(n)
    if len(set(out)) != len(out):
        raise CliError("--sizes: a size appears twice")
    return tuple(out)


def parse_gpus(text: str) -> Tuple[int, int]:
    from .._input import parse_uint
    nums = [parse_uint(p, 4) for p in text.split(",")]
    gpus = [n for n in nums if n is not None]
    if len(nums) not in (1, 2) or len(gpus) != len(nums):
        raise CliError(f"--gpus must be one or two GPU indices (e.g. 0 or 0,1), got {text!r}")
    return (gpus[0], gpus[-1])


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nic", choices=("auto", "softnic", "devx"), default="auto",
                   help="softnic, a real NIC through DevX, or auto: DevX when --device is given or a usable "
                        "RDMA device exists, else the softnic")
    p.add_argument("--device", default="", help="DevX device(s), one per endpoint or one for both: mlx5_0[,mlx5_1]")
    p.add_argument("--gpus", default="0", help="GPU of each endpoint: 0 (both on GPU 0) or 0,1")
    p.add_argument("--poster", choices=("gpu", "cpu"), default="gpu",
                   help="who posts the WQEs: GPU threads (default) or CPU threads (softnic only)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes, K/M/G suffixes (default {DEFAULT_SIZES})")
    p.add_argument("--test", choices=("lat", "bw", "both"), default="both", help="latency, bandwidth, or both")
    p.add_argument("--iters", type=int, default=0, help="iterations per size (default: 1000 lat, 1000 bw; "
                                                        "CPU poster 200)")
    p.add_argument("--warmup", type=int, default=50, help="untimed iterations before each size")
    p.add_argument("--window", type=int, default=128,
                   help="most writes outstanding in the bandwidth test: the send ring's size (rounded up to a "
                        "power of two, at least 8)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds any single wait of a poster may take")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def build_config(args: argparse.Namespace) -> "LoopbackConfig":
    from ..transport.loopback_config import LoopbackConfig, resolve_nic
    sizes, gpus = parse_sizes(args.sizes), parse_gpus(args.gpus)
    devices = tuple(d.strip() for d in args.device.split(",") if d.strip()) if args.device else ()
    if len(devices) > 2:
        raise CliError("--device takes at most two names (one per endpoint)")
    nic, devices = resolve_nic(args.nic, devices, args.poster)
    if nic == "softnic" and devices:
        raise CliError("--device names a real NIC; it cannot be combined with --nic softnic")
    if nic == "devx" and not devices:
        raise CliError("--nic devx needs --device (e.g. --device mlx5_0)")
    if args.iters < 0 or args.iters > 1 << 24:
        raise CliError(f"--iters must be in 0 .. {1 << 24}, got {args.iters}")
    iters = args.iters or (200 if args.poster == "cpu" else 1000)
    tests = ("lat", "bw") if args.test == "both" else (args.test,)
    try:
        cfg = LoopbackConfig(nic=nic, devices=devices, gpus=gpus, poster=args.poster, sizes=sizes, tests=tests,
                             lat_iters=iters, bw_iters=iters, warmup=args.warmup, window=args.window,
                             timeout_s=args.timeout)
    except (TypeError, ValueError) as exc:
        raise CliError(str(exc)) from None
    return cfg


def render(report: Dict[str, Any]) -> List[str]:
    """The report as text tables (plain, so it reads the same in logs and terminals)."""
    cfg = report["config"]
    where = "host memory" if cfg["poster"] == "cpu" else \
        f"GPU {cfg['gpus'][0]}" + ("" if cfg["gpus"][0] == cfg["gpus"][1] else f" <-> GPU {cfg['gpus'][1]}")
    lines = [f"pyep qp loopback: {report['nic']}, {cfg['poster'].upper()} posters, {where}, "
             f"window {report['window']} WQEs, data verified after every case"]
    if report["latency"]:
        lines += ["", "RDMA write latency (one way = half the round trip), microseconds",
                  f"{'bytes':>10} {'iters':>7} {'t_min':>9} {'t_median':>9} {'t_avg':>9} {'t_p99':>9} {'t_max':>9}"]
        for r in report["latency"]:
            lines.append(f"{r['size']:>10} {r['iterations']:>7} {r['t_min_us']:>9.2f} {r['t_median_us']:>9.2f} "
                         f"{r['t_avg_us']:>9.2f} {r['t_p99_us']:>9.2f} {r['t_max_us']:>9.2f}")
    if report["bandwidth"]:
        lines += ["", "RDMA write bandwidth (one direction)",
                  f"{'bytes':>10} {'iters':>7} {'GB/s':>10} {'Mmsg/s':>9} {'seconds':>9}"]
        for r in report["bandwidth"]:
            lines.append(f"{r['size']:>10} {r['iterations']:>7} {r['gb_s']:>10.3f} {r['mmsg_s']:>9.3f} "
                         f"{r['seconds']:>9.4f}")
    return lines


def _check_host(cfg: "LoopbackConfig") -> None:
    """CliError for a device or GPU named on the command line that this host cannot use; RuntimeError
    (exit status 1, not bad input) when the installation cannot run GPU posters at all."""
    from ..transport.loopback_config import check_devx, check_gpus
    if cfg.nic == "devx":
        try:
            check_devx(cfg.devices)
        except ValueError as exc:
            raise CliError(f"--nic devx: {exc}") from None
    if cfg.poster == "gpu":
        try:
            check_gpus(cfg.gpus)
        except ValueError as exc:
            raise CliError(f"--gpus: {exc}") from None


def _run(args: argparse.Namespace) -> int:
    from ..transport.loopback import LoopbackError, run_loopback
    cfg = build_config(args)
    try:
        _check_host(cfg)
        report = run_loopback(cfg)
    except (LoopbackError, RuntimeError, TimeoutError, OSError) as exc:
        print(f"pyep qp loopback: failed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1) if args.json else "\n".join(render(report)))
    return 0


QP_ACTIONS = (
    QpAction("loopback", "GPU-initiated RDMA write latency/bandwidth between two local endpoints "
                         "(softnic or a real NIC)", _configure, _run),
)
