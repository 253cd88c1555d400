"""Rank-side code of tests/test_gda_gpu.py: GPU kernels posting RDMA writes + signals through qp.h to
every other rank's GPU, over the softnic (one softnic per rank process, QPs with host-mapped rings).

Each rank builds `qps_per_peer` QPs towards every peer, registers its GPU buffers, publishes a connect
blob through a FileStore, connects, copies its QP contexts into GPU memory and launches the engine's
`launch_post_writes` kernel: warp w posts to QP w / warps_per_qp `msgs_per_warp` writes, each followed
(same doorbell) by a +1 masked fetch-add on that QP's signal word at the receiver, then quiet()s.
Receivers then check every byte (a pattern unique to (sender, receiver, QP) and position) and every
signal word. With `faults`, QP 0 from the lower to the higher rank of every pair targets an MR its owner
invalidated and QP 1 uses a corrupted rkey: their warps must report kErrQp with REMOTE_ACCESS_ERR (0x13)
in the QP's error slot, and nothing of theirs may land, while the other QPs deliver everything. (The
higher rank does not post on QPs 0 and 1: their partners are in error, and a QP posting to a partner
in error fails with TRANSPORT_RETRY_EXC_ERR on real RC hardware too, whichever side fails first.)

`poster="cpu"` runs the same case without a GPU: buffers in the softnic's shared host memory and one
CPU thread per "warp" doing exactly what the kernel does, through the same qp.h code (HostQp). CI runs
it, so the tables, the exchange and the checks below are exercised before a GPU machine sees them.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, List

log = logging.getLogger("tests.gda_gpu_cases")

K_OK, K_ERR_QP = 0, 1                 # gda::Status
REMOTE_ACCESS_ERR, REQ_ERR, KIND_CQE = 0x13, 13, 1


@dataclass(frozen=True)
class Case:
    name: str
    qps_per_peer: int
    warps_per_qp: int
    msgs_per_warp: int
    msg_bytes: int
    log_sq: int
    faults: bool = False
    timeout_s: float = 30.0           # bounds every wait inside the kernel

    @property
    def msgs_per_qp(self) -> int:
        return self.warps_per_qp * self.msgs_per_warp

    @property
    def region(self) -> int:          # receive bytes per (sender, QP), 64-byte aligned
        return (self.msgs_per_qp * self.msg_bytes + 63) // 64 * 64

    def faulty(self, src: int, dst: int, j: int) -> bool:
        return self.faults and j in (0, 1) and src < dst

    def active(self, src: int, dst: int, j: int) -> bool:
        return not (self.faults and j in (0, 1) and src > dst)


def pattern(seed: int, n: int, device: Any) -> Any:
    import torch
    x = torch.arange(n, dtype=torch.int64, device=device)
    v = x * 2654435761 + seed * 97531
    v = v ^ (v >> 13)
    return (v & 0xFF).to(torch.uint8)


def seed_of(src: int, dst: int, j: int) -> int:
    return (src * 1024 + dst) * 64 + j + 1


def barrier(store: Any, prefix: str, name: str, rank: int, world: int, timeout_s: float) -> None:
    store.set(f"{prefix}/barrier/{name}/{rank}", b"1")
    keys = [f"{prefix}/barrier/{name}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - torch raises several store error types
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise TimeoutError(f"rank {rank}: barrier '{name}' waited {timeout_s} s for ranks {missing}: {exc}") from exc


def wait_event(ev: Any, bound_s: float, what: str) -> None:
    deadline = time.monotonic() + bound_s
    while not ev.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish within {bound_s:.0f} s")
        time.sleep(0.001)


def run_case(case: Case, store_path: str, prefix: str, poster: str = "gpu") -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from pyep.softnic import SoftNic, SoftNicConfig, agree_fabric_id
    if poster not in ("gpu", "cpu"):
        raise ValueError(f"poster must be 'gpu' or 'cpu', got {poster!r}")
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.FileStore(store_path, world)
    fabric = agree_fabric_id(store, rank, prefix, timeout_s=120)
    if poster == "cpu":
        with SoftNic(SoftNicConfig(node_id=rank, fabric_id=fabric)) as nic:
            return _run(case, nic, store, prefix, rank, world, torch.device("cpu"))
    dev = rank % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    with SoftNic(SoftNicConfig(node_id=rank, fabric_id=fabric, cuda_device=dev)) as nic:
        assert nic.has_cuda, "the softnic of a CUDA build must reach GPU memory"
        return _run(case, nic, store, prefix, rank, world, torch.device("cuda", dev))


def _zeros(nic: Any, n: int, dtype: Any, device: Any) -> Any:
    """GPU memory, or (CPU posters) the softnic's shared host memory, which peer processes can reach."""
    import torch
    if device.type == "cuda":
        return torch.zeros(n, dtype=dtype, device=device)
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    t = torch.frombuffer(nic.alloc_host(nbytes).view, dtype=dtype)
    return t.zero_()


