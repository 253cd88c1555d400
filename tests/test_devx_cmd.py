"""DevX PRM mailboxes (engine/mlx5gda/devx_cmd.*) checked bit for bit.

The expected layouts below are written the way the PRM's field tables give them — (byte offset of the
big-endian dword inside the mailbox, high bit, low bit), bit 31 being the dword's MSB — converted by
hand from the mlx5_ifc structures (create_cq_in/cqc, create_qp_in/qpc/ads, the *_qp_in modify
commands, query_hca_cap_out/cmd_hca_cap/atomic_caps). They share nothing with the encoder's own
tables (bit offsets from the start of each structure). Every test builds the complete expected
mailbox from this table and compares all bytes, so a stray bit anywhere fails too.
"""
from __future__ import annotations

from typing import Dict, Tuple

import pytest

from pyep._native import engine

devx = engine().devx

Prm = Tuple[int, int, int]  # (dword byte offset, high bit, low bit)


def put(buf: bytearray, where: Prm, value: int) -> None:
    off, hi, lo = where
    width = hi - lo + 1
    assert 0 <= value < (1 << width), (where, value)
    word = int.from_bytes(buf[off:off + 4], "big")
    word = (word & ~(((1 << width) - 1) << lo)) | (value << lo)
    buf[off:off + 4] = word.to_bytes(4, "big")


def take(buf: bytes, where: Prm) -> int:
    off, hi, lo = where
    return (int.from_bytes(buf[off:off + 4], "big") >> lo) & ((1 << (hi - lo + 1)) - 1)


def put64(buf: bytearray, off: int, value: int) -> None:
    buf[off:off + 8] = value.to_bytes(8, "big")


def expected(size: int, fields: Dict[Prm, int], u64: Dict[int, int] = {}, raw: Dict[int, bytes] = {}) -> bytes:
    buf = bytearray(size)
    for where, v in fields.items():
        put(buf, where, v)
    for off, v in u64.items():
        put64(buf, off, v)
    for off, b in raw.items():
        buf[off:off + len(b)] = b
    return bytes(buf)


OPCODE: Prm = (0x00, 31, 16)
OP_MOD: Prm = (0x04, 15, 0)
QPN: Prm = (0x08, 23, 0)

# create_cq_in: cqc starts at byte 0x10.
CQ = {
    "dbr_umem_valid": (0x10, 25, 25), "cqe_sz": (0x10, 23, 21), "cc": (0x10, 20, 20), "oi": (0x10, 17, 17),
    "dbr_umem_id": (0x14, 31, 0), "log_cq_size": (0x1c, 28, 24), "uar_page": (0x1c, 23, 0),
    "c_eqn": (0x24, 31, 0), "log_page_size": (0x28, 28, 24),
    "cq_umem_id": (0x58, 31, 0), "cq_umem_valid": (0x5c, 31, 31),
}
CQ_DBR_ADDR, CQ_UMEM_OFFSET = 0x48, 0x50

