"""A dump document as plain text (`pyep qp dump` prints it): per QP its indices, state, traffic and
errors, what the errors and a full ring mean, and totals per peer.
"""
from __future__ import annotations

import time
from typing import Any, List, Mapping


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
