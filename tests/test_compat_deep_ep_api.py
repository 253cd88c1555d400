"""pyep.compat.deep_ep as DeepEP V1's own tests/test_low_latency.py, SGLang's DeepEP dispatcher and
vLLM's DeepEP all2all managers call it (reference backend, gloo, 2 ranks; the per-rank checks take
backend="native" too, run on GPUs by tests/test_compat_gpu.py), under the default dtype
DeepEP's test utilities set (bfloat16): constructor in DeepEP's positional order, the static API,
the low-latency round trip with DeepEP's numerical checks, shrink mode, destroy semantics, the
`import deep_ep` alias, and the clear errors for what pyep does not do."""
from __future__ import annotations

import gc
import importlib
import logging
import random
import sys
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist

import pyep.compat
from pyep.compat import deep_ep
from pyep.compat._shapes import qps_per_peer
from pyep.ep.ll import EpBuffer

NUM_TOKENS, HIDDEN, NUM_TOPK, NUM_EXPERTS = 12, 256, 4, 16


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    n, groups = x_fp8.size(0), x_fp8.size(1) // 128
    if x_scales.dtype == torch.int:   # UE8M0: four exponent bytes per int32 (padded past `groups`)
        exps = x_scales.reshape(-1).contiguous().view(torch.uint8).to(torch.int32) << 23
        x_scales = exps.view(torch.float).view(n, -1)[:, :groups]
    x = x_fp8.float().view(n, groups, 128)
    return (x * x_scales.reshape(n, groups, 1)).view(x_fp8.shape).to(torch.bfloat16)


def _inputs(rank: int, num_ranks: int):
    torch.manual_seed(rank)
    random.seed(rank)
    offset = 128   # as DeepEP's test: values below 256 stay exact in BF16
    x = torch.ones((NUM_TOKENS, HIDDEN), dtype=torch.bfloat16) * (rank - offset)
    x[:, -128:] = torch.arange(NUM_TOKENS).to(torch.bfloat16).view(-1, 1)
    scores = torch.randn((NUM_TOKENS, NUM_EXPERTS), dtype=torch.float32).abs() + 1
    topk_idx = torch.topk(scores, NUM_TOPK, dim=-1, largest=True, sorted=True)[1].to(deep_ep.topk_idx_t)
    topk_weights = torch.randn((NUM_TOKENS, NUM_TOPK), dtype=torch.float32).abs()
    for _ in range(5):
        topk_idx[random.randint(0, NUM_TOKENS - 1), random.randint(0, NUM_TOPK - 1)] = -1
    parts = [torch.empty_like(topk_idx) for _ in range(num_ranks)]
    dist.all_gather(parts, topk_idx)     # gloo has no all_gather_into_tensor of this shape
    return x, topk_idx, topk_weights, torch.stack(parts), offset


def _cpu(t: Any) -> Any:
    if isinstance(t, tuple):
        return tuple(_cpu(v) for v in t)
    return t.detach().cpu() if isinstance(t, torch.Tensor) else t