# qpc starts at byte 0x18 of create_qp_in and of every *_qp_in modify mailbox.
QPC = {
    "st": (0x18, 23, 16), "pm_state": (0x18, 12, 11), "pd": (0x1c, 23, 0),
    "mtu": (0x20, 31, 29), "log_msg_max": (0x20, 28, 24), "log_rq_size": (0x20, 22, 19),
    "log_rq_stride": (0x20, 18, 16), "no_sq": (0x20, 15, 15), "log_sq_size": (0x20, 14, 11),
    "ts_format": (0x20, 7, 6), "uar_page": (0x24, 23, 0), "user_index": (0x28, 23, 0),
    "log_page_size": (0x2c, 28, 24), "remote_qpn": (0x2c, 23, 0),
    "log_ack_req_freq": (0x88, 31, 28), "log_sra_max": (0x88, 23, 21), "retry_count": (0x88, 18, 16),
    "rnr_retry": (0x88, 15, 13), "next_send_psn": (0x90, 23, 0), "cqn_snd": (0x94, 23, 0),
    "log_rra_max": (0xa8, 23, 21), "atomic_mode": (0xa8, 19, 16), "rre": (0xa8, 15, 15),
    "rwe": (0xa8, 14, 14), "rae": (0xa8, 13, 13), "min_rnr_nak": (0xac, 28, 24),
    "next_rcv_psn": (0xac, 23, 0), "cqn_rcv": (0xb4, 23, 0), "rq_type": (0xc4, 26, 24),
    "dbr_umem_valid": (0xe8, 28, 28), "dbr_umem_id": (0xfc, 31, 0),
}
QPC_DBR_ADDR = 0xb8
# primary_address_path (ads) starts at byte 0x30.
ADS = {
    "pkey_index": (0x30, 15, 0), "grh": (0x34, 23, 23), "rlid": (0x34, 15, 0),
    "ack_timeout": (0x38, 31, 27), "src_addr_index": (0x38, 23, 16), "hop_limit": (0x38, 7, 0),
    "tclass": (0x3c, 27, 20), "flow_label": (0x3c, 19, 0), "udp_sport": (0x50, 15, 0),
    "eth_prio": (0x54, 30, 28), "sl": (0x54, 27, 24), "vhca_port_num": (0x54, 23, 16),
}
ADS_RGID, ADS_RMAC = 0x40, 0x56
WQ_UMEM_OFFSET, WQ_UMEM_ID, WQ_UMEM_VALID = 0x100, (0x108, 31, 0), (0x10c, 31, 31)
OPT_PARAM_MASK: Prm = (0x10, 31, 0)
MAILBOX_0x880 = 0x880 // 8


def test_sizes_and_opcodes() -> None:
    assert devx.OPCODES == {"QUERY_HCA_CAP": 0x100, "CREATE_CQ": 0x400, "DESTROY_CQ": 0x401, "CREATE_QP": 0x500,
                            "DESTROY_QP": 0x501, "RST2INIT_QP": 0x502, "INIT2RTR_QP": 0x503, "RTR2RTS_QP": 0x504,
                            "2ERR_QP": 0x507, "2RST_QP": 0x50a, "QUERY_QP": 0x50b}
    assert devx.QUERY_HCA_CAP_OUT_BYTES == 16 + 4096


def test_create_cq_bit_exact() -> None:
    got = devx.encode_create_cq(log_cq_size=11, uar_page=0xABCDE, eqn=0x1F3, cq_umem_id=0x11223344,
                                cq_umem_offset=0x1000, dbr_umem_id=0x55667788, dbr_offset=0x20040,
                                log_page_size=4, collapsed=True, overrun_ignore=True)
    want = expected(MAILBOX_0x880, {
        OPCODE: 0x400, CQ["dbr_umem_valid"]: 1, CQ["cqe_sz"]: 0, CQ["cc"]: 1, CQ["oi"]: 1,
        CQ["dbr_umem_id"]: 0x55667788, CQ["log_cq_size"]: 11, CQ["uar_page"]: 0xABCDE, CQ["c_eqn"]: 0x1F3,
        CQ["log_page_size"]: 4, CQ["cq_umem_id"]: 0x11223344, CQ["cq_umem_valid"]: 1,
    }, u64={CQ_DBR_ADDR: 0x20040, CQ_UMEM_OFFSET: 0x1000})
    assert got == want
    plain = devx.encode_create_cq(log_cq_size=3, uar_page=1, eqn=2, cq_umem_id=3, dbr_umem_id=3, dbr_offset=512)
    assert take(plain, CQ["cc"]) == 0 and take(plain, CQ["oi"]) == 0 and take(plain, CQ["log_cq_size"]) == 3


def test_create_qp_bit_exact() -> None:
    got = devx.encode_create_qp(pd=0x3456, uar_page=0x12345, cqn_snd=0x777, cqn_rcv=0x777, log_sq_size=10,
                                log_msg_max=30, wq_umem_id=0xCAFE01, wq_umem_offset=0x40, dbr_umem_id=0xCAFE02,
                                dbr_offset=0x10000, log_page_size=0, ts_format=1, user_index=0x42)
    want = expected(MAILBOX_0x880, {
        OPCODE: 0x500, QPC["st"]: 0, QPC["pm_state"]: 3, QPC["pd"]: 0x3456, QPC["log_msg_max"]: 30,
        QPC["log_rq_size"]: 0, QPC["no_sq"]: 0, QPC["log_sq_size"]: 10, QPC["ts_format"]: 1,
        QPC["uar_page"]: 0x12345, QPC["user_index"]: 0x42, QPC["cqn_snd"]: 0x777, QPC["cqn_rcv"]: 0x777,
        QPC["rq_type"]: 3, QPC["dbr_umem_valid"]: 1, QPC["dbr_umem_id"]: 0xCAFE02,
        WQ_UMEM_ID: 0xCAFE01, WQ_UMEM_VALID: 1,
    }, u64={QPC_DBR_ADDR: 0x10000, WQ_UMEM_OFFSET: 0x40})
    assert got == want


