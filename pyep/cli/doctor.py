"""`pyep doctor`: checks this host (or saved sysfs/proc/dev trees) for what pyep and GPU-initiated RDMA
need. Exit status 1 when any check FAILs, 2 on bad arguments."""
from __future__ import annotations

import argparse
import json
import os

from . import CliError

_STYLE = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red", "SKIP": "dim"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check GPUs, NVLink, RDMA NICs and driver settings; exit 1 on FAIL")
    p.add_argument("--sysfs", default="/sys", metavar="DIR", help="sysfs root (a saved tree; default /sys)")
    p.add_argument("--proc", default="/proc", metavar="DIR", help="procfs root (a saved tree; default /proc)")
    p.add_argument("--dev", default="/dev", metavar="DIR", help="/dev root for the uverbs permission check")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..doctor import DoctorInputs, as_json, exit_status, run_doctor
    for flag in ("sysfs", "proc", "dev"):
        path = getattr(args, flag)
        if not os.path.isdir(path):
            raise CliError(f"--{flag} {path!r} is not a directory")
    try:
        checks = run_doctor(DoctorInputs(sysfs=args.sysfs, proc=args.proc, dev=args.dev))
    except (ValueError, TypeError) as exc:      # a saved tree the discovery refuses
        raise CliError(str(exc)) from None
    status = exit_status(checks)
    if args.json:
        print(json.dumps({"checks": as_json(checks), "exit_status": status}, indent=2))
        return status
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text
    table = Table(title="pyep doctor", show_lines=False)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail")
    table.add_column("fix")
    for c in checks:
        table.add_row(c.name, Text(c.status, style=_STYLE[c.status]), c.detail, c.fix)
    # No markup: the details quote the (possibly saved) tree, where "[/x]" would be read as a tag.
    console = Console(markup=False, highlight=False)
    console.print(table)
    fails = [c.name for c in checks if c.status == "FAIL"]
    if fails:
        console.print(Text(f"{len(fails)} check(s) failed:", style="bold red") + Text(f" {', '.join(fails)}"))
    else:
        console.print(Text("no failures", style="green"))
    return status