def _check_dispatch(rank: int, num_ranks: int, recv: Any, count: torch.Tensor, handle: Any,
                    stats: torch.Tensor, all_topk_idx: torch.Tensor, mask: torch.Tensor, use_fp8: bool,
                    round_scale: bool, offset: int) -> int:
    """DeepEP test_low_latency.py's per-expert checks, on the CPU (only the first count rows of an
    expert are defined); returns the tokens received."""
    recv, count, stats = _cpu(recv), _cpu(count), _cpu(stats)
    src_infos, layouts = _cpu(handle[0]), _cpu(handle[1])
    e_l = NUM_EXPERTS // num_ranks
    if mask[rank]:      # the masked rank itself: "dead" in DeepEP's test; here nothing reaches it
        assert int(count.sum()) == 0 and int(stats.sum()) == 0
        return 0
    got = 0
    for i in range(e_l):
        expert_id = rank * e_l + i
        recv_x = per_token_cast_back(recv[0][i], recv[1][i]) if use_fp8 else recv[i]
        n, src_info, layout = int(count[i]), src_infos[i], layouts[i]
        assert int(stats[i]) == n
        assert n == int((layout & (2 ** 32 - 1)).sum())
        assert n == int((all_topk_idx == expert_id).sum(dim=[1, 2])[mask == 0].sum())
        got += n
        if n == 0:
            continue
        recv_x, src_info = recv_x[:n], src_info[:n]
        amin = recv_x[:, :-128].amin(dim=-1)
        assert torch.equal(amin, recv_x[:, :-128].amax(dim=-1))
        if round_scale:
            assert calc_diff(recv_x[:, -1], src_info.view(-1)) < 0.007
        else:
            assert int((recv_x[:, -128:] - src_info.view(-1, 1) % NUM_TOKENS).sum()) == 0
        for j in range(num_ranks):
            if mask[j]:
                continue
            begin, cnt = int(layout[j] >> 32), int(layout[j] & (2 ** 32 - 1))
            if not round_scale:
                assert int((amin == j - offset).sum()) == int((all_topk_idx[j] == expert_id).sum())
                assert int((recv_x[begin:begin + cnt, :-128] - j + offset).sum()) == 0
    return got


# test_low_latency.py calls with async_finish = not return_recv_hook; pyep also checks the plain call
# (neither), which on the native backend takes the C++ fast path.
CALL_MODES = (("async", False, True), ("hook", True, False), ("plain", False, False))


def check_low_latency_flow(shrink: bool, backend: str = "reference") -> Dict[str, Any]:
    """test_low_latency.py's loop on `backend` (inputs on its device, checks on the CPU). With shrink,
    rank 1 is masked by the caller, standing in for DeepEP's rank that failed and was masked by a
    timeout: the reference backend's collectives need every rank, so there rank 1 keeps calling and
    receives nothing; on the native backend rank 1 is dead as in DeepEP's test: after the collective
    setup it makes no low-latency call (a masked rank that kept calling would wait for peers that no
    longer send to it), only the collective clean_low_latency_buffer."""
    from ep_native_cases import rank_device
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = rank_device(backend)
    torch.set_default_dtype(torch.bfloat16)   # DeepEP's init_dist does this (and set_default_device)
    try:
        group = dist.group.WORLD
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(NUM_TOKENS, HIDDEN, num_ranks, NUM_EXPERTS)
        buffer = deep_ep.Buffer(group, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                                num_qps_per_rank=NUM_EXPERTS // num_ranks, allow_nvlink_for_low_latency_mode=True,
                                explicitly_destroy=True, allow_mnnvl=False, enable_shrink=shrink,
                                backend=backend)
        x, topk_idx, topk_weights, all_topk_idx, offset = _inputs(rank, num_ranks)
        x_d, idx_d, w_d = x.to(dev), topk_idx.to(dev), topk_weights.to(dev)
        mask_status = torch.zeros((num_ranks,), dtype=torch.int, device=dev)
        if shrink:
            buffer.low_latency_update_mask_buffer(1, True)   # before any buffer exists: kept pending
        buffer.clean_low_latency_buffer(NUM_TOKENS, HIDDEN, NUM_EXPERTS)   # creates the buffer (collective)
        dead = shrink and backend == "native" and rank == 1
        expected = torch.tensor([0, 1] if shrink else [0, 0], dtype=torch.int32)
        received, runs = 0, 0
        for _, return_recv_hook, async_finish in CALL_MODES:
            for use_fp8 in (False, True):
                for round_scale in (False, True) if use_fp8 else (False,):
                    for use_ue8m0 in (False, True) if round_scale else (False,):
                        if not dead:
                            received += _round_trip(buffer, rank, num_ranks, dev, x_d, idx_d, w_d, x, topk_idx,
                                                    topk_weights, all_topk_idx, offset, expected, mask_status,
                                                    shrink, return_recv_hook, async_finish, use_fp8, round_scale,
                                                    use_ue8m0)
                        if shrink:
                            buffer.clean_low_latency_buffer(NUM_TOKENS, HIDDEN, NUM_EXPERTS)
                            buffer.low_latency_query_mask_buffer(mask_status)
                            assert torch.equal(_cpu(mask_status), expected)   # clean keeps the mask
                        runs += 1
        if shrink:
            buffer.low_latency_clean_mask_buffer()
            buffer.low_latency_query_mask_buffer(mask_status)
            assert int(mask_status.sum()) == 0
            buffer.low_latency_update_mask_buffer(0, True)      # live tensor path (pending on a dead rank)
            buffer.low_latency_query_mask_buffer(mask_status)
            assert mask_status.tolist() == [1, 0]
            buffer.low_latency_update_mask_buffer(0)            # mask=False by default: unmask
            buffer.low_latency_query_mask_buffer(mask_status)
            assert mask_status.tolist() == [0, 0]
            with pytest.raises(ValueError, match="rank_to_mask"):
                buffer.low_latency_update_mask_buffer(num_ranks, True)
            with pytest.raises(ValueError, match="int32"):
                buffer.low_latency_query_mask_buffer(torch.zeros(num_ranks, dtype=torch.int64, device=dev))
        else:
            for api, args in (("low_latency_update_mask_buffer", (1, True)),
                              ("low_latency_query_mask_buffer", (mask_status,)),
                              ("low_latency_clean_mask_buffer", ())):
                with pytest.raises(RuntimeError, match="enable_shrink=True"):
                    getattr(buffer, api)(*args)
        buffer.destroy()
        return {"received": received, "runs": runs, "default": str(torch.get_default_dtype())}
    finally:
        torch.set_default_dtype(torch.float32)


