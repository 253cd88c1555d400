"""mlx5 send WQEs and CQEs from Python: typed wrappers over the engine's one encoder/decoder.

The bytes come from `engine/mlx5gda/wqe.h` through `pyep._engine.wqe` — the same code GPU kernels and
the softnic run — so what the diagnostics print is exactly what the engine posts. The names below
mirror `engine/mlx5gda/prm.h` (tests check them against the values the engine exports).
"""
from __future__ import annotations

import enum
import string
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Dict, List, Mapping, Optional, Union

from ._native import engine

WQEBB_BYTES = 64
CQE_BYTES = 64
SEG_BYTES = 16
OPMOD_EXT_ATOMIC_4B = 0x08
MAX_LENGTH = (1 << 31) - 1  # bit 31 of a data segment's byte_count is the inline flag

BytesLike = Union[bytes, bytearray, memoryview]


class Opcode(enum.IntEnum):
    """Send opcodes (MLX5_OPCODE_*)."""
    NOP = 0x00
    RDMA_WRITE = 0x08
    RDMA_WRITE_IMM = 0x09
    SEND = 0x0A
    RDMA_READ = 0x10
    ATOMIC_CS = 0x11
    ATOMIC_FA = 0x12
    ATOMIC_MASKED_CS = 0x14
    ATOMIC_MASKED_FA = 0x15


class CtrlFlag(enum.IntFlag):
    """Bits of the ctrl segment's fm_ce_se byte (MLX5_WQE_CTRL_*)."""
    SOLICITED = 0x02
    CQ_UPDATE = 0x08
    SMALL_FENCE = 0x20
    FENCE = 0x80


class CqeOpcode(enum.IntEnum):
    """CQE opcodes (op_own >> 4, MLX5_CQE_*)."""
    REQ = 0
    RESP_WR_IMM = 1
    RESP_SEND = 2
    REQ_ERR = 13
    RESP_ERR = 14
    INVALID = 15


class Syndrome(enum.IntEnum):
    """Error-CQE syndromes (MLX5_CQE_SYNDROME_*)."""
    LOCAL_LENGTH_ERR = 0x01
    LOCAL_QP_OP_ERR = 0x02
    LOCAL_PROT_ERR = 0x04
    WR_FLUSH_ERR = 0x05
    MW_BIND_ERR = 0x06
    BAD_RESP_ERR = 0x10
    LOCAL_ACCESS_ERR = 0x11
    REMOTE_INVAL_REQ_ERR = 0x12
    REMOTE_ACCESS_ERR = 0x13
    REMOTE_OP_ERR = 0x14
    TRANSPORT_RETRY_EXC_ERR = 0x15
    RNR_RETRY_EXC_ERR = 0x16
    REMOTE_ABORTED_ERR = 0x22


# What each syndrome usually means for an RDMA user; printed by `pyep qp decode-cqe`.
SYNDROME_HINTS: Mapping[Syndrome, str] = {
    Syndrome.LOCAL_LENGTH_ERR: "local length error: the local buffer is shorter than the operation",
    Syndrome.LOCAL_QP_OP_ERR: "local QP operation error: malformed WQE (bad ds/opcode) or QP misconfigured",
    Syndrome.LOCAL_PROT_ERR: "local protection error: bad lkey, or laddr outside its memory region",
    Syndrome.WR_FLUSH_ERR: "flushed: the QP was already in error; this WQE was not executed",
    Syndrome.MW_BIND_ERR: "memory window bind error",
    Syndrome.BAD_RESP_ERR: "bad response from the responder",
    Syndrome.LOCAL_ACCESS_ERR: "local access error: the local region lacks the needed access right",
    Syndrome.REMOTE_INVAL_REQ_ERR: "remote invalid request: the responder cannot do this operation "
                                   "(e.g. atomics not enabled on the remote QP)",
    Syndrome.REMOTE_ACCESS_ERR: "remote access error: bad rkey, raddr outside the remote region, or "
                                "missing remote access rights",
    Syndrome.REMOTE_OP_ERR: "remote operation error: the responder failed to complete the operation",
    Syndrome.TRANSPORT_RETRY_EXC_ERR: "transport retry exceeded: no ACK from the peer (peer down, wrong "
                                      "address/GID, or fabric problem)",
    Syndrome.RNR_RETRY_EXC_ERR: "RNR retry exceeded: the receiver had no receive WQE posted",
    Syndrome.REMOTE_ABORTED_ERR: "remote aborted",
}

