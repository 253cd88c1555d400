"""GPU tests of the native normal mode's active_ranks mask (issue 26; marked `gpu`): ranks on one GPU or
several (rank % device_count), each beside a reference NormalBuffer with the same mask, compared bit for
bit (tests/normal_gpu_elastic.py). A static mask, a mask changed in place between calls, and a rank that
goes silent inside a dispatch: marked by the survivors' kernels within the timeout, the call completing
among them, the later calls too. The same on the native internode path with one rank per virtual node
(the column relay on the softnic): the relay's count exchange and rings leave the masked rank out and
mark the silent one."""
from __future__ import annotations

import pytest
from multiproc import usable_gpus

pytestmark = pytest.mark.gpu

NGPU = usable_gpus("normal")
requires_gpus = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU and the CUDA build of pyep._engine")


@requires_gpus
@pytest.mark.timeout(240)
@pytest.mark.parametrize("masked", [3, 0])
def test_static_mask_matches_reference(pools, masked):
    from normal_gpu_elastic import static_mask
    res = pools[4].run(static_mask, (96, 1024, 32, 4), masked, timeout_s=220)
    assert sum(res[0]) > 0     # rank 0 routed tokens to the masked rank (or is it): counted dropped


@requires_gpus
@pytest.mark.timeout(240)
def test_silent_rank_is_marked_and_calls_complete_among_the_survivors(pools):
    from normal_gpu_elastic import silent_rank
    timeout_us = 500_000
    res = pools[4].run(silent_rank, (96, 1024, 32, 4), timeout_us, timeout_s=220)
    for r in res[:3]:
        assert r["mask"] == [1, 1, 1, 0], r
        assert r["took_s"] < 10 * timeout_us / 1e6 + 5, r       # bounded: about one timeout, not a hang


@requires_gpus
@pytest.mark.timeout(240)
@pytest.mark.parametrize("masked", [2])
def test_deepep_shim_mask_reaches_the_native_normal_mode(pools, masked):
    from normal_gpu_elastic import shim_mask
    res = pools[4].run(shim_mask, (96, 1024, 32, 4), masked, timeout_s=220)
    for seen in res:
        assert seen == [[1 if d == masked and i % 2 == 0 else 0 for d in range(4)] for i in range(4)], seen


INTERNODE = {"ranks_per_node": 1, "transport": "emulated-internode"}
# 2 virtual nodes of 2 ranks: a buffer given active_ranks= runs its data path rank to rank, its contract
# (num_tokens_per_rdma_rank, combine's BF16 partial per node) on the 2 x 2 nodes.
INTERNODE_2X2 = {"ranks_per_node": 2, "transport": "emulated-internode"}
LAYOUTS = {"4x1": INTERNODE, "2x2": INTERNODE_2X2}
requires_relay = pytest.mark.skipif(usable_gpus("relay") < 1, reason="needs a CUDA GPU and the CUDA build of pyep._engine")


@requires_relay
@pytest.mark.timeout(300)
@pytest.mark.parametrize("masked", [3, 0])
@pytest.mark.parametrize("layout", ["4x1", "2x2"])
def test_internode_static_mask_matches_reference(pools, masked, layout):
    """4 virtual nodes of one rank, 2 of two: the mask leaves a rank out of the layout, the relay's count
    exchange, its rings and the combine's partials, exactly as the reference on the same nodes."""
    from normal_gpu_elastic import static_mask
    res = pools[4].run(static_mask, (96, 1024, 32, 4), masked, LAYOUTS[layout], timeout_s=280)
    assert sum(res[0]) > 0


@requires_relay
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["4x1", "2x2"])
def test_internode_silent_rank_is_marked_by_the_relay(pools, layout):
    from normal_gpu_elastic import silent_rank
    timeout_us = 1_000_000
    res = pools[4].run(silent_rank, (96, 1024, 32, 4), timeout_us, LAYOUTS[layout], timeout_s=280)
    for r in res[:3]:
        assert r["mask"] == [1, 1, 1, 0], r
        assert r["took_s"] < 10 * timeout_us / 1e6 + 5, r


@requires_relay
@pytest.mark.timeout(300)
@pytest.mark.parametrize("masked", [1])
@pytest.mark.parametrize("layout", ["4x1", "2x2"])
def test_internode_take_back_after_a_mask(pools, masked, layout):
    """take_back_ranks on the internode path (one rank per node on the data path): without it the first
    call after the unmask finds the rank's count records several calls old (a call mismatch)."""
    from normal_gpu_elastic import take_back
    res = pools[4].run(take_back, (96, 1024, 32, 4), masked, LAYOUTS[layout], timeout_s=280)
    assert res == [8] * 4


@requires_relay
@pytest.mark.timeout(300)
def test_deepep_shim_mask_reaches_the_internode_kernels(pools):
    """The shim's one mask per Buffer on 2 virtual nodes of 2 ranks: its elastic normal buffer runs the
    internode kernels rank to rank; mask, clean, mask, unmask, each round against the reference."""
    from normal_gpu_elastic import shim_mask
    res = pools[4].run(shim_mask, (96, 1024, 32, 4), 2, 2, timeout_s=280)
    for seen in res:
        assert seen == [[1 if d == 2 and i % 2 == 0 else 0 for d in range(4)] for i in range(4)], seen
