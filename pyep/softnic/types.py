"""Types of the softnic API: enums with the PRM values, configs and info records, validators."""
from __future__ import annotations

import enum

import struct
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional

from .._native import engine
from ..wqe import Syndrome  # the one Python name table for MLX5_CQE_SYNDROME_*


class Access(enum.IntFlag):
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8


RDMA_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC


class Placement(enum.IntEnum):
    HOST = 0         # plain host memory (CPU posters)
    HOST_MAPPED = 1  # pinned host memory mapped for the GPU (GPU posters); == HOST without CUDA
    DEVICE = 2       # GPU memory: not supported by the softnic (it polls from the host)


class QpState(enum.IntEnum):
    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    ERR = 6


class PostStatus(enum.IntEnum):
    """gda::Status returned by the posting calls (qp.h)."""
    OK = 0
    ERR_QP = 1       # the QP is in error: HostQp.error() says why
    ERR_TIMEOUT = 2  # this call timed out waiting (ring space, doorbell order, completion)
    ERR_INVALID = 3  # bad request (e.g. batch larger than the ring allows)


class SoftNicError(RuntimeError):
    """A softnic operation failed (bad state transition, resources, a posted WQE that errored)."""


def check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return int(value)


def call(fn, *args: Any) -> Any:
    """Native call with provider errors as SoftNicError (ValueErrors stay ValueErrors)."""
    try:
        return fn(*args)
    except ValueError:
        raise
    except RuntimeError as exc:
        raise SoftNicError(str(exc)) from None


@dataclass(frozen=True)
class SoftNicConfig:
    node_id: int = 0                  # unique per softnic within a fabric (e.g. the rank)
    fabric_id: Optional[int] = None   # shared by all softnics of a job; None = a fresh random one
    max_mrs: int = 1024
    max_qps: int = 1024
    idle_spin: int = 2000             # empty passes before the progress thread sleeps
    idle_sleep_us: int = 20
    cuda_device: int = -1             # CUDA build: device for the softnic's streams (-1 = current)
    start: bool = True                # start the progress thread at once

    def __post_init__(self) -> None:
        check_int("node_id", self.node_id, 0, 2**63 - 1)
        if self.fabric_id is not None:
            check_int("fabric_id", self.fabric_id, 1, 2**64 - 1)
        check_int("max_mrs", self.max_mrs, 1, 1 << 16)
        check_int("max_qps", self.max_qps, 1, 1 << 16)
        check_int("idle_spin", self.idle_spin, 0, 1 << 30)
        check_int("idle_sleep_us", self.idle_sleep_us, 0, 1_000_000)
        check_int("cuda_device", self.cuda_device, -1, 1023)


@dataclass(frozen=True)
class ConnectAttr:
    """INIT->RTR / RTR->RTS parameters. Retry time = 4.096 us * 2**ack_timeout * (retry_cnt + 1);
    ack_timeout 0 means retry forever (IB semantics)."""
    mtu: int = 4096
    retry_cnt: int = 7
    rnr_retry: int = 7
    ack_timeout: int = 20
    min_rnr_timer: int = 12
    sq_psn: int = 0
    rq_psn: int = 0
    max_rd_atomic: int = 16
    sl: int = 0
    traffic_class: int = 0
    udp_sport: int = 0

    def __post_init__(self) -> None:
        if self.mtu not in (256, 512, 1024, 2048, 4096):
            raise ValueError(f"mtu must be 256, 512, 1024, 2048 or 4096, got {self.mtu}")
        check_int("retry_cnt", self.retry_cnt, 0, 7)
        check_int("rnr_retry", self.rnr_retry, 0, 7)
        check_int("ack_timeout", self.ack_timeout, 0, 31)
        check_int("min_rnr_timer", self.min_rnr_timer, 0, 31)
        check_int("sq_psn", self.sq_psn, 0, 0xFFFFFF)
        check_int("rq_psn", self.rq_psn, 0, 0xFFFFFF)
        check_int("max_rd_atomic", self.max_rd_atomic, 0, 255)
        check_int("sl", self.sl, 0, 15)
        check_int("traffic_class", self.traffic_class, 0, 255)
        check_int("udp_sport", self.udp_sport, 0, 0xFFFF)

    def retry_time_s(self) -> Optional[float]:
        return None if self.ack_timeout == 0 else 4.096e-6 * 2**self.ack_timeout * (self.retry_cnt + 1)