CQE_OPCODE_HINTS: Mapping[CqeOpcode, str] = {
    CqeOpcode.REQ: "requester completion: the signaled WQE and all before it completed",
    CqeOpcode.RESP_WR_IMM: "responder completion of an RDMA write with immediate",
    CqeOpcode.RESP_SEND: "responder completion of a send",
    CqeOpcode.REQ_ERR: "requester error: the WQE failed and the QP is now in error",
    CqeOpcode.RESP_ERR: "responder error",
    CqeOpcode.INVALID: "not written by the NIC yet (software pre-sets every CQE to INVALID)",
}

# The operations pyep posts, by the names the CLI uses.
POSTED_OPCODES: Mapping[str, Opcode] = {
    "rdma_write": Opcode.RDMA_WRITE,
    "masked_fa32": Opcode.ATOMIC_MASKED_FA,
    "fa64": Opcode.ATOMIC_FA,
    "nop": Opcode.NOP,
}

# ds (16-byte segments) of each posted WQE, and the bytes its data segment fetches (atomics).
_DS: Mapping[Opcode, int] = {Opcode.NOP: 1, Opcode.RDMA_WRITE: 3, Opcode.ATOMIC_MASKED_FA: 4, Opcode.ATOMIC_FA: 4}
_FETCH_BYTES: Mapping[Opcode, int] = {Opcode.ATOMIC_MASKED_FA: 4, Opcode.ATOMIC_FA: 8}


def _name(enum_cls: type, value: int) -> str:
    try:
        return enum_cls(value).name
    except ValueError:
        return f"UNKNOWN(0x{value:02x})"


def opcode_name(value: int) -> str:
    return _name(Opcode, value)


def cqe_opcode_name(value: int) -> str:
    return _name(CqeOpcode, value)


def syndrome_name(value: int) -> str:
    return _name(Syndrome, value)


def flag_names(fm_ce_se: int) -> List[str]:
    names = [f.name for f in CtrlFlag if fm_ce_se & f.value]
    rest = fm_ce_se & ~sum(f.value for f in CtrlFlag) & 0xFF
    if rest:
        names.append(f"0x{rest:02x}")
    return [n for n in names if n is not None]