def test_rst2init_bit_exact() -> None:
    got = devx.encode_rst2init(qpn=0xABCDEF, port=2, pkey_index=0, remote_write=True, remote_atomic=True,
                               atomic_mode=3)
    want = expected(MAILBOX_0x880, {OPCODE: 0x502, QPN: 0xABCDEF, QPC["pm_state"]: 3, QPC["rwe"]: 1,
                                    QPC["rae"]: 1, QPC["atomic_mode"]: 3, ADS["vhca_port_num"]: 2})
    assert got == want
    # Least rights: nothing remote unless asked.
    bare = devx.encode_rst2init(qpn=5)
    assert (take(bare, QPC["rre"]), take(bare, QPC["rwe"]), take(bare, QPC["rae"])) == (0, 0, 0)


def test_init2rtr_infiniband_bit_exact() -> None:
    got = devx.encode_init2rtr(qpn=0x100, mtu=4096, log_msg_max=30, remote_qpn=0x2F00D, next_rcv_psn=0x123,
                               min_rnr_nak=12, log_rra_max=4, port=1, roce=False, rlid=0x1A2B, sl=5)
    want = expected(MAILBOX_0x880, {
        OPCODE: 0x503, QPN: 0x100, QPC["mtu"]: 5, QPC["log_msg_max"]: 30, QPC["remote_qpn"]: 0x2F00D,
        QPC["next_rcv_psn"]: 0x123, QPC["min_rnr_nak"]: 12, QPC["log_rra_max"]: 4,
        ADS["vhca_port_num"]: 1, ADS["rlid"]: 0x1A2B, ADS["sl"]: 5, ADS["grh"]: 0,
    })
    assert got == want


def test_init2rtr_roce_bit_exact() -> None:
    rgid = bytes(range(0xA0, 0xB0))
    rmac = bytes([0x02, 0x11, 0x22, 0x33, 0x44, 0x55])
    got = devx.encode_init2rtr(qpn=0x200, mtu=1024, log_msg_max=31, remote_qpn=0x300, next_rcv_psn=7,
                               min_rnr_nak=1, log_rra_max=2, port=1, roce=True, sl=3, rgid=rgid, rmac=rmac,
                               src_addr_index=3, hop_limit=64, traffic_class=0x68, flow_label=0xABCDE,
                               udp_sport=0xC123)
    want = expected(MAILBOX_0x880, {
        OPCODE: 0x503, QPN: 0x200, QPC["mtu"]: 3, QPC["log_msg_max"]: 31, QPC["remote_qpn"]: 0x300,
        QPC["next_rcv_psn"]: 7, QPC["min_rnr_nak"]: 1, QPC["log_rra_max"]: 2,
        ADS["vhca_port_num"]: 1, ADS["grh"]: 1, ADS["eth_prio"]: 3, ADS["src_addr_index"]: 3,
        ADS["hop_limit"]: 64, ADS["tclass"]: 0x68, ADS["flow_label"]: 0xABCDE, ADS["udp_sport"]: 0xC123,
    }, raw={ADS_RGID: rgid, ADS_RMAC: rmac})
    assert got == want
    assert take(got, ADS["rlid"]) == 0 and take(got, ADS["sl"]) == 0


def test_init2rtr_infiniband_with_grh() -> None:
    rgid = bytes([0xFE, 0x80] + [0] * 6 + list(range(8)))
    got = devx.encode_init2rtr(qpn=1, mtu=2048, log_msg_max=30, remote_qpn=2, rlid=9, grh=True, rgid=rgid,
                               src_addr_index=0, hop_limit=1, traffic_class=4)
    assert got[ADS_RGID:ADS_RGID + 16] == rgid
    assert (take(got, ADS["grh"]), take(got, ADS["rlid"]), take(got, ADS["hop_limit"]), take(got, ADS["tclass"]),
            take(got, QPC["mtu"])) == (1, 9, 1, 4, 4)
    assert got[ADS_RMAC:ADS_RMAC + 6] == bytes(6) and take(got, ADS["udp_sport"]) == 0


