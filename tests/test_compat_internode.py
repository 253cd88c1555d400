"""DeepEP V1's tests/test_internode.py correctness part, in its calling form, on pyep's DeepEP shim: the
reference backend, 2 virtual nodes x 2 ranks (PYEP_VIRTUAL_NODE_SIZE=2, 4 gloo ranks). The layout
against a hand computation (num_tokens_per_rdma_rank included), then for previous-event / async / BF16,
FP8 / with and without top-k: dispatch(**dispatch_args) with DeepEP's Config(num_sms, 8, 512, 16,
128), the received rows checked by source through `handle[-4]` (recv_gbl_rank_prefix_sum, where the
shim returned the 6-tuple's recv_channel_prefix_matrix before), num_worst_tokens, cached dispatch and
combine with a bias pair. Then DeepEP's internode 10-tuple entry by entry against an oracle built from
every rank's is_token_in_rank. On a GPU the test file itself runs unchanged (docs/compat.md)."""
from __future__ import annotations

import os
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from pyep.compat import deep_ep
from test_normal_compat import calc_diff, per_token_cast_back, per_token_cast_to_fp8

NUM_TOKENS, HIDDEN, NUM_TOPK, NUM_EXPERTS, LOCAL_RANKS = 24, 256, 4, 16, 2


def _buffer() -> Any:
    os.environ["PYEP_VIRTUAL_NODE_SIZE"] = str(LOCAL_RANKS)
    try:
        return deep_ep.Buffer(dist.group.WORLD, int(2e9), int(1e9), low_latency_mode=False, num_qps_per_rank=24,
                              explicitly_destroy=True, backend="reference")
    finally:
        del os.environ["PYEP_VIRTUAL_NODE_SIZE"]


