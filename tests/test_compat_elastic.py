"""pyep.compat.deep_ep.ElasticBuffer (DeepEP V2's API) on the reference backend over gloo: DeepEP V2's
tests/elastic/test_ep.py checks, adapted (docs/compat.md lists which apply), against an oracle built
from every rank's inputs -- dispatch (plain, expanded, cached, cached expanded with zero padding),
BF16 and FP8, expert alignment, do_cpu_sync on and off, the handle's prefix sums and metadata,
cumulative stats, combine with 0 / 1 / 2 biases in pyep's documented order -- inside a node (2 ranks)
and across 2 virtual nodes of 2 (4 ranks). Also: the shim's device-side derivations never read a
value on the host (what keeps do_cpu_sync=False free of host waits and capturable), and the API
surface: Engram / PP / AGRS refused by name, hints, SM/QP counts, barrier, destroy."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from pyep.compat import _elastic_layout as lay
from pyep.compat import deep_ep
from pyep.ep.normal.contract import combine_order
from test_normal_compat import per_token_cast_to_fp8

T_MAX, HIDDEN, TOPK, EXPERTS = 12, 256, 3, 8


def _gather(obj: Any) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def pre_combine(gidx: torch.Tensor, k: int, h: int) -> torch.Tensor:
    """bf16 [n, K, H]: what expert k returns for the token of global index gidx (deterministic)."""
    seeds = (gidx.to(torch.float64).unsqueeze(1) * k + torch.arange(k, dtype=torch.float64)).unsqueeze(-1)
    return torch.sin(seeds * 0.731 + torch.arange(h, dtype=torch.float64) * 0.013).to(torch.bfloat16)


def ordered_sum(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """bf16 [n, H]: 0 + y[:, k] over the masked k in order, fp32, rounded once."""
    acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32)
    for k in range(y.shape[1]):
        acc += torch.where(mask[:, k:k + 1], y[:, k].float(), torch.zeros((), dtype=torch.float32))
    return acc.to(torch.bfloat16)


def _inputs(rank: int, num_ranks: int, seed: int):
    n = max(1, T_MAX - rank)
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    scores = torch.rand(n, EXPERTS, generator=gen)
    topk_weights, topk_idx = torch.topk(scores, TOPK, dim=-1, sorted=False)
    topk_idx = topk_idx.to(deep_ep.topk_idx_t)
    topk_idx[torch.rand(n, TOPK, generator=gen) < 0.15] = -1
    topk_weights = topk_weights.masked_fill(topk_idx < 0, 0)
    x = torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16)
    return n, x, topk_idx, topk_weights


def _expected_combine(topk_idx: torch.Tensor, gidx: torch.Tensor, bias: Any, nodes: int) -> torch.Tensor:
    r_n = dist.get_world_size()
    e_l = EXPERTS // r_n
    y = pre_combine(gidx, TOPK, HIDDEN)
    partial = [ordered_sum(y, (topk_idx >= d * e_l) & (topk_idx < (d + 1) * e_l)) for d in range(r_n)]
    acc = torch.zeros(y.shape[0], HIDDEN, dtype=torch.float32)
    for b in ([] if bias is None else [bias] if isinstance(bias, torch.Tensor) else list(bias)):
        acc += b.float()
    groups = combine_order(r_n, r_n // nodes)
    for grp in groups:
        if len(groups) == 1:
            for d in grp:
                acc += partial[d].float()
        else:
            part = torch.zeros(y.shape[0], HIDDEN, dtype=torch.float32)
            for d in grp:
                part += partial[d].float()
            acc += part.to(torch.bfloat16).float()
    return acc.to(torch.bfloat16)


def _make_buffer(nodes: int, backend: str) -> Any:
    if nodes > 1:
        os.environ["PYEP_VIRTUAL_NODE_SIZE"] = str(dist.get_world_size() // nodes)
    try:
        return deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=T_MAX, hidden=HIDDEN,
                                     explicitly_destroy=True, backend=backend)
    finally:
        os.environ.pop("PYEP_VIRTUAL_NODE_SIZE", None)


def _to(v: Any, dev: torch.device) -> Any:
    return tuple(t.to(dev) for t in v) if isinstance(v, tuple) else v.to(dev)


def _cpu(v: Any) -> Any:
    if isinstance(v, tuple):
        return tuple(_cpu(t) for t in v)
    return v.cpu() if isinstance(v, torch.Tensor) else v


def check_test_ep_flow(nodes: int, cpu_sync: bool, backend: str = "reference") -> Dict[str, Any]:
    """Inputs are made on the CPU and passed on the backend's device (rank_device); outputs are
    checked on the CPU."""
    from ep_native_cases import rank_device
    rank, r_n = dist.get_rank(), dist.get_world_size()
    dev = rank_device(backend)
    buffer = _make_buffer(nodes, backend)
    assert buffer.get_logical_domain_size() == (nodes, r_n // nodes)
    e_l = EXPERTS // r_n
    num_sms = buffer.get_theoretical_num_sms(EXPERTS, TOPK)
    num_qps = buffer.get_theoretical_num_qps(num_sms)
    cases = 0
    modes = [(a, f, b) for a in (4, 1) for f in (1, 0) for b in (0, 1, 2)]
    for i, (expert_alignment, use_fp8, num_bias) in enumerate(modes):
        with_previous_event, async_mode, allocate, copy = i % 2, (i // 2) % 2, (i // 4) % 2, (i // 3) % 2
        n, x_bf16, topk_idx, topk_weights = _inputs(rank, r_n, i)
        x = per_token_cast_to_fp8(x_bf16) if use_fp8 else x_bf16
        bias: Any = None
        if num_bias:
            gen = torch.Generator().manual_seed(7 * i + rank)
            bias = tuple(torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(num_bias))
            bias = bias[0] if num_bias == 1 else bias
        # Oracle: every source's rows for this rank, by (source, token).
        everyone = _gather((x_bf16, x[1] if use_fp8 else None, topk_idx, topk_weights))
        lo, hi = rank * e_l, (rank + 1) * e_l
        ref_x, ref_sf, ref_idx, ref_w, ref_src, per_source = [], [], [], [], [], []
        for s, (xs, sfs, idxs, ws) in enumerate(everyone):
            local = (idxs >= lo) & (idxs < hi)
            sel = local.any(1).nonzero().flatten()
            per_source.append(int(sel.numel()))
            ref_x.append(per_token_cast_to_fp8(xs)[0][sel] if use_fp8 else xs[sel])
            ref_sf.append(sfs[sel] if use_fp8 else None)
            ref_idx.append(torch.where(local[sel], idxs[sel] - lo, torch.full_like(idxs[sel], -1)))
            ref_w.append(torch.where(local[sel], ws[sel], torch.zeros_like(ws[sel])))
            ref_src.append((s * T_MAX + sel).to(torch.int32))
        ref_src_t = torch.cat(ref_src)
        rows = int(ref_src_t.numel())

        def launch(name: str, **params: Any) -> Any:
            if with_previous_event:
                params.update(previous_event=buffer.capture())
            params = {k: (v.to(dev) if isinstance(v, torch.Tensor) else
                          tuple(t.to(dev) for t in v) if isinstance(v, tuple) else v) for k, v in params.items()}
            values = getattr(buffer, name)(async_with_compute_stream=async_mode,
                                           allocate_on_comm_stream=allocate, **params)
            values[-1].current_stream_wait() if async_mode else ()
            return tuple(_cpu(v) for v in values)

        x_d, topk_idx_d, topk_weights_d = _to(x, dev), topk_idx.to(dev), topk_weights.to(dev)
        dispatch_args = dict(x=x_d, topk_idx=topk_idx_d, topk_weights=topk_weights_d, num_sms=num_sms, num_qps=num_qps,
                             num_max_tokens_per_rank=T_MAX, num_experts=EXPERTS, expert_alignment=expert_alignment,
                             do_handle_copy=copy, do_cpu_sync=cpu_sync)
        recv_x, recv_topk_idx, recv_topk_weights, handle, _ = launch('dispatch', **dispatch_args)
        e_recv_x, e_recv_topk_idx, e_recv_topk_weights, e_handle, _ = launch(
            'dispatch', **dispatch_args, do_expand=True, use_tma_aligned_col_major_sf=True)
        c_recv_x, c_recv_topk_idx, _, c_handle, _ = launch('dispatch', x=x_d, num_sms=num_sms, num_qps=num_qps,
                                                           handle=handle)
        ce_recv_x, _, ce_recv_w, _, _ = launch('dispatch', x=x_d, topk_weights=topk_weights_d, handle=e_handle,
                                              do_expand=True, use_tma_aligned_col_major_sf=True,
                                              do_zero_padding=True)
        num_recv = handle.psum_num_recv_tokens_per_scaleup_rank[-1].item()
        assert num_recv == rows == e_handle.psum_num_recv_tokens_per_scaleup_rank[-1].item()
        assert (recv_topk_idx.shape[0] == rows) == cpu_sync
        # Handle copies, cached handle, scale-up prefix sum.
        assert (topk_idx_d.data_ptr() != handle.topk_idx.data_ptr()) == bool(copy) and c_handle is handle
        counts = [sum(per_source[s] for s in range(j, r_n, buffer.num_scaleup_ranks))
                  for j in range(buffer.num_scaleup_ranks)]
        assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == torch.tensor(counts).cumsum(0).tolist()
        # Rows, bit for bit, in (source, token) order (= sorted by recv_src_metadata[:, 0]).
        data = recv_x[0] if use_fp8 else recv_x
        assert torch.equal(handle.recv_src_metadata[:rows, 0].cpu(), ref_src_t)
        if use_fp8:
            assert torch.equal(data[:rows].view(torch.uint8), torch.cat(ref_x).view(torch.uint8))
            assert torch.equal(recv_x[1][:rows], torch.cat(ref_sf))
        else:
            assert torch.equal(data[:rows], torch.cat(ref_x))
        assert torch.equal(recv_topk_idx[:rows], torch.cat(ref_idx))
        assert torch.equal(recv_topk_weights[:rows], torch.cat(ref_w))
        assert torch.equal(c_recv_topk_idx, recv_topk_idx)
        c_data = c_recv_x[0] if use_fp8 else c_recv_x
        assert torch.equal(c_data[:rows].float(), data[:rows].float())
        # Per-expert counts: aligned inclusive prefix; expanded: start + real count.
        ref_counts = [int((torch.cat(ref_idx) == e).sum()) for e in range(e_l)]
        aligned = [(c + expert_alignment - 1) // expert_alignment * expert_alignment for c in ref_counts]
        assert handle.psum_num_recv_tokens_per_expert.tolist() == torch.tensor(aligned).cumsum(0).tolist()
        assert handle.num_recv_tokens_per_expert_list == (aligned if cpu_sync else [])
        starts = [0] + torch.tensor(aligned).cumsum(0).tolist()[:-1]
        assert e_handle.psum_num_recv_tokens_per_expert.tolist() == [s + c for s, c in zip(starts, ref_counts)]
        # Expanded rows: every slot of a row holds that row; padding of the cached zero-padded one is 0.
        assert e_recv_topk_idx is None and e_recv_topk_weights.dim() == 1
        e_data, ce_data = (e_recv_x[0], ce_recv_x[0]) if use_fp8 else (e_recv_x, ce_recv_x)
        slots = e_handle.recv_src_metadata[:rows, 2:].cpu()
        assert torch.equal(e_handle.recv_src_metadata[:rows, 0].cpu(), ref_src_t)
        for k in range(TOPK):
            valid = slots[:, k] >= 0
            sl = slots[valid, k].long()
            assert torch.equal(e_data[sl].float(), data[:rows][valid].float())
            assert torch.equal(ce_data[sl].float(), data[:rows][valid].float())
            assert torch.equal(e_recv_topk_weights[sl], recv_topk_weights[:rows][valid, k])
            assert torch.equal(ce_recv_w[sl], recv_topk_weights[:rows][valid, k])
            if use_fp8:
                assert e_recv_x[1].stride(0) == 1 and torch.equal(e_recv_x[1][sl], recv_x[1][:rows][valid])
        for e in range(e_l):
            end = e_handle.psum_num_recv_tokens_per_expert[e].item()
            pad = slice(end, starts[e] + aligned[e])
            assert (ce_data[pad].float() == 0).all() and (ce_recv_w[pad] == 0).all()
        # Where each sent token landed, seen from its destination.
        metas = _gather(handle.recv_src_metadata[:rows, 0].tolist())
        for t in range(n):
            for d in range(r_n):
                pos = int(handle.dst_buffer_slot_idx[t, d])
                assert (pos >= 0) == bool(((topk_idx[t] >= d * e_l) & (topk_idx[t] < (d + 1) * e_l)).any())
                assert pos < 0 or metas[d][pos] == rank * T_MAX + t
        # Cumulative stats: the unaligned per-expert counts, added by every dispatch that takes them.
        stats = torch.zeros((e_l,), dtype=torch.int, device=dev)
        launch('dispatch', **dispatch_args, cumulative_local_expert_recv_stats=stats)
        launch('dispatch', x=x_d, handle=handle, cumulative_local_expert_recv_stats=stats)
        assert stats.tolist() == [2 * c for c in ref_counts]
        # Combine: each rank returns its top-k outputs reduced in top-k order.
        y = pre_combine(ref_src_t.long(), TOPK, HIDDEN)
        x_comb = torch.zeros(recv_topk_idx.shape[0], HIDDEN, dtype=torch.bfloat16)
        x_comb[:rows] = ordered_sum(y, recv_topk_idx[:rows] >= 0)
        x_exp = torch.zeros(e_handle.num_expanded_tokens + 1, HIDDEN, dtype=torch.bfloat16)
        x_exp[slots.flatten().long()] = y.view(-1, HIDDEN)
        x_exp = x_exp[:-1]
        combined_x, combined_w, _ = launch('combine', x=x_comb, topk_weights=recv_topk_weights, bias=bias,
                                           handle=handle, num_sms=num_sms, num_qps=num_qps)
        reduced_x, reduced_w, _ = launch('combine', x=x_exp, topk_weights=e_recv_topk_weights, bias=bias,
                                         handle=e_handle, num_sms=num_sms, num_qps=num_qps)
        want = _expected_combine(topk_idx, rank * T_MAX + torch.arange(n), bias, nodes)
        assert torch.equal(combined_x, want) and torch.equal(reduced_x, want)
        assert torch.equal(combined_w, topk_weights) and torch.equal(reduced_w, topk_weights)
        cases += 1
    buffer.destroy()
    return {"cases": cases, "rows": rows}


@pytest.mark.parametrize("cpu_sync", [True, False])
def test_test_ep_flow_one_node(pool2: Any, cpu_sync: bool) -> None:
    res = pool2.run(check_test_ep_flow, 1, cpu_sync, timeout_s=300)
    assert all(r["cases"] == 12 for r in res) and sum(r["rows"] for r in res) > 0


@pytest.mark.parametrize("cpu_sync", [True, False])
def test_test_ep_flow_two_virtual_nodes(pool4: Any, cpu_sync: bool) -> None:
    res = pool4.run(check_test_ep_flow, 2, cpu_sync, timeout_s=300)
    assert all(r["cases"] == 12 for r in res)


class _NoHostReads(TorchDispatchMode):
    """Refuses every op that reads a tensor value on the host or whose output shape depends on values:
    inside a CUDA graph capture those would wait for the device (or fail)."""
    REFUSED = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "bincount", "item")

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Optional[Dict[str, Any]] = None):
        name = func.overloadpacket.__name__
        if any(name == r or name.startswith(r + ".") for r in self.REFUSED):
            raise AssertionError(f"host read: aten.{name}")
        return func(*args, **(kwargs or {}))


def test_layout_derivations_read_nothing_on_the_host() -> None:
    gen = torch.Generator().manual_seed(3)
    rows, k, e_l, r_n = 9, 3, 4, 2
    ridx = torch.randint(-1, e_l, (rows, k), generator=gen)
    rpm = torch.tensor([[4, 3], [6, 9]], dtype=torch.int32)
    src_idx = torch.arange(rows, dtype=torch.int32)
    x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
    w = torch.rand(rows, k, generator=gen)
    in_rank = torch.rand(5, r_n, generator=gen) < 0.5
    with pytest.raises(AssertionError, match="host read"), _NoHostReads():
        torch.tensor([1]).item()                                     # the mode does refuse host reads
    with _NoHostReads():
        counts = lay.expert_counts(ridx, e_l)
        lay.aligned_prefix(counts, 4)
        lay.scaleup_prefix(rpm, 1, 1, r_n)
        slots, psum = lay.expand_slots(ridx, counts, 4)
        cap = rows * k + e_l * 3
        ex = lay.expand_rows(x, slots, cap, zero=True)
        ew = lay.expand_values(w, slots, cap)
        lay.fold_rows(ew, slots)
        lay.reduce_expanded(ex, slots)
        lay.src_metadata(rpm, 1, src_idx, ridx, 16, slots)
        lay.src_metadata(rpm, 1, src_idx, ridx, 16)
        lay.dst_slots(in_rank, rpm, 1)
        lay.unpack_weights(lay.pack_weights(w), k, ridx)
    # And they agree with a per-row construction.
    assert counts.tolist() == [int((ridx == e).sum()) for e in range(e_l)]
    for r in range(rows):
        for j in range(k):
            e = int(ridx[r, j])
            if e < 0:
                assert slots[r, j] == -1
            else:
                before = sum(int(ridx[q, m] == e) for q in range(rows) for m in range(k) if (q, m) < (r, j))
                start = sum((int(c) + 3) // 4 * 4 for c in counts[:e])
                assert slots[r, j] == start + before and torch.equal(ex[slots[r, j]], x[r])
    assert torch.equal(lay.unpack_weights(lay.pack_weights(w), k, ridx), torch.where(ridx >= 0, w, 0.0))


def check_api_surface() -> Dict[str, Any]:
    r_n = dist.get_world_size()
    with pytest.raises(NotImplementedError, match="Engram"):
        deep_ep.ElasticBuffer(dist.group.WORLD, num_bytes=1 << 22, num_cpu_bytes=1 << 21)
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=T_MAX, hidden=HIDDEN, num_topk=TOPK,
                                num_allocated_qps=7, explicitly_destroy=True, backend="reference")
    for name, feature in (("engram_write", "Engram"), ("engram_fetch", "Engram"), ("pp_set_config", "PP"),
                          ("pp_send", "PP"), ("pp_recv", "PP"), ("create_agrs_session", "AGRS"),
                          ("agrs_new_session", "AGRS"), ("all_gather", "AGRS"), ("agrs_get_inplace_tensor", "AGRS")):
        with pytest.raises(NotImplementedError, match=f"{name}: {feature}"):
            getattr(buf, name)(torch.zeros(1))
    for name in ("get_engram_storage_size_hint", "get_pp_buffer_size_hint", "get_agrs_buffer_size_hint"):
        with pytest.raises(NotImplementedError, match=name):
            getattr(deep_ep.ElasticBuffer, name)(1, 2)
    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(dist.group.WORLD, T_MAX, HIDDEN, TOPK)
    assert hint % (1 << 21) == 0 and hint >= deep_ep.NormalBuffer.size_hint(HIDDEN, r_n)
    assert buf.num_bytes == buf._nb.buffer_bytes and buf.get_physical_domain_size() == (1, r_n)
    assert 4 <= buf.get_theoretical_num_sms(num_experts=EXPERTS, num_topk=TOPK) <= 128
    assert buf.get_theoretical_num_qps(24) == 0 and buf.num_allocated_qps == 7   # one node: NVLink only
    assert isinstance(buf.capture(), deep_ep.EventHandle) and buf.get_comm_stream() is None
    buf.barrier()
    buf.barrier(use_comm_stream=False, with_cpu_sync=True)
    n, x, idx, w = _inputs(dist.get_rank(), r_n, 0)
    with pytest.raises(ValueError, match="num_max_tokens_per_rank"):
        buf.dispatch(torch.zeros(T_MAX + 1, HIDDEN, dtype=torch.bfloat16), topk_idx=torch.zeros(
            T_MAX + 1, TOPK, dtype=torch.int64), num_experts=EXPERTS)
    recv, _, _, handle, event = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=EXPERTS)
    assert event.event is None                                  # vLLM's check: no event unless async
    with pytest.raises(ValueError, match="do_expand"):
        buf.dispatch(x, handle=handle, do_expand=True)
    with pytest.raises(ValueError, match="CPU sync"):
        buf.dispatch(x, handle=handle, do_cpu_sync=True)
    other = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=T_MAX, hidden=HIDDEN, backend="reference")
    with pytest.raises(ValueError, match="another ElasticBuffer"):
        other.combine(recv, handle)
    other.destroy()
    out, _, _ = buf.combine(recv, handle)
    assert out.shape == x.shape
    buf.destroy()
    with pytest.raises(RuntimeError, match="after destroy"):
        buf.dispatch(x, topk_idx=idx, num_experts=EXPERTS)
    return {"rows": int(recv.shape[0])}


def test_api_surface(pool2: Any) -> None:
    assert sum(r["rows"] for r in pool2.run(check_api_surface)) > 0


def check_graph_capture(backend: str = "native") -> Dict[str, Any]:
    """do_cpu_sync=False on a GPU: no host synchronisation (torch's sync debug mode set to error) and a
    dispatch + combine captured in a CUDA graph replays to the eager results on new inputs."""
    from ep_native_cases import rank_device
    dev = rank_device(backend)
    rank = dist.get_rank()
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=T_MAX, hidden=HIDDEN, explicitly_destroy=True,
                                backend=backend)

    def step(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> Any:
        recv, _, r_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=EXPERTS,
                                               do_cpu_sync=False)
        out, out_w, _ = buf.combine((recv.float() * 0.5).to(torch.bfloat16), handle, topk_weights=r_w)
        return out, out_w

    first = [t.to(dev) for t in _inputs(rank, 0, 1)[1:]]     # the same N per rank: the graph's static shapes
    second = [t.to(dev) for t in _inputs(rank, 0, 2)[1:]]
    eager = [t.cpu() for t in step(*second)]
    torch.cuda.synchronize(dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(*first)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    static = [t.clone() for t in first]
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        step(*static)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(*static)
    for dst, src in zip(static, second):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize(dev)
    assert torch.equal(outs[0].cpu(), eager[0]) and torch.equal(outs[1].cpu(), eager[1])
    buf.destroy()
    return {"tokens": int(first[0].shape[0])}
