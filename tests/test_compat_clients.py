"""Every DeepEP call site of Megatron-LM, SGLang and vLLM (../shared/REFERENCE.md section 6), in exactly
the form those files use -- imports through `import deep_ep` (pyep.compat.install_deep_ep_alias),
positional order, keywords, attributes read, return unpacking -- on the reference backend over gloo,
inside a node (2 ranks) and, for the normal-mode clients, across 2 virtual nodes of 2 (4 ranks).
Files (docs/compat.md names the revisions read):
  Megatron-LM megatron/core/transformer/moe/fused_a2a.py            check_megatron_fused_a2a
  SGLang python/sglang/srt/layers/moe/token_dispatcher/deepep.py      check_sglang_deepep
  SGLang python/sglang/srt/layers/moe/token_dispatcher/deepep_v2.py   check_sglang_deepep_v2
  vLLM vllm/distributed/device_communicators/all2all.py (DeepEPHT/LL/V2 managers),
       vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ht.py, deepep_ll.py, deepep_v2.py
                                                                     check_vllm_deepep_*
SGLang's token_dispatcher/mooncake.py is pinned in tests/test_compat_mooncake_api.py."""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Dict, Iterator

import pytest
import torch
import torch.distributed as dist

import pyep.compat

H, E, K, T_MAX = 256, 8, 3, 16


