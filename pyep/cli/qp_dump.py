"""`pyep qp dump`: show the QP dumps of a running (or finished) job, and trigger new ones.

    pyep qp dump RUN_DIR_OR_FILE ...                 print dumps already written (qp_dump-rank<r>.json)
    pyep qp dump --signal PID[,PID] [--dir DIR]      signal the ranks, wait for their fresh dumps, print them
    pyep qp dump --trigger FILE --ranks N [--dir D]  touch the trigger file the ranks watch, same
    pyep qp dump --demo                              a live dump of softnic host QPs (one with an rkey fault)

The ranks install the triggers from their environment (PYEP_QP_DUMP_SIGNAL / PYEP_QP_DUMP_TRIGGER; see
pyep.transport.qp_dump). Exit status: 0 printed, 1 no dump arrived in time or a dump reports QPs in
error (except --demo, whose error is injected), 2 bad arguments or unreadable files.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Mapping, Sequence

from . import CliError
from .qp import QpAction


def _configure(p: argparse.ArgumentParser) -> None:
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


def _fmt_bytes(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def _error_text(q: Mapping[str, Any]) -> str:
    e = q.get("error")
    if not e:
        return "-"
    if e.get("syndrome_name"):
        return f"{e['syndrome_name']} on WQE {e['wqe_counter']} ({e['wqe_opcode_name']})"
    return e["kind_name"]


def render_document(doc: Mapping[str, Any]) -> List[str]:
    """One rank's dump as plain text."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc.get("time", 0)))
    lines = [f"rank {doc['rank']} on {doc.get('host', '?')} (pid {doc.get('pid', '?')}), {when}, "
             f"reason: {doc.get('reason', '?')}"]
    if doc.get("error"):
        lines.append(f"  the dump failed: {doc['error']}")
    qps = doc.get("qps", [])
    if not qps:
        lines.append("  no QPs")
        return lines
    lines.append(f"  {'peer':>4} {'#':>2} {'qpn':>8} {'state':<16} {'resv':>9} {'ready':>9} {'cons':>9} {'out':>5} "
                 f"{'cq_ci':>8} {'wqes':>9} {'bytes':>10}  error")
    for q in qps:
        lines.append(f"  {q['peer']:>4} {q['index']:>2} {q['qpn']:>#8x} {q['state']:<16} {q['resv']:>9} "
                     f"{q['ready']:>9} {q['cons']:>9} {q['outstanding']:>5} {q['cq_ci']:>8} {q['wqes_posted']:>9} "
                     f"{_fmt_bytes(q['bytes_posted']):>10}  {_error_text(q)}")
    for q in qps:
        e, c = q.get("error"), q.get("last_error_cqe")
        if e:
            lines.append(f"  QP {q['qpn']:#x} (peer {q['peer']}): first error: {e['kind_name']}"
                         + (f", {e['cqe_opcode_name']} syndrome {e['syndrome']:#04x} {e['syndrome_name']}, vendor "
                            f"{e['vendor_syndrome']:#04x}, WQE {e['wqe_counter']} ({e['wqe_opcode_name']}): {e['hint']}"
                            if e.get("syndrome_name") else ""))
        if c:
            lines.append(f"  QP {q['qpn']:#x} (peer {q['peer']}): newest error CQE in the ring (entry {c['index']}, "
                         f"{'consumed' if c['consumed'] else 'not consumed'}): {c['opcode_name']} "
                         f"{c['syndrome_name']} on WQE {c['wqe_counter']} ({c['wqe_opcode_name']}), "
                         f"{c['error_cqes_in_ring']} error CQE(s) in the ring")
        if q.get("reserved_unrung"):
            lines.append(f"  QP {q['qpn']:#x}: {q['reserved_unrung']} WQEBB(s) reserved but their doorbell not rung "
                         f"(a poster is mid-post or stuck)")
        if q.get("outstanding", 0) >= q.get("sq_size", 1 << 62):
            lines.append(f"  QP {q['qpn']:#x}: the send ring is full ({q['outstanding']} of {q['sq_size']} WQEBBs "
                         f"outstanding): completions are not arriving")
        prov = q.get("provider") or {}
        if prov.get("last_error"):
            lines.append(f"  QP {q['qpn']:#x}: {prov['kind']} says: {prov['last_error']}")
    lines.append(f"  {'peer':>4} {'QPs':>4} {'in error':>8} {'outstanding':>11} {'WQEs':>10} {'bytes':>10}")
    for p in doc.get("peers", []):
        lines.append(f"  {p['peer']:>4} {p['qps']:>4} {p['qps_in_error']:>8} {p['outstanding']:>11} "
                     f"{p['wqes_posted']:>10} {_fmt_bytes(p['bytes_posted']):>10}")
    return lines


def _out_dir(args: argparse.Namespace) -> str:
    return args.dir or os.environ.get("PYEP_QP_DUMP_DIR") or os.environ.get("PYEP_RUN_DIR") or os.getcwd()