@dataclass(frozen=True)
class CqInfo:
    cqn: int
    log_size: int
    cqes: int    # address posters use
    dbrec: int


@dataclass(frozen=True)
class QpInfo:
    qpn: int
    log_sq: int
    sq: int      # ring address posters use
    dbrec: int
    bf: int
    bf_size: int
    cqn: int


@dataclass(frozen=True)
class MrInfo:
    addr: int
    length: int
    lkey: int
    rkey: int
    access: int


@dataclass(frozen=True)
class PeerInfo:
    """A decoded connect blob: who the peer is, its QPs and the MRs it lets us access."""
    fabric_id: int
    node_id: int
    host_id: int
    pid: int
    qpns: tuple
    mrs: tuple


@dataclass(frozen=True)
class QpStats:
    qpn: int
    state: QpState
    remote_node: int
    remote_qpn: int
    wqes: int
    bytes: int
    atomics: int
    errors: int
    flushed: int
    cqes: int
    doorbells: int
    consumer_index: int
    pending: int
    last_syndrome: int
    last_vendor_syndrome: int
    last_error_wqe: int
    last_error: str


@dataclass(frozen=True)
class CqStats:
    cqn: int
    log_size: int
    producer_index: int
    consumer_index: int
    overrun: bool
    error: str


@dataclass(frozen=True)
class QpError:
    """The error slot of a QP context (qp.h): first error wins."""
    valid: bool
    kind: int
    cqe_opcode: int
    syndrome: int
    vendor_syndrome: int
    wqe_opcode: int
    wqe_counter: int
    when_ns: int

    def describe(self) -> str:
        if not self.valid:
            return "no error"
        kinds = {1: "error CQE", 2: "no ring space in time", 3: "doorbell order timeout", 4: "quiet timeout"}
        text = kinds.get(self.kind, f"kind {self.kind}")
        if self.kind == 1:
            try:
                name = Syndrome(self.syndrome).name
            except ValueError:
                name = hex(self.syndrome)
            text += f": {name} (vendor {self.vendor_syndrome:#x}) on WQE {self.wqe_counter}, opcode {self.wqe_opcode:#x}"
        return text


@dataclass(frozen=True)
class RawCqe:
    """One 64-byte CQE as it sits in the ring (mlx5_cqe64 / mlx5_err_cqe fields)."""
    index: int
    opcode: int           # op_own >> 4: 0 REQ, 13 REQ_ERR, 15 INVALID
    owner: int
    wqe_counter: int
    byte_cnt: int
    qpn: int
    wqe_opcode: int       # s_wqe_opcode (top byte of sop_drop_qpn)
    syndrome: int         # error CQEs only
    vendor_syndrome: int

    @staticmethod
    def decode(index: int, raw: bytes) -> "RawCqe":
        if len(raw) != 64:
            raise ValueError(f"a CQE is 64 bytes, got {len(raw)}")
        byte_cnt, = struct.unpack_from(">I", raw, 44)
        sdq, counter = struct.unpack_from(">IH", raw, 56)
        op = raw[63] >> 4
        err = op in (13, 14)
        return RawCqe(index, op, raw[63] & 1, counter, byte_cnt, sdq & 0xFFFFFF, sdq >> 24,
                      raw[55] if err else 0, raw[54] if err else 0)


def vendor_syndromes() -> Dict[str, int]:
    """Softnic vendor syndromes (byte 54 of an error CQE): which softnic check failed."""
    return dict(engine().softnic_vendor_syndromes)


def from_dict(cls, d: Dict[str, Any]):
    return cls(**{f.name: d[f.name] for f in fields(cls)})


def check_seconds(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number of seconds")
    if not 0 <= v <= 3600:
        raise ValueError(f"{name} must be in [0, 3600] seconds, got {v}")
    return float(v)
