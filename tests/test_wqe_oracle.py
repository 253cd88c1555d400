"""pyep's WQE and CQE bytes against rdma-core's mlx5dv.h (an independent encoder), over many random
field values for every opcode pyep posts."""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from typing import Any, Callable, Dict

import pytest

from pyep import wqe
from pyep.wqe import CqeOpcode, CtrlFlag, Opcode, Syndrome, WorkRequest

CASES_PER_OPCODE = 2500


def _loader() -> Any:
    name = "pyep_tests_mlx5_oracle_loader"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "oracle" / "loader.py")
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _loader().build_oracle(tmp_path_factory.mktemp("mlx5_oracle"))


def _field(rng: random.Random, bits: int) -> int:
    # Edge values are where byte-order and width bugs show; the rest is uniform over the width.
    roll = rng.random()
    if roll < 0.05:
        return 0
    if roll < 0.10:
        return (1 << bits) - 1
    if roll < 0.15:
        return 1 << rng.randrange(bits)
    return rng.getrandbits(bits)


def _random_wr(rng: random.Random, op: Opcode) -> WorkRequest:
    signaled, fence = rng.random() < 0.5, rng.random() < 0.3
    if op == Opcode.NOP:
        return WorkRequest(op, signaled, fence)
    common = dict(laddr=_field(rng, 64), lkey=_field(rng, 32), raddr=_field(rng, 64), rkey=_field(rng, 32))
    if op == Opcode.RDMA_WRITE:
        return WorkRequest(op, signaled, fence, length=_field(rng, 31), **common)
    return WorkRequest(op, signaled, fence, add=_field(rng, 32 if op == Opcode.ATOMIC_MASKED_FA else 64), **common)


def _oracle_wqe(oracle: Any, wr: WorkRequest, pi: int, qpn: int) -> bytes:
    """The WQEBB composed from rdma-core's segment builders, in the layout REFERENCE.md §3 gives."""
    fm_ce_se = (CtrlFlag.CQ_UPDATE if wr.signaled else 0) | (CtrlFlag.FENCE if wr.fence else 0)
    if wr.opcode == Opcode.NOP:
        segs = [oracle.ctrl_seg(pi, Opcode.NOP, 0, qpn, fm_ce_se, 1)]
    elif wr.opcode == Opcode.RDMA_WRITE:
        segs = [oracle.ctrl_seg(pi, Opcode.RDMA_WRITE, 0, qpn, fm_ce_se, 3),
                oracle.raddr_seg(wr.raddr, wr.rkey),
                oracle.data_seg(wr.length, wr.lkey, wr.laddr)]
    elif wr.opcode == Opcode.ATOMIC_MASKED_FA:
        segs = [oracle.ctrl_seg(pi, Opcode.ATOMIC_MASKED_FA, 0x08, qpn, fm_ce_se, 4),
                oracle.raddr_seg(wr.raddr, wr.rkey),
                oracle.masked_fa32_seg(wr.add, 0),
                oracle.data_seg(4, wr.lkey, wr.laddr)]
    else:
        segs = [oracle.ctrl_seg(pi, Opcode.ATOMIC_FA, 0, qpn, fm_ce_se, 4),
                oracle.raddr_seg(wr.raddr, wr.rkey),
                oracle.atomic_seg(wr.add, 0),
                oracle.data_seg(8, wr.lkey, wr.laddr)]
    return b"".join(segs).ljust(64, b"\0")


@pytest.mark.parametrize("op", [Opcode.NOP, Opcode.RDMA_WRITE, Opcode.ATOMIC_MASKED_FA, Opcode.ATOMIC_FA],
                         ids=lambda o: o.name)
def test_wqe_bytes_equal_rdma_core(oracle: Any, op: Opcode) -> None:
    rng = random.Random(0x5EED + int(op))
    for case in range(CASES_PER_OPCODE):
        wr = _random_wr(rng, op)
        pi, qpn = _field(rng, 16), _field(rng, 24)
        ours = wqe.encode_wqe(wr, pi, qpn)
        theirs = _oracle_wqe(oracle, wr, pi, qpn)
        assert ours == theirs, (f"case {case}: {wr} pi={pi} qpn={qpn}\n ours  {ours.hex()}\n rdma  {theirs.hex()}")
        # The oracle's bytes decode back to the request: the decoder reads what rdma-core writes.
        decoded = wqe.decode_wqe(theirs)
        assert decoded.work_request() == wr and decoded.wqe_index == pi and decoded.qpn == qpn


def test_oracle_notices_a_wrong_encoding(oracle: Any) -> None:
    # Guards the comparison above against a vacuous oracle: a one-field change must show up.
    wr = WorkRequest(Opcode.RDMA_WRITE, True, laddr=0x1000, lkey=1, raddr=0x2000, rkey=2, length=64)
    assert wqe.encode_wqe(wr, 3, 9) == _oracle_wqe(oracle, wr, 3, 9)
    assert wqe.encode_wqe(wr, 3, 9) != _oracle_wqe(oracle, wr, 4, 9)
    assert wqe.encode_wqe(wr, 3, 9) != _oracle_wqe(oracle, WorkRequest(Opcode.RDMA_WRITE, True, laddr=0x1000,
                                                                      lkey=1, raddr=0x2000, rkey=3, length=64), 3, 9)


_ENUMS: Dict[str, Callable[[], list]] = {
    "OPCODE_": lambda: list(Opcode),
    "CTRL_": lambda: list(CtrlFlag),
    "CQE_": lambda: list(CqeOpcode),
    "SYNDROME_": lambda: list(Syndrome),
}


@pytest.mark.parametrize("prefix", sorted(_ENUMS))
def test_names_match_rdma_core(oracle: Any, prefix: str) -> None:
    for member in _ENUMS[prefix]():
        assert oracle.constant(prefix + member.name) == member.value, member
    assert oracle.constant("SEND_WQE_BB") == wqe.WQEBB_BYTES


def test_cqes_equal_rdma_core(oracle: Any) -> None:
    rng = random.Random(0xC0E)
    posted = [int(o) for o in (Opcode.NOP, Opcode.RDMA_WRITE, Opcode.ATOMIC_MASKED_FA, Opcode.ATOMIC_FA)]
    for case in range(2000):
        owner, counter, qpn, wqe_op = rng.getrandbits(1), _field(rng, 16), _field(rng, 24), rng.choice(posted)
        if case % 2:
            opcode = rng.choice([CqeOpcode.REQ_ERR, CqeOpcode.RESP_ERR])
            synd, vendor = rng.choice(list(Syndrome)), _field(rng, 8)
            theirs = oracle.err_cqe(opcode, owner, counter, qpn, wqe_op, synd, vendor)
            ours = wqe.encode_cqe(opcode, owner, counter, qpn, 0, wqe_op, synd, vendor)
        else:
            opcode, synd, vendor = CqeOpcode.REQ, 0, 0
            byte_cnt = _field(rng, 32)
            theirs = oracle.cqe(opcode, owner, counter, qpn, wqe_op, byte_cnt)
            ours = wqe.encode_cqe(opcode, owner, counter, qpn, byte_cnt, wqe_op)
        assert ours == theirs, f"case {case}\n ours {ours.hex()}\n rdma {theirs.hex()}"
        d = wqe.decode_cqe(theirs)
        assert (d.opcode, d.owner) == (oracle.cqe_opcode(theirs), oracle.cqe_owner(theirs)) == (opcode, owner)
        assert (d.wqe_counter, d.qpn, d.wqe_opcode) == (counter, qpn, wqe_op)
        assert (d.syndrome, d.vendor_syndrome) == (synd, vendor)
