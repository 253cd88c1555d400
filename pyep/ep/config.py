"""Limits and settings both modes share: the bounds of a shape, the default wait, the transport modes,
and `LinkConfig`, what a peer set (pyep.ep.peers) needs to connect a buffer to its peers. The
low-latency buffer's own configuration is pyep.ep.ll.config.EpConfig; the normal mode's is
pyep.ep.normal.config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# H: multiple of the FP8 group size, up to the largest hidden size the kernels are built for.
FP8_GROUP = 128
MAX_HIDDEN = 16384
MAX_TOPK = 16
# A host wait without a bound is a hang; ten seconds covers first-call JIT/registration on a busy node
# while still surfacing a dead peer in a time a person will wait for.
DEFAULT_TIMEOUT_US = 10_000_000
CHECK_VALUES = (True, False, "strict")
TRANSPORTS = ("auto", "nvlink", "ibgda", "emulated", "emulated-internode")
BACKENDS = ("auto", "reference", "native")


def _check_int(name: str, value: object, lo: int, hi: Optional[int] = None) -> int:
    # bool is an int subclass; True as a token count is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}, got {value}")
    return value


@dataclass(frozen=True)
class LinkConfig:
    """How a buffer reaches its peers (the same on every rank).

    transport: "auto" (self: local copy; same node with P2P: NVLink IPC; else IBGDA on device_name),
    "nvlink" (NVLink for every peer, error if a peer is not reachable), "ibgda" (the NIC for every
    peer), "emulated" (IBGDA through the softnic for every non-local peer), "emulated-internode"
    (softnic only between nodes, NVLink inside a node). allow_nvlink=False makes "auto" use the NIC
    path for same-node peers too. ranks_per_node overrides node detection (virtual nodes on one box).
    """

    transport: str = "auto"
    allow_nvlink: bool = True
    device_name: str = "mlx5_0"
    num_qps_per_peer: Optional[int] = None      # None: the backend picks
    ranks_per_node: Optional[int] = None        # None: detected

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not isinstance(self.allow_nvlink, bool):
            raise TypeError(f"allow_nvlink must be a bool, got {type(self.allow_nvlink).__name__}")
        if not isinstance(self.device_name, str) or not self.device_name:
            raise ValueError(f"device_name must be a non-empty str, got {self.device_name!r}")
        if self.transport == "nvlink" and not self.allow_nvlink:
            raise ValueError("transport='nvlink' contradicts allow_nvlink=False")
        if self.num_qps_per_peer is not None:
            _check_int("num_qps_per_peer", self.num_qps_per_peer, 1, 64)
        if self.ranks_per_node is not None:
            _check_int("ranks_per_node", self.ranks_per_node, 1)
