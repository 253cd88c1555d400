"""GPU tests of the native normal mode's call gates (marked `gpu`; skipped without CUDA and the CUDA
build of pyep._engine): DistPool workers over gloo whose buffers share the GPUs there are (rank %
device_count; one GPU is enough), intranode and across virtual nodes (the relay on the softnic).
The drills are tests/normal_gpu_tags.py: a call refused on one rank's host while its peers make it
(PeerRefusedCall on every peer, at the call or its event wait, none waits out the timeout, later calls
bit for bit right; one refusal raised by the next call, which is made), an extra call on one rank and a
moved call counter (NormalCallMismatch on every rank, BufferBroken until clean(), then right again),
layout tensors that contradict topk_idx (LayoutMismatch on the rank that passed them)."""
from __future__ import annotations

import pytest
from multiproc import usable_gpus

pytestmark = pytest.mark.gpu
NGPU = usable_gpus("normal")
requires_gpus = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU and the CUDA build of pyep._engine")
SHAPE = (67, 256, 16, 4)      # N (odd), H, E, K
# (world, ranks per node): one node of 2 and of 4; 2 virtual nodes of 1 and of 2 (the relay between them).
LAYOUTS = [(2, None), (4, None), (2, 1), (4, 2)]
IDS = ["2ranks", "4ranks", "2x1nodes", "2x2nodes"]


@requires_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,p", LAYOUTS, ids=IDS)
def test_refused_call_raises_on_every_peer(pools, world, p):
    from normal_gpu_tags import refusals
    res = pools[world].run(refusals, SHAPE, p, timeout_s=560)
    assert all(set(r) == {"dispatch", "dispatch-worst", "cached", "combine"} for r in res), res


# One rank per node: the node gate has no peer, so the relay's count record carries the call's kind
# (normal_tags.h relay_count_record): a combine one rank makes alone is found against its peer's
# dispatch of the same call number.
EXTRA_CALL = [pytest.param(*lay, id=i) for lay, i in zip(LAYOUTS, IDS)]


@requires_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,p", EXTRA_CALL)
def test_extra_call_is_a_call_mismatch_until_clean(pools, world, p):
    from normal_gpu_tags import extra_call
    pools[world].run(extra_call, SHAPE, p, timeout_s=560)


@requires_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_moved_call_counter_is_found_not_timed_out(pools, world):
    from normal_gpu_tags import moved_counter
    pools[world].run(moved_counter, SHAPE, timeout_s=560)


@requires_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,p", LAYOUTS, ids=IDS)
def test_layout_values_that_contradict_topk_idx(pools, world, p):
    from normal_gpu_tags import layout_values
    res = pools[world].run(layout_values, SHAPE, p, timeout_s=560)
    want = ["num_tokens_per_expert", "is_token_in_rank", "num_tokens_per_rank"] + (["num_tokens_per_rdma_rank"] if p else [])
    assert res[-1] == want and all(r == [] for r in res[:-1]), res


@requires_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,p", LAYOUTS, ids=IDS)
def test_call_with_a_void_dispatchs_handle_is_void(pools, world, p):
    from normal_gpu_tags import void_handle
    res = pools[world].run(void_handle, SHAPE, p, timeout_s=560)
    assert res == ["void handle"] * (world - 1) + ["PeerRefusedCall"], res