def _group_mask(idx: torch.Tensor, per_group: int, num_groups: int) -> torch.Tensor:
    """bool [N, G]: which groups of per_group consecutive ids a token's entries hit (-1 hits none)."""
    grp = torch.where(idx >= 0, idx // per_group, -1)
    return torch.stack([(grp == g).any(dim=1) for g in range(num_groups)], dim=1)


def check_internode_flow() -> Dict[str, Any]:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    num_nodes = num_ranks // LOCAL_RANKS
    buffer = _buffer()
    torch.manual_seed(rank)
    x = torch.ones((NUM_TOKENS, HIDDEN), dtype=torch.bfloat16) * rank
    x_pure_rand = torch.randn((NUM_TOKENS, HIDDEN), dtype=torch.bfloat16)
    x_e4m3 = per_token_cast_to_fp8(x)
    x_pure_rand_e4m3 = per_token_cast_to_fp8(x_pure_rand)
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T)
    # Top-k inside the best node groups, as DeepEP's test picks them (groups = nodes).
    scores = torch.randn((NUM_TOKENS, NUM_EXPERTS), dtype=torch.float32).abs() + 1
    group_scores = scores.view(NUM_TOKENS, num_nodes, -1).amax(dim=-1)
    group_idx = torch.topk(group_scores, k=num_nodes, dim=-1, sorted=False).indices
    keep = torch.zeros((NUM_TOKENS, num_nodes), dtype=torch.bool).scatter_(1, group_idx, True)
    masked_scores = (scores.view(NUM_TOKENS, num_nodes, -1) * keep.unsqueeze(-1)).view(NUM_TOKENS, NUM_EXPERTS)
    topk_idx = torch.topk(masked_scores, NUM_TOPK, dim=-1, largest=True, sorted=False)[1].to(deep_ep.topk_idx_t)
    topk_idx[5, 1] = -1                                         # an entry that goes nowhere
    topk_weights = torch.ones((NUM_TOKENS, NUM_TOPK), dtype=torch.float32) * rank
    topk_weights_pure_rand = torch.randn((NUM_TOKENS, NUM_TOPK), dtype=torch.float32)

    is_token_in_rank = _group_mask(topk_idx, NUM_EXPERTS // num_ranks, num_ranks)
    num_tokens_per_rank = is_token_in_rank.sum(0).to(torch.int)
    num_tokens_per_rdma_rank = _group_mask(topk_idx, NUM_EXPERTS // num_nodes, num_nodes).sum(0).to(torch.int)
    num_tokens_per_expert = torch.tensor([int((topk_idx == i).sum()) for i in range(NUM_EXPERTS)], dtype=torch.int)
    gbl_num_tokens_per_expert = num_tokens_per_expert.clone()
    dist.all_reduce(gbl_num_tokens_per_expert, group=group)
    gbl_num_tokens_per_rank = num_tokens_per_rank.clone()
    dist.all_reduce(gbl_num_tokens_per_rank, group=group)

    ref_num_tokens_per_rank, ref_num_tokens_per_rdma_rank, ref_num_tokens_per_expert, ref_is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    assert torch.allclose(ref_num_tokens_per_rank, num_tokens_per_rank)
    assert torch.allclose(ref_num_tokens_per_rdma_rank, num_tokens_per_rdma_rank)
    assert torch.allclose(ref_num_tokens_per_expert, num_tokens_per_expert)
    assert torch.allclose(ref_is_token_in_rank, is_token_in_rank)

    num_sms = 24
    rdma_buffer_size, nvl_buffer_size = 128, 512
    config = deep_ep.Config(num_sms, 8, nvl_buffer_size, 16, rdma_buffer_size)

    def check_data(check_x: torch.Tensor, recv_gbl_rank_prefix_sum: torch.Tensor) -> None:
        assert torch.allclose(check_x.amin(dim=1), check_x.amax(dim=1))
        check_start = 0
        for i in range(num_ranks):
            check_end = recv_gbl_rank_prefix_sum[i].item()
            assert (check_x[check_start:check_end, :].int() - i).sum().item() == 0
            check_start = check_end

    runs = 0
    for previous_mode in (False, True):
        for async_mode in (False, True):
            for current_x in (x_pure_rand, x, x_pure_rand_e4m3, x_e4m3):
                for with_topk in (False, True):
                    is_rand = current_x is x_pure_rand or current_x is x_pure_rand_e4m3
                    dispatch_args = {'x': current_x, 'num_tokens_per_rank': num_tokens_per_rank,
                                     'num_tokens_per_rdma_rank': num_tokens_per_rdma_rank,
                                     'is_token_in_rank': is_token_in_rank,
                                     'num_tokens_per_expert': num_tokens_per_expert, 'config': config,
                                     'async_finish': async_mode}
                    if with_topk:
                        dispatch_args.update({'topk_idx': topk_idx,
                                              'topk_weights': topk_weights_pure_rand if is_rand else topk_weights})
                    if previous_mode:
                        dispatch_args.update({'previous_event': buffer.capture()})
                    recv_x, recv_topk_idx, recv_topk_weights, recv_num_tokens_per_expert_list, handle, event = \
                        buffer.dispatch(**dispatch_args)
                    event.current_stream_wait() if async_mode else ()
                    recv_x = per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x

                    recv_gbl_rank_prefix_sum = handle[-4]
                    assert gbl_num_tokens_per_rank[rank].item() == recv_x.size(0)
                    assert gbl_num_tokens_per_expert.view(num_ranks, -1)[rank].tolist() == \
                        recv_num_tokens_per_expert_list
                    if not is_rand:
                        check_data(recv_x, recv_gbl_rank_prefix_sum)
                    recv_topk_weights_clone = None
                    if with_topk:
                        assert (recv_topk_idx.eq(-1) | ((recv_topk_idx >= 0) & (
                            recv_topk_idx < (NUM_EXPERTS // num_ranks)))).sum().item() == recv_topk_idx.numel()
                        for i, count in enumerate(recv_num_tokens_per_expert_list):
                            assert recv_topk_idx.eq(i).sum().item() == count
                        recv_topk_weights_clone = recv_topk_weights.clone()
                        if not is_rand:
                            recv_topk_weights[recv_topk_idx.eq(-1)] = recv_topk_weights.amax(
                                dim=1, keepdim=True).expand_as(recv_topk_weights)[recv_topk_idx.eq(-1)]
                            check_data(recv_topk_weights, recv_gbl_rank_prefix_sum)

                    if with_topk:
                        num_worst_tokens = NUM_TOKENS * num_ranks
                        dispatch_args.update({'num_worst_tokens': num_worst_tokens})
                        recv_worst_x, recv_worst_topk_idx, recv_worst_topk_weights, empty_list, _, event = \
                            buffer.dispatch(**dispatch_args)
                        event.current_stream_wait() if async_mode else ()
                        recv_worst_x = per_token_cast_back(*recv_worst_x) if isinstance(recv_worst_x, tuple) \
                            else recv_worst_x
                        assert len(empty_list) == 0
                        assert num_worst_tokens == recv_worst_x.size(0) == recv_worst_topk_idx.size(0)
                        assert num_worst_tokens == recv_worst_topk_weights.size(0)
                        assert torch.equal(recv_x, recv_worst_x[:recv_x.size(0)])
                        assert torch.equal(recv_topk_idx, recv_worst_topk_idx[:recv_x.size(0)])
                        assert torch.equal(recv_topk_weights_clone, recv_worst_topk_weights[:recv_x.size(0)])
                        assert torch.all(recv_worst_topk_idx[recv_x.size(0):] == -1).item()

                    if not with_topk:
                        dispatch_args = {'x': current_x, 'handle': handle, 'config': config,
                                         'async_finish': async_mode}
                        if previous_mode:
                            dispatch_args.update({'previous_event': buffer.capture()})
                        recv_x, _, _, _, _, event = buffer.dispatch(**dispatch_args)
                        event.current_stream_wait() if async_mode else ()
                        recv_x = per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x
                        if not is_rand:
                            check_data(recv_x, recv_gbl_rank_prefix_sum)

                    bias_0 = torch.ones((NUM_TOKENS, HIDDEN), dtype=torch.bfloat16)
                    bias_1 = torch.randn((NUM_TOKENS, HIDDEN), dtype=torch.bfloat16)
                    combine_args = {'x': recv_x, 'bias': (bias_0, bias_1), 'handle': handle, 'config': config,
                                    'async_finish': async_mode}
                    if with_topk:
                        combine_args.update({'topk_weights': recv_topk_weights})
                    if previous_mode:
                        combine_args.update({'previous_event': buffer.capture()})
                    combined_x, combined_topk_weights, event = buffer.combine(**combine_args)
                    event.current_stream_wait() if async_mode else ()
                    check_x = (combined_x.float() - bias_0.float() - bias_1.float()) / \
                        is_token_in_rank.sum(dim=1).unsqueeze(1)
                    ref_x = x_pure_rand if is_rand else x
                    sent = is_token_in_rank.any(dim=1)
                    assert calc_diff(check_x[sent], ref_x[sent]) < (5e-4 if current_x is x_pure_rand_e4m3 else 5e-3)
                    if with_topk:
                        check_topk_weights = combined_topk_weights if is_rand else \
                            (combined_topk_weights / is_token_in_rank.sum(dim=1).unsqueeze(1))
                        ref_topk_weights = topk_weights_pure_rand if is_rand else topk_weights
                        live = topk_idx >= 0
                        assert calc_diff(check_topk_weights[live], ref_topk_weights[live]) < 1e-9
                    runs += 1
    tuple_checks = check_handle_entries(buffer, handle, is_token_in_rank, num_nodes)
    buffer.destroy()
    return {"runs": runs, "tuple": tuple_checks}


def _oracle_forward(all_in_rank: List[torch.Tensor], me: int, num_nodes: int, num_channels: int):
    """What rank `me` forwards inside its node, by a per-row construction: for each source node a, the
    tokens of its column peer (a, l) that node n(me) wants, in token order; and send_nvl_head by
    counting earlier rows of the same channel."""
    p = LOCAL_RANKS
    node, local = me // p, me % p
    rows: List[torch.Tensor] = []
    per_node = []
    for a in range(num_nodes):
        src = all_in_rank[a * p + local][:, node * p:(node + 1) * p]
        take = [t for t in range(src.shape[0]) if bool(src[t].any())]
        per_node.append(len(take))
        rows.extend(src[t] for t in take)
    f = len(rows)
    per = max(1, -(-f // num_channels))
    head = torch.full((f, p), -1, dtype=torch.int32)
    for i, row in enumerate(rows):
        for d in range(p):
            if bool(row[d]):
                head[i, d] = sum(1 for j in range((i // per) * per, i) if bool(rows[j][d]))
    return per_node, head


def check_handle_entries(buffer: Any, handle: Any, in_rank: torch.Tensor, num_nodes: int) -> int:
    """DeepEP's internode handle, entry by entry: it unpacks into its ten names, in DeepEP's order."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    (is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix,
     recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta,
     send_rdma_head, send_nvl_head) = handle
    assert len(handle) == 10 and handle[-4] is recv_gbl_rank_prefix_sum and handle[0] is is_token_in_rank
    nh = handle.normal
    c_n = nh.num_channels
    assert torch.equal(is_token_in_rank, in_rank)
    assert torch.equal(gbl_channel_prefix_matrix, nh.channel_prefix_matrix)
    assert torch.equal(recv_gbl_channel_prefix_matrix, nh.recv_channel_prefix_matrix)
    assert torch.equal(recv_gbl_rank_prefix_sum, nh.rank_prefix_matrix[:, rank])
    # Sender side: per node, per channel (token t in channel t // ceil(N / C)), and positions.
    node_mask = _group_mask(torch.where(in_rank, torch.arange(num_ranks), -1), LOCAL_RANKS, num_nodes)
    per = -(-NUM_TOKENS // c_n)
    want = torch.zeros(num_nodes, c_n, dtype=torch.int32)
    for t in range(NUM_TOKENS):
        for m in range(num_nodes):
            want[m, t // per:] += int(node_mask[t, m])
    assert rdma_channel_prefix_matrix.dtype == torch.int32 and torch.equal(rdma_channel_prefix_matrix, want)
    for m in range(num_nodes):
        pos = [int(v) for v in send_rdma_head[:, m]]
        assert pos == [int(node_mask[:t, m].sum()) if node_mask[t, m] else -1 for t in range(NUM_TOKENS)]
    # Receiver side: each row's (source rank, token index), sources ascending.
    ends = recv_gbl_rank_prefix_sum.tolist()
    for row in range(recv_src_meta.shape[0]):
        src = next(s for s in range(num_ranks) if row < ends[s])
        assert recv_src_meta[row].tolist() == [src, int(nh.recv_src_idx[row])]
    # The forwarding stage against every rank's routing.
    gathered = [torch.zeros_like(in_rank, dtype=torch.uint8) for _ in range(num_ranks)]
    dist.all_gather(gathered, in_rank.to(torch.uint8))
    per_node, head = _oracle_forward([g.bool() for g in gathered], rank, num_nodes, c_n)
    assert recv_rdma_rank_prefix_sum.tolist() == torch.tensor(per_node).cumsum(0).tolist()
    assert torch.equal(send_nvl_head, head)
    f = head.shape[0]
    fper = max(1, -(-f // c_n))
    want = torch.zeros(num_nodes, c_n, dtype=torch.int32)
    starts = [0] + torch.tensor(per_node).cumsum(0).tolist()
    for a in range(num_nodes):
        for row in range(starts[a], starts[a + 1]):
            want[a, row // fper:] += 1
    assert torch.equal(recv_rdma_channel_prefix_matrix, want)
    # Cached dispatch and combine take the handle back; a forged tuple is refused by type.
    recv, *_ = buffer.dispatch(torch.zeros(NUM_TOKENS, HIDDEN, dtype=torch.bfloat16), handle=handle)
    assert recv.shape[0] == ends[-1]
    try:
        buffer.combine(recv, tuple(handle))
    except TypeError as exc:
        assert "handle" in str(exc)
    else:
        raise AssertionError("combine took a plain tuple as a handle")
    return 10


def test_deepep_internode_flow(pool4: Any) -> None:
    res = pool4.run(check_internode_flow, timeout_s=300)
    assert all(r["runs"] == 32 and r["tuple"] == 10 for r in res)