def test_rtr2rts_bit_exact() -> None:
    got = devx.encode_rtr2rts(qpn=0x55, retry_count=6, rnr_retry=5, ack_timeout=18, next_send_psn=0xFFFFFF,
                              log_sra_max=3, log_ack_req_freq=2)
    want = expected(MAILBOX_0x880, {
        OPCODE: 0x504, QPN: 0x55, QPC["retry_count"]: 6, QPC["rnr_retry"]: 5, ADS["ack_timeout"]: 18,
        QPC["next_send_psn"]: 0xFFFFFF, QPC["log_sra_max"]: 3, QPC["log_ack_req_freq"]: 2,
    })
    assert got == want


@pytest.mark.parametrize("fn,opcode", [("encode_qp_2err", 0x507), ("encode_qp_2rst", 0x50a),
                                       ("encode_query_qp", 0x50b)])
def test_qpn_only_commands(fn: str, opcode: int) -> None:
    assert getattr(devx, fn)(0x123456) == expected(16, {OPCODE: opcode, QPN: 0x123456})


def test_query_hca_cap_input() -> None:
    assert devx.encode_query_hca_cap(0, True) == expected(16, {OPCODE: 0x100, OP_MOD: 0x1})
    assert devx.encode_query_hca_cap(3, True) == expected(16, {OPCODE: 0x100, OP_MOD: 0x7})
    assert devx.encode_query_hca_cap(3, False) == expected(16, {OPCODE: 0x100, OP_MOD: 0x6})


# query_hca_cap_out: the capability page starts at byte 0x10.
CAP = {
    "log_max_qp_sz": (0x20, 23, 16), "log_max_qp": (0x20, 4, 0), "log_max_cq_sz": (0x28, 23, 16),
    "log_max_cq": (0x28, 4, 0), "log_max_ra_req_qp": (0x38, 21, 16), "log_max_ra_res_qp": (0x38, 5, 0),
    "port_type": (0x44, 9, 8), "num_ports": (0x44, 7, 0), "log_max_msg": (0x48, 28, 24),
    "cqe_version": (0x4c, 3, 0), "roce": (0x50, 2, 2), "atomic": (0x50, 1, 1), "rc": (0x54, 0, 0),
    "uar_4k": (0x58, 31, 31), "umem_uid_0": (0x58, 13, 13), "log_bf_reg_size": (0x5c, 20, 16),
    "log_max_pd": (0x74, 20, 16), "sq_ts_format": (0x98, 31, 30),
}
ATOMIC = {"atomic_req_8b_endianness_mode": (0x18, 31, 30), "atomic_operations": (0x20, 15, 0),
          "atomic_size_qp": (0x24, 15, 0)}
GENERAL_VALUES = {"log_max_qp_sz": 15, "log_max_qp": 18, "log_max_cq_sz": 22, "log_max_cq": 24,
                  "log_max_ra_req_qp": 4, "log_max_ra_res_qp": 5, "port_type": 1, "num_ports": 1,
                  "log_max_msg": 30, "cqe_version": 1, "roce": 1, "atomic": 1, "rc": 1, "uar_4k": 1,
                  "umem_uid_0": 1, "log_bf_reg_size": 9, "log_max_pd": 23, "sq_ts_format": 2}


def cap_out(fields: Dict[str, Prm], values: Dict[str, int]) -> bytes:
    return expected(devx.QUERY_HCA_CAP_OUT_BYTES, {fields[k]: v for k, v in values.items()})


