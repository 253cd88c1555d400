"""GPU tests of the native normal mode across (virtual) nodes (pyep/ep/normal/native_internode.py), marked
`gpu`: DistPool workers over gloo, their buffers on GPU rank % device_count (one GPU is enough: the
ranks share it), the column relay on the softnic (transport "emulated-internode"), every output
compared with the reference backend on the same nodes bit for bit (tests/normal_internode_gpu_cases.py).

Layouts: 2 nodes x 2 ranks and 2 nodes x 1 rank; the correctness cases also at 4 nodes x 1, 2 nodes x 4,
4 nodes x 2 and 2 nodes x 8 (ranks per node 1, 2, 4, 8; up to 16 ranks sharing one GPU). Cases: random, hot expert, masked (-1), empty (N = 0
on a rank), all on one rank; BF16 and FP8; cached dispatch; expert_alignment 128; num_worst_tokens
(no host wait); async_finish + previous_event; small NVLink and RDMA rings (every ring wraps); a
combine with a bias pair. Then 1,000 rounds with a stable hash, a dropped peer / a bad rkey ->
PeerTimeout / RelayError naming the peer within the timeout, and CUDA graphs: dispatch + combine with
num_worst_tokens captured once and replayed with new inputs (bit-equal to the reference at every
replay), a cached dispatch + combine captured with a handle, NotCapturable for what a capture cannot
hold, an error recorded during a replay raised at the next call.
"""
from __future__ import annotations


import pytest
from multiproc import usable_gpus

pytestmark = pytest.mark.gpu
NGPU = usable_gpus("relay")   # the internode kernels live in pyep._engine.relay
requires_gpus = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU and the CUDA build of pyep._engine")
SHAPE = (67, 256, 16, 4)      # N (odd), H, E, K
TIMEOUT_US = 3_000_000


@requires_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,p", [(4, 2), (2, 1)])
def test_internode_native_matches_reference(pools, world, p):
    from normal_internode_gpu_cases import correctness
    res = pools[world].run(correctness, SHAPE, p, timeout_s=580)
    assert all(r == res[0] for r in res) and res[0] > 10


@requires_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,p", [(4, 1), (8, 4), (8, 2), (16, 8)])
def test_internode_native_ranks_per_node(world, p):
    """The issue's "ranks per node: any (1, 2, 4, 8)": the node notify over P ranks carrying M records,
    the relay over M column peers, the row map over P forwarders. Own pool: 16 ranks on one GPU are not
    kept for the rest of the module."""
    from multiproc import DistPool
    from normal_internode_gpu_cases import correctness
    with DistPool(world, start_timeout_s=300.0, pg_timeout_s=500.0) as pool:
        res = pool.run(correctness, SHAPE, p, timeout_s=560)
    assert all(r == res[0] for r in res) and res[0] > 10


@requires_gpus
@pytest.mark.timeout(600)
def test_internode_native_thousand_rounds_hash_stable(pools):
    from normal_internode_gpu_cases import stability
    res = pools[4].run(stability, SHAPE, 2, 1000, timeout_s=580)
    assert res == [1000] * 4


@requires_gpus
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["dropped", "bad_rkey"])
def test_internode_native_fault_gives_typed_error(kind):
    from multiproc import DistPool
    from normal_internode_gpu_cases import fault
    with DistPool(2, start_timeout_s=180.0, pg_timeout_s=300.0) as pool:
        res = pool.run(fault, SHAPE, kind, TIMEOUT_US, timeout_s=160)
    assert {r["error"] for r in res} <= {"RelayError", "PeerTimeout", "dropped"}, res
    assert any(r["error"] != "dropped" for r in res), res


@requires_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,p", [(4, 2), (2, 1)])
def test_internode_native_cuda_graph(pools, world, p):
    """normal_internode_gpu_cases.graph_case: 50 replays of the captured dispatch + combine, 10 of the
    captured cached dispatch + combine, 4 more of the first graph after them, one after a bad id."""
    from normal_internode_gpu_cases import graph_case
    replays = 50
    res = pools[world].run(graph_case, SHAPE, p, replays, timeout_s=580)
    assert res == [replays + max(2, replays // 5) + 4 + 1] * world, res