@contextlib.contextmanager
def deep_ep_installed(nodes: int = 1) -> Iterator[Any]:
    """`import deep_ep` as the clients do (the alias), on `nodes` virtual nodes; restored afterwards."""
    saved = {k: v for k, v in sys.modules.items() if k == "deep_ep" or k.startswith("deep_ep.")}
    pyep.compat.install_deep_ep_alias()
    if nodes > 1:
        os.environ["PYEP_VIRTUAL_NODE_SIZE"] = str(dist.get_world_size() // nodes)
    try:
        import deep_ep  # type: ignore[import-not-found]
        yield deep_ep
    finally:
        os.environ.pop("PYEP_VIRTUAL_NODE_SIZE", None)
        for k in [k for k in sys.modules if k == "deep_ep" or k.startswith("deep_ep.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def _tokens(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    x = torch.randn(n, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)])
    return x, idx, torch.rand(n, K, generator=gen)


def _copies(idx: torch.Tensor) -> torch.Tensor:
    """[N, 1]: how many ranks a token goes to (a combine of the received rows sums that many copies)."""
    r_n = dist.get_world_size()
    grp = torch.where(idx >= 0, idx // (E // r_n), -1)
    return torch.stack([(grp == d).any(1) for d in range(r_n)], 1).sum(1, keepdim=True)


def check_megatron_fused_a2a(nodes: int, async_finish: bool) -> Dict[str, Any]:
    with deep_ep_installed(nodes):
        from deep_ep import Buffer  # type: ignore[import-not-found]
        from deep_ep.utils import EventHandle, EventOverlap  # type: ignore[import-not-found]
        with pytest.raises(ImportError):
            from deep_ep import HybridEPBuffer  # type: ignore[import-not-found]  # noqa: F401
        group = dist.new_group(list(range(dist.get_world_size())))
        x, token_indices, token_probs = _tokens(10, 1)
        hidden_bytes = x.size(1) * max(x.element_size(), 2)
        num_nvl_bytes, num_rdma_bytes = 0, 0
        for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
            num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
        _buffer = None
        if (_buffer is None or _buffer.group != group or _buffer.num_nvl_bytes < num_nvl_bytes
                or _buffer.num_rdma_bytes < num_rdma_bytes):
            _buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes)
        buffer = _buffer
        allocate_on_comm_stream = async_finish
        Buffer.set_num_sms(20)                               # set_deepep_num_sms
        # FusedDispatch.forward
        previous_event = EventOverlap(EventHandle()) if async_finish else None
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event) = \
            buffer.get_dispatch_layout(token_indices, E, previous_event=previous_event, async_finish=async_finish,
                                       allocate_on_comm_stream=allocate_on_comm_stream)
        (recv_x, recv_token_indices, recv_token_probs, num_recv_tokens_per_expert_list, handle,
         after_event_overlap) = buffer.dispatch(
            x, topk_idx=token_indices, topk_weights=token_probs, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, previous_event=event, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after_event_overlap.current_stream_wait()
        tokens_per_expert = torch.tensor(num_recv_tokens_per_expert_list)
        assert int(tokens_per_expert.sum()) == int((recv_token_indices >= 0).sum())
        assert (num_tokens_per_rdma_rank is None) == (nodes == 1)
        # FusedDispatch.backward: combine of the gradient, with the probabilities' gradient
        previous_event = EventOverlap(EventHandle()) if async_finish else None
        grad_x, grad_token_probs, after_event = buffer.combine(
            recv_x.contiguous(), handle, topk_weights=recv_token_probs.float(), previous_event=previous_event,
            async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after_event.current_stream_wait()
        assert torch.equal(grad_x, (x.float() * _copies(token_indices)).to(torch.bfloat16))
        assert torch.equal(grad_token_probs, token_probs)
        # FusedCombine.forward / backward
        previous_event = EventOverlap(EventHandle()) if async_finish else None
        combined_x, _, after_event = buffer.combine(recv_x, handle=handle, async_finish=async_finish,
                                                   previous_event=previous_event,
                                                   allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after_event.current_stream_wait()
        assert torch.equal(combined_x, grad_x)
        previous_event = EventOverlap(EventHandle()) if async_finish else None
        grad_x, _, _, _, _, after_event = buffer.dispatch(
            combined_x.contiguous(), handle=handle, previous_event=previous_event, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after_event.current_stream_wait()
        assert grad_x.shape == recv_x.shape
        Buffer.set_num_sms(24)
        buffer.destroy()
    return {"rows": int(recv_x.shape[0])}


def check_sglang_deepep(nodes: int, async_finish: bool) -> Dict[str, Any]:
    """DeepEPBuffer.get_deepep_buffer (mode AUTO, a --deepep-config JSON), the normal dispatcher's
    dispatch_a/b and combine_a/b, the switch to low latency, the LL dispatcher (hook and event)."""
    with deep_ep_installed(nodes):
        from deep_ep import Buffer, Config  # type: ignore[import-not-found]
        group = dist.group.WORLD
        config_parsed = {"normal_dispatch": {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 8,
                                             "num_max_nvl_chunked_recv_tokens": 256,
                                             "num_max_rdma_chunked_send_tokens": 6,
                                             "num_max_rdma_chunked_recv_tokens": 128},
                         "normal_combine": {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 8,
                                            "num_max_nvl_chunked_recv_tokens": 256,
                                            "num_max_rdma_chunked_send_tokens": 6,
                                            "num_max_rdma_chunked_recv_tokens": 128}}
        normal_dispatch_config = Config(**config_parsed["normal_dispatch"])
        normal_combine_config = Config(**config_parsed["normal_combine"])
        num_sms = config_parsed["normal_dispatch"]["num_sms"]
        hidden_bytes = H * 2
        num_nvl_bytes, num_rdma_bytes = 0, 0
        for config in (normal_dispatch_config or Buffer.get_dispatch_config(group.size()),
                       normal_combine_config or Buffer.get_combine_config(group.size())):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
            num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
        num_rdma_bytes = max(Buffer.get_low_latency_rdma_size_hint(T_MAX, H, group.size(), E), num_rdma_bytes)
        num_qps_per_rank = max(num_sms, E // group.size())
        buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True,
                        num_qps_per_rank=num_qps_per_rank, allow_mnnvl=True)
        assert Buffer.num_sms >= 2 and buffer.low_latency_mode
        # Normal mode
        hidden_states, topk_ids, topk_weights = _tokens(9, 2)
        topk_ids = topk_ids.to(torch.int64)
        previous_event = Buffer.capture() if async_finish else None
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
         previous_event) = buffer.get_dispatch_layout(topk_ids, E, previous_event=previous_event,
                                                      async_finish=async_finish,
                                                      allocate_on_comm_stream=previous_event is not None)
        (recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, handle, event) = buffer.dispatch(
            hidden_states, topk_idx=topk_ids, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, previous_event=previous_event, async_finish=async_finish,
            allocate_on_comm_stream=(previous_event is not None) and async_finish, expert_alignment=128,
            config=normal_dispatch_config)
        event.current_stream_wait() if async_finish else ()
        assert all(c % 128 == 0 for c in num_recv_tokens_per_expert)
        previous_event = Buffer.capture() if async_finish else None
        combined_x, _, event = buffer.combine(recv_x, handle, async_finish=async_finish, previous_event=previous_event,
                                              allocate_on_comm_stream=previous_event is not None,
                                              config=normal_combine_config)
        event.current_stream_wait() if async_finish else ()
        assert torch.equal(combined_x, (hidden_states.float() * _copies(topk_ids)).to(torch.bfloat16))
        # set_dispatch_mode_as_low_latency after normal: clean_buffer
        buffer.clean_low_latency_buffer(T_MAX, H, E)
        for return_recv_hook in (False, True):
            expected_m = (hidden_states.shape[0] * buffer.group_size * topk_ids.shape[1] + E) // E
            packed_recv_hidden, packed_recv_count, ll_handle, event, hook = buffer.low_latency_dispatch(
                hidden_states, topk_ids, T_MAX, E, use_fp8=False, async_finish=not return_recv_hook,
                return_recv_hook=return_recv_hook)
            hook() if return_recv_hook else event.current_stream_wait()
            combined, event, hook = buffer.low_latency_combine(
                x=packed_recv_hidden, topk_idx=topk_ids, topk_weights=topk_weights, handle=ll_handle,
                async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
            hook() if return_recv_hook else event.current_stream_wait()
            want = hidden_states.float() * topk_weights.sum(1, keepdim=True)
            assert torch.allclose(combined.float(), want, rtol=2e-2, atol=2e-2) and expected_m >= 1
            assert int(packed_recv_count.sum()) == int((recv_topk_ids >= 0).sum())
        with pytest.raises(TypeError):
            buffer.low_latency_dispatch(hidden_states, topk_ids, T_MAX, E, use_nvfp4=True)   # SGLang-fork keyword
        buffer.destroy()
    return {"rows": int(recv_x.shape[0])}


def check_sglang_deepep_v2(use_expand_layout: bool) -> Dict[str, Any]:
    with deep_ep_installed():
        from deep_ep import ElasticBuffer  # type: ignore[import-not-found]
        group = dist.group.WORLD
        buffer = ElasticBuffer(group, num_max_tokens_per_rank=T_MAX, hidden=H, num_topk=K, use_fp8_dispatch=False,
                               allow_hybrid_mode=True, sl_idx=0, prefer_overlap_with_compute=False)
        assert isinstance(buffer.num_bytes, int)
        _num_sms = buffer.get_theoretical_num_sms(E, K)
        _num_qps = buffer.get_theoretical_num_qps(_num_sms)
        hidden_states, topk_ids, topk_weights = _tokens(7, 3)
        do_cpu_sync_val = not use_expand_layout
        recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
            hidden_states, topk_idx=topk_ids, topk_weights=topk_weights, num_experts=E, num_max_tokens_per_rank=T_MAX,
            expert_alignment=4, num_sms=_num_sms, num_qps=_num_qps, use_tma_aligned_col_major_sf=False,
            do_cpu_sync=do_cpu_sync_val, do_expand=use_expand_layout)
        if event.event is not None:
            event.current_stream_wait()
        if use_expand_layout:
            assert recv_topk_idx is None and recv_topk_weights.dim() == 1
            assert recv_x.shape[0] >= int(handle.psum_num_recv_tokens_per_expert[-1])
            expert_out = recv_x
            combine_weights = None
        else:
            num_recv_tokens = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1].item())
            recv_topk_idx = recv_topk_idx[:num_recv_tokens]
            num_recv_tokens_per_expert = list(handle.num_recv_tokens_per_expert_list)
            assert sum(num_recv_tokens_per_expert) >= int((recv_topk_idx >= 0).sum())
            expert_out = recv_x
            combine_weights = recv_topk_weights
        combined_x, _, event = buffer.combine(expert_out, handle=handle, topk_weights=combine_weights,
                                              num_sms=_num_sms, num_qps=_num_qps)
        if event.event is not None:
            event.current_stream_wait()
        copies = _copies(topk_ids)
        if use_expand_layout:   # each token's row comes back once per (rank, local expert) slot
            r_n = dist.get_world_size()
            copies = torch.stack([((topk_ids // (E // r_n)) == d).sum(1) for d in range(r_n)], 1).sum(1, keepdim=True)
        assert torch.equal(combined_x, (hidden_states.float() * copies).to(torch.bfloat16))
        buffer.destroy()
    return {"rows": int(recv_x.shape[0])}


def check_vllm_deepep_ht_ll() -> Dict[str, Any]:
    """DeepEPHTAll2AllManager / DeepEPLLAll2AllManager kwargs, deepep_ht.py and deepep_ll.py calls."""
    with deep_ep_installed():
        import deep_ep  # type: ignore[import-not-found]
        cpu_group = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
        num_dispatchers = dist.get_world_size()
        kwargs = dict(group=cpu_group, num_nvl_bytes=1024 * 1024 * 1024, num_rdma_bytes=0, low_latency_mode=False,
                      num_qps_per_rank=1, explicitly_destroy=True)
        handle_buf = deep_ep.Buffer(**kwargs)
        deep_ep.Buffer.set_num_sms(20)
        available_rank_configs = [2, 4, 8, 16, 24, 32, 64, 128, 144, 160]
        config = deep_ep.Buffer.get_dispatch_config(num_dispatchers) if num_dispatchers in available_rank_configs \
            else None
        a1, rank_topk_ids, rank_topk_weights = _tokens(8, 4)
        previous_event = handle_buf.capture()
        (num_tokens_per_rank, num_tokens_per_rdma_rank, dispatch_expert_num_tokens, is_token_in_rank, event) = \
            handle_buf.get_dispatch_layout(topk_idx=rank_topk_ids, num_experts=E, previous_event=previous_event,
                                           async_finish=False, allocate_on_comm_stream=False)
        (token_data, expert_topk_ids, expert_topk_weights, expert_num_tokens_per_expert_list, handle, event) = \
            handle_buf.dispatch(x=a1, handle=None, num_tokens_per_rank=num_tokens_per_rank,
                                num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                                num_tokens_per_expert=dispatch_expert_num_tokens, topk_idx=rank_topk_ids,
                                topk_weights=rank_topk_weights, expert_alignment=1, config=config,
                                previous_event=previous_event, async_finish=True, allocate_on_comm_stream=False)
        if event.event is not None:
            event.current_stream_wait()
        assert isinstance(event, deep_ep.EventOverlap) and sum(expert_num_tokens_per_expert_list) == \
            int((expert_topk_ids >= 0).sum())
        combined_x, _, event = handle_buf.combine(x=token_data, handle=handle, topk_weights=None,
                                                  config=deep_ep.Buffer.get_combine_config(num_dispatchers),
                                                  previous_event=handle_buf.capture(), async_finish=True,
                                                  allocate_on_comm_stream=False)
        if event.event is not None:
            event.current_stream_wait()
        assert torch.equal(combined_x, (a1.float() * _copies(rank_topk_ids)).to(torch.bfloat16))
        handle_buf.destroy()
        deep_ep.Buffer.set_num_sms(24)
        # Low latency
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank=T_MAX, hidden=H, num_ranks=num_dispatchers, num_experts=E)
        ll = deep_ep.Buffer(group=cpu_group, num_nvl_bytes=1024 * 1024 * 1024, num_rdma_bytes=num_rdma_bytes,
                            low_latency_mode=True, num_qps_per_rank=E // num_dispatchers,
                            allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=True,
                            enable_shrink=True)
        expert_x, expert_num_tokens, ll_handle, event, hook = ll.low_latency_dispatch(
            a1, rank_topk_ids, T_MAX, E, use_fp8=False, async_finish=False, return_recv_hook=False)
        output = torch.empty_like(a1)
        out, event, hook = ll.low_latency_combine(expert_x, rank_topk_ids, rank_topk_weights, ll_handle,
                                                  async_finish=False, zero_copy=False, return_recv_hook=False,
                                                  out=output)
        assert out.data_ptr() == output.data_ptr()
        assert torch.allclose(out.float(), a1.float() * rank_topk_weights.sum(1, keepdim=True), rtol=2e-2, atol=2e-2)
        ll.destroy()
    return {"tokens": int(expert_num_tokens.sum())}


def check_vllm_deepep_v2(use_cudagraph: bool) -> Dict[str, Any]:
    """DeepEPV2All2AllManager's buffer kwargs and DeepEPV2PrepareAndFinalize: decode (no expand, no CPU
    sync, worst-case rows) or prefill (expand, CPU sync); combine async on the comm stream."""
    with deep_ep_installed():
        import deep_ep  # type: ignore[import-not-found]
        timeout_secs = 1800
        buffer_kwargs = dict(group=dist.group.WORLD, num_max_tokens_per_rank=T_MAX, hidden=H, num_topk=K,
                             use_fp8_dispatch=False, allow_hybrid_mode=True, prefer_overlap_with_compute=True,
                             allow_multiple_reduction=True, num_cpu_timeout_secs=timeout_secs,
                             num_gpu_timeout_secs=timeout_secs, explicitly_destroy=True)
        handle_buf = deep_ep.ElasticBuffer(**buffer_kwargs)
        num_sms = handle_buf.get_theoretical_num_sms(num_experts=E, num_topk=K)
        assert num_sms >= 4
        tokens, rank_topk_ids, rank_topk_weights = _tokens(5, 6)
        do_expand = do_cpu_sync = not use_cudagraph
        num_max_tokens_per_rank = None
        if not do_expand:
            n = tokens.shape[0]
            num_max_tokens_per_rank = min(1 << max(n - 1, 0).bit_length(), T_MAX)
        recv_x, recv_topk_idx, recv_topk_weights, handle, event = handle_buf.dispatch(
            x=tokens, topk_idx=rank_topk_ids, topk_weights=rank_topk_weights, num_experts=E,
            num_max_tokens_per_rank=num_max_tokens_per_rank, do_expand=do_expand, do_cpu_sync=do_cpu_sync,
            async_with_compute_stream=False)
        recv_expert_num_tokens = handle.num_recv_tokens_per_expert_list
        psum_recv_per_rank = handle.psum_num_recv_tokens_per_scaleup_rank
        if event.event is not None:
            event.current_stream_wait()
        assert bool(recv_expert_num_tokens) == do_cpu_sync
        if recv_topk_idx is not None:     # globalize in place, as the Triton kernel does
            rows = torch.arange(recv_topk_idx.shape[0]).unsqueeze(1)
            offset = dist.get_rank() * (E // dist.get_world_size())
            valid = (recv_topk_idx >= 0) & (rows < psum_recv_per_rank[-1])
            recv_topk_idx.copy_(torch.where(valid, recv_topk_idx + offset, torch.full_like(recv_topk_idx, -1)))
            assert recv_x.shape[0] == num_max_tokens_per_rank * dist.get_world_size()
        if recv_topk_weights is not None and recv_topk_weights.ndim == 1:
            recv_topk_weights = recv_topk_weights.unsqueeze(1)
        fused_expert_output = recv_x
        combined_x, _, event = handle_buf.combine(x=fused_expert_output, handle=handle, topk_weights=None,
                                                  async_with_compute_stream=True, allocate_on_comm_stream=True)
        output = torch.empty_like(tokens)
        if event.event is not None:
            event.current_stream_wait()
        output.copy_(combined_x, non_blocking=True)
        r_n = dist.get_world_size()
        if do_expand:
            copies = torch.stack([((rank_topk_ids // (E // r_n)) == d).sum(1) for d in range(r_n)], 1).sum(1, keepdim=True)
        else:
            copies = _copies(rank_topk_ids)
        assert torch.equal(output, (tokens.float() * copies).to(torch.bfloat16))
        handle_buf.destroy()
    return {"rows": int(recv_x.shape[0])}


@pytest.mark.parametrize("async_finish", [False, True])
def test_megatron_fused_a2a(pool2: Any, async_finish: bool) -> None:
    assert sum(r["rows"] for r in pool2.run(check_megatron_fused_a2a, 1, async_finish)) > 0


def test_megatron_fused_a2a_two_virtual_nodes(pool4: Any) -> None:
    assert sum(r["rows"] for r in pool4.run(check_megatron_fused_a2a, 2, True, timeout_s=120)) > 0


@pytest.mark.parametrize("async_finish", [False, True])
def test_sglang_deepep(pool2: Any, async_finish: bool) -> None:
    assert sum(r["rows"] for r in pool2.run(check_sglang_deepep, 1, async_finish)) > 0


def test_sglang_deepep_two_virtual_nodes(pool4: Any) -> None:
    assert sum(r["rows"] for r in pool4.run(check_sglang_deepep, 2, False, timeout_s=120)) > 0


@pytest.mark.parametrize("use_expand_layout", [False, True])
def test_sglang_deepep_v2(pool2: Any, use_expand_layout: bool) -> None:
    assert sum(r["rows"] for r in pool2.run(check_sglang_deepep_v2, use_expand_layout)) > 0


def test_vllm_deepep_ht_ll(pool2: Any) -> None:
    assert sum(r["tokens"] for r in pool2.run(check_vllm_deepep_ht_ll)) > 0


@pytest.mark.parametrize("use_cudagraph", [True, False])
def test_vllm_deepep_v2(pool2: Any, use_cudagraph: bool) -> None:
    assert sum(r["rows"] for r in pool2.run(check_vllm_deepep_v2, use_cudagraph)) > 0
