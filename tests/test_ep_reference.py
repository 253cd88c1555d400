"""The reference backend through EpBuffer in 2- and 4-rank gloo groups, against a brute-force per-token
oracle: received rows, src_info, layout_range, counts, FP8 bytes and scales, and combine values
(bitwise: the oracle does the same fp32 arithmetic one token and one top-k slot at a time).

Every rank can rebuild every rank's inputs from the case seed, so the oracle needs no communication.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from pyep.ep.ll import EpBuffer
from pyep.ep import fp8

Case = Dict[str, Any]


def _inputs(case: Case, rank: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x bf16 [N, H], topk_idx int64 [N, K] (distinct experts per row, some -1), weights fp32 [N, K]."""
    gen = torch.Generator().manual_seed(case["seed"] * 1000 + rank)
    t, h, e, k = case["T"], case["H"], case["E"], case["K"]
    n = case["N"][rank] if "N" in case else int(torch.randint(0, t + 1, (1,), generator=gen))
    x = (torch.randn(n, h, generator=gen) * (1 + rank)).to(torch.bfloat16)
    if case.get("hot") is not None:
        idx = torch.full((n, k), -1, dtype=torch.int64)
        idx[:, 0] = case["hot"]
    else:
        idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]) if n else \
            torch.zeros((0, k), dtype=torch.int64)
        drop = torch.rand(n, k, generator=gen) < case.get("neg", 0.2)
        idx = torch.where(drop, torch.full_like(idx, -1), idx)
    w = torch.rand(n, k, generator=gen) + 0.25
    return x, idx.contiguous(), w


def _views(case: Case, key: str, r_n: int) -> List[List[int]]:
    """Per rank, its view of which ranks are active (all ones unless the case says otherwise)."""
    views = case.get(key)
    return [list(views[r]) if views else [1] * r_n for r in range(r_n)]


def _expert_fn(global_expert: int, rows: torch.Tensor) -> torch.Tensor:
    """A per-row, elementwise 'expert': the same bits whichever rank computes it."""
    return (rows.float() * (0.5 + global_expert / 8) + global_expert / 16).to(torch.bfloat16)


def _dequant_rows(case: Case, x: torch.Tensor) -> torch.Tensor:
    if not case.get("fp8"):
        return x
    q, s = fp8.quantize_fp8(x, case.get("round_scale", False))
    return fp8.dequantize_fp8(q, s).to(torch.bfloat16)


