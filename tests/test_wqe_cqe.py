"""CQE decoding: requester and error CQEs, the owner bit, wqe_counter and the word at offset 60."""
from __future__ import annotations

import random
import struct

import pytest

from pyep import wqe
from pyep.wqe import CqeOpcode, Opcode, Syndrome


def _cqe_by_hand(op_own: int, wqe_counter: int, qpn: int, wqe_opcode: int, byte_cnt: int = 0,
                 syndrome: int = 0, vendor: int = 0, signature: int = 0, timestamp: int = 0) -> bytes:
    """struct mlx5_cqe64 / mlx5_err_cqe laid out from the header's offsets, independently of pyep."""
    raw = bytearray(64)
    struct.pack_into(">I", raw, 44, byte_cnt)
    struct.pack_into(">Q", raw, 48, timestamp)
    if syndrome or vendor:
        raw[54], raw[55] = vendor, syndrome
    struct.pack_into(">I", raw, 56, (wqe_opcode << 24) | qpn)
    struct.pack_into(">HBB", raw, 60, wqe_counter, signature, op_own)
    return bytes(raw)


def test_req_cqe() -> None:
    d = wqe.decode_cqe(_cqe_by_hand(op_own=0x01, wqe_counter=513, qpn=0x1ABCD, wqe_opcode=0x08, byte_cnt=4096))
    assert (d.opcode, d.owner, d.wqe_counter, d.qpn, d.wqe_opcode, d.byte_cnt) == (CqeOpcode.REQ, 1, 513, 0x1ABCD,
                                                                                  0x08, 4096)
    assert not d.is_error and (d.syndrome, d.vendor_syndrome) == (0, 0)
    text = "\n".join(d.describe())
    assert "CQE REQ" in text and "wqe_counter 513" in text and "RDMA_WRITE" in text and "byte_cnt 4096" in text


def test_req_cqe_timestamp_is_not_read_as_a_syndrome() -> None:
    # Bytes 54/55 are the syndrome only in error CQEs; in a good CQE they belong to the timestamp.
    d = wqe.decode_cqe(_cqe_by_hand(op_own=0x00, wqe_counter=1, qpn=2, wqe_opcode=0x12,
                                    timestamp=0x1122334455667788))
    assert (d.opcode, d.syndrome, d.vendor_syndrome) == (CqeOpcode.REQ, 0, 0)


@pytest.mark.parametrize("syndrome", list(Syndrome), ids=lambda s: s.name)
@pytest.mark.parametrize("opcode", [CqeOpcode.REQ_ERR, CqeOpcode.RESP_ERR], ids=lambda o: o.name)
def test_error_cqe_syndromes(opcode: CqeOpcode, syndrome: Syndrome) -> None:
    raw = _cqe_by_hand(op_own=(opcode << 4) | 1, wqe_counter=0xFFFF, qpn=0xFFFFFF, wqe_opcode=0x15,
                       syndrome=syndrome, vendor=0x68)
    d = wqe.decode_cqe(raw)
    assert d.is_error and (d.opcode, d.syndrome, d.vendor_syndrome) == (opcode, syndrome, 0x68)
    assert (d.wqe_counter, d.qpn, d.wqe_opcode, d.owner) == (0xFFFF, 0xFFFFFF, Opcode.ATOMIC_MASKED_FA, 1)
    text = "\n".join(d.describe())
    assert f"syndrome {syndrome.name} (0x{syndrome:02x})" in text and wqe.SYNDROME_HINTS[syndrome] in text
    assert "vendor syndrome 0x68" in text
    js = d.to_json()
    assert (js["syndrome_name"], js["opcode_name"], js["is_error"]) == (syndrome.name, opcode.name, True)
    # What the softnic writes for the same failure is byte-identical.
    assert wqe.encode_cqe(opcode, 1, 0xFFFF, 0xFFFFFF, 0, 0x15, syndrome, 0x68) == raw


