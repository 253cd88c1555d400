"""DeepEP V1's internode handle on pyep's normal mode.

DeepEP's `dispatch` returns, across nodes, the 10-tuple

    (is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix,
     recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix,
     recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, send_nvl_head)

and its tests read entries by position (tests/test_internode.py: `handle[-4]`, the received rows'
prefix sum by source rank). `InternodeHandle` unpacks like that tuple and carries pyep's NormalHandle,
which cached dispatch and combine take back. Entries follow pyep's route (docs/normal_internode.md):
a token goes once to its column peer on each node that wants it (the forwarder), which passes it on
inside its node. Per rank, with M nodes of P ranks, C channels, N tokens, F forwarded rows:

  0 is_token_in_rank          bool [N, R]
  1 rdma_channel_prefix_matrix int32 [M, C]  tokens for node m in channels 0..c (inclusive)
  2 gbl_channel_prefix_matrix  int32 [R, C]  the same per destination rank (the handle's
                                              channel_prefix_matrix)
  3 recv_rdma_channel_prefix_matrix int32 [M, C]  forwarded rows from node m in this rank's
                                              forwarding channels 0..c (F split into C ranges)
  4 recv_rdma_rank_prefix_sum  int32 [M]     forwarded rows from nodes 0..m (inclusive)
  5 recv_gbl_channel_prefix_matrix int32 [R, C]  the handle's recv_channel_prefix_matrix
  6 recv_gbl_rank_prefix_sum   int32 [R]     received rows from ranks 0..s (inclusive): the rows of
                                              source s are [entry[s-1], entry[s])
  7 recv_src_meta              int32 [rows, 2]  (source rank, token index at the source); -1 past
                                              the real rows (num_worst_tokens)
  8 send_rdma_head             int32 [N, M]  position of token t among this rank's tokens for node m,
                                              -1 if none of m's ranks wants it
  9 send_nvl_head              int32 [F, P]  position of forwarded row f in the (channel, -> local
                                              rank p) stream, -1 if p does not want it

Entries are computed on first access (device ops, no communication). 3, 4 and 9 describe the
forwarding stage: the native internode path keeps it in its handle state; the reference backend,
which sends every row straight to its destination, has none, so `reference_forward_stage` exchanges
the forwarders' row masks once per dispatch (one bounded all-to-all of counts and one of P-bit rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Union

from ..ep.normal.handle import NormalHandle
from ..ep.normal.reference import token_channels

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

FIELDS = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
          "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
          "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")


@dataclass(frozen=True)
class ForwardStage:
    """The rows a rank forwards inside its node, by source node: how many from each node, and which of
    the node's ranks want each row."""
    rows_per_node: "torch.Tensor"     # int64 [M]
    send_nvl_head: "torch.Tensor"     # int32 [F, P]


