"""Hostile inputs to the DeepEP / Mooncake shims (issue 22's suite, area: compat). Each case asserts a
typed error (or the documented behaviour), then a correct round trip on the same buffer. Reference
backend, 2 gloo ranks. Among them: a caller whose low-latency shape changes every call (vLLM pads
batches to powers of two) no longer pins one buffer per shape forever -- at most max_ll_shapes stay
(docs/compat.md, "Low-latency buffers per shape")."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

from pyep.compat import deep_ep, mooncake

H, E, K = 256, 8, 3


def _inputs(n: int, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    x = torch.randn(n, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)])
    return x, idx, torch.rand(n, K, generator=gen)


def _ll_round_trip(buf: Any, t: int, seed: int) -> torch.Tensor:
    x, idx, w = _inputs(4, seed)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, E, use_fp8=False)
    out, _, _ = buf.low_latency_combine(recv, idx, w, handle)
    want = x.float() * w.sum(1, keepdim=True)
    assert torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2)
    return out


def case_ll_shape_flood_is_bounded() -> None:
    buf = deep_ep.Buffer(None, 0, 0, low_latency_mode=True, num_qps_per_rank=1, backend="reference", max_ll_shapes=2)
    x, idx, w = _inputs(4)
    _, _, first, _, _ = buf.low_latency_dispatch(x, idx, 4, E, use_fp8=False)
    for t in (5, 6, 7, 8):                                   # a new shape each call
        buf.low_latency_dispatch(x, idx, t, E, use_fp8=False)
        assert len(buf._buffers.buffers) <= 2
    assert sorted(k[0] for k in buf._buffers.buffers) == [7, 8]
    recv = torch.zeros(E // dist.get_world_size(), dist.get_world_size() * 4, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="evicted"):
        buf.low_latency_combine(recv, idx, w, first)
    _ll_round_trip(buf, 4, 1)                                # the evicted shape comes back, fresh
    assert sorted(k[0] for k in buf._buffers.buffers) == [4, 8]
    buf.destroy()


def case_mooncake_shape_flood_is_bounded() -> None:
    buf = mooncake.Buffer(None, backend="reference", max_ll_shapes=1)
    active = torch.ones(dist.get_world_size(), dtype=torch.int32)
    x, idx, w = _inputs(3)
    _, _, first, _, _ = buf.dispatch(x, idx, active, 4, E, 1_000_000, use_fp8=False)
    recv, _, handle, _, _ = buf.dispatch(x, idx, active, 6, E, 1_000_000, use_fp8=False)
    assert len(buf._buffers.buffers) == 1
    with pytest.raises(ValueError, match="evicted"):
        buf.combine(recv, idx, w, active, 1_000_000, first)
    out, _, _ = buf.combine(recv, idx, w, active, 1_000_000, handle)
    assert torch.allclose(out.float(), x.float() * w.sum(1, keepdim=True), rtol=2e-2, atol=2e-2)
    buf.destroy()


def case_max_ll_shapes_not_positive() -> None:
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="max_ll_shapes"):
            deep_ep.Buffer(None, 0, 0, low_latency_mode=True, num_qps_per_rank=1, backend="reference",
                           max_ll_shapes=bad)
        with pytest.raises(ValueError, match="max_ll_shapes"):
            mooncake.Buffer(None, backend="reference", max_ll_shapes=bad)
    buf = deep_ep.Buffer(None, 0, 0, low_latency_mode=True, num_qps_per_rank=1, backend="reference")
    _ll_round_trip(buf, 4, 2)
    buf.destroy()


def _normal_round_trip(buf: Any) -> Any:
    x, idx, w = _inputs(6, 3)
    ntpr, ntprr, ntpe, tir, _ = buf.get_dispatch_layout(idx, E)
    recv, _, r_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr,
                                              is_token_in_rank=tir, num_tokens_per_expert=ntpe, topk_idx=idx,
                                              topk_weights=w)
    out, out_w, _ = buf.combine(recv, handle, topk_weights=r_w)
    assert torch.equal(out_w, w) and out.shape == x.shape
    return recv, handle


def case_v1_forged_tuple_handle() -> None:
    buf = deep_ep.Buffer(None, int(1e9), 0, backend="reference")
    recv, handle = _normal_round_trip(buf)
    with pytest.raises(TypeError, match="handle"):
        buf.combine(recv, tuple(handle))
    with pytest.raises(TypeError, match="handle"):
        buf.dispatch(torch.zeros(6, H, dtype=torch.bfloat16), handle=list(handle))
    _normal_round_trip(buf)
    buf.destroy()


def case_v1_config_for_unsupported_rank_count() -> None:
    for bad in (3, 12, 0, -8):
        with pytest.raises(ValueError):
            deep_ep.Buffer.get_dispatch_config(bad)
    assert deep_ep.Buffer.get_dispatch_config(16).num_sms == deep_ep.Buffer.num_sms
    assert deep_ep.Buffer.get_combine_config(160).get_rdma_buffer_size_hint(7168 * 2, 160) == 0
    buf = deep_ep.Buffer(None, int(1e9), 0, backend="reference")
    _normal_round_trip(buf)
    buf.destroy()


def _v2() -> Any:
    return deep_ep.ElasticBuffer(None, num_max_tokens_per_rank=8, hidden=H, backend="reference")


def _v2_round_trip(buf: Any, **kw: Any) -> None:
    x, idx, w = _inputs(6, 4)
    recv, _, r_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, **kw)
    out, out_w, _ = buf.combine(recv, handle, topk_weights=r_w)
    assert torch.equal(out_w, w) and out.shape == x.shape


def _v2_case(call: Callable[[Any, Any], None], error: type, match: str) -> Callable[[], None]:
    def case() -> None:
        buf = _v2()
        x, idx, w = _inputs(6, 4)
        ctx = dict(x=x, idx=idx, w=w)
        with pytest.raises(error, match=match):
            call(buf, ctx)
        _v2_round_trip(buf)
        _v2_round_trip(buf, do_cpu_sync=False)
        buf.destroy()
    return case


def _with_handle(buf: Any, c: Dict[str, Any], **kw: Any) -> Any:
    return buf.dispatch(c["x"], topk_idx=c["idx"], topk_weights=c["w"], num_experts=E, **kw)[3]


V2_CASES: List[Tuple[str, Callable[[], None]]] = [
    ("v2_tokens_over_num_max_tokens_per_rank", _v2_case(
        lambda b, c: b.dispatch(torch.zeros(9, H, dtype=torch.bfloat16), topk_idx=torch.zeros(9, K, dtype=torch.int64),
                                num_experts=E), ValueError, "num_max_tokens_per_rank")),
    ("v2_scale_packs_too_wide", _v2_case(
        lambda b, c: b.dispatch((c["x"].to(torch.float8_e4m3fn), torch.zeros(6, H // 128 + 1, dtype=torch.int32)),
                                topk_idx=c["idx"], num_experts=E), ValueError, "packs")),
    ("v2_scale_packs_wrong_dtype", _v2_case(
        lambda b, c: b.dispatch((c["x"].to(torch.float8_e4m3fn), torch.zeros(6, 2, dtype=torch.float64)),
                                topk_idx=c["idx"], num_experts=E), ValueError, "fp32 or int32")),
    ("v2_flag_not_bool", _v2_case(
        lambda b, c: b.dispatch(c["x"], topk_idx=c["idx"], num_experts=E, async_with_compute_stream=2),
        TypeError, "async_with_compute_stream")),
    ("v2_num_experts_not_multiple_of_ranks", _v2_case(
        lambda b, c: b.dispatch(c["x"], topk_idx=c["idx"], num_experts=E + 1), ValueError, "multiple")),
    ("v2_stats_wrong_shape", _v2_case(
        lambda b, c: b.dispatch(c["x"], topk_idx=c["idx"], num_experts=E,
                                cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int64)),
        ValueError, "cumulative_local_expert_recv_stats")),
    ("v2_zero_padding_without_expand", _v2_case(
        lambda b, c: b.dispatch(c["x"], topk_idx=c["idx"], num_experts=E, do_zero_padding=True),
        ValueError, "do_zero_padding")),
    ("v2_expanded_combine_wrong_rows", _v2_case(
        lambda b, c: b.combine(torch.zeros(1, H, dtype=torch.bfloat16), _with_handle(b, c, do_expand=True)),
        ValueError, "expanded handle")),
    ("v2_cached_weights_wrong_shape", _v2_case(
        lambda b, c: b.dispatch(c["x"], topk_weights=torch.zeros(6, K + 1), handle=_with_handle(b, c)),
        ValueError, "topk_weights")),
    ("v2_cached_with_topk_idx", _v2_case(
        lambda b, c: b.dispatch(c["x"], topk_idx=c["idx"], handle=_with_handle(b, c)), ValueError, "topk_idx=None")),
    ("v2_handle_not_an_ephandle", _v2_case(
        lambda b, c: b.combine(c["x"], ("not", "a", "handle")), TypeError, "EPHandle")),
    ("v2_num_sms_negative", _v2_case(
        lambda b, c: b.dispatch(c["x"], topk_idx=c["idx"], num_experts=E, num_sms=-2), ValueError, "num_sms")),
    ("v2_missing_num_experts", _v2_case(
        lambda b, c: b.dispatch(c["x"], topk_idx=c["idx"]), ValueError, "num_experts")),
    ("v2_x_tuple_of_three", _v2_case(
        lambda b, c: b.dispatch((c["x"], c["x"], c["x"]), topk_idx=c["idx"], num_experts=E), ValueError, "tuple")),
]


def case_v2_engram_cpu_bytes() -> None:
    with pytest.raises(NotImplementedError, match="Engram"):
        deep_ep.ElasticBuffer(None, num_bytes=1 << 22, num_cpu_bytes=1 << 21, backend="reference")
    buf = _v2()
    _v2_round_trip(buf)
    buf.destroy()


CASES: List[Tuple[str, Callable[[], None]]] = [
    ("ll_shape_flood_is_bounded", case_ll_shape_flood_is_bounded),
    ("mooncake_shape_flood_is_bounded", case_mooncake_shape_flood_is_bounded),
    ("max_ll_shapes_not_positive", case_max_ll_shapes_not_positive),
    ("v1_forged_tuple_handle", case_v1_forged_tuple_handle),
    ("v1_config_for_unsupported_rank_count", case_v1_config_for_unsupported_rank_count),
    ("v2_engram_cpu_bytes", case_v2_engram_cpu_bytes),
] + V2_CASES


def run_case(name: str) -> str:
    dict(CASES)[name]()
    return name


@pytest.mark.parametrize("name", [name for name, _ in CASES], ids=[name for name, _ in CASES])
def test_hostile_compat(pool2: Any, name: str) -> None:
    assert pool2.run(run_case, name) == [name, name]
