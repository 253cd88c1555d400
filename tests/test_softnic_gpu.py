"""The softnic's CUDA backend (marked `gpu`; skipped without a GPU and the CUDA build): GPU memory as
source, target and fetch destination, mixed host/GPU WQEs in order on one QP, host-mapped rings, and
two processes writing into each other's GPU memory through CUDA IPC. Posting is from host threads
(HostQp); GPU-kernel posting is exercised by the engine's GPU tests."""
from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any, Iterator

import pytest

pytestmark = pytest.mark.gpu


def _usable() -> bool:
    try:
        import torch
        from pyep._native import load
        mod = load()
        return bool(torch.cuda.is_available() and mod is not None and mod.has_cuda)
    except Exception:  # noqa: BLE001 - any failure means "no usable CUDA build"
        return False


requires_gpu = pytest.mark.skipif(not _usable(), reason="needs a CUDA GPU and the CUDA build of pyep._engine")


@pytest.fixture
def pair() -> Iterator[Any]:
    from pyep.softnic import ConnectAttr, Placement, SoftNic, SoftNicConfig, new_fabric_id
    fabric = new_fabric_id()
    a = SoftNic(SoftNicConfig(node_id=0, fabric_id=fabric, cuda_device=0))
    b = SoftNic(SoftNicConfig(node_id=1, fabric_id=fabric, cuda_device=0))
    try:
        assert a.has_cuda and b.has_cuda
        cq_a, cq_b = a.create_cq(6, Placement.HOST_MAPPED), b.create_cq(6, Placement.HOST_MAPPED)
        qp_a, qp_b = a.create_qp(cq_a, 4, Placement.HOST_MAPPED), b.create_qp(cq_b, 4, Placement.HOST_MAPPED)
        a.connect(qp_a, 1, qp_b.qpn, ConnectAttr(ack_timeout=14))
        b.connect(qp_b, 0, qp_a.qpn, ConnectAttr(ack_timeout=14))
        yield a, b, a.host_qp(qp_a, cq_a)
    finally:
        a.close()
        b.close()


