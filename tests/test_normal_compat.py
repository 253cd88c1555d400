"""pyep.compat.deep_ep.Buffer's normal mode, called the way DeepEP's tests/test_intranode.py and
SGLang's DeepEP normal dispatcher call it (reference backend, gloo, 2 ranks): layout against a hand
computation, dispatch with/without top-k, BF16/FP8 (column-major and TMA-padded scales), previous
events, async_finish + allocate_on_comm_stream, num_worst_tokens, cached dispatch, default configs
after set_num_sms, and combine; and that the shim's results equal NormalBuffer's."""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

from pyep.compat import deep_ep
from pyep.ep.normal import NormalBuffer, NormalHandle

NUM_TOKENS, HIDDEN, NUM_TOPK, NUM_EXPERTS = 24, 256, 4, 16


def per_token_cast_to_fp8(x: torch.Tensor):
    """Per-128-column groups: scale = amax / 448, data = x / scale in e4m3."""
    m, n = x.shape
    xv = x.float().view(m, n // 128, 128)
    amax = xv.abs().amax(dim=2).clamp(min=1e-4)
    data = (xv * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, n)
    return data, amax / 448.0


def per_token_cast_back(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (data.float().view(data.shape[0], -1, 128) * scales.unsqueeze(2)).view(data.shape).to(torch.bfloat16)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def check_deepep_intranode_flow() -> Dict[str, Any]:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    torch.manual_seed(rank)
    buffer = deep_ep.Buffer(group, int(2e9), 0, low_latency_mode=False, num_qps_per_rank=1,
                            explicitly_destroy=True, backend="reference")
    x = torch.ones((NUM_TOKENS, HIDDEN), dtype=torch.bfloat16) * rank
    x_pure_rand = torch.randn((NUM_TOKENS, HIDDEN), dtype=torch.bfloat16)
    x_e4m3 = per_token_cast_to_fp8(x)
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T)          # column-major scales, as DeepEP's test
    scores = torch.randn((NUM_TOKENS, NUM_EXPERTS), dtype=torch.float32).abs() + 1
    topk_idx = torch.topk(scores, NUM_TOPK, dim=-1, largest=True, sorted=False)[1].to(deep_ep.topk_idx_t)
    topk_idx[3, :] = -1                                       # a token that goes nowhere
    topk_weights = torch.ones((NUM_TOKENS, NUM_TOPK), dtype=torch.float32) * rank
    topk_weights_pure_rand = torch.randn((NUM_TOKENS, NUM_TOPK), dtype=torch.float32)
    rank_idx = torch.where(topk_idx >= 0, topk_idx // (NUM_EXPERTS // num_ranks), -1)

    num_tokens_per_expert = torch.tensor([int((topk_idx == i).sum()) for i in range(NUM_EXPERTS)], dtype=torch.int)
    gbl_num_tokens_per_expert = num_tokens_per_expert.clone()
    dist.all_reduce(gbl_num_tokens_per_expert, group=group)
    is_token_in_rank = torch.stack([(rank_idx == i).any(dim=1) for i in range(num_ranks)], dim=1)
    num_tokens_per_rank = is_token_in_rank.sum(dim=0).to(torch.int)
    gbl_num_tokens_per_rank = num_tokens_per_rank.clone()
    dist.all_reduce(gbl_num_tokens_per_rank, group=group)

    ref_ntpr, rdma, ref_ntpe, ref_tir, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    assert rdma is None
    assert torch.equal(ref_ntpr, num_tokens_per_rank) and torch.equal(ref_ntpe, num_tokens_per_expert)
    assert torch.equal(ref_tir, is_token_in_rank)

    config = deep_ep.Config(24, 8, 256)

    def check_data(check_x: torch.Tensor, rank_prefix_matrix: torch.Tensor) -> None:
        assert torch.equal(check_x.amin(dim=1), check_x.amax(dim=1))
        start = 0
        for i in range(num_ranks):
            end = int(rank_prefix_matrix[i][rank])
            assert int((check_x[start:end, :].int() - i).abs().sum()) == 0
            start = end

    runs = 0
    for previous_mode in (False, True):
        for async_mode in (False, True):
            for current_x in (x_pure_rand, x, x_e4m3):
                for with_topk in (False, True):
                    dispatch_args: Dict[str, Any] = {
                        "x": current_x, "num_tokens_per_rank": num_tokens_per_rank,
                        "is_token_in_rank": is_token_in_rank, "num_tokens_per_expert": num_tokens_per_expert,
                        "config": config, "async_finish": async_mode}
                    if with_topk:
                        dispatch_args.update({"topk_idx": topk_idx, "topk_weights": topk_weights_pure_rand
                                              if current_x is x_pure_rand else topk_weights})
                    if previous_mode:
                        dispatch_args.update({"previous_event": buffer.capture()})
                    recv_x, recv_topk_idx, recv_topk_weights, recv_list, handle, event = buffer.dispatch(**dispatch_args)
                    event.current_stream_wait() if async_mode else ()
                    assert isinstance(event, deep_ep.EventOverlap)
                    recv_x = per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x
                    rank_prefix_matrix = handle[0]
                    assert int(gbl_num_tokens_per_rank[rank]) == recv_x.size(0)
                    assert gbl_num_tokens_per_expert.view(num_ranks, -1)[rank].tolist() == recv_list
                    if current_x is not x_pure_rand:
                        check_data(recv_x, rank_prefix_matrix)
                    recv_topk_weights_clone = None
                    if with_topk:
                        assert bool((recv_topk_idx.eq(-1) | ((recv_topk_idx >= 0) & (
                            recv_topk_idx < NUM_EXPERTS // num_ranks))).all())
                        for i, count in enumerate(recv_list):
                            assert int(recv_topk_idx.eq(i).sum()) == count
                        recv_topk_weights_clone = recv_topk_weights.clone()
                        if current_x is not x_pure_rand:
                            # In place, as DeepEP's test: combine then sums `rank` once per rank.
                            w = recv_topk_weights
                            w[recv_topk_idx.eq(-1)] = w.amax(dim=1, keepdim=True).expand_as(w)[recv_topk_idx.eq(-1)]
                            check_data(w, rank_prefix_matrix)
                        num_worst_tokens = NUM_TOKENS * num_ranks
                        dispatch_args.update({"num_worst_tokens": num_worst_tokens})
                        worst_x, worst_idx, worst_w, empty_list, _, event = buffer.dispatch(**dispatch_args)
                        event.current_stream_wait() if async_mode else ()
                        worst_x = per_token_cast_back(*worst_x) if isinstance(worst_x, tuple) else worst_x
                        assert len(empty_list) == 0 and worst_x.size(0) == num_worst_tokens
                        assert worst_idx.size(0) == num_worst_tokens and worst_w.size(0) == num_worst_tokens
                        assert torch.equal(recv_x, worst_x[:recv_x.size(0)])
                        assert torch.equal(recv_topk_idx, worst_idx[:recv_x.size(0)])
                        assert torch.equal(recv_topk_weights_clone, worst_w[:recv_x.size(0)])
                        assert bool((worst_idx[recv_x.size(0):] == -1).all())
                    else:
                        cached_args: Dict[str, Any] = {"x": current_x, "handle": handle, "config": config,
                                                       "async_finish": async_mode}
                        if previous_mode:
                            cached_args.update({"previous_event": buffer.capture()})
                        cached_x, a, b, c, d, event = buffer.dispatch(**cached_args)
                        event.current_stream_wait() if async_mode else ()
                        assert (a, b, c, d) == (None, None, None, None)
                        cached_x = per_token_cast_back(*cached_x) if isinstance(cached_x, tuple) else cached_x
                        assert torch.equal(cached_x, recv_x)
                    combine_args: Dict[str, Any] = {"x": recv_x, "handle": handle, "config": config,
                                                    "async_finish": async_mode}
                    if with_topk:
                        combine_args.update({"topk_weights": recv_topk_weights})
                    if previous_mode:
                        combine_args.update({"previous_event": buffer.capture()})
                    combined_x, combined_topk_weights, event = buffer.combine(**combine_args)
                    event.current_stream_wait() if async_mode else ()
                    count = is_token_in_rank.sum(dim=1).unsqueeze(1)
                    sent = count.squeeze(1) > 0
                    ref_x = x_pure_rand if current_x is x_pure_rand else x
                    check_x = combined_x.float()[sent] / count[sent]
                    assert calc_diff(check_x, ref_x[sent]) < 5e-6
                    assert int(combined_x[~sent].abs().sum()) == 0
                    if with_topk:
                        ref_w = topk_weights_pure_rand if current_x is x_pure_rand else topk_weights
                        check_w = combined_topk_weights if current_x is x_pure_rand else \
                            combined_topk_weights / count.clamp(min=1)
                        assert calc_diff(check_w[sent], ref_w[sent]) < 1e-9
                    runs += 1

    # Tuning section: cached dispatch and combine with the default configs after set_num_sms.
    deep_ep.Buffer.set_num_sms(24)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=num_tokens_per_rank,
                                                 is_token_in_rank=is_token_in_rank,
                                                 num_tokens_per_expert=num_tokens_per_expert, config=config)
    buffer.dispatch(x=x_e4m3, handle=handle, config=deep_ep.Buffer.get_dispatch_config(num_ranks))
    out, _, _ = buffer.combine(x=recv_x, handle=handle, config=deep_ep.Buffer.get_combine_config(num_ranks))
    assert torch.equal(out, (x.float() * is_token_in_rank.sum(1, keepdim=True)).to(torch.bfloat16))
    # DeepEP's internode names run the same call (the buffer picks the protocol from its nodes).
    recv_i, _, _, _, _, _ = buffer.internode_dispatch(x, handle)
    assert torch.equal(recv_i, recv_x)
    out_i, _, _ = buffer.internode_combine(recv_x, handle)
    assert torch.equal(out_i, out)
    assert buffer.normal_buffer().hidden >= HIDDEN and buffer.get_comm_stream() is None
    buffer.destroy()
    with pytest.raises(RuntimeError, match="after destroy"):
        buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    return {"runs": runs}


def check_sglang_normal_flow(async_finish: bool, fp8: bool) -> Dict[str, Any]:
    """SGLang's DeepEPDispatcher, normal mode: size the buffer from the configs' hints, capture an event
    when async, layout and dispatch with allocate_on_comm_stream, expert_alignment=128, combine."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    hidden_bytes = HIDDEN * 2
    num_nvl_bytes = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) for cfg in (
        deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)))
    buffer = deep_ep.Buffer(group, num_nvl_bytes, 0, low_latency_mode=True, num_qps_per_rank=1, backend="reference")
    gen = torch.Generator().manual_seed(100 + rank)
    hidden_states = torch.randn(NUM_TOKENS - rank * 5, HIDDEN, generator=gen).to(torch.bfloat16)
    n = hidden_states.shape[0]
    topk_idx = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:NUM_TOPK] for _ in range(n)])
    topk_weights = torch.rand(n, NUM_TOPK, generator=gen)
    x: Any = hidden_states
    if fp8:
        data, scales = per_token_cast_to_fp8(hidden_states)
        padded = torch.zeros(scales.shape[1], n + 3)              # TMA-aligned column-major scales
        padded[:, :n] = scales.T
        x = (data, padded[:, :n].T)
    previous_event = deep_ep.Buffer.capture() if async_finish else None
    (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
     previous_event) = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS, previous_event=previous_event,
                                                  async_finish=async_finish,
                                                  allocate_on_comm_stream=previous_event is not None)
    (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert, handle, event) = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, previous_event=previous_event, async_finish=async_finish,
        allocate_on_comm_stream=(previous_event is not None) and async_finish, expert_alignment=128, config=None)
    event.current_stream_wait() if async_finish else ()
    assert isinstance(handle, NormalHandle) and all(c % 128 == 0 for c in num_recv_tokens_per_expert)
    recv = per_token_cast_back(*recv_x) if fp8 else recv_x
    # The same call through NormalBuffer directly gives the same bits.
    direct = NormalBuffer(group, hidden=HIDDEN, backend="reference")
    d_ntpr, _, d_ntpe, d_tir, _ = direct.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    d_recv, d_idx, d_w, d_list, d_handle, _ = direct.dispatch(
        x, num_tokens_per_rank=d_ntpr, is_token_in_rank=d_tir, num_tokens_per_expert=d_ntpe, topk_idx=topk_idx,
        topk_weights=topk_weights, expert_alignment=128)
    d_recv = per_token_cast_back(*d_recv) if fp8 else d_recv
    assert torch.equal(recv, d_recv) and torch.equal(recv_topk_idx, d_idx) and torch.equal(recv_topk_weights, d_w)
    assert num_recv_tokens_per_expert == d_list
    assert torch.equal(handle.send_head, d_handle.send_head)

    expert_out = (recv.float() * 0.5).to(torch.bfloat16)
    previous_event = deep_ep.Buffer.capture() if async_finish else None
    combined_x, _, event = buffer.combine(expert_out, handle, async_finish=async_finish,
                                          previous_event=previous_event,
                                          allocate_on_comm_stream=previous_event is not None)
    event.current_stream_wait() if async_finish else ()
    d_out, _, _ = direct.combine(expert_out, d_handle)
    assert torch.equal(combined_x, d_out) and combined_x.shape == (n, HIDDEN)
    direct.destroy()
    buffer.destroy()
    return {"received": int(recv.shape[0])}


def test_deepep_intranode_flow(pool2: Any) -> None:
    res = pool2.run(check_deepep_intranode_flow, timeout_s=120)
    assert all(r["runs"] == 24 for r in res)


@pytest.mark.parametrize("async_finish,fp8", [(False, False), (True, True)])
def test_sglang_normal_flow(pool2: Any, async_finish: bool, fp8: bool) -> None:
    res = pool2.run(check_sglang_normal_flow, async_finish, fp8)
    assert sum(r["received"] for r in res) > 0


def test_static_api() -> None:
    assert deep_ep.Config is NormalBuffer.get_dispatch_config(2).__class__
    assert deep_ep.Buffer.get_dispatch_config(8) == NormalBuffer.get_dispatch_config(8)
    old = NormalBuffer.num_sms
    try:
        deep_ep.Buffer.set_num_sms(20)
        assert deep_ep.Buffer.num_sms == NormalBuffer.num_sms == 20
        assert deep_ep.Buffer.get_combine_config(4).num_sms == 20
        with pytest.raises(ValueError, match="even"):
            deep_ep.Buffer.set_num_sms(7)
    finally:
        deep_ep.Buffer.set_num_sms(old)
    with pytest.raises(ValueError, match="1, 2, 4 or 8"):
        deep_ep.Buffer.get_dispatch_config(3)
    assert deep_ep.normal_hidden(NormalBuffer.size_hint(4096, 8), 8) >= 4096
    assert deep_ep.normal_hidden(1000, 8) == 0
    ev = deep_ep.Buffer.capture()
    with ev:
        pass
    ev.current_stream_wait()
