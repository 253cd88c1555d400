"""The normal-mode communication handle: DeepEP's six tensors (it unpacks like DeepEP's tuple) plus the
bookkeeping that lets a buffer refuse a handle that is not its own or no longer valid."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False)
class NormalHandle:
    rank_prefix_matrix: "torch.Tensor"          # int32 [R, R]
    channel_prefix_matrix: "torch.Tensor"       # int32 [R, C]
    recv_channel_prefix_matrix: "torch.Tensor"  # int32 [R, C]
    recv_src_idx: "torch.Tensor"                # int32 [num_recv_rows]
    is_token_in_rank: "torch.Tensor"            # bool [N, R]
    send_head: "torch.Tensor"                   # int32 [N, R]
    owner: str                                  # the buffer that made it
    epoch: int                                  # the buffer's epoch then (clean() starts a new one)
    num_channels: int
    num_tokens: int                             # N
    num_recv_tokens: int                        # real received rows, -1 if not known on the host
    num_worst_tokens: int                       # 0, or the row count of the outputs
    hidden: int
    num_topk: int                               # K of the dispatch, 0 without topk_idx
    ranks_per_node: int = 0                     # P of the buffer's nodes (0: one node of all ranks)
    internode: Any = None                       # the native internode path's state (internode_order.StagedState)
    tag: Any = None                             # the backend's mark of the dispatch (contract.DispatchResult.tag)
    num_dropped_tokens: Any = None              # int32 [R]: the dispatch's tokens routed to inactive rank r
    # The C++ fast path's plans of this handle (NormalBuffer._remember_fast): (kind, id(config)) -> (config, plan)
    fast_plans: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_nodes(self) -> int:
        r_n = int(self.rank_prefix_matrix.shape[0])
        return r_n // self.ranks_per_node if self.ranks_per_node else 1

    @property
    def num_recv_rows(self) -> int:
        """Rows of the received tensors (num_worst_tokens when set, else the real count)."""
        return int(self.recv_src_idx.shape[0])

    # DeepEP code unpacks the handle: (rank_prefix_matrix, channel_prefix_matrix,
    # recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head) = handle
    def _tuple(self) -> tuple:
        return (self.rank_prefix_matrix, self.channel_prefix_matrix, self.recv_channel_prefix_matrix,
                self.recv_src_idx, self.is_token_in_rank, self.send_head)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._tuple())

    def __getitem__(self, i: int) -> Any:
        return self._tuple()[i]

    def __len__(self) -> int:
        return 6
