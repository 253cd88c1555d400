"""`pyep info`: what this installation of pyep can do."""
from __future__ import annotations

import argparse
import json

from .._native import availability


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="which parts of pyep this build has")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    av = availability()
    if args.json:
        print(json.dumps(av.__dict__))
    else:
        print(f"pyep: {av.describe()}")
    return 0