def _cpu_post_writes(hqs: List[Any], case: Case, tables: Dict[str, List[int]], src: int, lkey: int, fetch: int,
                     fetch_lkey: int, status: Any) -> None:
    """What post_writes_kernel does, one CPU thread per warp, through the same qp.h calls."""
    def warp(w: int) -> None:
        q, j = divmod(w, case.warps_per_qp)
        hq, st = hqs[q], 0
        for i in range(case.msgs_per_warp):
            off = (j * case.msgs_per_warp + i) * case.msg_bytes
            st = int(hq.post_write_with_signal(src + tables["src"][q] + off, lkey, tables["dst"][q] + off,
                                               tables["rkey"][q], case.msg_bytes, tables["sig"][q],
                                               tables["sig_rkey"][q], 1, fetch + 8 * w, fetch_lkey, False,
                                               case.timeout_s))
            if st:
                break
        if not st:
            st = int(hq.quiet(case.timeout_s))
        status[w] = st
    threads = [threading.Thread(target=warp, args=(w,), daemon=True) for w in range(len(status))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * case.timeout_s + 60)
        if t.is_alive():
            raise TimeoutError(f"a CPU poster of case {case.name} did not finish")


def _run(case: Case, nic: Any, store: Any, prefix: str, rank: int, world: int, device: Any) -> Dict[str, Any]:
    import torch
    from pyep._native import engine
    from pyep.softnic import ConnectAttr, Placement, exchange_blobs
    from pyep.transport.qp_dump import QpRef, qp_dump
    eng = engine()
    gpu = device.type == "cuda"
    place = Placement.HOST_MAPPED if gpu else Placement.HOST
    nq, peers = case.qps_per_peer, [p for p in range(world) if p != rank]
    cqs, qps = [], []
    for _p in peers:
        for _j in range(nq):
            cq = nic.create_cq(case.log_sq, place)
            cqs.append(cq)
            qps.append(nic.create_qp(cq, case.log_sq, place))
    nqp_total = len(qps)
    recv = _zeros(nic, world * nq * case.region, torch.uint8, device)
    sig = _zeros(nic, world * nq + 16, torch.int32, device)
    victim = _zeros(nic, world * nq * case.region, torch.uint8, device)
    src = _zeros(nic, nqp_total * case.region, torch.uint8, device)
    fetch = _zeros(nic, nqp_total * case.warps_per_qp, torch.int64, device)
    # The QPs this rank posts on, in kernel order: (position in qps, peer, QP index within the peer).
    active = [(i * nq + j, p, j) for i, p in enumerate(peers) for j in range(nq) if case.active(rank, p, j)]
    status = torch.full((len(active) * case.warps_per_qp,), -1, dtype=torch.int32, device=device)
    for a, (_, p, j) in enumerate(active):
        src[a * case.region:a * case.region + case.msgs_per_qp * case.msg_bytes] = \
            pattern(seed_of(rank, p, j), case.msgs_per_qp * case.msg_bytes, device)
    if gpu:
        torch.cuda.synchronize(device)
    m_recv, m_sig, m_victim, m_src, m_fetch = (nic.reg_mr(t) for t in (recv, sig, victim, src, fetch))
    blobs = exchange_blobs(store, rank, world, nic.connect_blob(qps, [m_recv, m_sig, m_victim]), prefix, 120)
    infos = {p: nic.parse_blob(blobs[p]) for p in peers}
    attr = ConnectAttr(ack_timeout=16, retry_cnt=3)   # ~2 s of retries: a peer still connecting is no error
    for i, p in enumerate(peers):
        mine_at_p = rank if rank < p else rank - 1    # our position in p's peer list
        remote = infos[p].qpns[mine_at_p * nq:(mine_at_p + 1) * nq]
        assert len(remote) == nq, f"rank {p} published {len(infos[p].qpns)} QPs, expected {(world - 1) * nq}"
        for j in range(nq):
            nic.connect(qps[i * nq + j], infos[p].node_id, remote[j], attr)
    barrier(store, prefix, "connected", rank, world, 120)
    if case.faults:
        nic.invalidate_key(m_victim)
        barrier(store, prefix, "invalidated", rank, world, 120)
    hqs = [nic.host_qp(qps[q], cqs[q]) for q, _, _ in active]
    ctx_size = int(eng.qp_context_size)
    srcs, dst, rkeys, sigs, sig_rkeys = [], [], [], [], []
    for a, (_, p, j) in enumerate(active):
        recv_mr, sig_mr, victim_mr = infos[p].mrs
        known = {m.rkey for m in infos[p].mrs}
        off = (rank * nq + j) * case.region
        srcs.append(a * case.region)
        if case.faulty(rank, p, j) and j == 0:
            dst.append(victim_mr.addr + off)
            rkeys.append(victim_mr.rkey)
        else:
            dst.append(recv_mr.addr + off)
            bad = recv_mr.rkey ^ 0x80000000
            assert bad not in known
            rkeys.append(bad if case.faulty(rank, p, j) else recv_mr.rkey)
        sigs.append(sig_mr.addr + 4 * (rank * nq + j))
        sig_rkeys.append(sig_mr.rkey)
    barrier(store, prefix, "ready", rank, world, 120)
    if gpu:
        seconds, ctx_dev, st = _gpu_post_writes(eng, hqs, case, device, src, m_src.lkey, fetch, m_fetch.lkey,
                                                (srcs, dst, rkeys, sigs, sig_rkeys), status, rank)
        ctx_after = bytes(ctx_dev.cpu().numpy().tobytes())
        contexts: List[Any] = [ctx_dev[a * ctx_size:(a + 1) * ctx_size] for a in range(len(active))]
    else:
        t0 = time.perf_counter()
        _cpu_post_writes(hqs, case, {"src": srcs, "dst": dst, "rkey": rkeys, "sig": sigs, "sig_rkey": sig_rkeys},
                         src.data_ptr(), m_src.lkey, fetch.data_ptr(), m_fetch.lkey, status)
        seconds = time.perf_counter() - t0
        st = status.tolist()
        ctx_after = b"".join(hq.context_bytes() for hq in hqs)
        contexts = [hq.addresses()["context"] for hq in hqs]
    # The same contexts through the dump API (device memory for GPU posters), read after the posters ended.

    class _Source:
        def qp_contexts(self) -> List[QpRef]:
            return [QpRef(peer=p, qpn=qps[q].qpn, context=contexts[a], index=j, provider=nic)
                    for a, (q, p, j) in enumerate(active)]
    dump = qp_dump(_Source())
    return _check(case, eng, store, prefix, rank, world, device, peers, active, ctx_after, ctx_size, dump, st,
                  seconds, recv, sig, victim, nic)


