"""The normal (high-throughput) mode's contract: what `NormalBuffer` (the front) asks of a backend
(reference over torch.distributed, or the native NVLink kernels), and the exact result every backend
produces. docs/normal_mode.md explains the protocol of the native kernels.

Notation: R ranks, E experts (E % R == 0), E_l = E / R, N tokens on this rank (may be 0), H hidden
(multiple of 128), K top-k (1..16), C channels (Config.num_channels()). The tokens of a rank are cut
into C contiguous channel ranges: channel c covers [min(c*P, N), min((c+1)*P, N)) with P = ceil(N/C).

Nodes (topology.py): M nodes of P ranks each, node n = ranks [n*P, (n+1)*P); M = 1 is the intranode
mode. With M > 1 the native kernels route a token over RDMA once per remote node and over NVLink
inside it (docs/normal_internode.md); the results below differ from M = 1 only in the combine sum.

Layout (``get_dispatch_layout``) for topk_idx int64 [N, K] with entries in [-1, E):
    num_tokens_per_rank int32 [R]: tokens with at least one expert of rank r (experts [r*E_l, (r+1)*E_l))
    num_tokens_per_rdma_rank int32 [M]: tokens with at least one expert on a rank of node n; None if M = 1
    num_tokens_per_expert int32 [E]: (t, k) entries naming expert e
    is_token_in_rank bool [N, R]
    An entry outside [-1, E) counts as -1 and is reported as InvalidExpertIndex (see errors below).

Dispatch (not cached: ``handle`` is None), x is bf16 [N, H] or (e4m3 [N, H], fp32 scales [N, H/128]):
    Received rows are ordered by (source rank ascending, source token index ascending). Row j that
    came from token t of source s holds
      recv_x[j] = x_s[t] (bit for bit; FP8 rows and their scales are passed through, never requantised)
      recv_topk_idx[j, k] = topk_idx_s[t, k] - rank*E_l if that expert is local, else -1 (int64)
      recv_topk_weights[j, k] = topk_weights_s[t, k] if that expert is local, else 0.0 (fp32)
      recv_src_idx[j] = t (int32)
    num_recv_tokens_per_expert_list[e] = round_up(sum_s num_tokens_per_expert_s[rank*E_l + e],
    expert_alignment), a Python list of E_l ints.
    num_worst_tokens > 0: outputs have num_worst_tokens rows and the host never waits: rows past the
    real count have recv_topk_idx -1, recv_topk_weights 0, recv_src_idx -1 and unspecified recv_x
    (the reference zeroes them); num_recv_tokens_per_expert_list is [] (as DeepEP). More than
    num_worst_tokens arriving is an error (WorstTokensExceeded), the extra rows are dropped.
    topk_idx / topk_weights may be None (then recv_topk_* are None).

Handle (``NormalHandle``, unpacks like DeepEP's 6-tuple):
    rank_prefix_matrix int32 [R, R]: [i][j] = sum_{k <= i} num_tokens_per_rank_k[j]
    channel_prefix_matrix int32 [R, C]: [d][c] = tokens of this rank for d in channels 0..c (inclusive)
    recv_channel_prefix_matrix int32 [R, C]: [s][c] = first row of source s, channel c among the rows
        received from source s (exclusive prefix over channels; add rank_prefix_matrix[s-1][rank] for
        the row in the received tensors, as DeepEP's handle does)
    recv_src_idx int32 [num_recv_rows]
    is_token_in_rank bool [N, R]
    send_head int32 [N, R]: position of token t in the (channel(t), this rank -> d) stream, counted
        from 0 in each call, -1 where is_token_in_rank[t, d] is False
    plus bookkeeping (owner, epoch, num_channels, num_recv_tokens, num_worst_tokens, hidden, N).

Cached dispatch (``handle`` given; topk_idx / topk_weights / counts must be None): x (same N) goes
the same way as when the handle was made, with no count exchange; returns
(recv_x, None, None, None, None, event) like DeepEP.

Combine (x bf16 [num_recv_rows, H] in received-row order; topk_weights fp32 [num_recv_rows, K] or
None; bias None, one bf16 [N, H] tensor or a pair):
  M = 1 (intranode):
    combined_x[t] = bf16(acc) with acc, in fp32 and in this order: 0, + bias_0[t], + bias_1[t],
        then + x_d[row of t at d] for every d with is_token_in_rank[t, d], d ascending.
    combined_topk_weights[t, k] = 0 + w_d[row, k] for d ascending (fp32), None without topk_weights.
  M > 1 (internode; the sum is reduced per node on the way back, see combine_order below):
    part_n[t] = bf16(0 + x_d[row of t at d] for every d of node n with is_token_in_rank[t, d], d
        ascending, in fp32) for every node n that holds one of t's ranks;
    combined_x[t] = bf16(acc), acc in fp32: 0, + bias_0[t], + bias_1[t], then + part_n[t] for those n
        ascending. A node with a single rank for t gives part_n = x_d exactly, so when every node holds
        at most one of t's ranks the result equals the M = 1 formula.
    wpart_n[t, k] = 0 + w_d[row, k] for d of node n ascending (fp32, not rounded);
    combined_topk_weights[t, k] = 0 + wpart_n[t, k] for those n ascending.
    Rows of x past the real received count (num_worst_tokens) are ignored.

Errors (pyep.ep.normal.errors): argument problems raise TypeError / ValueError before anything is
sent. Problems found in tensor values on the device (expert ids out of range, more rows than
num_worst_tokens) and peers that did not answer within the timeout are recorded by the kernels and
raised as NormalModeError subclasses at the next call of the buffer or when the call's event is
waited on; the buffer stays usable after a value error. A timed-out peer leaves the channels in an
unknown state: the buffer then refuses calls until ``clean()``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, NamedTuple, Optional, Protocol, Tuple, runtime_checkable

if TYPE_CHECKING:
    import torch

    from .config import Config
    from .handle import NormalHandle
    from .topology import NodeLayout


@dataclass
class LayoutResult:
    num_tokens_per_rank: "torch.Tensor"       # int32 [R]
    num_tokens_per_expert: "torch.Tensor"     # int32 [E]
    is_token_in_rank: "torch.Tensor"          # bool [N, R]
    num_tokens_per_rdma_rank: Optional["torch.Tensor"] = None   # int32 [M], None on one node
    num_dropped_tokens: Optional["torch.Tensor"] = None   # int32 [R]: tokens routed to inactive ranks


def combine_order(num_ranks: int, ranks_per_node: int) -> List[List[int]]:
    """The groups of ranks whose rows combine sums into one BF16 partial, in the order the partials are
    added (after the bias): one group of all ranks, not rounded separately, when the group is one node
    (the intranode formula); else one group per node. Backends and tests read the order from here."""
    if ranks_per_node >= num_ranks:
        return [list(range(num_ranks))]
    return [list(range(n, n + ranks_per_node)) for n in range(0, num_ranks, ranks_per_node)]


# The call records are NamedTuples: immutable like a frozen dataclass, and built in about half the host
# time (a frozen dataclass sets each of its fields through object.__setattr__; this runs every call).
class DispatchCall(NamedTuple):
    x: "torch.Tensor"                         # bf16 or e4m3 [N, H], contiguous
    x_scales: Optional["torch.Tensor"]        # fp32 [N, H/128] with e4m3 x, else None
    topk_idx: Optional["torch.Tensor"]        # int64 [N, K] (None for cached dispatch)
    topk_weights: Optional["torch.Tensor"]    # fp32 [N, K] or None
    num_tokens_per_rank: Optional["torch.Tensor"]   # int32 [R] (None for cached dispatch)
    num_tokens_per_rdma_rank: Optional["torch.Tensor"]   # int32 [M] (None on one node / cached)
    is_token_in_rank: "torch.Tensor"          # bool [N, R]
    num_tokens_per_expert: Optional["torch.Tensor"]  # int32 [E] (None for cached dispatch)
    num_experts: int                          # E (0 for cached dispatch)
    expert_alignment: int                     # >= 1
    num_worst_tokens: int                     # >= 0
    config: "Config"
    handle: Optional["NormalHandle"]          # cached dispatch when given (already validated)
    timeout_us: int
    seq: int                                  # call number of this buffer, from 1
    caller_stream: int = 0                    # the caller's cudaStream_t (0: unknown or CPU): one-copy
                                              # outputs are used there too (direct_pool.py)


@dataclass
class DispatchResult:
    recv_x: "torch.Tensor"
    recv_x_scales: Optional["torch.Tensor"]
    recv_topk_idx: Optional["torch.Tensor"]
    recv_topk_weights: Optional["torch.Tensor"]
    num_recv_tokens_per_expert_list: Optional[List[int]]   # None for cached dispatch
    rank_prefix_matrix: "torch.Tensor"
    channel_prefix_matrix: "torch.Tensor"
    recv_channel_prefix_matrix: "torch.Tensor"
    recv_src_idx: "torch.Tensor"
    send_head: "torch.Tensor"
    num_recv_tokens: int                      # real received rows; -1 when unknown on the host
                                              # (num_worst_tokens > 0 without a host wait)
    internode: Any = None                     # backend state a cached dispatch / combine needs (native
                                              # internode: internode_order.StagedState), kept in the handle
    tag: Any = None                           # the backend's mark of this dispatch (tags.py: a cached
                                              # dispatch / combine names it so that every rank uses
                                              # the handle of the same dispatch), kept in the handle
    is_token_in_rank: Any = None              # bool [N, R] the call used (the caller's, less inactive
                                              # ranks), kept in the handle; None: the caller's
    num_dropped_tokens: Any = None            # int32 [R]: tokens routed to rank r that the call did not
                                              # deliver (r inactive); None: the backend drops nothing


class CombineCall(NamedTuple):
    x: "torch.Tensor"                         # bf16 [num_recv_rows, H], contiguous
    topk_weights: Optional["torch.Tensor"]    # fp32 [num_recv_rows, K] or None
    bias: Tuple[Optional["torch.Tensor"], Optional["torch.Tensor"]]   # bf16 [N, H] each, or None
    handle: "NormalHandle"
    config: "Config"
    timeout_us: int
    seq: int


@dataclass
class CombineResult:
    combined_x: "torch.Tensor"                # bf16 [N, H]
    combined_topk_weights: Optional["torch.Tensor"]   # fp32 [N, K] or None
    num_dropped_tokens: Any = None            # int32 [R]: tokens sent to rank r whose rows did not come back


@runtime_checkable
class NormalBackend(Protocol):
    """Backends run on the stream the front hands them (the current stream when the call starts);
    the front does the stream/event bookkeeping (previous_event, async_finish,
    allocate_on_comm_stream). All ranks make the same calls in the same order."""
    name: str
    device: "torch.device"
    rank: int
    num_ranks: int
    nodes: "NodeLayout"

    def get_dispatch_layout(self, topk_idx: "torch.Tensor", num_experts: int) -> LayoutResult: ...

    def dispatch(self, call: DispatchCall) -> DispatchResult: ...

    def combine(self, call: CombineCall) -> CombineResult: ...

    def check_errors(self) -> None:
        """Raise the NormalModeError the device recorded since the last check (no device sync)."""

    def pending_error(self) -> Optional[Exception]:
        """The error the device recorded for an earlier call, taken (cleared) without raising; raises
        instead when the buffer is broken (BufferBroken, PeerTimeout, NormalCallMismatch): a broken
        buffer takes part in no exchange."""

    def check_call(self, call: Any) -> None:
        """Backend limits a call must meet (ValueError), checked before anything is launched."""

    def fit_config(self, config: Any) -> Any:
        """`config`, changed only as far as this backend's buffer needs to run it (fewer ring rows, then
        fewer SMs); ValueError when nothing fits."""

    def refuse(self, kind: int, reason: str) -> Optional[Exception]:
        """Take part in this call's exchange with a REFUSED tag (tags.py) so that every peer raises
        PeerRefusedCall for it; returns the NormalCallMismatch that exchange found, if any (the buffer
        is then broken), for the caller to report beside its own error."""

    def clean(self) -> None:
        """Collective: reset every channel and counter; earlier handles go stale."""

    def buffer_bytes(self) -> int:
        """Bytes of communication buffer this backend holds per rank (0 for the reference)."""

    def destroy(self) -> None: ...
