"""EpBuffer behaviour around the computation: every bad argument is refused before anything is sent and
leaves the buffer usable (bad expert-id values: tests/test_ep_value_errors.py), handle lifetime rules
(two in flight, foreign, stale after membership change, destroy), the transport table, and bounded
waits when a peer never shows up."""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

from multiproc import DistPool
from pyep.ep.ll import EpBuffer

T, H, E = 8, 256, 8


def _make(seed: int, n: int = 5) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    x = torch.randn(n, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(n)])
    return x, idx, torch.rand(n, 2, generator=gen)


def _round_trip(buf: EpBuffer, seed: int) -> torch.Tensor:
    """dispatch + identity experts + combine; out must equal sum_k w_k * x (fp32, then bf16)."""
    x, idx, w = _make(seed)
    recv, _, handle, _, _ = buf.dispatch(x, idx, use_fp8=False)
    out, _, _ = buf.combine(recv, idx, w, handle)
    want = (w[:, 0:1] * x.float() + w[:, 1:2] * x.float()).to(torch.bfloat16)
    assert torch.equal(out, want)
    return out


def check_bad_inputs_leave_buffer_usable() -> int:
    buf = EpBuffer(backend="reference", num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E)
    x, idx, w = _make(1)
    recv, _, handle, _, _ = buf.dispatch(x, idx, use_fp8=False)
    e_l = E // dist.get_world_size()
    bad: List[Tuple[str, Callable[[], Any], type]] = [
        ("x fp32", lambda: buf.dispatch(x.float(), idx), TypeError),
        ("x wrong H", lambda: buf.dispatch(x[:, :128].contiguous(), idx), ValueError),
        ("x non-contiguous", lambda: buf.dispatch(torch.cat([x, x], 1)[:, ::2], idx), ValueError),
        ("N > T", lambda: buf.dispatch(torch.zeros(T + 1, H, dtype=torch.bfloat16),
                                       torch.zeros(T + 1, 1, dtype=torch.int64)), ValueError),
        ("idx int32", lambda: buf.dispatch(x, idx.int()), TypeError),
        ("idx rows", lambda: buf.dispatch(x, idx[:2].contiguous()), ValueError),
        ("K > 16", lambda: buf.dispatch(x, torch.full((5, 17), -1, dtype=torch.int64)), ValueError),
        ("ue8m0 w/o round", lambda: buf.dispatch(x, idx, use_fp8=True, use_ue8m0=True), ValueError),
        ("active size", lambda: buf.dispatch(x, idx, active_ranks=torch.ones(9, dtype=torch.int32)), ValueError),
        ("active dtype", lambda: buf.dispatch(x, idx, active_ranks=torch.ones(2, dtype=torch.bool)), TypeError),
        ("timeout 0", lambda: buf.dispatch(x, idx, timeout_us=0), ValueError),
        ("stats shape", lambda: buf.dispatch(x, idx, cumulative_local_expert_recv_stats=torch.zeros(
            e_l + 1, dtype=torch.int32)), ValueError),
        ("combine x shape", lambda: buf.combine(recv[:, :1].contiguous(), idx, w, handle), ValueError),
        ("combine fp8 x", lambda: buf.combine(recv.to(torch.float8_e4m3fn), idx, w, handle), TypeError),
        ("combine idx shape", lambda: buf.combine(recv, idx[:, :1].contiguous(), w, handle), ValueError),
        ("combine w dtype", lambda: buf.combine(recv, idx, w.double(), handle), TypeError),
        ("combine out", lambda: buf.combine(recv, idx, w, handle, out=torch.zeros(5, H)), TypeError),
        ("combine handle tuple", lambda: buf.combine(recv, idx, w, tuple(handle)), TypeError),
        ("combine logfmt-like flag", lambda: buf.combine(recv, idx, w, handle, zero_copy=None), TypeError),
        ("both async+hook", lambda: buf.combine(recv, idx, w, handle, async_finish=True,
                                                return_recv_hook=True), ValueError),
        ("next buffer of tuple", lambda: buf.get_next_combine_buffer(tuple(handle)), TypeError),
        ("update bad active", lambda: buf.update_ep_member(torch.ones(3)), TypeError),
    ]
    for name, call, exc in bad:
        if name.startswith("combine") or name == "both async+hook":
            # A refused dispatch keeps its call number (its peers got its abort marker): the handle of a
            # fresh dispatch is the one the combines are refused for.
            recv, _, handle, _, _ = buf.dispatch(x, idx, use_fp8=False)
        with pytest.raises(exc):
            call()
        del name
    # Every refused call took part in its exchange (both ranks refused the same ones). The last refused
    # combine stood for its handle's combine on every rank, so that handle is refused (CombineAfterRefusal,
    # before anything is sent); the buffer works: a new dispatch combines.
    from pyep.ep.ll.errors import CombineAfterRefusal
    with pytest.raises(CombineAfterRefusal):
        buf.combine(recv, idx, w, handle)
    recv, _, handle, _, _ = buf.dispatch(x, idx, use_fp8=False)
    out, _, _ = buf.combine(recv, idx, w, handle)
    assert out.shape == (5, H)
    _round_trip(buf, 2)
    buf.destroy()
    return len(bad)


