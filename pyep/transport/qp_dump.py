"""Live QP diagnostics: what every RC queue pair of a running job is doing (`pyep qp dump`).

For each QP the dump reads the gda::Qp device context the GPU posts through (qp.h) and, where it can,
the send CQ ring and the provider's own view (softnic statistics, or the DevX QP state):
producer indices (resv = WQEBBs reserved, ready = doorbell rung, cons = known complete), outstanding
WQEBBs, CQ consumer index, the QP's first error (from its error slot) and the newest error CQE in the
ring, decoded with pyep.wqe's names, and WQEs/bytes posted; plus totals per peer.

Sources. `qp_dump(obj)` works on any object with a `qp_contexts()` method (or an `_backend` attribute
that has one, which is how an EpBuffer delegates to its backend) returning, per QP, a `QpRef` or a
tuple `(peer, qp_info, cq_info, context[, provider])`: qp_info/cq_info are pyep.softnic QpInfo/CqInfo
or the provider dicts (qpn; cqes, log_size), `context` is the context's bytes, a torch tensor holding
them (any device), or its address (host or device memory), and `provider` is a pyep.softnic.SoftNic
or a DevX provider (optional).

Triggers in running jobs (`install_dump_triggers`): with PYEP_QP_DUMP_SIGNAL=SIGUSR1 (any signal
name or number) the signal writes `qp_dump-rank<r>.json` into $PYEP_QP_DUMP_DIR, else $PYEP_RUN_DIR,
else the working directory; with PYEP_QP_DUMP_TRIGGER=<file> a watcher thread does the same whenever
that file is created or touched (`pyep qp dump --trigger FILE` does that and waits for the dumps).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

log = logging.getLogger("pyep.transport.qp_dump")

FORMAT = "pyep-qp-dump/1"
SIGNAL_ENV = "PYEP_QP_DUMP_SIGNAL"
TRIGGER_ENV = "PYEP_QP_DUMP_TRIGGER"
DIR_ENV = "PYEP_QP_DUMP_DIR"
TRIGGER_POLL_S = 0.5
ERROR_KINDS = {0: "none", 1: "error CQE", 2: "no ring space in time (completions stopped)",
               3: "doorbell order timeout (an earlier poster never rang)",
               4: "quiet timeout (posted WQEs never completed)"}
QP_STATES = {0: "RESET", 1: "INIT", 2: "RTR", 3: "RTS", 6: "ERR"}


@dataclass(frozen=True)
class QpRef:
    """One QP to dump (see the module docstring for what `context` and `provider` may be)."""
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
    from .._native import engine
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
    from .. import wqe
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
    from .. import wqe
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


def write_document(doc: Mapping[str, Any], path: str) -> str:
    """Atomically (readers never see half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
    return path


def parse_signal(text: str) -> signal.Signals:
    t = text.strip().upper()
    try:
        return signal.Signals(int(t)) if t.isdigit() else signal.Signals[t if t.startswith("SIG") else "SIG" + t]
    except (KeyError, ValueError):
        raise ValueError(f"${SIGNAL_ENV}={text!r} is not a signal name or number (e.g. SIGUSR1)") from None


class DumpTriggers:
    """The installed triggers of one source; close() removes them (the signal handler goes back to
    what it was before). The source is held weakly: a destroyed EpBuffer is simply not dumped."""

    def __init__(self, source: Any, rank: int, out_dir: str, sig: Optional[signal.Signals], trigger: str,
                 tag: str = "") -> None:
        self.rank, self.out_dir, self.trigger = rank, out_dir, trigger
        self.path = os.path.join(out_dir, f"qp_dump-rank{rank}{'-' + tag if tag else ''}.json")
        self._source = weakref.ref(source)
        self._sig = sig
        self._previous: Any = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if sig is not None:
            self._previous = signal.signal(sig, self._on_signal)
        if trigger:
            # The baseline is taken here, not in the thread: a touch right after installation must count.
            self._thread = threading.Thread(target=self._watch, args=(_mtime(trigger),), name=f"pyep-qp-dump-{rank}",
                                            daemon=True)
            self._thread.start()

    def dump(self, reason: str) -> Optional[str]:
        source = self._source()
        if source is None:
            return None
        path = write_document(dump_document(source, self.rank, reason), self.path)
        log.warning("rank %d: QP dump (%s) written to %s", self.rank, reason, path)
        return path

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.dump(f"signal {signal.Signals(signum).name}")
        prev = self._previous
        if callable(prev) and prev not in (signal.default_int_handler,):
            prev(signum, frame)

    def _watch(self, last: Optional[float]) -> None:
        while not self._stop.wait(TRIGGER_POLL_S):
            now = _mtime(self.trigger)
            if now is not None and now != last:
                try:
                    self.dump(f"trigger file {self.trigger}")
                except Exception:  # noqa: BLE001 - keep watching; the failure is logged
                    log.exception("rank %d: QP dump on trigger failed", self.rank)
            last = now

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * TRIGGER_POLL_S)
        if self._sig is not None and signal.getsignal(self._sig) == self._on_signal:
            if threading.current_thread() is threading.main_thread():
                signal.signal(self._sig, self._previous if self._previous is not None else signal.SIG_DFL)
            else:  # only the main thread may change handlers; a dead source makes ours a no-op anyway
                log.warning("QP dump handler for %s stays installed: close() ran outside the main thread",
                            self._sig.name)
        self._sig = None


def _mtime(path: str) -> Optional[float]:
    try:
        return os.stat(path).st_mtime_ns / 1e9
    except OSError:
        return None


def install_dump_triggers(source: Any, rank: int, environ: Optional[Mapping[str, str]] = None,
                          out_dir: Optional[str] = None, tag: str = "") -> Optional[DumpTriggers]:
    """Installs the triggers the environment asks for (None if it asks for none). The signal handler
    can only be installed from the main thread; elsewhere that part is skipped with a warning."""
    env = os.environ if environ is None else environ
    sig_text, trigger = env.get(SIGNAL_ENV, "").strip(), env.get(TRIGGER_ENV, "").strip()
    if not sig_text and not trigger:
        return None
    sig = parse_signal(sig_text) if sig_text else None
    if sig is not None and threading.current_thread() is not threading.main_thread():
        log.warning("%s=%s ignored: signal handlers can only be installed from the main thread", SIGNAL_ENV, sig_text)
        sig = None
    where = out_dir or env.get(DIR_ENV) or env.get("PYEP_RUN_DIR") or os.getcwd()
    os.makedirs(where, exist_ok=True)
    return DumpTriggers(source, rank, where, sig, trigger, tag)


def dump_paths(out_dir: str) -> List[str]:
    """The dump files in a directory, in rank order."""
    names = [n for n in os.listdir(out_dir) if n.startswith("qp_dump-rank") and n.endswith(".json")]

    def key(n: str) -> Any:
        digits = "".join(ch for ch in n[len("qp_dump-rank"):].split("-")[0].split(".")[0] if ch.isdigit())
        return (int(digits) if digits else 0, n)
    return [os.path.join(out_dir, n) for n in sorted(names, key=key)]


def load_document(path: str) -> Dict[str, Any]:
    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path} is not a pyep QP dump (format {FORMAT})")
    return doc

