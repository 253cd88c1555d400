"""DeepEP's per-source receive-wait statistics (`dispatch_wait_recv_cost_stats`,
`combine_wait_recv_cost_stats`) through pyep.compat.deep_ep and EpBuffer: the caller's int64
[num_ranks] tensors accumulate, per source rank, the nanoseconds each receive waited for it. One rank
that enters every call late must stand out on the other ranks as the largest wait, by about its
delay; the tensors only grow; the receive hook adds them too; shapes and dtypes are refused on the
host before anything is sent. Reference backend on gloo here (2 ranks); tests/test_compat_gpu.py runs
the same check on the native kernels. The kernels' own semantics are in tests/test_ll_sim.py."""
from __future__ import annotations

import time
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from pyep.compat import deep_ep

T, H, E, K = 16, 256, 8, 2
LATE_S = 0.25


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu")


def check_late_rank_stands_out(backend: str = "reference") -> Dict[str, Any]:
    """Rank 0 sleeps LATE_S before each dispatch and each combine (after a barrier); every rank passes
    both statistics, with and without the receive hook. Returns the final tensors (as lists)."""
    from ep_native_cases import rank_device
    rank, r_n = dist.get_rank(), dist.get_world_size()
    dev = rank_device(backend)
    buf = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True, num_qps_per_rank=E // r_n, backend=backend,
                         explicitly_destroy=True)
    buf.clean_low_latency_buffer(T, H, E)   # makes the buffer now (collective: it would absorb the delay)
    gen = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(dev)
    w = torch.rand(T, K, generator=gen).to(dev)
    dstats = torch.zeros(r_n, dtype=torch.int64, device=dev)
    cstats = torch.zeros(r_n, dtype=torch.int64, device=dev)
    history: List[List[List[int]]] = []
    for hook in (False, True):
        dist.barrier()
        if rank == 0:
            time.sleep(LATE_S)
        recv, _, handle, _, recv_hook = buf.low_latency_dispatch(x, idx, T, E, dispatch_wait_recv_cost_stats=dstats,
                                                                 use_fp8=False, return_recv_hook=hook)
        if recv_hook is not None:
            recv_hook()
        dist.barrier()
        if rank == 0:
            time.sleep(LATE_S)
        _, _, recv_hook = buf.low_latency_combine(recv, idx, w, handle, combine_wait_recv_cost_stats=cstats,
                                                  return_recv_hook=hook)
        if recv_hook is not None:
            recv_hook()
        history.append([_cpu(dstats).tolist(), _cpu(cstats).tolist()])
    assert dstats.dtype == torch.int64 and dstats.device == dev and cstats.shape == (r_n,)
    late_ns = int(LATE_S * 1e9)
    for i, (d, c) in enumerate(history):
        for kind, got in (("dispatch", d), ("combine", c)):
            assert min(got) >= 0, f"rank {rank} call {i} {kind}: {got}"
            if rank != 0:
                # Rank 0 came LATE_S late to each of the i + 1 calls so far.
                assert got[0] >= int(0.7 * late_ns) * (i + 1), f"rank {rank} call {i} {kind}: {got}"
                assert got[0] > 2 * max(got[1:]), f"rank {rank} call {i} {kind}: rank 0 must dominate {got}"
    for kind in (0, 1):   # cumulative: the second pair of calls only added
        assert all(b >= a for a, b in zip(history[0][kind], history[1][kind])), history
    buf.destroy()
    return {"dispatch": history[-1][0], "combine": history[-1][1]}


