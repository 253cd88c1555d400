"""Reading a job's QPs into dump documents (see the package docstring): the QP contexts, the send CQ
rings and the providers' views, decoded with pyep.wqe's names; and a live demo on two softnics.
Writing and loading the documents is pyep.transport.qp_dump.files.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

log = logging.getLogger("pyep.transport.qp_dump")

from .files import FORMAT

ERROR_KINDS = {0: "none", 1: "error CQE", 2: "no ring space in time (completions stopped)",
               3: "doorbell order timeout (an earlier poster never rang)",
               4: "quiet timeout (posted WQEs never completed)"}
QP_STATES = {0: "RESET", 1: "INIT", 2: "RTR", 3: "RTS", 6: "ERR"}


@dataclass(frozen=True)
class QpRef:
    """One QP to dump (see the package docstring for what `context` and `provider` may be)."""
    peer: int
    qpn: int
    context: Any
    index: int = 0            # which of the peer's QPs
    cqes: int = 0             # address of the send CQ ring (0: take it from the context)
    cq_log_size: int = 0
    provider: Any = None


def _field(obj: Any, name: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def as_ref(item: Any, index: int = 0) -> QpRef:
    """A QpRef from a QpRef or a (peer, qp_info, cq_info, context[, provider]) tuple."""
    if isinstance(item, QpRef):
        return item
    if not isinstance(item, (tuple, list)) or len(item) not in (4, 5):
        raise TypeError("qp_contexts() must yield QpRef or (peer, qp_info, cq_info, context[, provider]) "
                        f"tuples, got {type(item).__name__}")
    peer, qp, cq, ctx = item[:4]
    qpn = _field(qp, "qpn", qp if isinstance(qp, int) else None)
    if isinstance(peer, bool) or not isinstance(peer, int) or peer < 0:
        raise ValueError(f"qp_contexts(): peer must be a rank (int >= 0), got {peer!r}")
    if isinstance(qpn, bool) or not isinstance(qpn, int) or not 0 < qpn <= 0xFFFFFF:
        raise ValueError(f"qp_contexts(): QP number must be a 24-bit non-zero int, got {qpn!r}")
    return QpRef(peer=peer, qpn=qpn, context=ctx, index=index, cqes=int(_field(cq, "cqes", 0) or 0),
                 cq_log_size=int(_field(cq, "log_size", 0) or 0), provider=item[4] if len(item) == 5 else None)


def _engine() -> Any:
    from ..._native import engine
    eng = engine()
    if not hasattr(eng, "decode_qp_context"):
        raise RuntimeError("pyep._engine predates the QP dump (no decode_qp_context): rebuild it")
    return eng


def read_context(context: Any, size: int) -> bytes:
    """The context's bytes from bytes, a torch tensor (any device) or an address."""
    if isinstance(context, (bytes, bytearray, memoryview)):
        raw = bytes(context)
    elif hasattr(context, "data_ptr") and hasattr(context, "element_size"):  # torch.Tensor
        nbytes = context.numel() * context.element_size()
        if nbytes != size or not context.is_contiguous():
            raise ValueError(f"a QP context tensor must be contiguous and {size} bytes, got {nbytes}")
        # Not tensor.cpu(): that would queue behind the (possibly stuck) kernels on the current stream.
        raw = _engine().read_memory(int(context.data_ptr()), size)
    elif isinstance(context, int) and not isinstance(context, bool):
        if context <= 0:
            raise ValueError(f"QP context address must be positive, got {context}")
        raw = _engine().read_memory(context, size)
    else:
        raise TypeError(f"a QP context must be bytes, a tensor or an address, got {type(context).__name__}")
    if len(raw) != size:
        raise ValueError(f"a QP context is {size} bytes, got {len(raw)}")
    return raw


