"""`pyep` command line. Each sub-command lives in its own module under pyep/cli/ and exposes
`add_parser(subparsers)`; the parser it adds sets `func(args) -> int`. Exit status 2 means bad input."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
from typing import List, Optional

# sub-command name -> module. Imported lazily so that `pyep qp ...` never pays for torch.
COMMANDS = {
    "qp": "pyep.cli.qp",
    "softnic": "pyep.cli.softnic",
    "info": "pyep.cli.info",
    "bench": "pyep.cli.bench",
    "launch": "pyep.cli.launch",
    "nic": "pyep.cli.nic",
    "doctor": "pyep.cli.doctor",
    "drill": "pyep.cli.drill",
}


# Commands that run torch code in this process. `launch` checks for itself: its local launcher starts
# torchrun here, while --dry-run and the ssh / slurm launchers need torch only on the nodes.
NEEDS_TORCH = ("bench", "drill")


class CliError(Exception):
    """Bad input on the command line: printed without a traceback, exit status 2."""


def check_output(path: str, flag: str, directory: bool) -> None:
    """CliError now for an output path (`directory`: a directory made later, else a file written later)
    that cannot be one, so a long run does not end in a traceback when it saves its results."""
    full = os.path.abspath(path)
    if os.path.exists(full):
        if os.path.isdir(full) != directory:
            raise CliError(f"{flag} {path!r} is {'not a directory' if directory else 'a directory'}")
        return
    parent = os.path.dirname(full)
    if not directory:
        if not os.path.isdir(parent):
            raise CliError(f"{flag} {path!r}: there is no directory {parent!r} to write it in")
        return
    while not os.path.exists(parent):       # makedirs creates the missing ones
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise CliError(f"{flag} {path!r}: {parent!r} is not a directory")


class NeedsTorch(Exception):
    """The command needs PyTorch and this interpreter cannot import it (torch is a declared dependency,
    but `pip install --no-deps`, used to keep a CUDA build, can leave it out): exit status 1 with
    words, not a ModuleNotFoundError traceback."""


def torch_importable() -> bool:
    return importlib.util.find_spec("torch") is not None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyep", description="pyep: IBGDA engine and MoE expert parallelism")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, modname in COMMANDS.items():
        importlib.import_module(modname).add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if args.command in NEEDS_TORCH and not torch_importable():
            raise NeedsTorch()
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"pyep {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except NeedsTorch:
        return _needs_torch(args.command)
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        return _needs_torch(args.command)


def _needs_torch(command: str) -> int:
    print(f"pyep {command}: error: this command needs PyTorch, which {sys.executable} cannot import; "
          "install the PyTorch build for this machine (README.md, 'Install'), then run it again", file=sys.stderr)
    return 1
