"""Configuration of a low-latency EP buffer (`EpConfig`) and its size hint. The native buffer layout, and
so its size, is defined in one place, pyep.ep.ll.layout, which the native backend allocates from; the
hint forwards to it so the hint and the allocation agree."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ..config import BACKENDS, DEFAULT_TIMEOUT_US, FP8_GROUP, MAX_HIDDEN, MAX_TOPK, LinkConfig, _check_int
from .layout import size_hint

# Bounds of what a low-latency buffer can address or allocate, checked before anything is allocated:
# T: a dispatch count word carries count + 1 in its 15-bit value field (docs/ll_kernels.md, "Call tags");
# E: the kernels keep per-expert tables in shared memory (about 20 bytes each; 227 KiB per SM on H100);
# bytes: the native buffer, and each receive tensor of a call, stay below the largest GPU memory
# (512 GiB); timeout: a per-call wait is at most an hour (it travels in nanoseconds).
MAX_TOKENS_PER_RANK = 0x7FFE
MAX_EXPERTS = 8192
MAX_BUFFER_BYTES = 1 << 39
MAX_TIMEOUT_US = 3_600_000_000
# A rejoin's call #A is the survivors' next call plus this many (docs/elastic.md): beyond it a newcomer
# would wait longer than any membership timeout for a call that far ahead.
MAX_REJOIN_LEAD_CALLS = 10_000


@dataclass(frozen=True)
class EpConfig:
    """Shape and transport settings of one EpBuffer (the same on every rank).

    transport, allow_nvlink, device_name, num_qps_per_peer, ranks_per_node: how peers are reached
    (pyep.ep.config.LinkConfig, which `links` returns).
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
    # Expert-id checks (pyep.ep.ll.errors). True: the dispatch kernel checks the ids it routes and the
    # error is raised later, at the next call / event wait / hook, with no host sync. "strict": topk_idx
    # is also read on the host and a bad id raises before launch (one device sync per call; skipped
    # during CUDA-graph capture). False: no checks (a bad id is still treated as -1, never out of bounds).
    check_values: Union[bool, str] = True

    def __post_init__(self) -> None:
        _check_int("num_max_dispatch_tokens_per_rank", self.num_max_dispatch_tokens_per_rank, 1, MAX_TOKENS_PER_RANK)
        h = _check_int("hidden", self.hidden, FP8_GROUP, MAX_HIDDEN)
        if h % FP8_GROUP:
            raise ValueError(f"hidden must be a multiple of {FP8_GROUP}, got {h}")
        _check_int("num_experts", self.num_experts, 1, MAX_EXPERTS)
        _check_int("max_topk", self.max_topk, 1, MAX_TOPK)
        _check_int("timeout_us", self.timeout_us, 1, MAX_TIMEOUT_US)
        self.links   # the transport settings' own checks (pyep.ep.config.LinkConfig)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.check_values, (bool, str)):
            raise TypeError(f"check_values must be True, False or 'strict', got "
                            f"{type(self.check_values).__name__}")
        if isinstance(self.check_values, str) and self.check_values != "strict":
            raise ValueError(f"check_values must be True, False or 'strict', got {self.check_values!r}")
        if self.num_buffer_bytes is not None:
            _check_int("num_buffer_bytes", self.num_buffer_bytes, 1, MAX_BUFFER_BYTES)

    @property
    def links(self) -> LinkConfig:
        """The transport settings, as the peer set reads them."""
        return LinkConfig(transport=self.transport, allow_nvlink=self.allow_nvlink, device_name=self.device_name,
                          num_qps_per_peer=self.num_qps_per_peer, ranks_per_node=self.ranks_per_node)

    def check_group_size(self, num_ranks: int) -> None:
        """Checks that depend on the group: experts split evenly, nodes tile the group."""
        self.num_local_experts(num_ranks)
        if self.ranks_per_node is not None and num_ranks % self.ranks_per_node:
            raise ValueError(f"ranks_per_node ({self.ranks_per_node}) must divide the number of "
                             f"ranks ({num_ranks})")
        need = self.size_hint(num_ranks)
        # What one call allocates besides: recv_x, bf16 [E_l, R*T, H].
        recv = 2 * self.num_experts * self.num_max_dispatch_tokens_per_rank * self.hidden
        if max(need, recv) > MAX_BUFFER_BYTES:
            raise ValueError(f"{self.describe_shape(num_ranks)} needs a {need}-byte buffer and {recv}-byte receive "
                             f"tensors, more than the {MAX_BUFFER_BYTES} bytes a GPU can hold")
        if self.num_buffer_bytes is not None:
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
