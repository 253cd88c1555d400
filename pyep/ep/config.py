"""Configuration of a low-latency EP buffer and its size hint.

The native buffer layout (and therefore its size) is defined in one place, pyep.ep.layout, which the
native backend allocates from; this module only forwards to it so the hint and the allocation agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

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
class EpConfig:
    """Shape and transport settings of one EpBuffer (the same on every rank).

    transport: "auto" (self: local copy; same node with P2P: NVLink IPC; else IBGDA on device_name),
    "nvlink" (NVLink for every peer, error if a peer is not reachable), "ibgda" (the NIC for every
    peer), "emulated" (IBGDA through the softnic for every non-local peer), "emulated-internode"
    (softnic only between nodes, NVLink inside a node). allow_nvlink=False makes "auto" use the NIC
    path for same-node peers too. ranks_per_node overrides node detection (virtual nodes on one box).
    backend: "auto" (native where it can run, else the reference), "reference", "native".
    """

    num_max_dispatch_tokens_per_rank: int = 128
    hidden: int = 7168
    num_experts: int = 256
    max_topk: int = MAX_TOPK
    transport: str = "auto"
    allow_nvlink: bool = True
    device_name: str = "mlx5_0"
    timeout_us: int = DEFAULT_TIMEOUT_US
    num_qps_per_peer: Optional[int] = None      # None: the backend picks
    num_buffer_bytes: Optional[int] = None      # None: derived from the shape (size_hint)
    ranks_per_node: Optional[int] = None        # None: detected
    backend: str = "auto"
    # Expert-id checks (pyep.ep.errors). True: the dispatch kernel checks the ids it routes and the
    # error is raised later, at the next call / event wait / hook, with no host sync. "strict": topk_idx
    # is also read on the host and a bad id raises before launch (one device sync per call; skipped
    # during CUDA-graph capture). False: no checks (a bad id is still treated as -1, never out of bounds).
    check_values: Union[bool, str] = True

    def __post_init__(self) -> None:
        _check_int("num_max_dispatch_tokens_per_rank", self.num_max_dispatch_tokens_per_rank, 1)
        h = _check_int("hidden", self.hidden, FP8_GROUP, MAX_HIDDEN)
        if h % FP8_GROUP:
            raise ValueError(f"hidden must be a multiple of {FP8_GROUP}, got {h}")
        _check_int("num_experts", self.num_experts, 1)
        _check_int("max_topk", self.max_topk, 1, MAX_TOPK)
        _check_int("timeout_us", self.timeout_us, 1)
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.allow_nvlink, bool):
            raise TypeError(f"allow_nvlink must be a bool, got {type(self.allow_nvlink).__name__}")
        if not isinstance(self.check_values, (bool, str)):
            raise TypeError(f"check_values must be True, False or 'strict', got "
                            f"{type(self.check_values).__name__}")
        if isinstance(self.check_values, str) and self.check_values != "strict":
            raise ValueError(f"check_values must be True, False or 'strict', got {self.check_values!r}")
        if not isinstance(self.device_name, str) or not self.device_name:
            raise ValueError(f"device_name must be a non-empty str, got {self.device_name!r}")
        if self.transport == "nvlink" and not self.allow_nvlink:
            raise ValueError("transport='nvlink' contradicts allow_nvlink=False")
        if self.num_qps_per_peer is not None:
            _check_int("num_qps_per_peer", self.num_qps_per_peer, 1, 64)
        if self.num_buffer_bytes is not None:
            _check_int("num_buffer_bytes", self.num_buffer_bytes, 1)
        if self.ranks_per_node is not None:
            _check_int("ranks_per_node", self.ranks_per_node, 1)

    def check_group_size(self, num_ranks: int) -> None:
        """Checks that depend on the group: experts split evenly, nodes tile the group."""
        self.num_local_experts(num_ranks)
        if self.ranks_per_node is not None and num_ranks % self.ranks_per_node:
            raise ValueError(f"ranks_per_node ({self.ranks_per_node}) must divide the number of "
                             f"ranks ({num_ranks})")
        if self.num_buffer_bytes is not None:
            need = self.size_hint(num_ranks)
            if self.num_buffer_bytes < need:
                raise ValueError(f"num_buffer_bytes ({self.num_buffer_bytes}) is smaller than this "
                                 f"shape needs ({need} bytes for {self.describe_shape(num_ranks)})")

    def num_local_experts(self, num_ranks: int) -> int:
        _check_int("num_ranks", num_ranks, 1)
        if self.num_experts % num_ranks:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by the number of "
                             f"ranks ({num_ranks})")
        return self.num_experts // num_ranks

    def describe_shape(self, num_ranks: int) -> str:
        return (f"T={self.num_max_dispatch_tokens_per_rank}, H={self.hidden}, E={self.num_experts}, "
                f"R={num_ranks}, K_max={self.max_topk}")

    def size_hint(self, num_ranks: int) -> int:
        """Bytes of the native low-latency buffer (both halves) for this shape and group size."""
        return size_hint(self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts,
                         num_ranks, self.max_topk)


def size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int, num_ranks: int,
              max_topk: int = MAX_TOPK) -> int:
    """Bytes of the native low-latency buffer for a shape (see pyep.ep.layout for the layout)."""
    t = _check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
    h = _check_int("hidden", hidden, FP8_GROUP, MAX_HIDDEN)
    if h % FP8_GROUP:
        raise ValueError(f"hidden must be a multiple of {FP8_GROUP}, got {h}")
    e = _check_int("num_experts", num_experts, 1)
    r = _check_int("num_ranks", num_ranks, 1)
    k = _check_int("max_topk", max_topk, 1, MAX_TOPK)
    if e % r:
        raise ValueError(f"num_experts ({e}) must be divisible by num_ranks ({r})")
    from .layout import ll_buffer_bytes  # lazy: owned by the native side, pure Python arithmetic
    return int(ll_buffer_bytes(t, h, e, r, k))
