"""Which ranks of a normal-mode group share a node. The internode mode (docs/normal_internode.md) needs
equal, contiguous nodes: node n holds ranks [n*P, (n+1)*P) for P ranks per node, as DeepEP assumes
(rank = node * P + local index), so that a token's forwarder on node m -- the rank with the sender's
local index -- is m*P + (rank % P).

Nodes come from, in this order: the ranks_per_node argument, $PYEP_VIRTUAL_NODE_SIZE (virtual nodes on
one box; the launcher sets it from ep.gpus_per_virtual_node), the host names of the ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass(frozen=True)
class NodeLayout:
    num_ranks: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.num_ranks % self.ranks_per_node:
            raise ValueError(f"{self.ranks_per_node} ranks per node do not divide the {self.num_ranks} ranks")

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    @property
    def internode(self) -> bool:
        return self.num_nodes > 1

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def ranks(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def forwarder(self, rank: int, node: int) -> int:
        """The rank of `node` that relays `rank`'s tokens there: the one with the same local index."""
        return node * self.ranks_per_node + self.local(rank)


def layout_from_nodes(nodes: List[int]) -> NodeLayout:
    """NodeLayout from every rank's node index; refuses uneven or interleaved nodes, naming a rank."""
    r_n = len(nodes)
    count = len(set(nodes))
    if r_n % count or any(nodes.count(n) != r_n // count for n in set(nodes)):
        raise ValueError(f"the {r_n} ranks sit on {count} nodes of unequal size; the normal mode needs the "
                         f"same number of ranks on every node")
    per = r_n // count
    for r, n in enumerate(nodes):
        if n != r // per:
            raise ValueError(f"rank {r} is on node {n} but the normal mode needs node-contiguous ranks "
                             f"(node k holds ranks {per}*k .. {per}*k+{per - 1}); order the ranks by node")
    return NodeLayout(r_n, per)


def detect_node_layout(group: "dist.ProcessGroup", ranks_per_node: Optional[int], timeout_us: int) -> NodeLayout:
    """Collective unless ranks_per_node or $PYEP_VIRTUAL_NODE_SIZE decides (then local): every rank
    gets the same answer."""
    import os

    import torch.distributed as dist

    from ...transport.base import VIRTUAL_NODE_ENV, node_ids
    r_n = dist.get_world_size(group)
    if ranks_per_node is not None:
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        if r_n % ranks_per_node:
            raise ValueError(f"ranks_per_node={ranks_per_node} does not divide the {r_n} ranks")
        return NodeLayout(r_n, ranks_per_node)
    if os.environ.get(VIRTUAL_NODE_ENV):
        return layout_from_nodes(node_ids(["?"] * r_n, None))
    return layout_from_nodes(node_ids(_gather_host_ids(group, timeout_us), None))


def _gather_host_ids(group: "dist.ProcessGroup", timeout_us: int) -> List[str]:
    """Every rank's host, as the first 8 bytes of the SHA-256 of its name (one bounded all-gather of
    int64; tensors on the group's device, never the default device)."""
    import hashlib
    import socket

    import torch
    import torch.distributed as dist

    from .._dist import group_device
    from .._dist import all_gather_bounded as all_gather
    dev = group_device(group)
    digest = hashlib.sha256(socket.gethostname().encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64, device=dev)
    outs = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(dist.get_world_size(group))]
    all_gather(outs, mine, group, timeout_us, "NormalBuffer node detection (host names)")
    return [str(int(o.item())) for o in outs]
