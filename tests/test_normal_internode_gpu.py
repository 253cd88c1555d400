"""GPU tests of the normal mode's RDMA stage across nodes (pyep.ep.normal.internode_relay, kernels in
engine/kernels/normal_internode_relay.cu), marked `gpu`: ranks are DistPool workers (gloo for setup),
their relay buffers on GPU rank % device_count (one GPU is enough: 4 ranks share it as 2 virtual nodes
x 2 ranks), their QPs on the softnic. Every rank regenerates every rank's rows from the seed, so each
checks what it received byte for byte without further communication.

Cases: 2 nodes x 2 ranks and 2 nodes x 1 rank; random, skewed (one node gets everything), empty and
all-to-one counts; a ring of 8 slots and chunks of 3 rows (every ring wraps, chunks split at the
wrap); 1,000 rounds with a stable hash; a bad rkey (RelayError naming the peer and the QP, with the
syndrome) and a dropped peer (PeerTimeout naming it) within the timeout. PYEP_RELAY_TRANSPORT=ibgda
runs the same tests on the host's ConnectX NICs instead of the softnic.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Dict, List

import pytest
from multiproc import usable_gpus

pytestmark = pytest.mark.gpu
NGPU = usable_gpus("relay")
requires_gpus = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU and the CUDA build of pyep._engine")
ROW = 272          # bytes per row: a multiple of 16, not a power of two
TIMEOUT_US = 3_000_000


def _counts(routing: str, seed: int, src: int, num_nodes: int, p: int) -> List[int]:
    """Rows rank `src` sends to each node (its own node: 0)."""
    import torch
    g = torch.Generator().manual_seed(seed * 131 + src)
    c = torch.randint(0, 60, (num_nodes,), generator=g).tolist()
    if routing == "skewed":
        c = [200 if m == 0 else 0 for m in range(num_nodes)]
    elif routing == "empty":
        c = [0] * num_nodes
    elif routing == "all_to_one":
        c = [150 if (src == 0 and m == num_nodes - 1) else 0 for m in range(num_nodes)]
    c[src // p] = 0
    return c


def _rows(seed: int, src: int, node: int, n: int) -> "Any":
    import torch
    g = torch.Generator().manual_seed(seed * 1_000_003 + src * 101 + node)
    return torch.randint(0, 256, (n, ROW), generator=g, dtype=torch.uint8)


def _relay(p: int) -> Any:
    import os

    import torch.distributed as dist
    from ep_native_cases import setup_device
    from pyep.ep.normal.internode_relay import Relay
    from pyep.ep.normal.topology import NodeLayout
    setup_device()
    nodes = NodeLayout(dist.get_world_size(), p)
    return Relay(dist.group.WORLD, nodes, ring_bytes=8 * ROW, transport=os.environ.get("PYEP_RELAY_TRANSPORT", "emulated"), timeout_us=TIMEOUT_US), nodes


def relay_rounds(p: int, routings: List[str], rounds: int, fixed_seed: bool) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    me = dist.get_rank()
    relay, nodes = _relay(p)
    m_n, local = nodes.num_nodes, nodes.local(me)
    digests = set()
    moved = 0
    for i in range(rounds):
        routing = routings[i % len(routings)]
        seed = 7 if fixed_seed else i
        send = _counts(routing, seed, me, m_n, p)
        src = torch.cat([_rows(seed, me, m, send[m]) for m in range(m_n)]).cuda()
        got = relay.counts(i + 1, torch.tensor(send, dtype=torch.int32).cuda())
        want = [_counts(routing, seed, m * p + local, m_n, p)[nodes.node(me)] for m in range(m_n)]
        assert got == want, (i, routing, got, want)
        out = relay.relay(4, src, send, got, ring_tokens=8, chunk_tokens=3)
        torch.cuda.synchronize()
        relay.check_errors()
        expect = torch.cat([_rows(seed, m * p + local, nodes.node(me), want[m]) for m in range(m_n)])
        assert torch.equal(out.cpu(), expect), (i, routing)
        moved += int(out.shape[0])
        digests.add(hashlib.sha256(out.cpu().numpy().tobytes()).hexdigest())
    relay.destroy()
    return {"moved": moved, "digests": len(digests)}


def relay_fault(kind: str) -> Dict[str, Any]:
    """kind "bad_rkey": rank 0 posts with a wrong rkey for its column peer -> RelayError naming it;
    the peer times out waiting (PeerTimeout naming rank 0). kind "dropped": the last rank never calls;
    its column peer reports PeerTimeout naming it."""
    import torch
    import torch.distributed as dist
    from pyep.ep.normal.errors import NormalModeError, PeerTimeout
    from pyep.ep.normal.internode_relay import RelayError
    me, r_n = dist.get_rank(), dist.get_world_size()
    relay, nodes = _relay(1)
    peer = 1 - me
    if kind == "bad_rkey" and me == 0:
        relay._tables["rkeys"][1] ^= 0x5A5A   # the count record's write hits a key the peer never issued
    if kind == "dropped" and me == r_n - 1:
        time.sleep(3 * TIMEOUT_US / 1e6)
        relay.destroy()
        return {"error": "dropped"}
    start = time.monotonic()
    with pytest.raises(NormalModeError) as info:
        relay.counts(1, torch.tensor([0, 4] if me == 0 else [4, 0], dtype=torch.int32).cuda())
        relay.check_errors()
    took = time.monotonic() - start
    assert took < 2 * TIMEOUT_US / 1e6 + 10, took
    err = info.value
    if kind == "bad_rkey" and me == 0:
        assert isinstance(err, RelayError) and err.peer == peer and err.qpn != 0, err
    else:
        assert isinstance(err, PeerTimeout) and err.peer == peer, err
    relay.destroy()
    return {"error": type(err).__name__}


@requires_gpus
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,p", [(4, 2), (2, 1)])
def test_relay_routings(pools, world, p):
    res = pools[world].run(relay_rounds, p, ["random", "skewed", "empty", "all_to_one"], 16, False, timeout_s=280)
    assert sum(r["moved"] for r in res) > 0


@requires_gpus
@pytest.mark.timeout(600)
def test_relay_thousand_rounds_hash_stable(pools):
    res = pools[4].run(relay_rounds, 2, ["random"], 1000, True, timeout_s=580)
    assert all(r["digests"] == 1 for r in res)


@requires_gpus
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["bad_rkey", "dropped"])
def test_relay_fault_gives_typed_error(kind):
    from multiproc import DistPool
    with DistPool(2, start_timeout_s=180.0, pg_timeout_s=300.0) as pool:
        res = pool.run(relay_fault, kind, timeout_s=100)
    assert {r["error"] for r in res} <= {"RelayError", "PeerTimeout", "dropped"}
