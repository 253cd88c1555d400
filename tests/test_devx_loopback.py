"""Real-NIC validation of the DevX provider: two endpoints on one ConnectX, connected through
pyep.transport.connect exactly as two ranks would be, then RDMA writes and 32-bit masked fetch-adds
posted by CPU threads through qp.h (the same posting code GPU kernels run) and checked in memory.

Needs an mlx5 device: `PYEP_TEST_NIC=mlx5_0 python -m pytest -q tests/test_devx_loopback.py` (without
PYEP_TEST_NIC the first device rdma-core lists is used). Skipped where there is none; it is the first
thing to run on a new cluster after `pyep doctor` (docs/nic.md)."""
from __future__ import annotations

import ctypes
import os

import pytest

from pyep._native import engine

devx = engine().devx


def _device() -> str:
    if not getattr(devx, "has_provider", False):
        pytest.skip(getattr(devx, "unavailable", "no DevX provider in this build"))
    name = os.environ.get("PYEP_TEST_NIC", "")
    if not name:
        try:
            names = devx.device_names()
        except RuntimeError as exc:
            pytest.skip(f"no RDMA devices here: {exc}")
        if not names:
            pytest.skip("no RDMA devices here")
        name = names[0]
    reason = devx.unavailable_reason(name)
    if reason:
        pytest.skip(reason)
    return name


def test_loopback_write_and_atomic() -> None:
    from pyep.transport.connect import ConnectConfig, Connections
    from pyep.transport.connect_info import Region
    prov = devx.DevxProvider(_device(), gid_index=int(os.environ.get("PYEP_TEST_GID_INDEX", "-1")))
    caps = prov.hca_caps()
    bufs = [ctypes.create_string_buffer(1 << 16) for _ in range(2)]
    mrs = [prov.reg_mr(ctypes.addressof(b), len(b), 1 | 2 | 8) for b in bufs]
    ends = [Connections(prov, r, 2, ConnectConfig(qps_per_peer=1, log_sq=8),
                        regions=[Region("buf", m["addr"], m["length"], m["rkey"])]) for r, m in enumerate(mrs)]
    try:
        blobs = [e.local_info().to_bytes() for e in ends]
        for e in ends:
            e.connect(blobs)
        assert ends[0].connected(1) and ends[1].connected(0)
        q = ends[0].qps(1)[0]
        hq = engine().HostQp(q.qp["qpn"], q.qp["log_sq"], q.qp["sq"], q.qp["dbrec"], q.qp["bf"], q.qp["bf_size"],
                             q.cq["cqes"], q.cq["dbrec"], q.cq["log_size"])
        payload = b"pyep devx loopback"
        ctypes.memmove(bufs[0], payload, len(payload))
        dst = ends[0].remote[1].region("buf")
        assert hq.post_rdma_write(mrs[0]["addr"], mrs[0]["lkey"], dst.addr, dst.rkey, len(payload), True, 5.0) == 0
        assert hq.quiet(5.0) == 0, hq.error()
        assert bufs[1].raw[:len(payload)] == payload
        if caps["masked_fetch_add_32"]:
            ctypes.c_uint32.from_buffer(bufs[1], 1024).value = 0
            for _ in range(10):
                assert hq.post_masked_fa32(dst.addr + 1024, dst.rkey, (-1) & 0xFFFFFFFF, mrs[0]["addr"] + 2048,
                                           mrs[0]["lkey"], False, 5.0) == 0
            assert hq.quiet(5.0) == 0, hq.error()
            assert ctypes.c_uint32.from_buffer(bufs[1], 1024).value == 0xFFFFFFF6   # ten times -1
    finally:
        for e in ends:
            e.close()
        for m in mrs:
            prov.dereg_mr(m["lkey"])