def _load(paths: Sequence[str]) -> List[Dict[str, Any]]:
    from ..transport.qp_dump import dump_paths, load_document
    files: List[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = dump_paths(p)
            if not found:
                raise CliError(f"{p} holds no qp_dump-rank*.json files")
            files.extend(found)
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise CliError(f"{p}: no such file or directory")
    try:
        return [load_document(f) for f in files]
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from None


def _wait_fresh(out_dir: str, since: float, count: int, wait_s: float, what: str) -> List[str]:
    """Waits for `count` dump files in out_dir written after `since`; TimeoutError names what is missing."""
    from ..transport.qp_dump import dump_paths
    deadline = time.monotonic() + wait_s
    while True:
        fresh = [p for p in (dump_paths(out_dir) if os.path.isdir(out_dir) else [])
                 if os.stat(p).st_mtime >= since]
        if len(fresh) >= count:
            return fresh
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {len(fresh)} of {count} fresh dump(s) appeared in {out_dir} within "
                               f"{wait_s:.0f} s (are the ranks running with PYEP_QP_DUMP_SIGNAL / "
                               f"PYEP_QP_DUMP_TRIGGER set, and writing to this directory?)")
        time.sleep(0.1)


def _demo() -> Dict[str, Any]:
    """Two softnics in this process, two QPs with host rings; QP 0 moves data, QP 1 hits a bad rkey."""
    from ..softnic import ConnectAttr, SoftNic, SoftNicConfig, new_fabric_id
    from ..transport.qp_dump import QpRef, dump_document
    fabric = new_fabric_id()
    with SoftNic(SoftNicConfig(node_id=0, fabric_id=fabric)) as a, \
            SoftNic(SoftNicConfig(node_id=1, fabric_id=fabric)) as b:
        refs, posters = [], []
        for j in range(2):
            cq_a, cq_b = a.create_cq(4), b.create_cq(4)
            qp_a, qp_b = a.create_qp(cq_a, 4), b.create_qp(cq_b, 4)
            a.connect(qp_a, 1, qp_b.qpn, ConnectAttr(ack_timeout=8, retry_cnt=1))
            b.connect(qp_b, 0, qp_a.qpn, ConnectAttr(ack_timeout=8, retry_cnt=1))
            hq = a.host_qp(qp_a, cq_a)
            posters.append(hq)
            refs.append(QpRef(peer=1, qpn=qp_a.qpn, context=hq.addresses()["context"], index=j, cqes=cq_a.cqes,
                              cq_log_size=cq_a.log_size, provider=a))
        src, dst, fetch = a.alloc_host(1 << 16), b.alloc_host(1 << 16), a.alloc_host(64)
        ms, md, mf = a.reg_mr(src), b.reg_mr(dst), a.reg_mr(fetch)
        for i in range(24):
            posters[0].check(posters[0].post_write_with_signal(src.addr + 1024 * i, ms.lkey, dst.addr + 1024 * i,
                                                               md.rkey, 1024, dst.addr + 60000, md.rkey, 1,
                                                               fetch.addr, mf.lkey), f"demo write {i}")
        posters[0].check(posters[0].quiet(), "demo quiet")
        posters[1].post_rdma_write(src.addr, ms.lkey, dst.addr, md.rkey ^ 0x80000000, 512)  # a corrupted rkey
        posters[1].quiet(timeout_s=5.0)

        class _Source:
            def qp_contexts(self) -> List[QpRef]:
                return refs
        return dump_document(_Source(), rank=0, reason="demo")


def _run(args: argparse.Namespace) -> int:
    from ..transport.qp_dump import parse_signal
    modes = sum(bool(x) for x in (args.paths, args.pids, args.trigger, args.demo))
    if modes != 1:
        raise CliError("give exactly one of: dump PATHs, --signal PIDs, --trigger FILE, --demo")
    if not 0 < args.wait <= 3600:
        raise CliError(f"--wait must be in (0, 3600] seconds, got {args.wait}")
    if args.ranks < 0:
        raise CliError(f"--ranks must be positive, got {args.ranks}")
    if args.demo:
        docs = [_demo()]
    elif args.paths:
        docs = _load(args.paths)
    else:
        out_dir, since = _out_dir(args), time.time() - 0.01
        try:
            if args.pids:
                try:
                    pids = [int(p) for p in args.pids.split(",") if p.strip()]
                except ValueError:
                    raise CliError(f"--signal takes PIDs, got {args.pids!r}") from None
                try:
                    sig = parse_signal(args.sig or os.environ.get("PYEP_QP_DUMP_SIGNAL") or "SIGUSR1")
                except ValueError as exc:
                    raise CliError(str(exc)) from None
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        raise CliError(f"--signal: no process {pid}") from None
                fresh = _wait_fresh(out_dir, since, len(pids), args.wait, f"{sig.name} to {len(pids)} rank(s)")
            else:
                with open(args.trigger, "a"):
                    pass
                os.utime(args.trigger)
                fresh = _wait_fresh(out_dir, since, args.ranks or 1, args.wait, f"trigger {args.trigger}")
        except (TimeoutError, OSError) as exc:
            print(f"pyep qp dump: {exc}", file=sys.stderr)
            return 1
        docs = _load(fresh)
    if args.json:
        print(json.dumps(docs, indent=1))
    else:
        print("\n\n".join("\n".join(render_document(d)) for d in docs))
    # The demo's QP error is injected on purpose; in a job's dump, a QP in error is what the user is after.
    bad = [d["rank"] for d in docs if d.get("error") or any(q.get("error") for q in d.get("qps", []))]
    return 1 if bad and not args.demo else 0


QP_ACTIONS = (
    QpAction("dump", "per-QP state, indices, errors and traffic of a running job (from its dump files, or "
                     "triggered now by a signal or a trigger file)", _configure, _run),
)