def _error(err: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    from ... import wqe
    if not err["valid"]:
        return None
    kind = int(err["kind"])
    out: Dict[str, Any] = {"kind": kind, "kind_name": ERROR_KINDS.get(kind, f"kind {kind}"),
                           "wqe_counter": int(err["wqe_counter"]), "when_ns": int(err["when_ns"])}
    if kind == 1:
        syn = int(err["syndrome"])
        out.update(cqe_opcode=int(err["cqe_opcode"]), cqe_opcode_name=wqe.cqe_opcode_name(int(err["cqe_opcode"])),
                   syndrome=syn, syndrome_name=wqe.syndrome_name(syn), vendor_syndrome=int(err["vendor_syndrome"]),
                   wqe_opcode=int(err["wqe_opcode"]), wqe_opcode_name=wqe.opcode_name(int(err["wqe_opcode"])))
        try:
            out["hint"] = wqe.SYNDROME_HINTS[wqe.Syndrome(syn)]
        except ValueError:
            out["hint"] = "unknown syndrome"
    return out


def last_error_cqe(ring: bytes, log_size: int, ci: int) -> Optional[Dict[str, Any]]:
    """The newest error CQE in a send CQ ring whose consumer index is `ci` (None if none), decoded.
    Unconsumed entries (owner bit of the current pass) are newer than consumed ones, which stay in the
    ring until overwritten: the newest is the last valid unconsumed entry, else the one before ci."""
    from ... import wqe
    size = 1 << log_size
    if len(ring) != 64 * size:
        raise ValueError(f"CQ ring of 2^{log_size} entries must be {64 * size} bytes, got {len(ring)}")

    def entry(i: int) -> Any:
        return wqe.decode_cqe(ring[64 * (i % size):64 * (i % size) + 64])

    ahead: List[Any] = []
    for k in range(size):
        c = entry(ci + k)
        if c.opcode == wqe.CqeOpcode.INVALID or c.owner != ((ci + k) >> log_size) & 1:
            break
        ahead.append((ci + k, c))
    behind = [(ci - k, entry(ci - k)) for k in range(1, size - len(ahead) + 1) if ci - k >= 0]
    errors = [(idx, c) for idx, c in list(reversed(ahead)) + behind
              if c.opcode != wqe.CqeOpcode.INVALID and c.is_error]
    if not errors:
        return None
    # After the failing WQE every later one completes as a flush: the newest error that is not a
    # flush is the one that says why, so prefer it.
    idx, c = next(((i, c) for i, c in errors if c.syndrome != wqe.Syndrome.WR_FLUSH_ERR), errors[0])
    d = c.to_json()
    d.update(index=idx, consumed=idx < ci, error_cqes_in_ring=len(errors))
    return d


def _provider_view(provider: Any, qpn: int) -> Dict[str, Any]:
    if provider is None:
        return {}
    try:
        if hasattr(provider, "qp_stats"):        # pyep.softnic.SoftNic
            st = provider.qp_stats(qpn)
            d = {k: getattr(st, k) for k in ("state", "remote_node", "remote_qpn", "wqes", "bytes", "atomics",
                                              "errors", "flushed", "cqes", "doorbells", "consumer_index",
                                              "pending", "last_error")}
            d["state"] = QP_STATES.get(int(d["state"]), str(int(d["state"])))
            return {"kind": "softnic", **d}
        if hasattr(provider, "query_qp_state"):  # DevX provider
            state = int(provider.query_qp_state(qpn))
            return {"kind": "devx", "state": QP_STATES.get(state, str(state))}
    except Exception as exc:  # noqa: BLE001 - a dump reports what it could not read instead of failing
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {}


def dump_ref(ref: QpRef, read_cq: bool = True) -> Dict[str, Any]:
    """Everything known about one QP, as a JSON-ready dict."""
    eng = _engine()
    c = eng.decode_qp_context(read_context(ref.context, int(eng.qp_context_size)))
    if c["qpn"] != ref.qpn:
        raise ValueError(f"the context given for QP {ref.qpn:#x} belongs to QP {c['qpn']:#x}")
    sq = 1 << c["log_sq"]
    out: Dict[str, Any] = {
        "peer": ref.peer, "index": ref.index, "qpn": ref.qpn, "sq_size": sq,
        "resv": c["resv"], "ready": c["ready"], "cons": c["cons"], "signaled": c["signaled"],
        "outstanding": c["ready"] - c["cons"],          # rung, not yet known complete
        "reserved_unrung": c["resv"] - c["ready"],      # claimed by posters that have not rung yet
        "cq_ci": c["cq_ci"], "cq_size": 1 << c["cq_log_size"], "cq_poll_locked": bool(c["cq_lock"]),
        "wqes_posted": c["wqes_posted"], "bytes_posted": c["bytes_posted"], "error": _error(c["err"]),
    }
    provider = _provider_view(ref.provider, ref.qpn)
    if provider:
        out["provider"] = provider
    if provider.get("state"):
        out["state"] = provider["state"]
    else:
        out["state"] = "ERR (error slot)" if c["err"]["valid"] else "unknown (context only)"
    out["last_error_cqe"] = None
    cqes, log_size = ref.cqes or c["cq_cqes"], ref.cq_log_size or c["cq_log_size"]
    if read_cq and cqes and log_size:
        try:
            ring = eng.read_memory(cqes, 64 << log_size)
            out["last_error_cqe"] = last_error_cqe(ring, log_size, c["cq_ci"])
        except (RuntimeError, ValueError) as exc:
            out["cq_read_error"] = str(exc)
    return out


def refs_from_table(links: Sequence[Any], table: Any, qps_per_peer: int, provider: Any = None) -> List[QpRef]:
    """QpRefs for a backend that packs every NIC link's QP contexts into one tensor, context j of peer r
    at (r * qps_per_peer + j) * context size (pyep.ep.ll.native's layout): `links` are PeerLinks (rank,
    qp_contexts = the contexts' initial bytes, which name the QP), `table` the tensor the kernels use."""
    size = int(_engine().qp_context_size)
    refs: List[QpRef] = []
    for link in links:
        for j, initial in enumerate(getattr(link, "qp_contexts", None) or ()):
            if len(initial) != size:
                raise ValueError(f"rank {link.rank}'s QP context {j} is {len(initial)} bytes, not {size}")
            at = (int(link.rank) * qps_per_peer + j) * size
            qpn = int(_engine().decode_qp_context(bytes(initial))["qpn"])
            refs.append(QpRef(peer=int(link.rank), qpn=qpn, context=table[at:at + size], index=j, provider=provider))
    return refs


def refs_of(obj: Any) -> List[QpRef]:
    fn = getattr(obj, "qp_contexts", None)
    if fn is None and getattr(obj, "backend", None) is not None:
        fn = getattr(obj.backend, "qp_contexts", None)
    if fn is None:
        raise TypeError(f"{type(obj).__name__} exposes no qp_contexts(); the QP dump needs its QP contexts "
                        "(see pyep.transport.qp_dump)")
    items = list(fn())
    seen: Dict[int, int] = {}
    refs = []
    for it in items:
        peer = it.peer if isinstance(it, QpRef) else it[0] if isinstance(it, (tuple, list)) and it else None
        idx = seen.get(peer, 0) if isinstance(peer, int) else 0
        refs.append(as_ref(it, idx))
        if isinstance(peer, int):
            seen[peer] = idx + 1
    return refs


def per_peer(qps: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    out: Dict[int, Dict[str, Any]] = {}
    for q in qps:
        p = out.setdefault(q["peer"], {"peer": q["peer"], "qps": 0, "wqes_posted": 0, "bytes_posted": 0,
                                       "outstanding": 0, "qps_in_error": 0})
        p["qps"] += 1
        p["wqes_posted"] += q["wqes_posted"]
        p["bytes_posted"] += q["bytes_posted"]
        p["outstanding"] += q["outstanding"]
        p["qps_in_error"] += q["error"] is not None
    return [out[k] for k in sorted(out)]


def qp_dump(obj: Any, read_cq: bool = True) -> List[Dict[str, Any]]:
    """One dict per QP of `obj` (an EpBuffer, a transport, anything with qp_contexts())."""
    return [dump_ref(r, read_cq) for r in refs_of(obj)]


def dump_document(obj: Any, rank: int = 0, reason: str = "api") -> Dict[str, Any]:
    """The JSON document the triggers write: who, when, why, every QP, and totals per peer."""
    doc: Dict[str, Any] = {"format": FORMAT, "rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                           "time": time.time(), "reason": reason}
    try:
        qps = qp_dump(obj)
        doc.update(qps=qps, peers=per_peer(qps))
    except Exception as exc:  # noqa: BLE001 - a dump in a running job must not take the job down
        log.exception("QP dump of rank %d failed", rank)
        doc.update(qps=[], peers=[], error=f"{type(exc).__name__}: {exc}")
    return doc


def demo_document() -> Dict[str, Any]:
    """A live dump of two softnics in this process, two QPs with host rings: QP 0 moves data, QP 1 hits
    a bad rkey (so a reader sees what an error looks like)."""
    from ...softnic import ConnectAttr, SoftNic, SoftNicConfig, new_fabric_id
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
