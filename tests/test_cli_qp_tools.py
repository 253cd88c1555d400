"""CPU tests of `pyep qp loopback` and `pyep qp dump` (pyep.transport.loopback, qp_dump) on the softnic.

The loopback runs with CPU posters (the GPU kernels are covered by tests/test_gda_gpu.py); the dump reads
softnic QPs with host rings: healthy, stalled (progress thread stopped), and failed with a bad rkey.
"""
from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator, List, Tuple

import pytest
from pytest import CaptureFixture, MonkeyPatch

import pyep.cli as cli
from pyep.transport import qp_dump as qd


def run(argv: List[str], monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> Tuple[int, str, str]:
    monkeypatch.setattr(cli, "COMMANDS", {"qp": "pyep.cli.qp"})
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    try:
        rc = cli.main(["qp"] + argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------- loopback
def test_parse_sizes() -> None:
    from pyep.cli.qp_loopback import parse_sizes
    assert parse_sizes("8, 64,4K,1m,2kb,1G") == (8, 64, 4096, 1 << 20, 2048, 1 << 30)
    for bad in ("", "0", "8,x", "2G", "4K,4096", "-1", "1.5K"):
        with pytest.raises(cli.CliError):
            parse_sizes(bad)


@pytest.mark.parametrize("argv, needle", [
    (["--sizes", "8,abc"], "not a size"),
    (["--nic", "devx"], "needs --device"),
    (["--nic", "softnic", "--device", "mlx5_0"], "cannot be combined"),
    (["--window", "2"], "window must be"),
    (["--gpus", "0,1,2"], "--gpus"),
    (["--iters", "-3"], "--iters"),
    (["--poster", "cpu", "--nic", "devx", "--device", "mlx5_0"], "CPU poster needs the softnic"),
    (["--timeout", "0"], "timeout_s"),
])
def test_loopback_bad_arguments(argv: List[str], needle: str, monkeypatch: MonkeyPatch,
                                capsys: CaptureFixture[str]) -> None:
    rc, out, err = run(["loopback"] + argv, monkeypatch, capsys)
    assert rc == 2 and needle in err and not out


def test_loopback_devx_without_device(monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    if os.path.isdir("/sys/class/infiniband/mlx5_0"):
        pytest.skip("this host has an mlx5_0")
    rc, _, err = run(["loopback", "--device", "mlx5_0"], monkeypatch, capsys)
    assert rc == 2 and "mlx5_0" in err, err


def test_loopback_gpu_posters_need_a_gpu(monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    import torch
    from pyep._native import engine
    if engine().has_cuda and torch.cuda.is_available():
        pytest.skip("a GPU is available here")
    rc, out, err = run(["loopback", "--nic", "softnic", "--sizes", "8"], monkeypatch, capsys)
    assert rc == 1 and "--poster cpu" in err and not out


def test_loopback_cpu_posters_json(monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    rc, out, err = run(["loopback", "--poster", "cpu", "--sizes", "8,3,64K", "--iters", "40", "--warmup", "5",
                        "--window", "8", "--json"], monkeypatch, capsys)
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["nic"].startswith("softnic") and rep["window"] == 8
    assert [r["size"] for r in rep["latency"]] == [8, 3, 65536] == [r["size"] for r in rep["bandwidth"]]
    for r in rep["latency"]:
        assert r["iterations"] == 40 and 0 < r["t_min_us"] <= r["t_median_us"] <= r["t_p99_us"] <= r["t_max_us"]
    for r in rep["bandwidth"]:
        assert r["iterations"] == 40 and r["gb_s"] > 0 and r["mmsg_s"] > 0


def test_loopback_cpu_posters_table(monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    rc, out, err = run(["loopback", "--poster", "cpu", "--sizes", "1K", "--iters", "20", "--test", "lat"],
                       monkeypatch, capsys)
    assert rc == 0, err
    assert "RDMA write latency" in out and "bandwidth" not in out and "data verified" in out
    row = [line for line in out.splitlines() if line.split()[:2] == ["1024", "20"]]
    assert len(row) == 1 and len(row[0].split()) == 7


def test_loopback_reports_a_failed_qp() -> None:
    from pyep.transport.loopback import Loopback, LoopbackConfig, LoopbackError
    cfg = LoopbackConfig(poster="cpu", sizes=(64,), lat_iters=10, bw_iters=10, warmup=0, window=8, timeout_s=5.0)
    with Loopback(cfg) as lb:
        assert lb.latency(64)["iterations"] == 10
        lb.eps[0].provider.force_error(lb.eps[0].host_qp.qpn)
        with pytest.raises(LoopbackError, match=r"endpoint 0 .*QP in error.*WR_FLUSH_ERR"):
            lb.bandwidth(64)


def test_loopback_catches_wrong_data() -> None:
    from pyep.transport.loopback import Loopback, LoopbackConfig, LoopbackError
    cfg = LoopbackConfig(poster="cpu", sizes=(256,), lat_iters=5, bw_iters=5, warmup=0, window=8)
    with Loopback(cfg) as lb:
        lb.eps[0].arena.view[lb.span + 100] ^= 0xFF    # corrupt the sender's source after setup
        with pytest.raises(LoopbackError, match="endpoint 1 received wrong data at byte 100"):
            lb.bandwidth(256)


# --------------------------------------------------------------------------- dump: API
class _Pair:
    """Two softnics, `n` QPs from a to b with host rings; qp_contexts() over a's posters."""

    def __init__(self, n: int = 2) -> None:
        from pyep.softnic import ConnectAttr, SoftNic, SoftNicConfig, new_fabric_id
        fabric = new_fabric_id()
        self.a = SoftNic(SoftNicConfig(node_id=0, fabric_id=fabric))
        self.b = SoftNic(SoftNicConfig(node_id=1, fabric_id=fabric))
        self.qps, self.posters = [], []
        for _ in range(n):
            cq_a, cq_b = self.a.create_cq(4), self.b.create_cq(4)
            qp_a, qp_b = self.a.create_qp(cq_a, 4), self.b.create_qp(cq_b, 4)
            self.a.connect(qp_a, 1, qp_b.qpn, ConnectAttr(ack_timeout=8, retry_cnt=1))
            self.b.connect(qp_b, 0, qp_a.qpn, ConnectAttr(ack_timeout=8, retry_cnt=1))
            self.qps.append((qp_a, cq_a))
            self.posters.append(self.a.host_qp(qp_a, cq_a))
        self.src, self.dst = self.a.alloc_host(1 << 16), self.b.alloc_host(1 << 16)
        self.ms, self.md = self.a.reg_mr(self.src), self.b.reg_mr(self.dst)

    def qp_contexts(self) -> List[Any]:
        return [(5, qp, cq, hq.addresses()["context"], self.a) for (qp, cq), hq in zip(self.qps, self.posters)]

    def write(self, k: int, n: int, rkey: int = 0, length: int = 1000) -> None:
        for i in range(n):
            self.posters[k].post_rdma_write(self.src.addr, self.ms.lkey, self.dst.addr + 8 * i,
                                            rkey or self.md.rkey, length)

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def pair() -> Iterator[_Pair]:
    p = _Pair()
    yield p
    p.close()


def test_dump_healthy_stalled_and_failed(pair: _Pair) -> None:
    pair.write(0, 6)
    assert pair.posters[0].quiet() == 0
    pair.a.stop()                        # nothing executes: posted WQEs stay outstanding
    pair.write(1, 3)
    stalled = qd.qp_dump(pair)[1]
    assert stalled["outstanding"] == 3 and stalled["ready"] == 3 and stalled["cons"] == 0
    assert stalled["state"] == "RTS" and stalled["error"] is None and stalled["provider"]["pending"] == 0
    pair.a.start()
    assert pair.posters[1].quiet() == 0
    pair.write(1, 1, rkey=pair.md.rkey ^ 0x40000000)
    assert pair.posters[1].quiet() != 0
    d = qd.qp_dump(pair)
    assert [q["index"] for q in d] == [0, 1] and {q["peer"] for q in d} == {5}
    ok, bad = d
    assert ok["error"] is None and ok["outstanding"] == 0 and ok["wqes_posted"] >= 6
    assert ok["bytes_posted"] == 6000 and ok["state"] == "RTS" and ok["last_error_cqe"] is None
    e = bad["error"]
    assert bad["state"] == "ERR" and e["syndrome_name"] == "REMOTE_ACCESS_ERR" and e["cqe_opcode_name"] == "REQ_ERR"
    assert e["wqe_opcode_name"] == "RDMA_WRITE" and e["wqe_counter"] == 4 and "rkey" in e["hint"]
    c = bad["last_error_cqe"]
    assert c["syndrome_name"] == "REMOTE_ACCESS_ERR" and c["wqe_counter"] == 4 and c["error_cqes_in_ring"] >= 1
    assert "not a valid MR" in bad["provider"]["last_error"]
    peers = qd.per_peer(d)
    assert peers == [{"peer": 5, "qps": 2, "wqes_posted": ok["wqes_posted"] + bad["wqes_posted"],
                      "bytes_posted": 6000 + bad["bytes_posted"], "outstanding": 0, "qps_in_error": 1}]
    assert json.loads(json.dumps(d)) == d


def test_dump_context_forms_and_errors(pair: _Pair) -> None:
    import torch
    qp, cq = pair.qps[0]
    raw = pair.posters[0].context_bytes()
    for ctx in (raw, bytearray(raw), torch.frombuffer(bytearray(raw), dtype=torch.uint8),
                pair.posters[0].addresses()["context"]):
        (d,) = [qd.dump_ref(qd.as_ref((0, qp, cq, ctx)))]
        assert d["qpn"] == qp.qpn and d["sq_size"] == 16 and d["cq_size"] == 16
    dict_ref = qd.as_ref((1, {"qpn": qp.qpn}, {"cqes": cq.cqes, "log_size": cq.log_size}, raw))
    assert dict_ref.cqes == cq.cqes and dict_ref.cq_log_size == 4
    with pytest.raises(ValueError, match="belongs to QP"):
        qd.dump_ref(qd.QpRef(peer=0, qpn=qp.qpn + 1, context=raw))
    with pytest.raises(ValueError, match="bytes"):
        qd.dump_ref(qd.QpRef(peer=0, qpn=qp.qpn, context=raw[:-8]))
    with pytest.raises(TypeError, match="bytes, a tensor or an address"):
        qd.dump_ref(qd.QpRef(peer=0, qpn=qp.qpn, context=1.5))
    with pytest.raises(TypeError, match="qp_contexts"):
        qd.qp_dump(object())
    with pytest.raises(TypeError, match="QpRef or"):
        qd.as_ref("nope")
    with pytest.raises(ValueError, match="peer"):
        qd.as_ref((-1, qp, cq, raw))
    with pytest.raises(ValueError, match="QP number"):
        qd.as_ref((0, {"qpn": 0}, cq, raw))


def test_last_error_cqe_order() -> None:
    from pyep import wqe
    ring = bytearray(wqe.encode_cqe(15, 1, 0, 0x10) * 8)   # 8 INVALID entries, owner 1

    def put(i: int, opcode: int, counter: int, syndrome: int = 0) -> None:
        owner = (i >> 3) & 1
        ring[64 * (i % 8):64 * (i % 8) + 64] = wqe.encode_cqe(opcode, owner, counter, 0x10, wqe_opcode=8,
                                                              syndrome=syndrome)
    assert qd.last_error_cqe(bytes(ring), 3, 0) is None
    put(0, 0, 1)
    put(1, 13, 2, 0x13)
    put(2, 13, 3, 0x05)   # flushes after the failure
    put(3, 13, 4, 0x05)
    got = qd.last_error_cqe(bytes(ring), 3, 2)    # entries 2, 3 not consumed yet
    assert got["syndrome_name"] == "REMOTE_ACCESS_ERR" and got["index"] == 1 and got["consumed"]
    assert got["error_cqes_in_ring"] == 3
    put(4, 13, 5, 0x15)   # a newer, unconsumed non-flush error wins
    got = qd.last_error_cqe(bytes(ring), 3, 2)
    assert got["syndrome_name"] == "TRANSPORT_RETRY_EXC_ERR" and got["index"] == 4 and not got["consumed"]
    with pytest.raises(ValueError):
        qd.last_error_cqe(bytes(ring[:64]), 3, 0)


# --------------------------------------------------------------------------- dump: triggers and CLI
def test_triggers_from_environment(pair: _Pair, tmp_path: Any) -> None:
    assert qd.install_dump_triggers(pair, 0, environ={}) is None
    with pytest.raises(ValueError, match="not a signal"):
        qd.install_dump_triggers(pair, 0, environ={qd.SIGNAL_ENV: "SIGNOPE"})
    trigger = tmp_path / "dump.trigger"
    env = {qd.SIGNAL_ENV: "USR1", qd.TRIGGER_ENV: str(trigger), "PYEP_RUN_DIR": str(tmp_path)}
    t = qd.install_dump_triggers(pair, 3, environ=env, tag="buf0")
    try:
        assert t is not None and t.path == str(tmp_path / "qp_dump-rank3-buf0.json")
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not os.path.exists(t.path):
            assert time.monotonic() < deadline, "the SIGUSR1 dump did not appear"
            time.sleep(0.01)
        doc = qd.load_document(t.path)
        assert doc["rank"] == 3 and doc["reason"] == "signal SIGUSR1" and len(doc["qps"]) == 2
        os.remove(t.path)
        trigger.write_text("now")
        deadline = time.monotonic() + 10
        while not os.path.exists(t.path):
            assert time.monotonic() < deadline, "the trigger-file dump did not appear"
            time.sleep(0.05)
        assert qd.load_document(t.path)["reason"].startswith("trigger file")
    finally:
        t.close()
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)


def test_triggers_skip_signal_off_main_thread(pair: _Pair, tmp_path: Any) -> None:
    got: List[Any] = []
    th = threading.Thread(target=lambda: got.append(qd.install_dump_triggers(
        pair, 0, environ={qd.SIGNAL_ENV: "SIGUSR2"}, out_dir=str(tmp_path))))
    th.start()
    th.join(10)
    assert got and got[0] is not None and got[0]._sig is None
    got[0].close()


def test_cli_dump_signal_then_files(pair: _Pair, tmp_path: Any, monkeypatch: MonkeyPatch,
                                    capsys: CaptureFixture[str]) -> None:
    pair.write(0, 4)
    assert pair.posters[0].quiet() == 0
    t = qd.install_dump_triggers(pair, 0, environ={qd.SIGNAL_ENV: "SIGUSR1"}, out_dir=str(tmp_path))
    try:
        rc, out, err = run(["dump", "--signal", str(os.getpid()), "--dir", str(tmp_path), "--wait", "20"],
                           monkeypatch, capsys)
    finally:
        t.close()
    assert rc == 0, err
    assert "rank 0 on" in out and "reason: signal SIGUSR1" in out and "3.9 KiB" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("5 ")]
    assert [r[3] for r in rows[:2]] == ["RTS", "RTS"]
    # the file it left behind, read back as JSON
    rc, out, err = run(["dump", str(tmp_path), "--json"], monkeypatch, capsys)
    assert rc == 0 and json.loads(out)[0]["peers"][0]["bytes_posted"] == 4000


def test_cli_dump_demo_and_errors(tmp_path: Any, monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    rc, out, err = run(["dump", "--demo"], monkeypatch, capsys)
    assert rc == 0, err
    assert "REMOTE_ACCESS_ERR on WQE 0 (RDMA_WRITE)" in out and "first error: error CQE, REQ_ERR syndrome 0x13" in out
    rc, out, _ = run(["dump", "--demo", "--json"], monkeypatch, capsys)
    doc = json.loads(out)[0]
    path = tmp_path / "qp_dump-rank0.json"
    path.write_text(json.dumps(doc))
    rc, out, _ = run(["dump", str(path)], monkeypatch, capsys)
    assert rc == 1 and "ERR" in out          # a job's dump with a QP in error: status 1
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "qp_dump-rank1.json").write_text("{}")
    for argv, needle in ((["dump"], "exactly one"), (["dump", "--demo", str(tmp_path)], "exactly one"),
                         (["dump", str(tmp_path / "none")], "no such file"),
                         (["dump", str(tmp_path / "bad")], "not a pyep QP dump"),
                         (["dump", "--signal", "x1"], "PIDs"), (["dump", "--demo", "--wait", "0"], "--wait")):
        rc, _, err = run(argv, monkeypatch, capsys)
        assert rc == 2 and needle in err, (argv, err)


def test_cli_dump_times_out_naming_the_wait(tmp_path: Any, monkeypatch: MonkeyPatch,
                                            capsys: CaptureFixture[str]) -> None:
    rc, _, err = run(["dump", "--trigger", str(tmp_path / "t"), "--ranks", "2", "--dir", str(tmp_path),
                      "--wait", "0.3"], monkeypatch, capsys)
    assert rc == 1 and "0 of 2 fresh dump(s)" in err and (tmp_path / "t").exists()


def test_refs_from_a_packed_table(pair: _Pair) -> None:
    """The layout pyep.ep.ll.native packs QP contexts in: [peer][qp] in one tensor the kernels read."""
    import torch
    from pyep.transport.base import PeerLink
    pair.write(1, 2)
    assert pair.posters[1].quiet() == 0
    ctx = [hq.context_bytes() for hq in pair.posters]
    links = [PeerLink(rank=0, kind="local"), PeerLink(rank=1, kind="emulated", qp_contexts=[bytes(c) for c in ctx])]
    table = torch.zeros(2 * 2 * len(ctx[0]), dtype=torch.uint8)
    table[2 * len(ctx[0]):] = torch.frombuffer(bytearray(b"".join(ctx)), dtype=torch.uint8)
    refs = qd.refs_from_table(links, table, 2, provider=pair.a)
    assert [(r.peer, r.index, r.qpn) for r in refs] == [(1, 0, pair.qps[0][0].qpn), (1, 1, pair.qps[1][0].qpn)]

    class Backend:
        def qp_contexts(self) -> List[qd.QpRef]:
            return refs

    class Buffer:        # an EpBuffer delegates to its backend
        backend = Backend()
    d = qd.qp_dump(Buffer())
    assert d[1]["wqes_posted"] == 3 and d[1]["bytes_posted"] == 2000 and d[1]["state"] == "RTS"
    with pytest.raises(ValueError, match="bytes, not"):
        qd.refs_from_table([PeerLink(rank=1, kind="emulated", qp_contexts=[b"x"])], table, 2)