def check_uint(field: str, value: object, bits: int) -> int:
    """`value` as an int that fits in `bits` unsigned bits, else TypeError/ValueError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int, got {type(value).__name__}")
    if value < 0 or value >> bits:
        raise ValueError(f"{field}={value:#x} does not fit in {bits} bits (0..{(1 << bits) - 1:#x})"
                         if value >= 0 else f"{field}={value} is negative")
    return value


@dataclass(frozen=True)
class WorkRequest:
    """One operation pyep posts. Fields an opcode does not use must stay 0 (a non-zero one is a bug
    in the caller, so it is rejected rather than silently dropped)."""
    opcode: Opcode
    signaled: bool = False
    fence: bool = False
    laddr: int = 0   # write source / atomic fetch destination
    lkey: int = 0
    raddr: int = 0
    rkey: int = 0
    length: int = 0  # RDMA_WRITE only: atomics imply their operand size
    add: int = 0     # atomics only; 32 bits for ATOMIC_MASKED_FA

    def __post_init__(self) -> None:
        if isinstance(self.opcode, bool) or not isinstance(self.opcode, int):
            raise TypeError(f"opcode must be an Opcode, got {type(self.opcode).__name__}")
        try:
            op = Opcode(self.opcode)
        except ValueError:
            raise ValueError(f"opcode {self.opcode:#x} is not an mlx5 send opcode") from None
        if op not in _DS:
            raise ValueError(f"opcode {op.name} is not one pyep posts ({', '.join(o.name for o in _DS)})")
        object.__setattr__(self, "opcode", op)
        for flag in ("signaled", "fence"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool")
        check_uint("laddr", self.laddr, 64)
        check_uint("lkey", self.lkey, 32)
        check_uint("raddr", self.raddr, 64)
        check_uint("rkey", self.rkey, 32)
        check_uint("length", self.length, 31)
        check_uint("add", self.add, 32 if op == Opcode.ATOMIC_MASKED_FA else 64)
        unused = {Opcode.NOP: ("laddr", "lkey", "raddr", "rkey", "length", "add"),
                  Opcode.RDMA_WRITE: ("add",)}.get(op, ("length",))
        for field in unused:
            if getattr(self, field):
                raise ValueError(f"{field} is not used by {op.name}; leave it 0")


def _engine_wqe() -> ModuleType:
    return engine().wqe


def encode_wqe(wr: WorkRequest, wqe_index: int, qpn: int) -> bytes:
    """The 64-byte WQEBB for `wr` at producer index `wqe_index` of QP `qpn`."""
    if not isinstance(wr, WorkRequest):
        raise TypeError(f"wr must be a WorkRequest, got {type(wr).__name__}")
    check_uint("wqe_index", wqe_index, 16)
    check_uint("qpn", qpn, 24)
    return _engine_wqe().encode_wqe(int(wr.opcode), wqe_index, qpn, wr.signaled, wr.fence, wr.laddr, wr.lkey,
                                    wr.raddr, wr.rkey, wr.length, wr.add)


def _as_bytes(data: BytesLike, expect: int, what: str) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} must be bytes, got {type(data).__name__}")
    raw = bytes(data)
    if len(raw) != expect:
        raise ValueError(f"{what} must be exactly {expect} bytes, got {len(raw)}")
    return raw


def parse_hex(text: str, nbytes: int, what: str) -> bytes:
    """Bytes from hex digits; whitespace, ':' and '_' separators and a leading 0x are allowed."""
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a hex string, got {type(text).__name__}")
    s = text.strip()
    if s[:2].lower() == "0x":
        s = s[2:]
    s = "".join(ch for ch in s if ch not in string.whitespace + ":_")
    for pos, ch in enumerate(s):
        if ch not in string.hexdigits:
            raise ValueError(f"{what}: {ch!r} at hex digit {pos} is not a hex digit")
    if len(s) != 2 * nbytes:
        raise ValueError(f"{what} must be {2 * nbytes} hex digits ({nbytes} bytes), got {len(s)}")
    return bytes.fromhex(s)


@dataclass(frozen=True)
class DecodedWqe:
    opcode: int
    opmod: int
    wqe_index: int
    qpn: int
    ds: int
    signature: int
    fm_ce_se: int
    imm: int
    signaled: bool
    fence: bool
    raddr: int
    rkey: int
    laddr: int
    lkey: int
    length: int          # the data segment's byte_count (atomics: the fetched operand's size)
    add: int
    field_boundary: int  # ATOMIC_MASKED_FA
    compare: int         # ATOMIC_FA / ATOMIC_CS atomic segment

    @property
    def opcode_name(self) -> str:
        return opcode_name(self.opcode)

    def problems(self) -> List[str]:
        """Ways these bytes differ from a WQE pyep's encoder would build (empty: none)."""
        out: List[str] = []
        try:
            op: Optional[Opcode] = Opcode(self.opcode)
        except ValueError:
            op = None
        if op is None or op not in _DS:
            out.append(f"opcode {self.opcode_name} (0x{self.opcode:02x}) is not one pyep posts")
            return out
        if self.ds != _DS[op]:
            out.append(f"ds={self.ds} but pyep's {op.name} WQE has {_DS[op]} segments")
        want_opmod = OPMOD_EXT_ATOMIC_4B if op == Opcode.ATOMIC_MASKED_FA else 0
        if self.opmod != want_opmod:
            out.append(f"opmod=0x{self.opmod:02x}, expected 0x{want_opmod:02x} for {op.name}")
        if op in _FETCH_BYTES and self.length != _FETCH_BYTES[op]:
            out.append(f"fetch data segment is {self.length} bytes, expected {_FETCH_BYTES[op]}")
        if op == Opcode.RDMA_WRITE and self.length >> 31:
            out.append("data segment has the inline bit (0x80000000) set in byte_count")
        if self.field_boundary:
            out.append(f"field_boundary=0x{self.field_boundary:08x}: not one plain 32-bit add")
        if self.compare:
            out.append(f"compare=0x{self.compare:x} is non-zero in a fetch-add")
        if self.signature or self.imm:
            out.append("signature/imm are non-zero; pyep leaves them 0")
        if self.fm_ce_se & ~int(CtrlFlag.CQ_UPDATE | CtrlFlag.FENCE) & 0xFF:
            out.append(f"fm_ce_se=0x{self.fm_ce_se:02x} has flags pyep never sets")
        return out

    def work_request(self) -> WorkRequest:
        """The WorkRequest that encodes to these bytes; ValueError if pyep would not build them."""
        bad = self.problems()
        if bad:
            raise ValueError("not a WQE pyep builds: " + "; ".join(bad))
        op = Opcode(self.opcode)
        if op == Opcode.NOP:
            return WorkRequest(op, self.signaled, self.fence)
        return WorkRequest(op, self.signaled, self.fence, laddr=self.laddr, lkey=self.lkey, raddr=self.raddr,
                           rkey=self.rkey, length=self.length if op == Opcode.RDMA_WRITE else 0, add=self.add)

    def describe(self) -> List[str]:
        """The WQE in words, one line per segment."""
        lines = [f"WQE {self.opcode_name} (opcode 0x{self.opcode:02x}, opmod 0x{self.opmod:02x}), "
                 f"wqe_index {self.wqe_index}, qpn 0x{self.qpn:06x} ({self.qpn}), ds {self.ds} "
                 f"({self.ds * SEG_BYTES} bytes)"]
        flags = flag_names(self.fm_ce_se)
        lines.append(f"  ctrl   fm_ce_se 0x{self.fm_ce_se:02x} [{', '.join(flags) or 'none'}]: "
                     + ("signaled, a CQE will be written" if self.signaled else "unsignaled, no CQE")
                     + ("; fenced behind earlier reads/atomics" if self.fence else ""))
        op = self.opcode
        if op in (Opcode.RDMA_WRITE, Opcode.ATOMIC_MASKED_FA, Opcode.ATOMIC_FA) and self.ds >= 2:
            lines.append(f"  raddr  raddr 0x{self.raddr:016x}, rkey 0x{self.rkey:08x}")
        if op == Opcode.ATOMIC_MASKED_FA:
            lines.append(f"  atomic add_data {self.add} (0x{self.add:08x}), field_boundary 0x{self.field_boundary:08x}"
                         " (32-bit fetch-add)")
        elif op == Opcode.ATOMIC_FA:
            lines.append(f"  atomic add {self.add} (0x{self.add:016x}), compare 0x{self.compare:016x}"
                         " (64-bit fetch-add)")
        if op in (Opcode.RDMA_WRITE, Opcode.ATOMIC_MASKED_FA, Opcode.ATOMIC_FA) and self.ds >= 3:
            role = "source" if op == Opcode.RDMA_WRITE else "fetch destination"
            lines.append(f"  data   {self.length} bytes at laddr 0x{self.laddr:016x}, lkey 0x{self.lkey:08x} ({role})")
        if op == Opcode.RDMA_WRITE:
            lines.append(f"  => write {self.length} bytes from local 0x{self.laddr:x} to remote 0x{self.raddr:x}")
        elif op == Opcode.ATOMIC_MASKED_FA:
            lines.append(f"  => add {self.add} to the 32-bit word at remote 0x{self.raddr:x}; old value to local "
                         f"0x{self.laddr:x}")
        elif op == Opcode.ATOMIC_FA:
            lines.append(f"  => add {self.add} to the 64-bit word at remote 0x{self.raddr:x}; old value to local "
                         f"0x{self.laddr:x}")
        elif op == Opcode.NOP:
            lines.append("  => no operation (used to complete or pad the ring)")
        lines.extend(f"  problem: {p}" for p in self.problems())
        return lines

    def to_json(self) -> Dict[str, object]:
        out: Dict[str, object] = asdict(self)
        out["opcode_name"] = self.opcode_name
        out["flags"] = flag_names(self.fm_ce_se)
        out["problems"] = self.problems()
        return out


