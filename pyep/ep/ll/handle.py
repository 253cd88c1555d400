"""The dispatch handle: what combine needs to send expert outputs back, plus the bookkeeping that lets
EpBuffer refuse a handle from another buffer or one whose buffer half was reused.

Received-token layout (every backend produces exactly this; the native kernels included):
for local expert e, received tokens are grouped by source rank ascending, and inside one source rank
by (source token index, top-k slot k) ascending. A token that names the same expert in two slots
arrives once: the later slot is treated as -1 (pyep.ep.ll.errors.DuplicateExpertIndex reports it).
layout_range[e][r] = (begin << 32) | count where count is the number of tokens of expert e from rank r
and begin = sum of the counts of ranks < r; recv_count[e] = sum over r; src_info[e][row] = the
token's index on its source rank. Rows >= recv_count[e] are unspecified (zero in the reference
backend).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterator, Tuple

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False)
class Handle:
    src_info: "torch.Tensor"          # int32 [E_l, R*T]
    layout_range: "torch.Tensor"      # int64 [E_l, R]
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_tokens: int                   # N of the dispatch: combine's topk_idx must be [N, K]
    num_topk: int                     # K of the dispatch
    owner: str                        # token of the EpBuffer that issued it
    epoch: int                        # membership epoch (update_ep_member bumps it)
    seq: int                          # dispatch sequence number, from 1
    buffer_idx: int                   # buffer half, seq & 1
    use_fp8: bool = False
    extras: Dict[str, Any] = field(default_factory=dict)  # backend-private tensors

    @classmethod
    def fast(cls, src_info: "torch.Tensor", layout_range: "torch.Tensor", num_max_dispatch_tokens_per_rank: int,
             hidden: int, num_experts: int, num_tokens: int, num_topk: int, owner: str, epoch: int, seq: int,
             use_fp8: bool, extras: Dict[str, Any]) -> "Handle":
        """The same Handle as the constructor (buffer_idx = seq & 1) for EpBuffer's hot path: the frozen
        dataclass __init__ sets 13 fields one object.__setattr__ at a time (about 2 us a handle)."""
        self = object.__new__(cls)
        self.__dict__.update(src_info=src_info, layout_range=layout_range,
                             num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, hidden=hidden,
                             num_experts=num_experts, num_tokens=num_tokens, num_topk=num_topk, owner=owner,
                             epoch=epoch, seq=seq, buffer_idx=seq & 1, use_fp8=use_fp8, extras=extras)
        return self

    # DeepEP code treats the handle as the tuple (src_info, layout_range, T, H, E); keep that working.
    def as_tuple(self) -> Tuple[Any, ...]:
        return (self.src_info, self.layout_range, self.num_max_dispatch_tokens_per_rank, self.hidden,
                self.num_experts)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.as_tuple())

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> Any:
        return self.as_tuple()[i]

    @property
    def num_local_experts(self) -> int:
        return int(self.layout_range.shape[0])

    @property
    def num_ranks(self) -> int:
        return int(self.layout_range.shape[1])

    def counts(self) -> "torch.Tensor":
        """int64 [E_l, R]: tokens of local expert e received from rank r."""
        return self.layout_range & 0xFFFFFFFF

    def begins(self) -> "torch.Tensor":
        """int64 [E_l, R]: first row of those tokens."""
        return self.layout_range >> 32

    def __repr__(self) -> str:
        return (f"Handle(seq={self.seq}, buffer_idx={self.buffer_idx}, epoch={self.epoch}, "
                f"N={self.num_tokens}, K={self.num_topk}, T={self.num_max_dispatch_tokens_per_rank}, "
                f"H={self.hidden}, E={self.num_experts}, R={self.num_ranks}, fp8={self.use_fp8})")
