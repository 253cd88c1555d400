"""pyep.wqe: encoding against hand-derived bytes, decode(encode(x)) round trips, input validation."""
from __future__ import annotations

import random
import struct
from typing import Any, Dict

import pytest

from pyep import wqe
from pyep._native import engine
from pyep.wqe import CqeOpcode, CtrlFlag, Opcode, Syndrome, WorkRequest

POSTED = [Opcode.NOP, Opcode.RDMA_WRITE, Opcode.ATOMIC_MASKED_FA, Opcode.ATOMIC_FA]


def test_python_names_match_prm_h() -> None:
    consts = engine().wqe.constants()
    for enum_cls, key in ((Opcode, "opcodes"), (CtrlFlag, "ctrl_flags"), (CqeOpcode, "cqe_opcodes"),
                          (Syndrome, "syndromes")):
        assert {m.name: m.value for m in enum_cls} == dict(consts[key]), key
    misc = consts["misc"]
    assert (misc["SEND_WQE_BB"], misc["CQE_BYTES"], misc["SEG_BYTES"]) == (wqe.WQEBB_BYTES, wqe.CQE_BYTES,
                                                                           wqe.SEG_BYTES)
    assert misc["OPMOD_EXT_ATOMIC_4B"] == wqe.OPMOD_EXT_ATOMIC_4B
    assert all(s in wqe.SYNDROME_HINTS for s in Syndrome)
    assert all(c in wqe.CQE_OPCODE_HINTS for c in CqeOpcode)


def test_rdma_write_bytes_by_hand() -> None:
    wr = WorkRequest(Opcode.RDMA_WRITE, signaled=True, laddr=0x7F0011223344, lkey=0xAABBCCDD,
                     raddr=0x0102030405060708, rkey=0x11223344, length=4096)
    raw = wqe.encode_wqe(wr, 0x1234, 0xABCDEF)
    ctrl = struct.pack(">II", (0x1234 << 8) | 0x08, (0xABCDEF << 8) | 3) + bytes([0, 0, 0, 0x08]) + bytes(4)
    raddr = struct.pack(">QII", 0x0102030405060708, 0x11223344, 0)
    data = struct.pack(">IIQ", 4096, 0xAABBCCDD, 0x7F0011223344)
    assert raw == ctrl + raddr + data + bytes(16)


def test_masked_fa32_and_fa64_bytes_by_hand() -> None:
    raw = wqe.encode_wqe(WorkRequest(Opcode.ATOMIC_MASKED_FA, fence=True, laddr=0x10, lkey=3, raddr=0x20, rkey=4,
                                     add=0xFFFFFFFE), 7, 0x42)
    assert raw[:16] == struct.pack(">II", (0x08 << 24) | (7 << 8) | 0x15, (0x42 << 8) | 4) + bytes([0, 0, 0, 0x80]) \
        + bytes(4)
    assert raw[16:] == struct.pack(">QII", 0x20, 4, 0) + struct.pack(">IIQ", 0xFFFFFFFE, 0, 0) \
        + struct.pack(">IIQ", 4, 3, 0x10)
    raw = wqe.encode_wqe(WorkRequest(Opcode.ATOMIC_FA, laddr=0x10, lkey=3, raddr=0x20, rkey=4,
                                     add=0x8000000000000001), 0xFFFF, 0xFFFFFF)
    assert raw[:8] == struct.pack(">II", (0xFFFF << 8) | 0x12, (0xFFFFFF << 8) | 4)
    assert raw[32:48] == struct.pack(">QQ", 0x8000000000000001, 0)
    assert raw[48:] == struct.pack(">IIQ", 8, 3, 0x10)


def test_nop_is_one_segment() -> None:
    raw = wqe.encode_wqe(WorkRequest(Opcode.NOP, signaled=True), 1, 2)
    assert raw == struct.pack(">II", (1 << 8), (2 << 8) | 1) + bytes([0, 0, 0, 0x08]) + bytes(52)


def test_round_trip_random() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        op = rng.choice(POSTED)
        kw = {}
        if op != Opcode.NOP:
            kw = dict(laddr=rng.getrandbits(64), lkey=rng.getrandbits(32), raddr=rng.getrandbits(64),
                      rkey=rng.getrandbits(32))
            if op == Opcode.RDMA_WRITE:
                kw["length"] = rng.getrandbits(31)
            else:
                kw["add"] = rng.getrandbits(32 if op == Opcode.ATOMIC_MASKED_FA else 64)
        wr = WorkRequest(op, rng.random() < 0.5, rng.random() < 0.5, **kw)
        pi, qpn = rng.getrandbits(16), rng.getrandbits(24)
        d = wqe.decode_wqe(wqe.encode_wqe(wr, pi, qpn))
        assert d.problems() == []
        assert (d.work_request(), d.wqe_index, d.qpn) == (wr, pi, qpn)
        assert d.ds == engine().wqe.wqe_ds(int(op))
        # And the JSON view carries the same numbers.
        js = d.to_json()
        assert (js["opcode"], js["qpn"], js["wqe_index"], js["problems"]) == (int(op), qpn, pi, [])