def check_handle_lifetime() -> Dict[str, str]:
    seen: Dict[str, str] = {}
    with EpBuffer(backend="reference", num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E) as buf:
        xa, ia, wa = _make(3)
        xb, ib, wb = _make(4)
        ra, _, ha, _, _ = buf.dispatch(xa, ia, use_fp8=False)
        rb, _, hb, _, _ = buf.dispatch(xb, ib, use_fp8=False)
        assert (ha.seq, ha.buffer_idx, hb.seq, hb.buffer_idx) == (1, 1, 2, 0)
        buf.combine(ra, ia, wa, ha)          # two results in flight: both combine
        buf.combine(rb, ib, wb, hb)
        xc, ic, wc = _make(5)
        rc, _, hc, _, _ = buf.dispatch(xc, ic, use_fp8=False)
        with pytest.raises(ValueError, match="stale") as ei:
            buf.combine(ra, ia, wa, ha)
        seen["stale"] = str(ei.value)
        with pytest.raises(ValueError, match="stale"):
            buf.get_next_combine_buffer(ha)
        buf.combine(rb, ib, wb, hb)
        zc = buf.get_next_combine_buffer(hc)
        assert zc.shape == (E // dist.get_world_size(), dist.get_world_size() * T, H)
        with EpBuffer(backend="reference", num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E) as other:
            with pytest.raises(ValueError, match="another EpBuffer") as ei:
                other.combine(rc, ic, wc, hc)
            seen["foreign"] = str(ei.value)
            _round_trip(other, 6)
        buf.update_ep_member(torch.ones(dist.get_world_size(), dtype=torch.int32))
        with pytest.raises(ValueError, match="update_ep_member") as ei:
            buf.combine(rc, ic, wc, hc)
        seen["epoch"] = str(ei.value)
        _round_trip(buf, 7)
        buf.clean()
        table = buf.transport_table()
        assert [p.rank for p in table] == list(range(dist.get_world_size()))
        assert table[dist.get_rank()].kind == "local"
        assert "backend reference" in buf.describe()
    with pytest.raises(RuntimeError, match="after destroy"):
        buf.dispatch(xa, ia)
    buf.destroy()   # idempotent
    return seen


def test_bad_inputs_leave_buffer_usable(pool2: Any) -> None:
    assert pool2.run(check_bad_inputs_leave_buffer_usable) == [22, 22]


def test_handle_lifetime(pool2: Any) -> None:
    seen = pool2.run(check_handle_lifetime)[0]
    assert "dispatch #1" in seen["stale"] and "#3" in seen["stale"]
    assert "another EpBuffer" in seen["foreign"]


def test_construction_errors_single_process() -> None:
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        EpBuffer(backend="reference", hidden=256, num_experts=8)
    with pytest.raises(TypeError, match="ProcessGroup"):
        EpBuffer(group="world", backend="reference", hidden=256, num_experts=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hidden"):
        EpBuffer(backend="reference", hidden=100)
    with pytest.raises(TypeError, match="EpConfig"):
        EpBuffer.from_config({"hidden": 256})  # type: ignore[arg-type]


def check_group_size_rules() -> str:
    with pytest.raises(ValueError, match="divisible") as ei:
        EpBuffer(backend="reference", hidden=256, num_experts=dist.get_world_size() + 1)
    return str(ei.value)


def test_group_size_rules(pool2: Any) -> None:
    assert "must be divisible by the number of ranks (2)" in pool2.run(check_group_size_rules)[0]


def check_timeout(absent_rank: int, timeout_us: int) -> Dict[str, Any]:
    buf = EpBuffer(backend="reference", num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E)
    if dist.get_rank() == absent_rank:
        time.sleep(timeout_us / 1e6 + 1.5)   # never calls dispatch
        return {"absent": True}
    x, idx, _ = _make(8)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as ei:
        buf.dispatch(x, idx, use_fp8=False, timeout_us=timeout_us)
    return {"absent": False, "elapsed": time.monotonic() - t0, "msg": str(ei.value)}


def test_missing_peer_times_out() -> None:
    # Its own pool: after a timed-out collective the gloo group is unusable.
    with DistPool(2) as pool:
        res = pool.run(check_timeout, 1, 300_000, timeout_s=60)
    waited = res[0]
    assert res[1]["absent"] and not waited["absent"]
    assert waited["elapsed"] < 0.3 + 1.0, f"waited {waited['elapsed']:.2f} s for a 0.3 s timeout"
    assert "dispatch #1" in waited["msg"] and "[0, 1]" in waited["msg"] and "300000 us" in waited["msg"]
