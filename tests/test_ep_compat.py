"""The drop-in shims give the same results as EpBuffer and keep their libraries' call shapes:
pyep.compat.deep_ep.Buffer (DeepEP low-latency API) and pyep.compat.mooncake.Buffer (Mooncake EP)."""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

from pyep.compat import deep_ep, mooncake
from pyep.ep.ll import EpBuffer

T, H, E = 8, 256, 8


def _inputs(seed: int, n: int = 6):
    gen = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    x = torch.randn(n, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:3] for _ in range(n)])
    idx[0, 1] = -1
    return x, idx, torch.rand(n, 3, generator=gen)


def _experts(recv: torch.Tensor) -> torch.Tensor:
    return (recv.float() * 0.75 + 0.5).to(torch.bfloat16)


def check_deep_ep() -> Dict[str, Any]:
    x, idx, w = _inputs(1)
    ref = EpBuffer(backend="reference", num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E)
    (rq, rs), rcount, rh, _, _ = ref.dispatch(x, idx, use_fp8=True, round_scale=True, use_ue8m0=True)
    rout, _, _ = ref.combine(_experts(rq.float().to(torch.bfloat16)), idx, w, rh)

    buf = deep_ep.Buffer(None, 0, 0, low_latency_mode=True, num_qps_per_rank=1, backend="reference")
    stats = torch.zeros(E // dist.get_world_size(), dtype=torch.int32)
    (q, s), count, handle, event, hook = buf.low_latency_dispatch(
        x, idx, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=True, round_scale=True,
        use_ue8m0=True, return_recv_hook=True)
    hook()
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert torch.equal(count, rcount) and torch.equal(stats, rcount)
    src_info, layout_range, t, h, e = handle
    assert torch.equal(src_info, rh.src_info) and torch.equal(layout_range, rh.layout_range)
    assert (t, h, e) == (T, H, E)
    zc = buf.get_next_low_latency_combine_buffer(handle)
    zc.copy_(_experts(q.float().to(torch.bfloat16)))
    out, event, hook = buf.low_latency_combine(torch.empty_like(zc), idx, w, handle, zero_copy=True,
                                               async_finish=True)
    with event:
        pass
    event.current_stream_wait()
    assert hook is None and torch.equal(out, rout)
    with pytest.raises(ValueError, match="use_logfmt=True needs hidden to be a multiple of 512"):
        buf.low_latency_combine(zc, idx, w, handle, use_logfmt=True)   # passed through, checked by EpBuffer
    waits = torch.zeros(dist.get_world_size(), dtype=torch.int64)   # accepted, per source (test_compat_wait_stats.py)
    buf.low_latency_dispatch(x, idx, T, E, dispatch_wait_recv_cost_stats=waits)
    assert waits.dtype == torch.int64 and min(waits.tolist()) >= 0
    with pytest.raises(TypeError, match="handle"):
        buf.low_latency_combine(zc, idx, w, (src_info, layout_range, t, h, e))
    with pytest.raises(ValueError, match="another Buffer"):
        deep_ep.Buffer(backend="reference").low_latency_combine(zc, idx, w, handle)
    # A second shape gets its own buffer; BF16 dispatch returns a bare tensor.
    x2 = torch.zeros(2, 2 * H, dtype=torch.bfloat16)
    recv2, _, h2, _, _ = buf.low_latency_dispatch(x2, idx[:2].contiguous(), T, E, use_fp8=False)
    assert isinstance(recv2, torch.Tensor) and recv2.shape[-1] == 2 * H and h2.hidden == 2 * H
    buf.clean_low_latency_buffer(T, H, E)
    with pytest.raises(ValueError, match="stale"):
        buf.low_latency_combine(zc, idx, w, handle)
    kinds = [p.kind for p in buf.ep_buffer(T, H, E).transport_table()]
    buf.destroy()
    with pytest.raises(RuntimeError, match="after destroy"):
        buf.low_latency_dispatch(x, idx, T, E)
    ref.destroy()
    return {"kinds": kinds}


def check_mooncake() -> Dict[str, Any]:
    r_n, rank = dist.get_world_size(), dist.get_rank()
    x, idx, w = _inputs(2)
    ref = EpBuffer(backend="reference", num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E)
    active = torch.ones(r_n, dtype=torch.int32)
    active[r_n - 1] = 0
    rrecv, rcount, rh, _, _ = ref.dispatch(x, idx, use_fp8=False, active_ranks=active)
    rout, _, _ = ref.combine(_experts(rrecv), idx, w, rh, active_ranks=active)

    buf = mooncake.Buffer(None, 0, backend="reference")
    recv, count, handle, event, hook = buf.dispatch(x, idx, active, T, E, 500_000, use_fp8=False)
    assert hook is None and torch.equal(recv, rrecv) and torch.equal(count, rcount)
    if rank == r_n - 1:
        assert int(count.sum()) == 0     # everybody, itself included, treats it as gone
    out, event, hook = buf.combine(_experts(recv), idx, w, active, 500_000, handle)
    assert torch.equal(out, rout) and active.tolist() == [1] * (r_n - 1) + [0]
    # Mooncake's -1 (no timeout) becomes a long bound; the call runs.
    _, count_unbounded, _, _, _ = buf.dispatch(x, idx, active, T, E, -1, use_fp8=False)
    assert torch.equal(count_unbounded, rcount)
    with pytest.raises(TypeError, match="active_ranks is required"):
        buf.combine(recv, idx, w, None, 500_000, handle)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="active_ranks must have shape"):
        buf.dispatch(x, idx, torch.ones(r_n + 1, dtype=torch.int32), T, E, 500_000)
    buf.update_ep_member()
    with pytest.raises(ValueError, match="stale"):
        buf.get_next_combine_buffer(handle)
    recv, _, handle, _, _ = buf.dispatch(x, idx, torch.ones(r_n, dtype=torch.int32), T, E, 500_000,
                                         use_fp8=True)
    assert isinstance(recv, tuple) and recv[0].dtype == torch.float8_e4m3fn
    assert buf.get_next_combine_buffer(handle).shape == (E // r_n, r_n * T, H)
    buf.destroy()
    ref.destroy()
    return {"received": int(count.sum())}


def test_deep_ep_shim(pool2: Any) -> None:
    res = pool2.run(check_deep_ep)
    assert res[0]["kinds"] == ["local", "reference"] and res[1]["kinds"] == ["reference", "local"]


def test_mooncake_shim(pool2: Any) -> None:
    res = pool2.run(check_mooncake)
    assert res[0]["received"] > 0 and res[1]["received"] == 0


def test_constructor_rejections() -> None:
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        deep_ep.Buffer(None, num_nvl_bytes=-1, low_latency_mode=False, backend="reference")
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        deep_ep.Buffer(None, num_rdma_bytes=-1, backend="reference")
    with pytest.raises(ValueError, match="num_qps_per_rank"):
        deep_ep.Buffer(None, num_qps_per_rank=-1, backend="reference")
    with pytest.raises(ValueError, match="low-latency mode"):
        deep_ep.Buffer(None, low_latency_mode=True, num_qps_per_rank=0, backend="reference")
    with pytest.raises(ValueError, match="transport"):
        deep_ep.Buffer(None, transport="smoke-signals")
    with pytest.raises(ValueError, match="num_ep_buffer_bytes"):
        mooncake.Buffer(None, -5)


def test_size_hints_match_ep() -> None:
    want = EpBuffer.size_hint(128, 7168, 288, 8)
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 288) == want
    assert mooncake.Buffer.get_ep_buffer_size_hint(128, 7168, 8, 288) == want