def test_unknown_syndrome_and_opcode_are_named_as_unknown() -> None:
    d = wqe.decode_cqe(_cqe_by_hand(op_own=0xD0, wqe_counter=0, qpn=0, wqe_opcode=0x33, syndrome=0x77))
    assert d.to_json()["syndrome_name"] == "UNKNOWN(0x77)" and d.to_json()["wqe_opcode_name"] == "UNKNOWN(0x33)"
    assert any("unknown syndrome" in line for line in d.describe())
    d = wqe.decode_cqe(_cqe_by_hand(op_own=0x70, wqe_counter=0, qpn=0, wqe_opcode=0))
    assert d.opcode_name == "UNKNOWN(0x07)"


@pytest.mark.parametrize("owner", [0, 1])
def test_owner_bit_and_other_op_own_bits(owner: int) -> None:
    # op_own = opcode<<4 | format<<2 | se<<1 | owner: the other bits must not leak into opcode/owner.
    for fmt in range(4):
        for se in range(2):
            op_own = (CqeOpcode.REQ_ERR << 4) | (fmt << 2) | (se << 1) | owner
            d = wqe.decode_cqe(_cqe_by_hand(op_own=op_own, wqe_counter=3, qpn=4, wqe_opcode=8, syndrome=0x05))
            assert (d.opcode, d.owner, d.cqe_format, d.solicited, d.op_own) == (CqeOpcode.REQ_ERR, owner, fmt, se,
                                                                               op_own)


def test_invalid_cqe_as_software_presets_it() -> None:
    d = wqe.decode_cqe(wqe.encode_cqe(CqeOpcode.INVALID, 1, 0, 0))
    assert (d.opcode, d.owner, d.op_own) == (CqeOpcode.INVALID, 1, 0xF1)
    assert "not written by the NIC yet" in d.describe()[0]


def test_word_at_offset_60() -> None:
    # The 32-bit word at 60 is wqe_counter(be16) | signature | op_own: one aligned load gives a poller
    # both the ownership test and the WQE index.
    rng = random.Random(60)
    for _ in range(500):
        opcode = rng.choice(list(CqeOpcode))
        owner, counter, qpn = rng.getrandbits(1), rng.getrandbits(16), rng.getrandbits(24)
        raw = wqe.encode_cqe(opcode, owner, counter, qpn, rng.getrandbits(32), rng.getrandbits(8),
                             rng.getrandbits(8), rng.getrandbits(8))
        (word,) = struct.unpack_from(">I", raw, 60)
        assert word == (counter << 16) | (0 << 8) | (opcode << 4) | owner
        assert struct.unpack_from("<I", raw, 60)[0] >> 24 == (opcode << 4) | owner  # little-endian load: top byte
        d = wqe.decode_cqe(raw)
        assert (d.wqe_counter, d.owner, d.opcode, d.qpn) == (counter, owner, opcode, qpn)


def test_encode_decode_round_trip() -> None:
    rng = random.Random(3)
    for _ in range(1000):
        err = rng.random() < 0.5
        f = dict(opcode=rng.choice([CqeOpcode.REQ_ERR, CqeOpcode.RESP_ERR]) if err else CqeOpcode.REQ,
                 owner=rng.getrandbits(1), wqe_counter=rng.getrandbits(16), qpn=rng.getrandbits(24),
                 byte_cnt=0 if err else rng.getrandbits(32), wqe_opcode=rng.getrandbits(8),
                 syndrome=rng.getrandbits(8) if err else 0, vendor_syndrome=rng.getrandbits(8) if err else 0)
        d = wqe.decode_cqe(wqe.encode_cqe(**f))
        assert {k: getattr(d, k) for k in f} == f


@pytest.mark.parametrize("field, value", [("opcode", 16), ("owner", 2), ("wqe_counter", 1 << 16), ("qpn", 1 << 24),
                                          ("byte_cnt", 1 << 32), ("syndrome", 256), ("vendor_syndrome", -1)])
def test_encode_cqe_rejects_out_of_range(field: str, value: int) -> None:
    f = dict(opcode=0, owner=0, wqe_counter=0, qpn=0)
    f[field] = value
    with pytest.raises(ValueError, match=field):
        wqe.encode_cqe(**f)


def test_decode_cqe_rejects_wrong_size() -> None:
    with pytest.raises(ValueError, match="a CQE must be exactly 64 bytes, got 32"):
        wqe.decode_cqe(bytes(32))