def _gpu_post_writes(eng: Any, hqs: List[Any], case: Case, device: Any, src: Any, lkey: int, fetch: Any,
                     fetch_lkey: int, cols: Any, status: Any, rank: int) -> Any:
    """Copies the QP contexts to the GPU and runs the engine's post_writes kernel; returns (seconds,
    the contexts as the kernel left them, per-warp status)."""
    import torch
    srcs, dst, rkeys, sigs, sig_rkeys = cols
    # post_writes_kernel reads QP q's source at src + q * src_stride_qp.
    assert srcs == [a * case.region for a in range(len(srcs))], "sources must be laid out in kernel QP order"
    ctx_dev = torch.frombuffer(bytearray(b"".join(hq.context_bytes() for hq in hqs)), dtype=torch.uint8).to(device)
    tables = {
        "dst": torch.tensor(dst, dtype=torch.int64, device=device),
        "rkey": torch.tensor([k if k < 2**31 else k - 2**32 for k in rkeys], dtype=torch.int32, device=device),
        "sig": torch.tensor(sigs, dtype=torch.int64, device=device),
        "sig_rkey": torch.tensor([k if k < 2**31 else k - 2**32 for k in sig_rkeys], dtype=torch.int32,
                                 device=device),
    }
    nqp_total = len(hqs)
    a = eng.PostWritesArgs()
    a.qp_ctx, a.num_qps, a.warps_per_qp = ctx_dev.data_ptr(), nqp_total, case.warps_per_qp
    a.src, a.lkey, a.src_stride_qp = src.data_ptr(), lkey, case.region
    a.dst_table, a.rkey_table = tables["dst"].data_ptr(), tables["rkey"].data_ptr()
    a.sig_table, a.sig_rkey_table = tables["sig"].data_ptr(), tables["sig_rkey"].data_ptr()
    a.fetch, a.fetch_lkey = fetch.data_ptr(), fetch_lkey
    a.msgs_per_warp, a.msg_bytes = case.msgs_per_warp, case.msg_bytes
    a.status, a.timeout_ns = status.data_ptr(), int(case.timeout_s * 1e9)
    stream = torch.cuda.Stream(device=device)
    a.stream = stream.cuda_stream
    t0 = time.perf_counter()
    eng.launch_post_writes(a)
    ev = torch.cuda.Event()
    ev.record(stream)
    # Every wait in the kernel is bounded by timeout_s; a few of them in a row is the worst case.
    wait_event(ev, 4 * case.timeout_s + 60, f"rank {rank}: post_writes kernel ({case.name})")
    return time.perf_counter() - t0, ctx_dev, status.cpu().tolist()


