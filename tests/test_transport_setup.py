"""PeerSet (pyep.ep.peers) in real multi-process gloo groups, with the CUDA runtime calls of the
NVLink transport replaced by a recording fake: the description exchange, the agreed plan, the links the
kernels get (local store base = own buffer, NVLink store base = the mapped peer buffer), reconnect
(mappings closed and reopened) and the errors of impossible plans, identical on every rank."""
from __future__ import annotations

import pytest

BUF = 0x7F0000000000


class FakeEp:
    """The few pyep._engine.ep calls the transports make; a 'mapping' is the peer buffer + 0x1000."""

    def __init__(self) -> None:
        self.opened: list = []
        self.closed: list = []

    def ipc_get_handle(self, ptr: int) -> bytes:
        return ptr.to_bytes(8, "little") + bytes(56)

    def ipc_open_handle(self, handle: bytes) -> int:
        addr = int.from_bytes(handle[:8], "little") + 0x1000
        self.opened.append(addr)
        return addr

    def ipc_close_handle(self, ptr: int) -> None:
        self.closed.append(ptr)

    def device_pci_bus_id(self, dev: int) -> str:
        return f"0000:{0x18 + dev:02x}:00.0"

    def can_access_peer(self, dev: int, peer: int) -> bool:
        return True


def _peerset(transport: str, ranks_per_node=None):
    import torch
    import torch.distributed as dist
    from pyep.ep.ll.config import EpConfig
    from pyep.ep.peers import PeerSet
    torch.cuda.device_count = lambda: 8          # the fake GPUs the bus ids above belong to
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = EpConfig(num_max_dispatch_tokens_per_rank=4, hidden=256, num_experts=2 * world, transport=transport,
                   ranks_per_node=ranks_per_node)
    ep = FakeEp()
    ps = PeerSet(dist.group.WORLD, cfg, ep, rank, world, rank, BUF + (rank << 32), 1 << 20, 30.0)
    return ps, ep


def nvlink_mesh():
    import torch.distributed as dist
    ps, ep = _peerset("nvlink")
    rank, world = dist.get_rank(), dist.get_world_size()
    ps.connect()
    kinds = [link.kind for link in ps.links]
    bases = [link.store_base for link in ps.links]
    assert kinds == ["local" if r == rank else "nvlink" for r in range(world)], kinds
    assert bases == [BUF + (r << 32) + (0 if r == rank else 0x1000) for r in range(world)], bases
    assert all(link.flag_expect == 1 for link in ps.links)
    assert all(len(row) == world and row[i] == "local" for i, row in enumerate(ps.plan))
    ps.reconnect()
    assert sorted(ep.closed) == sorted(b for r, b in enumerate(bases) if r != rank)
    assert len(ep.opened) == 2 * (world - 1) and ps.generation == 1
    ps.close()
    return [i.pci_bus_id for i in ps.infos]


def impossible(transport: str, ranks_per_node):
    ps, _ = _peerset(transport, ranks_per_node)
    try:
        ps.connect()
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        ps.close()
    return "connected"


def test_nvlink_mesh_and_reconnect(pool4):
    res = pool4.run(nvlink_mesh)
    assert res[0] == ["0000:18:00.0", "0000:19:00.0", "0000:1a:00.0", "0000:1b:00.0"]
    assert all(r == res[0] for r in res)


@pytest.mark.parametrize("transport,rpn,what", [("nvlink", 2, "ValueError: transport='nvlink': rank"),
                                                ("auto", 2, "RuntimeError: ranks")])
def test_impossible_plans_fail_alike_on_every_rank(pool4, transport, rpn, what):
    res = pool4.run(impossible, transport, rpn)
    assert all(r.startswith(what) for r in res), res
    assert len(set(res)) == 1, res
