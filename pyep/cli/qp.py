"""`pyep qp`: queue-pair diagnostics.

Each action (`pyep qp ACTION ...`) is a `QpAction`. The WQE/CQE encode/decode actions and `dump` (the
QP dumps of a job, pyep.transport.qp_dump) live here; other actions live in modules named
`pyep/cli/qp_<something>.py` that define `QP_ACTIONS: tuple[QpAction, ...]` and are picked up without
editing this file. An action's `run` returns the exit status and raises
`CliError` for bad input (exit status 2); argparse rejects malformed numbers itself (also status 2).
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import pkgutil
import re
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import CliError

log = logging.getLogger("pyep.cli.qp")

_NUMBER = re.compile(r"(?:0[xX][0-9a-fA-F]+|[0-9]+)")


@dataclass(frozen=True)
class QpAction:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]  # adds the action's arguments
    run: Callable[[argparse.Namespace], int]


def uint_arg(bits: int) -> Callable[[str], int]:
    """argparse `type=` for an unsigned field of `bits` bits, written in decimal or 0x-hex."""
    def parse(text: str) -> int:
        if not _NUMBER.fullmatch(text.strip()):
            raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative decimal or 0x-hex number")
        value = int(text.strip(), 0) if text.strip()[:2].lower() == "0x" else int(text.strip(), 10)
        if value >> bits:
            raise argparse.ArgumentTypeError(f"{text} does not fit in {bits} bits (max {(1 << bits) - 1:#x})")
        return value
    parse.__name__ = f"uint{bits}"
    return parse


def _wqe_module() -> ModuleType:
    # Imported here so that `pyep --help` works (and says what is wrong) without a built engine.
    from .. import wqe
    return wqe


def _engine_or_exit() -> bool:
    try:
        importlib.import_module("pyep._engine")
    except ImportError as exc:
        # Not bad input: the installation is incomplete, so exit status 1 and say how to fix it.
        print(f"pyep qp: error: the native engine cannot be loaded ({exc}); build it with "
              "`python setup.py build_ext --inplace` in the pyep checkout", file=sys.stderr)
        return False
    return True


# --- encode-wqe -------------------------------------------------------------------------------------
# Fields each opcode needs; every other field must be absent (a stray one means the user expects an
# effect the WQE will not have).
_ADDR_FIELDS = ("laddr", "lkey", "raddr", "rkey")
_REQUIRED: Dict[str, Tuple[str, ...]] = {
    "rdma_write": _ADDR_FIELDS + ("length",),
    "masked_fa32": _ADDR_FIELDS + ("add",),
    "fa64": _ADDR_FIELDS + ("add",),
    "nop": (),
}
_OPTIONAL_FIELDS = _ADDR_FIELDS + ("length", "add")


def _configure_encode(p: argparse.ArgumentParser) -> None:
    p.add_argument("--opcode", required=True, choices=sorted(_REQUIRED), help="operation to encode")
    p.add_argument("--wqe-index", required=True, type=uint_arg(16), help="producer index (16 bits)")
    p.add_argument("--qpn", required=True, type=uint_arg(24), help="QP number (24 bits)")
    p.add_argument("--signaled", action="store_true", help="ask for a CQE (MLX5_WQE_CTRL_CQ_UPDATE)")
    p.add_argument("--fence", action="store_true", help="wait for earlier reads/atomics (MLX5_WQE_CTRL_FENCE)")
    p.add_argument("--laddr", type=uint_arg(64), help="local address: write source or fetch destination")
    p.add_argument("--lkey", type=uint_arg(32), help="local memory key")
    p.add_argument("--raddr", type=uint_arg(64), help="remote address")
    p.add_argument("--rkey", type=uint_arg(32), help="remote memory key")
    p.add_argument("--length", type=uint_arg(31), help="rdma_write: bytes to write (< 2^31)")
    p.add_argument("--add", type=uint_arg(64), help="atomics: addend (masked_fa32: 32 bits)")


def _run_encode(args: argparse.Namespace) -> int:
    need = _REQUIRED[args.opcode]
    missing = [f"--{f}" for f in need if getattr(args, f) is None]
    if missing:
        raise CliError(f"--opcode {args.opcode} needs {', '.join(missing)}")
    stray = [f"--{f}" for f in _OPTIONAL_FIELDS if f not in need and getattr(args, f) is not None]
    if stray:
        raise CliError(f"--opcode {args.opcode} does not use {', '.join(stray)}")
    if not _engine_or_exit():
        return 1
    wqe = _wqe_module()
    fields = {f: getattr(args, f) for f in need}
    try:
        wr = wqe.WorkRequest(wqe.POSTED_OPCODES[args.opcode], signaled=args.signaled, fence=args.fence, **fields)
        raw = wqe.encode_wqe(wr, args.wqe_index, args.qpn)
    except (TypeError, ValueError) as exc:
        raise CliError(str(exc)) from None
    print(raw.hex())
    return 0


# --- decode-wqe / decode-cqe ------------------------------------------------------------------------
def _configure_decode(what: str) -> Callable[[argparse.ArgumentParser], None]:
    def configure(p: argparse.ArgumentParser) -> None:
        p.add_argument("hex", nargs="+", metavar="HEX",
                       help=f"the 64-byte {what} as 128 hex digits (spaces, ':' and '_' allowed; '-' reads stdin)")
        p.add_argument("--json", action="store_true", help="print the fields as JSON")
    return configure


# 128 hex digits with separators fit many times over; more on stdin is not one WQE or CQE.
_MAX_STDIN_BYTES = 1 << 16


def _read_hex(parts: List[str], what: str, nbytes: int) -> bytes:
    from .._input import decode_text
    try:
        if parts == ["-"]:
            # Bytes where stdin has them (a text stream would raise UnicodeDecodeError on non-UTF-8).
            raw = (getattr(sys.stdin, "buffer", None) or sys.stdin).read(_MAX_STDIN_BYTES + 1)
            if len(raw) > _MAX_STDIN_BYTES:
                raise ValueError(f"stdin: more than {_MAX_STDIN_BYTES} bytes; a {what} is 128 hex digits")
            text = decode_text(raw, "stdin") if isinstance(raw, bytes) else raw
        else:
            text = " ".join(parts)
        return _wqe_module().parse_hex(text, nbytes, what)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _run_decode_wqe(args: argparse.Namespace) -> int:
    raw = _read_hex(args.hex, "WQE", _wqe_module().WQEBB_BYTES)
    if not _engine_or_exit():
        return 1
    decoded = _wqe_module().decode_wqe(raw)
    print(json.dumps(decoded.to_json()) if args.json else "\n".join(decoded.describe()))
    return 0


def _run_decode_cqe(args: argparse.Namespace) -> int:
    raw = _read_hex(args.hex, "CQE", _wqe_module().CQE_BYTES)
    if not _engine_or_exit():
        return 1
    decoded = _wqe_module().decode_cqe(raw)
    print(json.dumps(decoded.to_json()) if args.json else "\n".join(decoded.describe()))
    return 0


# --- dump ---------------------------------------------------------------------------------------------
# pyep qp dump RUN_DIR_OR_FILE ...                 print dumps already written (qp_dump-rank<r>.json)
# pyep qp dump --signal PID[,PID] [--dir DIR]      signal the ranks, wait for their fresh dumps, print them
# pyep qp dump --trigger FILE --ranks N [--dir D]  touch the trigger file the ranks watch, same
# pyep qp dump --demo                              a live dump of softnic host QPs (one with an rkey fault)
# The ranks install the triggers from their environment (PYEP_QP_DUMP_SIGNAL / PYEP_QP_DUMP_TRIGGER).
# Exit status: 0 printed, 1 no dump arrived in time or a dump reports QPs in error (except --demo, whose
# error is injected), 2 bad arguments or unreadable files.


def _configure_dump(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="*", metavar="PATH", help="dump files, or directories holding qp_dump-rank*.json")
    p.add_argument("--signal", dest="pids", default="", help="PIDs of ranks to signal for a fresh dump (comma list)")
    p.add_argument("--sig", default="", help="signal to send (default $PYEP_QP_DUMP_SIGNAL, else SIGUSR1)")
    p.add_argument("--trigger", default="", help="trigger file the ranks watch ($PYEP_QP_DUMP_TRIGGER): touch it")
    p.add_argument("--ranks", type=int, default=0, help="fresh dumps to wait for with --trigger (default 1)")
    p.add_argument("--dir", default="", help="where the ranks write their dumps (default $PYEP_QP_DUMP_DIR, "
                                             "$PYEP_RUN_DIR, or the working directory)")
    p.add_argument("--wait", type=float, default=30.0, help="seconds to wait for fresh dumps")
    p.add_argument("--demo", action="store_true", help="dump two softnic host QPs (one with an injected rkey error)")
    p.add_argument("--json", action="store_true", help="print the dump documents as JSON")


def _load_dumps(paths: List[str]) -> List[Dict[str, Any]]:
    from ..transport.qp_dump import load_documents
    try:
        return load_documents(paths)
    except ValueError as exc:
        raise CliError(str(exc)) from None


# Linux's largest pid_max. kill() reads 0 as "my process group" and -1 as "every process I may
# signal": a PID list must never reach it with either.
_MAX_PID = 1 << 22


def _pids(text: str) -> List[int]:
    from .._input import parse_uint
    pids = [parse_uint(p, 7) for p in text.split(",") if p.strip()]
    if not pids or any(p is None or not 0 < p <= _MAX_PID for p in pids):
        raise CliError(f"--signal takes PIDs (1..{_MAX_PID}, comma-separated), got {text!r}")
    return [p for p in pids if p is not None]


def _fresh_dumps(args: argparse.Namespace) -> List[str]:
    """Signals the ranks or touches their trigger file, then waits for their fresh dumps."""
    from ..transport.qp_dump import dump_dir, parse_signal, touch_trigger, wait_fresh
    out_dir, since = dump_dir(args.dir), time.time() - 0.01
    if not args.pids:
        try:
            touch_trigger(args.trigger)
        except ValueError as exc:
            raise CliError(f"--trigger: {exc}") from None
        return wait_fresh(out_dir, since, args.ranks or 1, args.wait, f"trigger {args.trigger}")
    pids = _pids(args.pids)
    try:
        sig = parse_signal(args.sig or os.environ.get("PYEP_QP_DUMP_SIGNAL") or "SIGUSR1")
    except ValueError as exc:
        raise CliError(str(exc)) from None
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            raise CliError(f"--signal: no process {pid}") from None
        except PermissionError:
            raise CliError(f"--signal: not allowed to signal process {pid}") from None
    return wait_fresh(out_dir, since, len(pids), args.wait, f"{sig.name} to {len(pids)} rank(s)")


def _run_dump(args: argparse.Namespace) -> int:
    from ..transport.qp_dump import demo_document, render_document
    modes = sum(bool(x) for x in (args.paths, args.pids, args.trigger, args.demo))
    if modes != 1:
        raise CliError("give exactly one of: dump PATHs, --signal PIDs, --trigger FILE, --demo")
    if not 0 < args.wait <= 3600:
        raise CliError(f"--wait must be in (0, 3600] seconds, got {args.wait}")
    if not 0 <= args.ranks <= _MAX_PID:
        raise CliError(f"--ranks must be in 1..{_MAX_PID} (0: 1), got {args.ranks}")
    if args.dir and not os.path.isdir(args.dir):
        raise CliError(f"--dir {args.dir!r} is not a directory")
    if args.demo:
        docs = [demo_document()]
    elif args.paths:
        docs = _load_dumps(args.paths)
    else:
        try:
            fresh = _fresh_dumps(args)
        except (TimeoutError, OSError) as exc:
            print(f"pyep qp dump: {exc}", file=sys.stderr)
            return 1
        docs = _load_dumps(fresh)
    if args.json:
        print(json.dumps(docs, indent=1))
    else:
        print("\n\n".join("\n".join(render_document(d)) for d in docs))
    # The demo's QP error is injected on purpose; in a job's dump, a QP in error is what the user is after.
    bad = [d["rank"] for d in docs if d.get("error") or any(q.get("error") for q in d.get("qps", []))]
    return 1 if bad and not args.demo else 0


BUILTIN_ACTIONS: Tuple[QpAction, ...] = (
    QpAction("encode-wqe", "print the 64-byte WQEBB pyep builds for a work request (128 hex digits)",
             _configure_encode, _run_encode),
    QpAction("decode-wqe", "explain a 64-byte send WQE", _configure_decode("WQE"), _run_decode_wqe),
    QpAction("decode-cqe", "explain a 64-byte CQE (completion or error)", _configure_decode("CQE"), _run_decode_cqe),
    QpAction("dump", "per-QP state, indices, errors and traffic of a running job (from its dump files, or "
                     "triggered now by a signal or a trigger file)", _configure_dump, _run_dump),
)


def all_actions() -> Tuple[QpAction, ...]:
    """Built-in actions plus those of every pyep/cli/qp_*.py module, sorted by name."""
    from . import __path__ as cli_path
    actions = list(BUILTIN_ACTIONS)
    for info in pkgutil.iter_modules(cli_path):
        if info.name.startswith("qp_"):
            mod = importlib.import_module(f"{__package__}.{info.name}")
            actions.extend(getattr(mod, "QP_ACTIONS", ()))
    names = [a.name for a in actions]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise RuntimeError(f"pyep qp: actions defined twice: {', '.join(dupes)}")
    return tuple(sorted(actions, key=lambda a: a.name))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("qp", help="queue-pair diagnostics: encode/decode WQEs and CQEs, ...",
                       description="Queue-pair diagnostics.")
    actions = p.add_subparsers(dest="qp_action", metavar="ACTION")
    for action in all_actions():
        ap = actions.add_parser(action.name, help=action.help, description=action.help)
        action.configure(ap)
        ap.set_defaults(func=action.run)

    def no_action(args: argparse.Namespace) -> int:
        p.print_help(sys.stderr)
        return 2
    p.set_defaults(func=no_action)


def main(argv: Optional[List[str]] = None) -> int:
    """`pyep qp ...` on its own (for tools and tests)."""
    from . import main as pyep_main
    return pyep_main(["qp"] + list(sys.argv[1:] if argv is None else argv))
