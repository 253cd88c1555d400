"""The staged internode path's bookkeeping (docs/normal_internode.md, steps 5-7), stated in torch ops.
The path runs it as kernels (engine/kernels/normal_internode_order.cu: inter_order, inter_recv_prefix;
normal_internode.cu: inter_unpack); these functions are their executable specification, checked on the
CPU by tests/test_normal_internode_order.py and held against the kernels by
tests/test_normal_internode_order_gpu.py. From the count records every rank gathered (one per source
rank: its token count N_s, the rows it sends every rank, its num_tokens_per_expert) they derive the
contract's rank_prefix_matrix, where the intranode kernels' rows go in the contract's (source rank,
token) order (row_map), the recv_channel_prefix_matrix of the received rows, and the per-expert counts.
StagedState and unpack (the cached dispatch's FP8 scales) are used by the path itself.

Record layout (int32, `meta_ints` per source): [N_s, rows for rank d (R), tokens per expert (E), pad].
The notify of the node gathers them as [forwarder l][source node a] (source rank a * P + l).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional

if TYPE_CHECKING:
    import torch


def meta_ints(num_ranks: int, num_experts_max: int) -> int:
    """Ints of one count record, 16-byte rows (the relay moves whole 16-byte units)."""
    return (1 + num_ranks + num_experts_max + 3) // 4 * 4


@dataclass
class StagedState:
    """What a staged dispatch leaves in its handle for a cached dispatch and the combine (device tensors
    unless said otherwise). F: rows this rank forwards inside its node (its own tokens for its node and
    the rows relayed from every other node), by source node; S: rows it relays to the other nodes."""
    node_head: "torch.Tensor"         # int32 [N, M]: position of t in the column stream to node m, or -1
    f_offsets: "torch.Tensor"         # int32 [M + 1]
    s_offsets: "torch.Tensor"         # int32 [M + 1]
    forward_rows: int                 # F (a bound under num_worst_tokens: P * num_worst_tokens)
    send_rows: int                    # S (a bound under num_worst_tokens: N * (M - 1))
    node_rank_prefix: "torch.Tensor"  # int32 [P, P]: the node-level handle of the intranode kernels
    node_channel_prefix: "torch.Tensor"
    node_recv_channel_prefix: "torch.Tensor"
    node_send_head: "torch.Tensor"    # int32 [F, P]
    node_in_rank: "torch.Tensor"      # bool [F, P]
    row_map: "torch.Tensor"           # int32 [rows]: intranode output row -> contract row


def records_by_source(gathered: "torch.Tensor", num_nodes: int, ranks_per_node: int, ints: int) -> "torch.Tensor":
    """[P, M * ints] as the node's notify gathered them ([forwarder l][source node a]) -> [R, ints] by
    source rank a * P + l."""
    return gathered.view(ranks_per_node, num_nodes, ints).transpose(0, 1).reshape(num_nodes * ranks_per_node, ints)


def rank_prefix(records: "torch.Tensor", num_ranks: int) -> "torch.Tensor":
    """The contract's rank_prefix_matrix: [i][j] = rows ranks 0..i send rank j."""
    import torch
    return records[:, 1:1 + num_ranks].cumsum(0).to(torch.int32)


def row_map(records: "torch.Tensor", me: int, num_nodes: int, ranks_per_node: int, rows: int) -> "torch.Tensor":
    """int32 [rows]: the contract row of every row in the intranode kernels' order. Those come from
    forwarder l, source node a, in the order (l, a, token); the contract's order is (a * P + l, token).
    Rows past the real count map to themselves (padding under num_worst_tokens is never mapped)."""
    import torch
    m_n, p = num_nodes, ranks_per_node
    col = records[:, 1 + me].to(torch.int64)                     # [R]: rows source s sends me
    final_off = col.cumsum(0) - col                              # contract order
    sizes = col.view(m_n, p).t().reshape(-1)                     # kernel order: index l * M + a
    ends = sizes.cumsum(0)
    starts = ends - sizes
    final_in_kernel_order = final_off.view(m_n, p).t().reshape(-1)
    k = torch.arange(rows, device=records.device, dtype=torch.int64)
    seg = torch.searchsorted(ends, k, right=True).clamp_(max=m_n * p - 1)
    mapped = k - starts[seg] + final_in_kernel_order[seg]
    return torch.where(k < ends[-1], mapped, k).to(torch.int32)


def recv_channel_prefix(records: "torch.Tensor", rpm: "torch.Tensor", me: int, recv_src_idx: "torch.Tensor",
                        num_channels: int) -> "torch.Tensor":
    """int32 [R, C]: [s][c] = rows from source s whose token lies in s's channels before c (the source's
    channel c covers [c * P_s, (c + 1) * P_s) with P_s = ceil(N_s / C)), from the received rows."""
    import torch
    r_n, c_n, dev = rpm.shape[0], num_channels, rpm.device
    rows = recv_src_idx.shape[0]
    ends = rpm[:, me].to(torch.int64)                            # inclusive: rows of sources 0..s
    r = torch.arange(rows, device=dev, dtype=torch.int64)
    src_rank = torch.searchsorted(ends, r, right=True).clamp_(max=r_n - 1)
    per = ((records[:, 0].to(torch.int64) + c_n - 1) // c_n).clamp_(min=1)
    chan = (recv_src_idx.to(torch.int64) // per[src_rank]).clamp_(0, c_n - 1)
    flat = torch.where(r < ends[-1], src_rank * c_n + chan, torch.full_like(r, r_n * c_n))
    hist = torch.zeros(r_n * c_n + 1, dtype=torch.int64, device=dev).index_add_(0, flat, torch.ones_like(flat))
    hist = hist[:r_n * c_n].view(r_n, c_n)
    return (hist.cumsum(1) - hist).to(torch.int32)


def expert_counts(records: "torch.Tensor", me: int, num_ranks: int, num_experts: int, alignment: int) -> List[int]:
    """num_recv_tokens_per_expert_list: every source's num_tokens_per_expert for this rank's experts,
    summed, rounded up to the alignment (one host read; the caller already waited for the counts)."""
    e_l = num_experts // num_ranks
    first = 1 + num_ranks + me * e_l
    per = records[:, first:first + e_l].sum(0).tolist()
    return [(int(v) + alignment - 1) // alignment * alignment for v in per]


def node_local_ids(ids: "torch.Tensor", node: int, ranks_per_node: int, local_experts: int) -> "torch.Tensor":
    """Global expert ids -> ids among the node's experts (node * P * E_l ...), -1 for other nodes': the
    intranode kernels then give rank j of the node exactly `id - (node*P + j) * E_l` or -1."""
    import torch
    lo = node * ranks_per_node * local_experts
    ok = (ids >= lo) & (ids < lo + ranks_per_node * local_experts)
    return torch.where(ok, ids - lo, torch.full_like(ids, -1)).contiguous()


def unpack(rows: "torch.Tensor", begin: int, nbytes: int, dtype: Any, shape_tail: Optional[int] = None) -> "torch.Tensor":
    """Bytes [begin, begin + nbytes) of every relayed row as a dense `dtype` tensor (one copy)."""
    out = rows[:, begin:begin + nbytes].contiguous().view(dtype)
    return out if shape_tail is None else out.reshape(rows.shape[0], shape_tail)