def test_parse_hca_caps_from_constructed_output() -> None:
    general = cap_out(CAP, GENERAL_VALUES)
    # CX-7-like atomics: CAS, FA, masked CAS, masked FA; 4- and 8-byte operands (sizes 1<<2 | 1<<3).
    atomic = cap_out(ATOMIC, {"atomic_operations": 0xF, "atomic_size_qp": 0xC, "atomic_req_8b_endianness_mode": 1})
    caps = devx.parse_hca_caps(general, atomic)
    for k, v in GENERAL_VALUES.items():
        assert caps[k] == v, k
    assert caps["atomic_operations"] == 0xF and caps["atomic_size_qp"] == 0xC
    assert caps["atomic_req_8b_endianness_mode"] == 1
    assert caps["fetch_add_64"] and caps["masked_fetch_add_32"]
    assert devx.atomic_mode_for(caps["atomic_size_qp"]) == 3


def test_parse_hca_caps_without_extended_atomics() -> None:
    general = cap_out(CAP, dict(GENERAL_VALUES))
    # Plain IB atomics only (CAS + FA, 8 bytes): no 32-bit masked fetch-add.
    atomic = cap_out(ATOMIC, {"atomic_operations": 0x3, "atomic_size_qp": 0x8})
    caps = devx.parse_hca_caps(general, atomic)
    assert caps["fetch_add_64"] and not caps["masked_fetch_add_32"]
    no_atomic = dict(GENERAL_VALUES, atomic=0)
    caps = devx.parse_hca_caps(cap_out(CAP, no_atomic), atomic)
    assert not caps["atomic"] and not caps["fetch_add_64"] and not caps["masked_fetch_add_32"]
    assert caps["atomic_operations"] == 0  # the atomic page is ignored when the device says no atomics


def test_output_parsers() -> None:
    out = expected(16, {(0x00, 31, 24): 0x3, (0x04, 31, 0): 0xDEADBEEF, (0x08, 23, 0): 0x4321})
    assert devx.parse_status(out) == (3, 0xDEADBEEF, "BAD_PARAM")
    assert devx.parse_created_id(out) == 0x4321
    qp_out = expected(devx.QUERY_QP_OUT_BYTES, {(0x18, 31, 28): 3})
    assert devx.parse_query_qp_state(qp_out) == 3


def test_field_helpers_match_prm_convention() -> None:
    buf = devx.set_field(bytes(16), 0x51, 4, 0xA)  # a log_sq_size-shaped field: bit 0x51, 4 wide
    assert take(buf, (0x08, 14, 11)) == 0xA
    assert devx.get_field(buf, 0x51, 4) == 0xA
    wide = devx.set_field(bytes(16), 0x40, 64, 0x0102030405060708)
    assert wide[8:16] == bytes(range(1, 9))


@pytest.mark.parametrize("call", [
    lambda: devx.encode_create_qp(pd=1 << 24, uar_page=0, cqn_snd=0, cqn_rcv=0, log_sq_size=4, log_msg_max=30,
                                  wq_umem_id=1),
    lambda: devx.encode_create_qp(pd=1, uar_page=0, cqn_snd=0, cqn_rcv=0, log_sq_size=16, log_msg_max=30,
                                  wq_umem_id=1),
    lambda: devx.encode_create_cq(log_cq_size=4, uar_page=0, eqn=0, cq_umem_id=1, dbr_offset=4),
    lambda: devx.encode_rst2init(qpn=1, port=0),
    lambda: devx.encode_init2rtr(qpn=1, mtu=1500, log_msg_max=30, remote_qpn=2),
    lambda: devx.encode_init2rtr(qpn=1, mtu=4096, log_msg_max=30, remote_qpn=2, roce=True, sl=8),
    lambda: devx.encode_init2rtr(qpn=1, mtu=4096, log_msg_max=30, remote_qpn=2, rgid=b"short"),
    lambda: devx.encode_init2rtr(qpn=1, mtu=4096, log_msg_max=30, remote_qpn=1 << 24),
    lambda: devx.encode_rtr2rts(qpn=1, retry_count=8),
    lambda: devx.encode_rtr2rts(qpn=1, ack_timeout=32),
    lambda: devx.encode_qp_2err(1 << 32),
    lambda: devx.set_field(bytes(4), 30, 4, 1),
])
def test_out_of_range_rejected(call) -> None:
    with pytest.raises(ValueError):
        call()


def test_short_outputs_rejected() -> None:
    with pytest.raises(ValueError, match="QUERY_HCA_CAP"):
        devx.parse_hca_caps(bytes(100))
    with pytest.raises(ValueError):
        devx.parse_created_id(bytes(4))
