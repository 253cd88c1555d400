"""`pyep nic`: the RDMA devices of this host (or of a saved sysfs tree), their ports and GIDs, which GPU
each is nearest to, whether GPU-initiated RDMA can work on them, and the NIC/port/GID pyep would use
for each GPU (honouring --hca/--gid-index/--port, PYEP_IB_* and NCCL_IB_* as pyep.nic.env describes)."""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Optional

from . import CliError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("nic", help="RDMA devices, ports, GIDs, GPU affinity, IBGDA readiness, NIC selection")
    p.add_argument("--sysfs", default="/sys", metavar="DIR", help="sysfs root (a saved tree; default /sys)")
    p.add_argument("--proc", default="/proc", metavar="DIR", help="procfs root for driver facts (default /proc)")
    p.add_argument("--dev", default="/dev", metavar="DIR", help="/dev root for the uverbs permission check")
    p.add_argument("--hca", default=None, help="device name or NCCL_IB_HCA-style filter ('^mlx5_2', '=mlx5_0:1,mlx5_1')")
    p.add_argument("--gid-index", type=int, default=None, help="GID index to use (default: RoCE v2 IPv4-mapped first)")
    p.add_argument("--port", type=int, default=None, help="port number to use (default: any ACTIVE port)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _selection(host: Any, settings: Any) -> List[Dict[str, Any]]:
    from ..nic.select import choose_gid, choose_nics
    rows: List[Dict[str, Any]] = []
    if not host.nics:
        return rows
    choices = choose_nics(host, hca=settings.hca, port=settings.port)
    for g, ch in sorted(choices.items()):
        port = next(p for p in host.nic(ch.nic).ports if p.num == ch.port)
        gid = choose_gid(port, settings.gid_index)
        rows.append({"gpu": g, "nic": ch.nic, "port": ch.port, "distance": str(ch.distance) if ch.distance else None,
                     "gid_index": gid.index, "gid": gid.gid, "gid_type": gid.type, "reason": ch.reason})
    return rows


def run(args: argparse.Namespace) -> int:
    from ..nic import NicSettings, load_host, resolve
    for flag in ("sysfs", "proc", "dev"):
        path = getattr(args, flag)
        if not os.path.isdir(path):
            raise CliError(f"--{flag} {path!r} is not a directory")
    try:
        resolved = resolve(NicSettings(hca=args.hca, gid_index=args.gid_index, port=args.port))
        if resolved.settings.hca:
            from ..nic.select import parse_hca_filter
            parse_hca_filter(resolved.settings.hca)
        host = load_host(args.sysfs, args.proc, args.dev)
        selection = _selection(host, resolved.settings)
    except (ValueError, TypeError) as exc:
        raise CliError(str(exc)) from None
    if args.json:
        doc = {"sysfs": host.sysfs_root, "devices": [n.to_json() for n in host.nics],
               "gpus": [{"index": g.index, "pci": g.pci.address, "numa_node": g.pci.numa_node, "model": g.model}
                        for g in host.gpus],
               "selection": selection, "settings": resolved.describe(),
               "message": None if host.nics else _NO_NIC}
        print(json.dumps(doc, indent=2, default=str))
        return 0
    _print(host, selection, resolved)
    return 0


_NO_NIC = ("no RDMA device found: the NIC path (IBGDA) is off on this host; pyep runs over NVLink "
           "within a node and over the softnic in tests")


def _print(host: Any, selection: List[Dict[str, Any]], resolved: Any) -> None:
    # No markup: device names, rates and paths come from the (possibly saved) tree and the command line,
    # and a "[/x]" in them would be read as a tag. Colour goes through Text styles instead.
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text
    console = Console(markup=False, highlight=False)
    if not host.nics:
        console.print(Text(_NO_NIC, style="yellow") + Text(f" (looked in {host.sysfs_root}/class/infiniband; "
                                                           f"{len(host.gpus)} GPU(s) on the PCI bus)"))
        return
    dev = Table(title=f"RDMA devices ({host.sysfs_root})")
    for col in ("device", "port", "state", "link", "rate", "MTU", "LID", "PCI", "NUMA", "nearest GPU", "DevX",
                "IBGDA"):
        dev.add_column(col, no_wrap=col not in ("IBGDA",))
    for n in host.nics:
        for p in n.ports:
            mtu: Optional[str] = str(p.active_mtu) if p.active_mtu else "?"
            near = f"GPU{n.nearest_gpu} ({n.gpu_distance})" if n.nearest_gpu is not None else "-"
            devx = "yes" if n.devx and n.devx_access is not False else ("no access" if n.devx else "no")
            ready = Text("ready", style="green") if n.ibgda_ready else Text("; ".join(n.ibgda_blockers), style="red")
            state = Text(p.state, style="green" if p.active else "red")
            dev.add_row(n.name, str(p.num), state, "IB" if not p.roce else f"RoCE ({p.netdev or '?'})", p.rate,
                        mtu, hex(p.lid) if not p.roce else "-", n.pci.address if n.pci else "?",
                        str(n.pci.numa_node) if n.pci else "?", near, devx, ready)
    console.print(dev)
    gids = Table(title="GIDs")
    for col in ("device", "port", "index", "GID", "type", "IPv4", "netdev"):
        gids.add_column(col, no_wrap=True)
    for n in host.nics:
        for p in n.ports:
            for g in p.gids:
                gids.add_row(n.name, str(p.num), str(g.index), g.gid, g.type, g.ipv4 or "-", g.netdev or "-")
    console.print(gids)
    if host.gpus:
        sel = Table(title="GPU -> NIC selection")
        for col in ("GPU", "PCI", "NUMA", "NIC", "port", "distance", "GID", "why"):
            sel.add_column(col, no_wrap=col != "why")
        pci = {g.index: g for g in host.gpus}
        for row in selection:
            g = pci.get(row["gpu"])
            sel.add_row(str(row["gpu"]), g.pci.address if g else "?", str(g.pci.numa_node) if g else "?",
                        row["nic"], str(row["port"]), row["distance"] or "-",
                        f"{row['gid_index']} ({row['gid_type']})", row["reason"])
        console.print(sel)
    console.print("settings: " + ", ".join(f"{k}={v}" for k, v in resolved.describe().items()))