@dataclass(frozen=True)
class DecodedCqe:
    opcode: int
    owner: int
    syndrome: int          # error CQEs only (0 otherwise)
    vendor_syndrome: int   # error CQEs only
    wqe_opcode: int        # opcode of the WQE this CQE reports (top byte of sop_drop_qpn)
    wqe_counter: int       # wqe_index of that WQE
    qpn: int
    byte_cnt: int
    op_own: int
    signature: int

    @property
    def opcode_name(self) -> str:
        return cqe_opcode_name(self.opcode)

    @property
    def is_error(self) -> bool:
        return self.opcode in (CqeOpcode.REQ_ERR, CqeOpcode.RESP_ERR)

    @property
    def solicited(self) -> int:
        return (self.op_own >> 1) & 1

    @property
    def cqe_format(self) -> int:
        return (self.op_own >> 2) & 3

    def describe(self) -> List[str]:
        try:
            hint = CQE_OPCODE_HINTS[CqeOpcode(self.opcode)]
        except ValueError:
            hint = "not a CQE opcode pyep knows"
        lines = [f"CQE {self.opcode_name} (opcode {self.opcode}): {hint}",
                 f"  owner {self.owner} (op_own 0x{self.op_own:02x}), wqe_counter {self.wqe_counter}, "
                 f"qpn 0x{self.qpn:06x} ({self.qpn}), wqe opcode {opcode_name(self.wqe_opcode)}"]
        if self.opcode == CqeOpcode.INVALID:
            return lines
        if self.is_error:
            try:
                why = SYNDROME_HINTS[Syndrome(self.syndrome)]
            except ValueError:
                why = "unknown syndrome"
            lines.append(f"  syndrome {syndrome_name(self.syndrome)} (0x{self.syndrome:02x}): {why}")
            lines.append(f"  vendor syndrome 0x{self.vendor_syndrome:02x} (NIC-specific detail)")
        else:
            lines.append(f"  byte_cnt {self.byte_cnt}")
        return lines

    def to_json(self) -> Dict[str, object]:
        out: Dict[str, object] = asdict(self)
        out["opcode_name"] = self.opcode_name
        out["wqe_opcode_name"] = opcode_name(self.wqe_opcode)
        out["is_error"] = self.is_error
        out["syndrome_name"] = syndrome_name(self.syndrome) if self.is_error else None
        return out