@requires_gpu
def test_gpu_writes_and_atomics(pair: Any) -> None:
    import torch
    from pyep.softnic import PostStatus
    a, b, poster = pair
    n = 1 << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    sig = torch.zeros(8, dtype=torch.int64, device="cuda")
    fetch = torch.zeros(8, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    ms, md, mg, mf = a.reg_mr(src), b.reg_mr(dst), b.reg_mr(sig), a.reg_mr(fetch)
    for i in range(200):
        off = (i * 4099) % (n - 4096)
        st = poster.post_write_with_signal(src.data_ptr() + off, ms.lkey, dst.data_ptr() + off, md.rkey, 4096,
                                           sig.data_ptr(), mg.rkey, 1, fetch.data_ptr(), mf.lkey)
        poster.check(st, f"write {i}")
    poster.check(poster.quiet(timeout_s=30), "quiet")
    assert int(sig.view(torch.int32)[0]) == 200
    offs = {(i * 4099) % (n - 4096) for i in range(200)}
    for off in offs:
        assert torch.equal(dst[off:off + 4096], src[off:off + 4096])
    for i in range(10):
        assert poster.post_fa64(sig.data_ptr() + 8, mg.rkey, 7, fetch.data_ptr() + 8, mf.lkey, True) == PostStatus.OK
        assert poster.quiet(timeout_s=30) == PostStatus.OK
        assert int(fetch[1]) == 7 * i
    assert int(sig[1]) == 70


@requires_gpu
def test_mixed_host_and_gpu_in_order(pair: Any) -> None:
    import numpy as np
    import torch
    a, b, poster = pair
    host_src, host_dst, host_fetch = a.alloc_host(8192), b.alloc_host(8192), a.alloc_host(4096)
    gpu_dst = torch.zeros(8192, dtype=torch.uint8, device="cuda")
    gpu_sig = torch.zeros(4, dtype=torch.int32, device="cuda")
    host_sig = b.alloc_host(4096)
    torch.cuda.synchronize()
    m_hs, m_hd, m_hf = a.reg_mr(host_src), b.reg_mr(host_dst), a.reg_mr(host_fetch)
    m_gd, m_gs, m_hsig = b.reg_mr(gpu_dst), b.reg_mr(gpu_sig), b.reg_mr(host_sig)
    host_src.numpy()[:] = np.arange(8192) % 253
    for round_ in range(50):
        # host -> GPU write, then a signal on host memory: the host atomic must wait for the copy
        poster.check(poster.post_rdma_write(host_src.addr, m_hs.lkey, gpu_dst.data_ptr(), m_gd.rkey, 8192))
        poster.check(poster.post_masked_fa32(host_sig.addr, m_hsig.rkey, 1, host_fetch.addr, m_hf.lkey))
        # GPU atomic with a host fetch destination, then GPU -> host write
        poster.check(poster.post_masked_fa32(gpu_sig.data_ptr(), m_gs.rkey, 2, host_fetch.addr + 4, m_hf.lkey))
        poster.check(poster.post_rdma_write(host_src.addr, m_hs.lkey, host_dst.addr, m_hd.rkey, 8192, signaled=True))
        poster.check(poster.quiet(timeout_s=30), f"round {round_}")
        assert int(host_fetch.numpy("uint32")[1]) == 2 * round_
    assert int(host_sig.numpy("uint32")[0]) == 50 and int(gpu_sig[0]) == 100
    assert bytes(gpu_dst.cpu().numpy()) == bytes(host_src.numpy()) == bytes(host_dst.numpy())


def _ipc_rank(rank: int, conn: Any, results: Any) -> None:
    try:
        import torch
        from pyep.softnic import ConnectAttr, SoftNic, SoftNicConfig
        dev = rank % torch.cuda.device_count()
        torch.cuda.set_device(dev)
        fabric = conn.recv()
        with SoftNic(SoftNicConfig(node_id=rank, fabric_id=fabric, cuda_device=dev)) as nic:
            cq = nic.create_cq(6)
            qp = nic.create_qp(cq, 4)
            n = 64 * 4096
            src = torch.full((n,), rank + 1, dtype=torch.uint8, device="cuda")
            dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
            sig = torch.zeros(4, dtype=torch.int32, device="cuda")
            fetch = torch.zeros(4, dtype=torch.int32, device="cuda")
            torch.cuda.synchronize()
            ms, md, mg, mf = (nic.reg_mr(t) for t in (src, dst, sig, fetch))
            conn.send(nic.connect_blob([qp], [md, mg]))
            peer = nic.parse_blob(conn.recv())
            nic.connect(qp, peer.node_id, peer.qpns[0], ConnectAttr(ack_timeout=16, retry_cnt=3))
            poster = nic.host_qp(qp, cq)
            pd, ps = peer.mrs
            for i in range(64):
                poster.check(poster.post_write_with_signal(src.data_ptr() + i * 4096, ms.lkey, pd.addr + i * 4096,
                                                           pd.rkey, 4096, ps.addr, ps.rkey, 1, fetch.data_ptr(),
                                                           mf.lkey), f"write {i}")
            poster.check(poster.quiet(timeout_s=30), "quiet")
            deadline = time.monotonic() + 30
            while int(sig[0]) < 64:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank} waited 30 s for 64 signals, got {int(sig[0])}")
                time.sleep(0.001)
            assert bool((dst == (2 - rank)).all()), f"rank {rank}: peer data wrong"
            conn.send("done")
            conn.recv()
        results.put((rank, "ok"))
    except BaseException:  # reported to the parent
        results.put((rank, traceback.format_exc()))


def _drain(results: Any) -> str:
    out = []
    while not results.empty():
        out.append(str(results.get_nowait()))
    return "\n".join(out) or "no rank reported"


@requires_gpu
def test_two_processes_cuda_ipc() -> None:
    from pyep.softnic import new_fabric_id
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ends = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_ipc_rank, args=(r, ends[r][1], results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        fabric = new_fabric_id()
        for parent, _ in ends:
            parent.send(fabric)
        blobs = [parent.recv() if parent.poll(120) else None for parent, _ in ends]
        assert all(blobs), f"a rank did not send its connect blob within 120 s: {_drain(results)}"
        ends[0][0].send(blobs[1])
        ends[1][0].send(blobs[0])
        for parent, _ in ends:
            assert parent.poll(120), f"a rank did not finish within 120 s: {_drain(results)}"
            parent.recv()
        for parent, _ in ends:
            parent.send("close")
        got = dict(results.get(timeout=60) for _ in range(2))
        assert got == {0: "ok", 1: "ok"}, "\n".join(got.values())
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