def _check(case: Case, eng: Any, store: Any, prefix: str, rank: int, world: int, device: Any, peers: List[int],
           active: List[Any], ctx_after: bytes, ctx_size: int, dump: List[Dict[str, Any]], st: List[int],
           seconds: float, recv: Any, sig: Any, victim: Any, nic: Any) -> Dict[str, Any]:
    import torch
    nq = case.qps_per_peer
    problems: List[str] = []
    for w, s in enumerate(st):
        a = w // case.warps_per_qp
        _, p, j = active[a]
        want = K_ERR_QP if case.faulty(rank, p, j) else K_OK
        if s != want:
            problems.append(f"warp {w} (QP {j} to rank {p}) status {s}, expected {want}")
    writes_ok = bytes_ok = 0
    for a, (_, p, j) in enumerate(active):
        c = eng.decode_qp_context(ctx_after[a * ctx_size:(a + 1) * ctx_size])
        e, d = c["err"], dump[a]
        where = f"QP {j} to rank {p} ({c['qpn']:#x})"
        if case.faulty(rank, p, j):
            if not (e["valid"] and e["kind"] == KIND_CQE and e["cqe_opcode"] == REQ_ERR
                    and e["syndrome"] == REMOTE_ACCESS_ERR):
                problems.append(f"{where}: error slot {e}, expected REQ_ERR syndrome 0x13 from an error CQE")
            if not d["error"] or d["error"].get("syndrome_name") != "REMOTE_ACCESS_ERR" or d["state"] != "ERR":
                problems.append(f"{where}: the dump shows state {d['state']} error {d['error']}")
        else:
            if e["valid"]:
                problems.append(f"{where}: unexpected error {e}")
            if not c["resv"] == c["ready"] == c["cons"] or c["wqes_posted"] < 2 * case.msgs_per_qp:
                problems.append(f"{where}: indices resv {c['resv']} ready {c['ready']} cons {c['cons']}, "
                                f"{c['wqes_posted']} WQEs posted (expected >= {2 * case.msgs_per_qp})")
            if d["outstanding"] != 0 or d["error"] is not None or d["state"] != "RTS":
                problems.append(f"{where}: the dump shows state {d['state']}, {d['outstanding']} outstanding, "
                                f"error {d['error']}")
            writes_ok += case.msgs_per_qp
            bytes_ok += case.msgs_per_qp * case.msg_bytes
    barrier(store, prefix, "posted", rank, world, 4 * case.timeout_s + 120)
    # Every sender's quiet() returned, so every write and signal to us has completed.
    sig_host = sig.cpu().tolist()
    data = case.msgs_per_qp * case.msg_bytes
    for s in peers:
        for j in range(nq):
            slot = s * nq + j
            region = recv[slot * case.region:slot * case.region + data]
            delivers = case.active(s, rank, j) and not case.faulty(s, rank, j)
            want_count = case.msgs_per_qp if delivers else 0
            if sig_host[slot] != want_count:
                problems.append(f"signal from rank {s} QP {j} is {sig_host[slot]}, expected {want_count}")
            expect = pattern(seed_of(s, rank, j), data, device) if delivers else torch.zeros_like(region)
            if not torch.equal(region, expect):
                bad = int((region != expect).nonzero()[0].item())
                problems.append(f"data from rank {s} QP {j} differs at byte {bad} of {data} "
                                f"(message {bad // case.msg_bytes})")
    if case.faults and bool(victim.any()):
        problems.append("the invalidated MR was written")
    events = nic.events(log_them=False)
    barrier(store, prefix, "verified", rank, world, 120)
    return {"rank": rank, "device": device.index, "qps": len(active), "writes": writes_ok, "signals": writes_ok,
            "bytes": bytes_ok, "seconds": seconds, "problems": problems,
            "errors_seen": sum(1 for d in dump if d["error"]), "softnic_events": len(events)}
