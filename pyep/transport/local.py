"""Self transport: the kernels store into this rank's own buffer."""
from __future__ import annotations

from typing import Dict, Sequence

from .base import PeerLink, RankInfo, Transport


class LocalTransport(Transport):
    kind = "local"

    def __init__(self, rank: int, buffer_addr: int) -> None:
        self.rank = rank
        self.buffer_addr = buffer_addr

    def connect(self, peers: Sequence[int], infos: Sequence[RankInfo]) -> Dict[int, PeerLink]:
        if list(peers) not in ([], [self.rank]):
            raise ValueError(f"the local transport only reaches rank {self.rank} itself, got {list(peers)}")
        return {r: PeerLink(rank=r, kind="local", detail="device stores", store_base=self.buffer_addr)
                for r in peers}

    def disconnect(self, peers: Sequence[int]) -> None:
        return None

    def close(self) -> None:
        return None
