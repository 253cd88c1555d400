"""DeepEP V2's `EPHandle` as the pyep shim makes it, and the host-side checks of ElasticBuffer calls."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional

from ..ep.normal.handle import NormalHandle

if TYPE_CHECKING:
    import torch

__all__ = ["EPHandle", "check_flag", "check_count", "check_stats", "split_x"]


@dataclass(eq=False)
class EPHandle:
    """DeepEP V2's communication handle: pass it to `combine`, or back to `dispatch` (cached, no count
    exchange). V2's attributes first, in V2's order; then pyep's state.

    psum_num_recv_tokens_per_scaleup_rank int32 [scale-up ranks]: inclusive prefix sum of the received
        tokens by the source's scale-up index; [-1] is the received token count (on the device).
    psum_num_recv_tokens_per_expert int32 [E_l]: inclusive prefix sum of the aligned per-expert counts;
        with do_expand, expert e's aligned start plus its real count.
    recv_src_metadata int32 [rows, 2 + K]: (source rank * num_max_tokens_per_rank + source token,
        row in the non-expanded order, then where each top-k entry sits in recv_x or -1).
    dst_buffer_slot_idx int32 [N, R]: the row at each destination where each sent token landed, -1.
    token_metadata_at_forward, channel_linked_list: V2's hybrid-kernel state; None (pyep's forwarding
        state is inside `normal`).
    num_recv_tokens, num_expanded_tokens: exact with do_cpu_sync, else the row capacity.
    """

    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: "torch.Tensor"
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: List[int]
    psum_num_recv_tokens_per_scaleup_rank: "torch.Tensor"
    psum_num_recv_tokens_per_expert: "torch.Tensor"
    num_unaligned_recv_tokens_per_expert: "torch.Tensor"
    recv_src_metadata: "torch.Tensor"
    dst_buffer_slot_idx: "torch.Tensor"
    token_metadata_at_forward: Optional["torch.Tensor"] = None
    channel_linked_list: Optional["torch.Tensor"] = None
    # pyep's state
    normal: Optional[NormalHandle] = field(default=None, repr=False)
    recv_topk_idx: Optional["torch.Tensor"] = field(default=None, repr=False)   # int64 [rows, K]
    slots: Optional["torch.Tensor"] = field(default=None, repr=False)           # int64 [rows, K], do_expand
    expand_capacity: int = 0                                                      # rows of expanded tensors
    owner: str = ""                                                               # the ElasticBuffer's token

    @property
    def num_topk(self) -> int:
        return int(self.topk_idx.shape[1])


def check_flag(name: str, v: Any) -> bool:
    """V2's flags are bools; its own test passes 0 / 1."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise TypeError(f"{name} must be a bool (or 0 / 1), got {v!r}")


def check_count(name: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


def check_stats(stats: Any, num_local_experts: int, device: "torch.device") -> None:
    import torch
    if not isinstance(stats, torch.Tensor):
        raise TypeError(f"cumulative_local_expert_recv_stats must be a torch.Tensor, got {type(stats).__name__}")
    if stats.dtype != torch.int32 or tuple(stats.shape) != (num_local_experts,) or stats.device != device:
        raise ValueError(f"cumulative_local_expert_recv_stats must be int32 [{num_local_experts}] on {device}, got "
                         f"{stats.dtype} {list(stats.shape)} on {stats.device}")


def split_x(x: Any) -> "tuple":
    """(data, scale factors or None) from V2's x (a tensor, or an (fp8 data, scale packs) tuple)."""
    import torch
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"x as a tuple must be (fp8 data, scale factors), got {len(x)} elements")
        data, sf = x
        if not isinstance(data, torch.Tensor) or not isinstance(sf, torch.Tensor):
            raise TypeError("x as a tuple must hold two torch.Tensors (fp8 data, scale factors)")
        return data, sf
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a bf16 torch.Tensor or an (fp8, scale factors) tuple, got {type(x).__name__}")
    return x, None