def _round_trip(buffer: Any, rank: int, num_ranks: int, dev: torch.device, x_d: torch.Tensor, idx_d: torch.Tensor,
                w_d: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                all_topk_idx: torch.Tensor, offset: int, expected: torch.Tensor, mask_status: torch.Tensor,
                shrink: bool, return_recv_hook: bool, async_finish: bool, use_fp8: bool, round_scale: bool,
                use_ue8m0: bool) -> int:
    """One dispatch and two combines (copied input, zero-copy) of test_low_latency.py's loop."""
    def wait(event: Any, hook: Any) -> None:
        if return_recv_hook:
            hook()
        elif async_finish:
            event.current_stream_wait()

    stats = torch.zeros((NUM_EXPERTS // num_ranks,), dtype=torch.int, device=dev)
    recv, count, handle, event, hook = buffer.low_latency_dispatch(
        x_d, idx_d, NUM_TOKENS, NUM_EXPERTS, use_fp8=use_fp8, round_scale=round_scale,
        use_ue8m0=use_ue8m0, cumulative_local_expert_recv_stats=stats,
        async_finish=async_finish, return_recv_hook=return_recv_hook)
    wait(event, hook)
    assert (hook is not None) == return_recv_hook and isinstance(event, deep_ep.EventOverlap)
    if shrink:
        buffer.low_latency_query_mask_buffer(mask_status)
        assert torch.equal(_cpu(mask_status), expected)
    recv = (recv[0], recv[1].contiguous()) if use_fp8 else recv
    got = _check_dispatch(rank, num_ranks, recv, count, handle, stats, all_topk_idx, expected, use_fp8,
                          round_scale, offset)
    sim = per_token_cast_back(recv[0].view(-1, HIDDEN), recv[1].view(-1, HIDDEN // 128)).view(
        recv[0].shape) if use_fp8 else recv.clone()
    for zero_copy in (False, True):
        if zero_copy:
            buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = sim
        out = torch.empty((NUM_TOKENS, HIDDEN), dtype=torch.bfloat16, device=dev)
        combined, event, hook = buffer.low_latency_combine(
            sim, idx_d, w_d, handle, use_logfmt=False, async_finish=async_finish, zero_copy=zero_copy,
            return_recv_hook=return_recv_hook, out=out)
        wait(event, hook)
        assert combined.data_ptr() == out.data_ptr()
        combined = _cpu(combined)
        idx = topk_idx.clone()
        if shrink:   # entries owned by a masked rank are dropped, as DeepEP's check does
            owner = torch.where(idx >= 0, idx // (NUM_EXPERTS // num_ranks), 0)
            idx[(idx >= 0) & (expected[owner] == 1)] = -1
        want = x * topk_weights.masked_fill(idx == -1, 0).sum(dim=1).view(-1, 1)
        diff = calc_diff(want, combined)
        assert not torch.isnan(combined).any()
        if not round_scale and not expected[rank]:
            assert diff < (9e-4 if use_fp8 else 1e-5), (diff, use_fp8, zero_copy)
    return got


def check_constructor_and_errors(backend: str = "reference") -> Dict[str, Any]:
    from ep_native_cases import rank_device
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = rank_device(backend)
    group = dist.group.WORLD
    # Every DeepEP argument, positionally in DeepEP's order; DeepEP's tests pass num_qps_per_rank=E // R.
    buf = deep_ep.Buffer(group, 0, 0, True, 144, True, True, True, False, False, None, backend=backend)
    assert (buf.rank, buf.group_size, buf.group) == (rank, num_ranks, group)
    assert (buf.num_nvl_bytes, buf.num_rdma_bytes, buf.low_latency_mode) == (0, 0, True)
    assert (buf.explicitly_destroy, buf.enable_shrink) == (False, False)
    assert buf.get_comm_stream() is None                 # no normal-mode buffer yet (and no streams on CPU)
    x = torch.randn(4, HIDDEN).to(torch.bfloat16).to(dev)
    idx = torch.tensor([[0, 5], [9, -1], [15, 2], [3, 12]], dtype=torch.int64, device=dev)
    recv, count, handle, event, hook = buf.low_latency_dispatch(x, idx, NUM_TOKENS, NUM_EXPERTS, use_fp8=False)
    ep = buf.ep_buffer(NUM_TOKENS, HIDDEN, NUM_EXPERTS)
    assert ep.config.num_qps_per_peer == NUM_EXPERTS // num_ranks and ep.backend_name == backend
    src_info, layout_range, t, h, e = handle             # DeepEP's 5-tuple
    assert (t, h, e) == (NUM_TOKENS, HIDDEN, NUM_EXPERTS) and src_info.dtype == torch.int32
    # DeepEP's per-source wait statistics: int64 [num_ranks], checked on the host before anything is sent.
    for bad, err in ((torch.zeros(num_ranks, dtype=torch.int32, device=dev), TypeError),
                     (torch.zeros(num_ranks + 1, dtype=torch.int64, device=dev), ValueError),
                     (torch.zeros(num_ranks, 1, dtype=torch.int64, device=dev), ValueError),
                     (torch.zeros(2 * num_ranks, dtype=torch.int64, device=dev)[::2], ValueError)):
        with pytest.raises(err, match="dispatch_wait_recv_cost_stats"):
            buf.low_latency_dispatch(x, idx, NUM_TOKENS, NUM_EXPERTS, dispatch_wait_recv_cost_stats=bad)
    # A refused dispatch keeps its call number (its peers got its abort marker): a fresh handle.
    recv, count, handle, event, hook = buf.low_latency_dispatch(x, idx, NUM_TOKENS, NUM_EXPERTS, use_fp8=False)
    w = torch.rand(4, 2).to(dev)
    with pytest.raises(TypeError, match="combine_wait_recv_cost_stats.*int64"):   # tests/test_compat_wait_stats.py
        buf.low_latency_combine(recv, idx, w, handle,
                                combine_wait_recv_cost_stats=torch.zeros(num_ranks, dtype=torch.float32, device=dev))
    # A refused combine stands for its handle's combine: the next refusal is tried on a fresh handle.
    recv, count, handle, event, hook = buf.low_latency_dispatch(x, idx, NUM_TOKENS, NUM_EXPERTS, use_fp8=False)
    with pytest.raises(ValueError, match="use_logfmt=True needs hidden to be a multiple of 512"):
        buf.low_latency_combine(recv, idx, w, handle, use_logfmt=True)   # LogFMT needs H % 512
    if backend == "reference":
        with pytest.raises(NotImplementedError, match="registered"):
            buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True)   # vLLM's clean_buffers call
    else:
        check_local_buffer_tensor(buf, ep.backend.raw_buffer(), True, dev)
    # A refused combine stood for the handle's combine on every rank (its abort marker is in the peers'
    # flags): combining the handle again is refused before anything is sent; a new dispatch combines.
    from pyep.ep.ll.errors import CombineAfterRefusal
    with pytest.raises(CombineAfterRefusal, match="dispatch again"):
        buf.low_latency_combine(recv, idx, w, handle)
    recv, count, handle, event, hook = buf.low_latency_dispatch(x, idx, NUM_TOKENS, NUM_EXPERTS, use_fp8=False)
    out, _, _ = buf.low_latency_combine(recv, idx, w, handle)
    assert out.shape == (4, HIDDEN)
    want = x.float() * w.masked_fill(idx < 0, 0).sum(1, keepdim=True)   # recv passed back unchanged
    assert torch.allclose(_cpu(out).float(), _cpu(want), rtol=1e-2, atol=1e-2)
    buf.update_ep_member()
    with pytest.raises(ValueError, match="stale"):
        buf.get_next_low_latency_combine_buffer(handle)
    del buf                                               # explicitly_destroy=False: freed by the finaliser
    gc.collect()
    assert "destroyed" in repr(ep)
    kept = deep_ep.Buffer(group, explicitly_destroy=True, backend=backend)
    ep2 = kept.ep_buffer(NUM_TOKENS, HIDDEN, NUM_EXPERTS)
    kept.destroy()
    assert "destroyed" in repr(ep2)
    with pytest.raises(RuntimeError, match="after destroy"):
        kept.low_latency_dispatch(x, idx, NUM_TOKENS, NUM_EXPERTS)
    with pytest.raises(RuntimeError, match="after destroy"):
        kept.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True)
    with pytest.raises(NotImplementedError, match="mpi4py"):
        deep_ep.Buffer(None, comm=object(), backend=backend)
    return {"received": int(count.sum())}


def check_local_buffer_tensor(buf: Any, raw: Any, use_rdma_buffer: bool, dev: torch.device) -> None:
    """get_local_buffer_tensor on a native backend: views of the registered memory (raw_buffer()'s
    address and size), offset in bytes, dtype and size as DeepEP's C++ applies them; readable."""
    ptr, nbytes = raw
    whole = buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=use_rdma_buffer)   # vLLM's clean_buffers call
    assert whole.device == dev and whole.dtype == torch.int8, (whole.device, whole.dtype)
    assert whole.numel() == nbytes and whole.data_ptr() == ptr
    part = buf.get_local_buffer_tensor(torch.bfloat16, torch.Size([4, 8]), 256, use_rdma_buffer)
    assert part.shape == (4, 8) and part.data_ptr() == ptr + 256
    words = buf.get_local_buffer_tensor(torch.int32, offset=64, use_rdma_buffer=use_rdma_buffer)
    assert words.numel() == (nbytes - 64) // 4 and words.data_ptr() == ptr + 64
    assert _cpu(words[:16]).shape == (16,)      # readable (peers may write it now: no value to compare)
    with pytest.raises(ValueError, match="offset"):
        buf.get_local_buffer_tensor(torch.int8, offset=nbytes + 1, use_rdma_buffer=use_rdma_buffer)
    with pytest.raises(ValueError, match="needs"):
        buf.get_local_buffer_tensor(torch.int8, torch.Size([nbytes + 1]), use_rdma_buffer=use_rdma_buffer)


def check_vllm_and_sglang_calls(backend: str = "reference") -> Dict[str, Any]:
    """vLLM's DeepEPLLAll2AllManager / DeepEPHTAll2AllManager and SGLang's DeepEPBuffer, by keyword."""
    from ep_native_cases import rank_device
    num_ranks = dist.get_world_size()
    dev = rank_device(backend)
    group = dist.new_group(list(range(num_ranks)), backend="gloo")   # vLLM passes its CPU group
    e_l = NUM_EXPERTS // num_ranks
    ll = deep_ep.Buffer(group=group, num_nvl_bytes=1024 * 1024 * 1024,
                        num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
                            num_max_dispatch_tokens_per_rank=NUM_TOKENS, hidden=HIDDEN, num_ranks=num_ranks,
                            num_experts=NUM_EXPERTS),
                        low_latency_mode=True, num_qps_per_rank=e_l, allow_nvlink_for_low_latency_mode=True,
                        allow_mnnvl=False, explicitly_destroy=True, enable_shrink=True, backend=backend)
    mask = torch.zeros(num_ranks, dtype=torch.int32, device=dev)
    ll.low_latency_query_mask_buffer(mask)                   # vLLM's query_active_mask
    assert not bool((mask != torch.zeros_like(mask)).any())  # vLLM's query_fault
    ll.low_latency_clean_mask_buffer()
    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    hidden_states = torch.randn(5, HIDDEN, generator=gen).to(torch.bfloat16)
    topk_ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:NUM_TOPK] for _ in range(5)]).to(torch.int64)
    topk_weights = torch.rand(5, NUM_TOPK, generator=gen)
    expected_m = (hidden_states.shape[0] * ll.group_size * topk_ids.shape[1] + NUM_EXPERTS) // NUM_EXPERTS
    hs_d, ids_d, tw_d = hidden_states.to(dev), topk_ids.to(dev), topk_weights.to(dev)
    results: List[torch.Tensor] = []
    for return_recv_hook in (False, True):                   # SGLang's LL dispatcher, both variants
        recv, masked_m, handle, event, hook = ll.low_latency_dispatch(
            hs_d, ids_d, NUM_TOKENS, NUM_EXPERTS, use_fp8=True, async_finish=not return_recv_hook,
            return_recv_hook=return_recv_hook, round_scale=False, use_ue8m0=False)
        hook() if return_recv_hook else event.current_stream_wait()
        hidden, scale = recv
        y = per_token_cast_back(hidden.view(-1, HIDDEN), scale.contiguous().view(-1, HIDDEN // 128)).view(hidden.shape)
        combined, event, hook = ll.low_latency_combine(x=y, topk_idx=ids_d, topk_weights=tw_d, handle=handle,
                                                       async_finish=not return_recv_hook,
                                                       return_recv_hook=return_recv_hook)
        hook() if return_recv_hook else event.current_stream_wait()
        results.append(_cpu(combined))
    assert torch.equal(results[0], results[1]) and expected_m >= 1
    want = hidden_states.float() * topk_weights.sum(1, keepdim=True)
    assert calc_diff(want, results[0]) < 9e-4
    ll.clean_low_latency_buffer(NUM_TOKENS, HIDDEN, NUM_EXPERTS)   # SGLang: normal -> low-latency switch
    ll.destroy()
    ht = deep_ep.Buffer(group=group, num_nvl_bytes=1024 * 1024 * 1024, num_rdma_bytes=0, low_latency_mode=False,
                        num_qps_per_rank=1, explicitly_destroy=True, backend=backend)
    old = deep_ep.Buffer.num_sms
    deep_ep.Buffer.set_num_sms(20)                           # vLLM's set_num_sms
    try:
        assert deep_ep.Buffer.get_dispatch_config(num_ranks).num_sms == 20
        ntpr, ntprr, ntpe, in_rank, _ = ht.get_dispatch_layout(ids_d, NUM_EXPERTS)
        assert ntprr is None and ht.normal_buffer().backend_name == backend
        assert torch.equal(_cpu(in_rank).sum(0).to(ntpr.dtype), _cpu(ntpr))
        if backend == "reference":
            with pytest.raises(NotImplementedError, match="registered"):
                ht.get_local_buffer_tensor(torch.int8)       # the NVLink buffer
        else:
            check_local_buffer_tensor(ht, ht.normal_buffer().backend.raw_buffer(), False, dev)
    finally:
        deep_ep.Buffer.set_num_sms(old)
        ht.destroy()
    return {"tokens": int(masked_m.sum())}


def test_low_latency_flow(pool2: Any) -> None:
    res = pool2.run(check_low_latency_flow, False, timeout_s=120)
    assert all(r["runs"] == 12 and r["default"] == "torch.bfloat16" for r in res)
    assert sum(r["received"] for r in res) > 0


def test_shrink_mode(pool2: Any) -> None:
    res = pool2.run(check_low_latency_flow, True, timeout_s=120)
    assert res[1]["received"] == 0 and res[0]["received"] > 0     # rank 1 masked: nothing to or from it


def test_constructor_and_clear_errors(pool2: Any) -> None:
    res = pool2.run(check_constructor_and_errors)
    assert sum(r["received"] for r in res) == 2 * 7       # 7 valid entries per rank, all delivered


def test_serving_framework_calls(pool2: Any) -> None:
    res = pool2.run(check_vllm_and_sglang_calls)
    assert sum(r["tokens"] for r in res) == 2 * 5 * NUM_TOPK


def test_static_api_and_qps_mapping() -> None:
    assert deep_ep.Buffer.is_sm90_compiled() is True
    assert deep_ep.topk_idx_t is torch.int64
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) == EpBuffer.size_hint(128, 7168, 256, 8)
    assert isinstance(deep_ep.Buffer.capture(), deep_ep.EventOverlap)
    assert qps_per_peer(144, 8) == 8 and qps_per_peer(24, 144) == 24 and qps_per_peer(1000, 1000) == 64
    assert qps_per_peer(1, 8) == 1 and qps_per_peer(0, 8) is None
    ev = deep_ep.EventOverlap()                           # DeepEP's signature: event=None, extra_tensors=None
    with ev:
        pass
    with pytest.raises(RuntimeError, match="no event"):
        ev.current_stream_wait()


@pytest.fixture
def clean_modules() -> Iterator[None]:
    saved = {k: v for k, v in sys.modules.items() if k == "deep_ep" or k.startswith("deep_ep.")}
    yield
    for k in [k for k in sys.modules if k == "deep_ep" or k.startswith("deep_ep.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_import_alias(clean_modules: None, tmp_path: Any, monkeypatch: Any, caplog: Any) -> None:
    assert pyep.compat.install_deep_ep_alias() == ["deep_ep", "deep_ep.buffer", "deep_ep.utils"]
    import deep_ep as alias  # type: ignore[import-not-found]
    from deep_ep import Buffer, Config, EventOverlap, topk_idx_t  # type: ignore[import-not-found]
    assert alias is deep_ep and Buffer is deep_ep.Buffer and topk_idx_t is torch.int64
    assert Config is deep_ep.Config and EventOverlap is deep_ep.EventOverlap
    assert importlib.util.find_spec("deep_ep") is not None      # vLLM's has_deep_ep() check
    pyep.compat.install_deep_ep_alias()                          # idempotent
    # A real DeepEP on the path is never shadowed silently.
    for k in ("deep_ep", "deep_ep.buffer", "deep_ep.utils"):
        del sys.modules[k]
    (tmp_path / "deep_ep").mkdir()
    (tmp_path / "deep_ep" / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    with pytest.raises(pyep.compat.AliasConflict, match="real 'deep_ep'"):
        pyep.compat.install_deep_ep_alias()
    assert "deep_ep" not in sys.modules
    with caplog.at_level(logging.WARNING, logger="pyep.compat"):
        pyep.compat.install_deep_ep_alias(force=True)
    assert "shadowing" in caplog.text and sys.modules["deep_ep"] is deep_ep


def check_defaults_independence(backend: str = "reference") -> Dict[str, Any]:
    """DeepEP's test utilities set the default dtype to bfloat16 and the default device to "cuda".
    Native backend: exactly that. Reference backend (CPU): "meta" stands in for that device, so any
    allocation inside pyep that relies on the default device lands on meta and fails the call. The
    inputs name their device, as DeepEP code does."""
    from ep_native_cases import rank_device
    dev = rank_device(backend)
    torch.set_default_device("meta" if backend == "reference" else "cuda")
    torch.set_default_dtype(torch.bfloat16)
    try:
        buf = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True, num_qps_per_rank=8, enable_shrink=True,
                             explicitly_destroy=True, backend=backend)
        x = torch.ones(4, HIDDEN, dtype=torch.bfloat16, device=dev)
        idx = torch.tensor([[0, 5], [9, -1], [15, 2], [3, 12]], dtype=torch.int64, device=dev)
        w = torch.rand(4, 2, dtype=torch.float32, device=dev)
        (q, s), count, handle, _, _ = buf.low_latency_dispatch(x, idx, NUM_TOKENS, NUM_EXPERTS, round_scale=True,
                                                               use_ue8m0=True)
        buf.get_next_low_latency_combine_buffer(handle).copy_(q.to(torch.bfloat16))
        out, _, _ = buf.low_latency_combine(q.to(torch.bfloat16), idx, w, handle, zero_copy=True)
        mask = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=dev)
        buf.low_latency_query_mask_buffer(mask)
        ntpr, _, ntpe, tir, _ = buf.get_dispatch_layout(idx, NUM_EXPERTS)
        rx, ri, rw, _, nh, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir,
                                            num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
        cx, cw, _ = buf.combine(rx, nh, topk_weights=rw)
        buf.destroy()
        devices = {t.device.type for t in (q, s, count, handle.src_info, out, mask, ntpr, tir, rx, ri, cx, cw)}
        equal = bool(torch.equal(cx, x * tir.sum(1, keepdim=True).to(torch.bfloat16)))
        return {"devices": sorted(devices), "want": [dev.type], "equal": equal}
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)


def test_no_dependence_on_default_device_or_dtype(pool2: Any) -> None:
    res = pool2.run(check_defaults_independence)
    assert all(r["devices"] == r["want"] == ["cpu"] for r in res)
    assert all(r["equal"] for r in res)   # normal combine sums a token once per rank it reached


# Files whose tensor factories must name device and dtype. The one exception builds host tables in
# NativeBackend._build_static (native_setup.py) and moves them with .to(device) (under a default
# device of "cuda" they are simply born there).
_AUDITED = ("pyep/ep/**/*.py", "pyep/compat/*.py")
_FACTORIES = {"empty", "zeros", "ones", "arange", "tensor", "full", "rand", "randn", "randint", "linspace",
              "empty_strided", "as_tensor", "randperm", "eye"}
_ALLOWED = {("pyep/ep/ll/native_setup.py", "_build_static")}


def test_tensor_factories_name_device_and_dtype() -> None:
    import ast
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent
    missing: List[str] = []
    for pattern in _AUDITED:
        for path in sorted(root.glob(pattern)):
            rel = str(path.relative_to(root))
            tree = ast.parse(path.read_text())
            for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
                for node in ast.walk(fn):
                    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                            and node.func.attr in _FACTORIES and isinstance(node.func.value, ast.Name)
                            and node.func.value.id == "torch"):
                        continue
                    kw = {k.arg for k in node.keywords}
                    if not {"device", "dtype"} <= kw and (rel, fn.name) not in _ALLOWED:
                        missing.append(f"{rel}:{node.lineno} torch.{node.func.attr} in {fn.name}() lacks "
                                       f"{sorted({'device', 'dtype'} - kw)}")
    assert not missing, "\n".join(sorted(set(missing)))