def check_refusals(backend: str = "reference") -> Dict[str, Any]:
    """Wrong dtype / shape / device / layout: TypeError or ValueError naming the argument, before any
    communication (every rank refuses the same call); the buffer stays usable and the refused calls
    add nothing."""
    from ep_native_cases import rank_device
    from pyep.ep.ll import EpBuffer
    r_n = dist.get_world_size()
    dev = rank_device(backend)
    ep = EpBuffer(backend=backend, num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E)
    x = torch.randn(4, H).to(torch.bfloat16).to(dev)
    idx = torch.tensor([[0, 5], [1, -1], [7, 2], [3, 4]], dtype=torch.int64, device=dev)
    w = torch.rand(4, K).to(dev)
    good = torch.zeros(r_n, dtype=torch.int64, device=dev)
    bad = [(torch.zeros(r_n, dtype=torch.int32, device=dev), TypeError, "int64"),
           (torch.zeros(r_n, dtype=torch.float64, device=dev), TypeError, "int64"),
           (torch.zeros(r_n + 1, dtype=torch.int64, device=dev), ValueError, "shape"),
           (torch.zeros(1, r_n, dtype=torch.int64, device=dev), ValueError, "shape"),
           (torch.zeros(2 * r_n, dtype=torch.int64, device=dev)[::2], ValueError, "contiguous"),
           ([0] * r_n, TypeError, "torch.Tensor")]
    if dev.type == "cuda":
        bad.append((torch.zeros(r_n, dtype=torch.int64), ValueError, "must be on"))
    for stats, err, word in bad:
        with pytest.raises(err, match=f"dispatch_wait_recv_cost_stats.*{word}"):
            ep.dispatch(x, idx, use_fp8=False, dispatch_wait_recv_cost_stats=stats)
    for stats, err, word in bad:
        # A refused combine stands for its handle's combine on every rank: each refusal gets a fresh one.
        recv, _, handle, _, _ = ep.dispatch(x, idx, use_fp8=False, dispatch_wait_recv_cost_stats=good)
        with pytest.raises(err, match=f"combine_wait_recv_cost_stats.*{word}"):
            ep.combine(recv, idx, w, handle, combine_wait_recv_cost_stats=stats)
    recv, _, handle, _, _ = ep.dispatch(x, idx, use_fp8=False, dispatch_wait_recv_cost_stats=good)
    out, _, _ = ep.combine(recv, idx, w, handle, combine_wait_recv_cost_stats=good)
    assert out.shape == (4, H) and min(_cpu(good).tolist()) >= 0
    ep.destroy()
    return {"calls": 2}


def test_late_rank_stands_out(pool2: Any) -> None:
    res = pool2.run(check_late_rank_stands_out, timeout_s=120)
    late_ns = int(LATE_S * 1e9)
    assert res[1]["dispatch"][0] >= 2 * int(0.7 * late_ns) and res[1]["combine"][0] >= 2 * int(0.7 * late_ns)
    assert res[0]["dispatch"][0] == 0 and res[0]["combine"][0] == 0   # the reference does not wait for itself


def test_refused_on_the_host(pool2: Any) -> None:
    assert [r["calls"] for r in pool2.run(check_refusals, timeout_s=120)] == [2, 2]


def test_reference_over_nccl_says_why() -> None:
    """The reference backend over a collective-only group (NCCL) cannot see per-source arrivals: it
    refuses the statistics with a sentence naming the alternatives (checked without NCCL: the rule is
    the group's backend name)."""
    from pyep.ep.ll.contract import DispatchOptions
    from pyep.ep.ll.reference import ReferenceBackend
    ref = ReferenceBackend.__new__(ReferenceBackend)
    ref._p2p_counts, ref._backend_name, ref._mail = False, "nccl", None
    with pytest.raises(NotImplementedError, match="dispatch_wait_recv_cost_stats.*nccl.*native backend.*gloo"):
        ref._check_wait_stats(torch.zeros(2, dtype=torch.int64), "dispatch_wait_recv_cost_stats")
    ref._backend_name, ref._mail = "store", object()     # a store-based buffer (pyep/ep/elastic/mailbox.py)
    with pytest.raises(NotImplementedError, match="combine_wait_recv_cost_stats.*store-based.*native backend"):
        ref._check_wait_stats(torch.zeros(2, dtype=torch.int64), "combine_wait_recv_cost_stats")
    ref._check_wait_stats(None, "dispatch_wait_recv_cost_stats")   # not asked: nothing to refuse
    assert "dispatch_wait_recv_cost_stats" in DispatchOptions.__dataclass_fields__