def test_decode_accepts_bytearray_and_memoryview() -> None:
    raw = wqe.encode_wqe(WorkRequest(Opcode.NOP), 5, 6)
    assert wqe.decode_wqe(bytearray(raw)) == wqe.decode_wqe(memoryview(raw)) == wqe.decode_wqe(raw)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(opcode="rdma_write"), TypeError, "opcode must be"),
    (dict(opcode=True), TypeError, "opcode must be"),
    (dict(opcode=0x10), ValueError, "RDMA_READ is not one pyep posts"),
    (dict(opcode=0x33), ValueError, "not an mlx5 send opcode"),
    (dict(opcode=Opcode.RDMA_WRITE, lkey=1 << 32), ValueError, "lkey"),
    (dict(opcode=Opcode.RDMA_WRITE, rkey=-1), ValueError, "rkey=-1 is negative"),
    (dict(opcode=Opcode.RDMA_WRITE, laddr=1 << 64), ValueError, "laddr"),
    (dict(opcode=Opcode.RDMA_WRITE, length=1 << 31), ValueError, "length"),
    (dict(opcode=Opcode.RDMA_WRITE, length=1.0), TypeError, "length must be an int"),
    (dict(opcode=Opcode.RDMA_WRITE, add=1), ValueError, "add is not used by RDMA_WRITE"),
    (dict(opcode=Opcode.ATOMIC_MASKED_FA, add=1 << 32), ValueError, "add"),
    (dict(opcode=Opcode.ATOMIC_FA, length=8), ValueError, "length is not used by ATOMIC_FA"),
    (dict(opcode=Opcode.NOP, raddr=1), ValueError, "raddr is not used by NOP"),
    (dict(opcode=Opcode.NOP, signaled=1), TypeError, "signaled must be a bool"),
])
def test_work_request_rejects_bad_fields(kwargs: Dict[str, Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        WorkRequest(**kwargs)


def test_encode_rejects_bad_index_and_qpn() -> None:
    wr = WorkRequest(Opcode.NOP)
    with pytest.raises(ValueError, match="wqe_index"):
        wqe.encode_wqe(wr, 1 << 16, 1)
    with pytest.raises(ValueError, match="qpn"):
        wqe.encode_wqe(wr, 1, 1 << 24)
    with pytest.raises(TypeError, match="qpn must be an int"):
        wqe.encode_wqe(wr, 1, "1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="WorkRequest"):
        wqe.encode_wqe({"opcode": 8}, 1, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("field, value", [("wqe_index", 1 << 16), ("qpn", 1 << 24), ("lkey", 1 << 32),
                                          ("rkey", 1 << 32), ("length", 1 << 31)])
def test_binding_guards_widths_itself(field: str, value: int) -> None:
    # The C++ binding must not truncate silently even when called without the Python wrapper.
    args = dict(opcode=0x08, wqe_index=0, qpn=0, lkey=0, rkey=0, length=0)
    args[field] = value
    with pytest.raises(ValueError, match=field):
        engine().wqe.encode_wqe(**args)


def test_binding_rejects_unposted_opcode_and_wide_add() -> None:
    with pytest.raises(ValueError, match="not one pyep posts"):
        engine().wqe.encode_wqe(0x10, 0, 0)
    with pytest.raises(ValueError, match="add"):
        engine().wqe.encode_wqe(0x15, 0, 0, add=1 << 32)
    with pytest.raises(ValueError, match="exactly 64 bytes"):
        engine().wqe.decode_wqe(bytes(63))


def test_decode_rejects_wrong_size_and_type() -> None:
    with pytest.raises(ValueError, match="exactly 64 bytes, got 65"):
        wqe.decode_wqe(bytes(65))
    with pytest.raises(TypeError, match="must be bytes"):
        wqe.decode_wqe("00" * 64)  # type: ignore[arg-type]


def _tamper(raw: bytes, offset: int, new: bytes) -> bytes:
    return raw[:offset] + new + raw[offset + len(new):]


def test_problems_name_what_pyep_would_not_build() -> None:
    good = wqe.encode_wqe(WorkRequest(Opcode.ATOMIC_MASKED_FA, laddr=1, lkey=2, raddr=3, rkey=4, add=5), 0, 1)
    assert wqe.decode_wqe(good).problems() == []
    cases = {
        "opmod=0x00": _tamper(good, 0, b"\x00"),
        "ds=3": _tamper(good, 7, b"\x03"),
        "field_boundary": _tamper(good, 36, b"\x00\x00\x00\x01"),
        "fetch data segment is 8 bytes": _tamper(good, 48, struct.pack(">I", 8)),
        "signature/imm": _tamper(good, 12, b"\x00\x00\x00\x09"),
        "flags pyep never sets": _tamper(good, 11, b"\x0a"),
        "not one pyep posts": _tamper(good, 3, b"\x10"),
    }
    for needle, raw in cases.items():
        d = wqe.decode_wqe(raw)
        assert any(needle in p for p in d.problems()), (needle, d.problems())
        with pytest.raises(ValueError, match="not a WQE pyep builds"):
            d.work_request()
        assert any(needle in line for line in d.describe())


@pytest.mark.parametrize("text", ["00" * 64, "0x" + "00" * 64, " ".join(["00000000"] * 16),
                                  ":".join(["00"] * 64), "_".join(["0000"] * 32) + "\n"])
def test_parse_hex_separators(text: str) -> None:
    assert wqe.parse_hex(text, 64, "WQE") == bytes(64)


@pytest.mark.parametrize("text, match", [("00" * 63, "128 hex digits .* got 126"), ("0" * 129, "got 129"),
                                         ("g" + "0" * 127, "'g' at hex digit 0"), ("", "got 0"),
                                         ("00" * 64 + "-", "'-' at hex digit 128")])
def test_parse_hex_errors(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        wqe.parse_hex(text, 64, "WQE")