def decode_wqe(data: BytesLike) -> DecodedWqe:
    raw = _as_bytes(data, WQEBB_BYTES, "a WQEBB")
    return DecodedWqe(**_engine_wqe().decode_wqe(raw))


def decode_cqe(data: BytesLike) -> DecodedCqe:
    raw = _as_bytes(data, CQE_BYTES, "a CQE")
    return DecodedCqe(**_engine_wqe().decode_cqe(raw))


def encode_cqe(opcode: int, owner: int, wqe_counter: int, qpn: int, byte_cnt: int = 0, wqe_opcode: int = 0,
               syndrome: int = 0, vendor_syndrome: int = 0) -> bytes:
    """A CQE exactly as the softnic writes it (for tests and drills)."""
    for field, value, bits in (("opcode", opcode, 4), ("owner", owner, 1), ("wqe_counter", wqe_counter, 16),
                               ("qpn", qpn, 24), ("byte_cnt", byte_cnt, 32), ("wqe_opcode", wqe_opcode, 8),
                               ("syndrome", syndrome, 8), ("vendor_syndrome", vendor_syndrome, 8)):
        check_uint(field, value, bits)
    return _engine_wqe().encode_cqe(int(opcode), owner, wqe_counter, qpn, byte_cnt, int(wqe_opcode), int(syndrome),
                                    vendor_syndrome)