def run_case(case: Case) -> Dict[str, Any]:
    rank, r_n = dist.get_rank(), dist.get_world_size()
    t_max, h, e, k = case["T"], case["H"], case["E"], case["K"]
    e_l = e // r_n
    use_fp8, rs, ue = case.get("fp8", False), case.get("round_scale", False), case.get("ue8m0", False)
    mode = case.get("mode", "sync")
    inputs = [_inputs(case, r) for r in range(r_n)]
    x, idx, w = inputs[rank]
    dview, cview = _views(case, "dispatch_active", r_n), _views(case, "combine_active", r_n)
    buf = EpBuffer(backend=case.get("backend", "reference"), num_max_dispatch_tokens_per_rank=t_max,
                   hidden=h, num_experts=e, max_topk=max(k, 1))
    stats = torch.full((e_l,), 7, dtype=torch.int32)
    d_active = torch.tensor(dview[rank], dtype=torch.int32) if case.get("dispatch_active") else None
    recv, count, handle, event, hook = buf.dispatch(
        x, idx, use_fp8=use_fp8, round_scale=rs, use_ue8m0=ue, active_ranks=d_active,
        async_finish=mode == "async", return_recv_hook=mode == "hook",
        cumulative_local_expert_recv_stats=stats)
    recv_x, scales = recv if use_fp8 else (recv, None)
    if mode == "hook":
        assert hook is not None and int(count.abs().sum()) == 0, "outputs must wait for the hook"
        hook()
        hook()   # a second call is harmless
    else:
        assert hook is None
        event.current_stream_wait()
        event.wait()
    rows = r_n * t_max
    assert recv_x.shape == (e_l, rows, h) and count.shape == (e_l,) and count.dtype == torch.int32
    assert recv_x.dtype == (torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
    assert handle.src_info.shape == (e_l, rows) and handle.src_info.dtype == torch.int32
    assert handle.layout_range.shape == (e_l, r_n) and handle.layout_range.dtype == torch.int64
    if use_fp8:
        want = (e_l, rows, fp8.num_packed_ue8m0(h)) if ue else (e_l, rows, h // 128)
        assert scales.shape == want and scales.dtype == (torch.int32 if ue else torch.float32)
        assert scales.stride(1) == 1, "scales must be column-major per expert"

    # ---- dispatch oracle: rows per local expert in (source rank, token, k) order
    total = 0
    for le in range(e_l):
        g = rank * e_l + le
        expect: List[Tuple[int, int]] = []
        begin = 0
        for s in range(r_n):
            xs, ids, _ = inputs[s]
            got_rng = int(handle.layout_range[le, s])
            mine = []
            if dview[s][rank] and dview[rank][s]:
                mine = [(s, t) for t in range(ids.shape[0]) for kk in range(k) if int(ids[t, kk]) == g]
            assert got_rng == (begin << 32) | len(mine), \
                f"layout_range[{le}][{s}]={got_rng:#x}, want begin {begin} count {len(mine)}"
            begin += len(mine)
            expect += mine
        n_e = len(expect)
        total += n_e
        assert int(count[le]) == n_e and int(stats[le]) == 7 + n_e
        want_src = torch.tensor([t for _, t in expect], dtype=torch.int32)
        assert torch.equal(handle.src_info[le, :n_e], want_src)
        assert int(handle.src_info[le, n_e:].abs().sum()) == 0
        for i, (s, t) in enumerate(expect):
            row = inputs[s][0][t:t + 1]
            if use_fp8:
                q, sc = fp8.quantize_fp8(row, rs)
                assert torch.equal(recv_x[le, i].view(torch.uint8), q[0].view(torch.uint8)), (le, i, s, t)
                want_sc = fp8.pack_ue8m0(sc)[0] if ue else sc[0]
                assert torch.equal(scales[le, i], want_sc), (le, i)
            else:
                assert torch.equal(recv_x[le, i].view(torch.int16), row[0].view(torch.int16)), (le, i, s, t)
        assert int(recv_x[le, n_e:].view(torch.uint8).abs().sum()) == 0

    # ---- experts, then combine
    ybuf = torch.zeros((e_l, rows, h), dtype=torch.bfloat16)
    for le in range(e_l):
        n_e = int(count[le])
        src_rows = recv_x[le, :n_e]
        if use_fp8:
            sc = scales[le, :n_e]
            sc = fp8.unpack_ue8m0(sc, h // 128) if ue else sc
            src_rows = fp8.dequantize_fp8(src_rows, sc).to(torch.bfloat16)
        ybuf[le, :n_e] = _expert_fn(rank * e_l + le, src_rows)
    c_active = torch.tensor(cview[rank], dtype=torch.int32) if case.get("combine_active") else None
    out_arg: Optional[torch.Tensor] = torch.full((x.shape[0], h), 3.0, dtype=torch.bfloat16) \
        if case.get("out") else None
    x_arg = ybuf
    if case.get("zero_copy"):
        buf.get_next_combine_buffer(handle).copy_(ybuf)
        x_arg = torch.full_like(ybuf, 9.0)     # must be ignored
    out, event, hook = buf.combine(x_arg, idx, w, handle, active_ranks=c_active, zero_copy=case.get("zero_copy", False),
                                   async_finish=mode == "async", return_recv_hook=mode == "hook", out=out_arg)
    if mode == "hook":
        hook()
    if out_arg is not None:
        assert out is out_arg
    assert out.shape == (x.shape[0], h) and out.dtype == torch.bfloat16
    owner_of = lambda gexp: gexp // e_l  # noqa: E731
    for t in range(x.shape[0]):
        acc = torch.zeros(h, dtype=torch.float32)
        for kk in range(k):
            g = int(idx[t, kk])
            if g < 0:
                continue
            d = owner_of(g)
            if not (dview[rank][d] and dview[d][rank] and cview[d][rank] and cview[rank][d]):
                continue
            y = _expert_fn(g, _dequant_rows(case, x[t:t + 1]))[0]
            acc = acc + w[t, kk] * y.float()
        assert torch.equal(out[t].view(torch.int16), acc.to(torch.bfloat16).view(torch.int16)), \
            f"rank {rank} token {t}: max diff {(out[t].float() - acc).abs().max()}"
    result = {"received": total, "backend": buf.backend_name}
    buf.destroy()
    return result


BASE: Case = dict(T=12, H=256, E=8, K=3, seed=1)

CASES_2 = {
    "bf16": dict(BASE),
    "bf16_k1": dict(BASE, K=1, seed=2),
    "n0_and_nT": dict(BASE, N=[0, 12], seed=3),
    "all_T": dict(BASE, N=[12, 12], seed=4, neg=0.0),
    "one_hot_expert": dict(BASE, hot=5, N=[12, 12], seed=5),
    "mostly_minus_one": dict(BASE, neg=0.9, seed=6),
    "max_topk": dict(BASE, E=32, K=16, T=6, neg=0.1, seed=7),
    "fp8": dict(BASE, fp8=True, seed=8),
    "fp8_round_scale": dict(BASE, fp8=True, round_scale=True, seed=9),
    "fp8_ue8m0_h384": dict(BASE, H=384, fp8=True, round_scale=True, ue8m0=True, seed=10),
    "hook": dict(BASE, mode="hook", seed=11),
    "async": dict(BASE, mode="async", seed=12),
    "zero_copy_out": dict(BASE, zero_copy=True, out=True, seed=13),
    "rank1_dead_everywhere": dict(BASE, dispatch_active=[[1, 0], [1, 0]], combine_active=[[1, 0], [1, 0]], seed=14),
    "rank0_thinks_1_dead": dict(BASE, dispatch_active=[[1, 0], [1, 1]], seed=15),
    "dead_only_at_combine": dict(BASE, combine_active=[[1, 0], [1, 1]], seed=16),
    "auto_backend": dict(BASE, backend="auto", seed=17),
}

CASES_4 = {
    "bf16": dict(BASE, E=8, seed=21),
    "varied_n": dict(BASE, E=16, K=4, N=[0, 12, 5, 1], seed=22),
    "one_hot_expert": dict(BASE, hot=7, N=[12, 3, 0, 12], seed=23),
    "fp8_ue8m0": dict(BASE, E=12, fp8=True, round_scale=True, ue8m0=True, H=640, seed=24),
    "hook_zero_copy": dict(BASE, mode="hook", zero_copy=True, seed=25),
    "rank2_dead": dict(BASE, dispatch_active=[[1, 1, 0, 1]] * 4, combine_active=[[1, 1, 0, 1]] * 4, seed=26),
    "mixed_views": dict(BASE, dispatch_active=[[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]],
                        combine_active=[[1, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 1]], seed=27),
}


@pytest.mark.parametrize("name", list(CASES_2))
def test_two_ranks(pool2: Any, name: str) -> None:
    res = pool2.run(run_case, CASES_2[name])
    assert all(r["backend"] == "reference" for r in res)
    if name not in ("mostly_minus_one",) and "dead" not in name:
        assert sum(r["received"] for r in res) > 0


@pytest.mark.parametrize("name", list(CASES_4))
def test_four_ranks(pool4: Any, name: str) -> None:
    res = pool4.run(run_case, CASES_4[name])
    assert sum(r["received"] for r in res) > 0
