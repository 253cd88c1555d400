"""NVLink transport: each peer's buffer is mapped into this process with CUDA IPC, and the kernels
store into it directly (16-byte vector stores over NVLink; the same path works for two processes on
one GPU)."""
from __future__ import annotations

import logging
from typing import Any, Dict, Sequence

from .base import PeerLink, RankInfo, Transport

log = logging.getLogger("pyep.transport.nvlink")


class NvlinkTransport(Transport):
    kind = "nvlink"

    def __init__(self, ep: Any, rank: int) -> None:
        self._ep = ep                      # pyep._engine.ep
        self.rank = rank
        self._mapped: Dict[int, int] = {}  # peer rank -> mapped address

    def connect(self, peers: Sequence[int], infos: Sequence[RankInfo]) -> Dict[int, PeerLink]:
        links: Dict[int, PeerLink] = {}
        for r in peers:
            if r == self.rank:
                raise ValueError("the NVLink transport does not connect a rank to itself")
            info = infos[r]
            handle = info.handle_bytes()
            if not handle:
                raise RuntimeError(f"rank {r} published no CUDA IPC handle for its buffer")
            if r in self._mapped:
                raise RuntimeError(f"rank {r} is already mapped; disconnect it first")
            try:
                addr = int(self._ep.ipc_open_handle(handle))
            except RuntimeError as exc:
                raise RuntimeError(f"cannot map rank {r}'s buffer (GPU {info.pci_bus_id} on {info.host}) "
                                   f"with CUDA IPC: {exc}") from exc
            self._mapped[r] = addr
            links[r] = PeerLink(rank=r, kind="nvlink", detail=f"CUDA IPC, GPU {info.pci_bus_id}",
                                store_base=addr)
            log.debug("rank %d: mapped rank %d's buffer at %#x", self.rank, r, addr)
        return links

    def disconnect(self, peers: Sequence[int]) -> None:
        for r in peers:
            addr = self._mapped.pop(r, None)
            if addr is not None:
                self._ep.ipc_close_handle(addr)

    def close(self) -> None:
        self.disconnect(list(self._mapped))