def stream_positions(in_rank: "torch.Tensor", num_channels: int) -> "torch.Tensor":
    """int32 [F, D]: position of row f in the (channel(f), -> d) stream counted from 0, -1 where
    in_rank[f, d] is False (the contract's send_head, for rows split into num_channels ranges)."""
    import torch
    f, d = in_rank.shape
    dev = in_rank.device
    sel = in_rank.to(torch.int64)
    incl = sel.cumsum(0)
    per = max(1, -(-f // num_channels))
    starts = (torch.arange(num_channels, device=dev, dtype=torch.int64) * per).clamp_(max=f)
    before = torch.cat([torch.zeros(1, d, dtype=torch.int64, device=dev), incl])[starts]   # [C, D]
    pos = incl - 1 - before[token_channels(f, num_channels, dev)]
    return torch.where(in_rank, pos, torch.full_like(pos, -1)).to(torch.int32)


def native_forward_stage(state: Any) -> ForwardStage:
    """From the native staged path's handle state (internode_order.StagedState)."""
    import torch
    offs = state.f_offsets.to(torch.int64)
    return ForwardStage(rows_per_node=offs[1:] - offs[:-1], send_nvl_head=state.node_send_head)


def reference_forward_stage(in_rank: "torch.Tensor", rank: int, num_nodes: int, ranks_per_node: int,
                            num_channels: int, group: "dist.ProcessGroup", timeout_us: int) -> ForwardStage:
    """Collective: every rank sends its forwarder on each node m (same local index) the P-bit masks
    of node m's ranks for its tokens that node m wants, in token order; each rank gets its forwarded
    rows by source node, as the native path lays them out."""
    import torch
    from ..ep._dist import all_to_all_bounded
    n, r_n = in_rank.shape
    m_n, p = num_nodes, ranks_per_node
    dev = in_rank.device
    local = rank % p
    node_mask = in_rank.view(n, m_n, p).any(-1)                          # [N, M]
    send_counts = torch.zeros(r_n, dtype=torch.int64, device=dev)
    send_counts[torch.arange(m_n, device=dev, dtype=torch.int64) * p + local] = node_mask.sum(0).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    all_to_all_bounded(recv_counts, send_counts, None, None, group, timeout_us,
                       "DeepEP internode handle: forwarded row counts")
    sends: List[int] = send_counts.tolist()
    recvs: List[int] = recv_counts.tolist()
    rows = [in_rank[node_mask[:, m]][:, m * p:(m + 1) * p] for m in range(m_n)]
    send = torch.cat(rows).to(torch.uint8) if rows else torch.zeros(0, p, dtype=torch.uint8, device=dev)
    recv = torch.empty((sum(recvs), p), dtype=torch.uint8, device=dev)
    all_to_all_bounded(recv, send.contiguous(), recvs, sends, group, timeout_us,
                       "DeepEP internode handle: forwarded row masks")
    per_node = torch.tensor([recvs[a * p + local] for a in range(m_n)], dtype=torch.int64, device=dev)
    return ForwardStage(rows_per_node=per_node, send_nvl_head=stream_positions(recv.bool(), num_channels))


class InternodeHandle:
    """DeepEP V1's internode handle (a 10-tuple when unpacked or indexed) over pyep's NormalHandle."""

    __slots__ = ("normal", "rank", "forward", "_cache")

    def __init__(self, normal: NormalHandle, rank: int, forward: ForwardStage) -> None:
        self.normal = normal
        self.rank = rank
        self.forward = forward
        self._cache: Dict[str, "torch.Tensor"] = {}

    def __getattr__(self, name: str) -> Any:
        # pyep extension: the NormalHandle's attributes (num_nodes, rank_prefix_matrix, ...) read through.
        if name.startswith("_") or name in InternodeHandle.__slots__:
            raise AttributeError(name)
        return getattr(self.normal, name)

    # ------------------------------------------------------------------ tuple protocol
    def __len__(self) -> int:
        return len(FIELDS)

    def __iter__(self) -> Iterator["torch.Tensor"]:
        return (self._entry(name) for name in FIELDS)

    def __getitem__(self, i: Union[int, slice]) -> Any:
        if isinstance(i, slice):
            return tuple(self._entry(name) for name in FIELDS[i])
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"handle indices must be integers or slices, not {type(i).__name__}")
        if not -len(FIELDS) <= i < len(FIELDS):
            raise IndexError(f"handle index {i} out of range (DeepEP's internode handle has {len(FIELDS)} entries)")
        return self._entry(FIELDS[i])

    def _entry(self, name: str) -> "torch.Tensor":
        t = self._cache.get(name)
        if t is None:
            t = getattr(self, "_make_" + name)()
            self._cache[name] = t
        return t

    def __repr__(self) -> str:
        h = self.normal
        return (f"InternodeHandle(rank={self.rank}, nodes={h.num_nodes}x{h.ranks_per_node}, N={h.num_tokens}, "
                f"rows={h.num_recv_rows}, forwarded={int(self.forward.send_nvl_head.shape[0])})")

    # ------------------------------------------------------------------ entries
    def _node_mask(self) -> "torch.Tensor":
        h = self.normal
        n = h.is_token_in_rank.shape[0]
        return h.is_token_in_rank.view(n, h.num_nodes, h.ranks_per_node).any(-1)

    def _make_is_token_in_rank(self) -> "torch.Tensor":
        return self.normal.is_token_in_rank

    def _make_rdma_channel_prefix_matrix(self) -> "torch.Tensor":
        import torch
        h = self.normal
        mask = self._node_mask().to(torch.int64)                              # [N, M]
        chan = token_channels(mask.shape[0], h.num_channels, mask.device)
        per = torch.zeros(h.num_channels, h.num_nodes, dtype=torch.int64, device=mask.device).index_add_(0, chan, mask)
        return per.t().cumsum(1).to(torch.int32).contiguous()

    def _make_gbl_channel_prefix_matrix(self) -> "torch.Tensor":
        return self.normal.channel_prefix_matrix

    def _make_recv_rdma_channel_prefix_matrix(self) -> "torch.Tensor":
        import torch
        h, fw = self.normal, self.forward
        f = int(fw.send_nvl_head.shape[0])
        dev = fw.send_nvl_head.device
        ends = fw.rows_per_node.to(dev).cumsum(0)
        rows = torch.arange(f, device=dev, dtype=torch.int64)
        node = torch.searchsorted(ends, rows, right=True)                     # F past the real rows: M
        flat = node * h.num_channels + token_channels(f, h.num_channels, dev)
        hist = torch.zeros((h.num_nodes + 1) * h.num_channels, dtype=torch.int64, device=dev)
        hist.index_add_(0, flat, torch.ones_like(flat))
        return hist[:h.num_nodes * h.num_channels].view(h.num_nodes, h.num_channels).cumsum(1).to(torch.int32)

    def _make_recv_rdma_rank_prefix_sum(self) -> "torch.Tensor":
        import torch
        return self.forward.rows_per_node.cumsum(0).to(torch.int32)

    def _make_recv_gbl_channel_prefix_matrix(self) -> "torch.Tensor":
        return self.normal.recv_channel_prefix_matrix

    def _make_recv_gbl_rank_prefix_sum(self) -> "torch.Tensor":
        return self.normal.rank_prefix_matrix[:, self.rank].contiguous()

    def _make_recv_src_meta(self) -> "torch.Tensor":
        import torch
        h = self.normal
        ends = self._entry("recv_gbl_rank_prefix_sum").to(torch.int64)
        rows = torch.arange(h.num_recv_rows, device=ends.device, dtype=torch.int64)
        src = torch.searchsorted(ends, rows, right=True)
        real = rows < ends[-1]
        meta = torch.stack([src, h.recv_src_idx.to(torch.int64)], dim=1)
        return torch.where(real.unsqueeze(1), meta, torch.full_like(meta, -1)).to(torch.int32)

    def _make_send_rdma_head(self) -> "torch.Tensor":
        import torch
        mask = self._node_mask()
        pos = mask.to(torch.int64).cumsum(0) - 1
        return torch.where(mask, pos, torch.full_like(pos, -1)).to(torch.int32)

    def _make_send_nvl_head(self) -> "torch.Tensor":
        return self.forward.send_nvl_head


def unwrap(handle: Any) -> Any:
    """The NormalHandle behind a handle the shim returned (pyep's buffer checks what is left)."""
    return handle.normal if isinstance(handle, InternodeHandle) else handle
