"""The normal mode's reference backend through NormalBuffer on 2, 3 and 4 gloo ranks, against a
brute-force per-token oracle written from contract.py: layout, received rows (bit for bit, BF16 and
FP8 with scales), top-k ids/weights, source indices, per-expert counts with alignment, the prefix
matrices and send_head from their definitions, num_worst_tokens padding, cached dispatch, and combine
(fp32 in the contract's order, bias first, then ranks ascending; the oracle adds one token at a time).

Every rank rebuilds every rank's inputs from the case seed, so the oracle needs no communication.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from multiproc import DistPool
from pyep.ep.normal import Config, InvalidExpertIndex, NormalBuffer

Case = Dict[str, Any]


def make_inputs(case: Case, rank: int) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(x bf16 or e4m3 [N, H], fp32 scales or None, topk_idx int64 [N, K], topk_weights fp32 [N, K])."""
    gen = torch.Generator().manual_seed(case["seed"] * 1000 + rank)
    h, e, k, r_n = case["H"], case["E"], case["K"], case["R"]
    n = case["N"][rank] if "N" in case else int(torch.randint(0, case.get("T", 12) + 1, (1,), generator=gen))
    xf = torch.randn(n, h, generator=gen) * (1 + rank)
    if case.get("hot") is not None:
        idx = torch.full((n, k), -1, dtype=torch.int64)
        idx[:, 0] = case["hot"]
    else:
        pool = e // r_n if case.get("one_rank") else e          # one_rank: only rank 0's experts
        idx = torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(n)]) if n else \
            torch.zeros((0, k), dtype=torch.int64)
        drop = torch.rand(n, k, generator=gen) < case.get("neg", 0.2)
        idx = torch.where(drop, torch.full_like(idx, -1), idx)
    w = torch.rand(n, k, generator=gen) + 0.25
    if case.get("fp8"):
        scales = torch.rand(n, h // 128, generator=gen) + 0.5
        return xf.to(torch.float8_e4m3fn), scales, idx.contiguous(), w
    return xf.to(torch.bfloat16), None, idx.contiguous(), w


def channel_of(t: int, n: int, c_n: int) -> int:
    """From the contract's ranges: channel c covers [min(c*P, N), min((c+1)*P, N)), P = ceil(N/C)."""
    p = -(-n // c_n)
    for c in range(c_n):
        if min(c * p, n) <= t < min((c + 1) * p, n):
            return c
    raise AssertionError(f"token {t} of {n} in no channel")


def to_rank(idx: torch.Tensor, t: int, d: int, e_l: int) -> bool:
    return any(0 <= int(g) and int(g) // e_l == d for g in idx[t])


def dequant(x: torch.Tensor, scales: Optional[torch.Tensor]) -> torch.Tensor:
    if scales is None:
        return x
    return (x.float() * scales.repeat_interleave(128, dim=1)).to(torch.bfloat16)


def expert_fn(rank: int, rows: torch.Tensor) -> torch.Tensor:
    """Elementwise, so the same bits whichever rank computes it for whichever token."""
    return (rows.float() * (0.75 + rank / 4) + rank / 8).to(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def run_case(case: Case) -> Dict[str, Any]:
    me, r_n = dist.get_rank(), dist.get_world_size()
    assert r_n == case["R"]
    h, e, k = case["H"], case["E"], case["K"]
    e_l = e // r_n
    cfg = Config(case.get("sms", 6), 4, 32)
    c_n = cfg.num_channels()
    align, nwt = case.get("align", 1), case.get("worst", 0)
    ins = [make_inputs(case, r) for r in range(r_n)]
    x, scales, idx, w = ins[me]
    n = x.shape[0]
    p_n = case.get("P", r_n)                       # ranks per node: P < R is the internode mode
    m_n = r_n // p_n
    buf = NormalBuffer(hidden=h, backend="reference", ranks_per_node=case.get("P"))
    assert (buf.num_nodes, buf.ranks_per_node) == (m_n, p_n)

    # ---- layout
    ntpr, rdma, ntpe, tir, ev = buf.get_dispatch_layout(idx, e)
    ev.wait()
    want_tir = torch.tensor([[to_rank(idx, t, d, e_l) for d in range(r_n)] for t in range(n)],
                            dtype=torch.bool).reshape(n, r_n)
    if m_n == 1:
        assert rdma is None
    else:
        want_rdma = [sum(any(to_rank(idx, t, d, e_l) for d in range(nd * p_n, (nd + 1) * p_n)) for t in range(n))
                     for nd in range(m_n)]
        assert rdma.dtype == torch.int32 and rdma.tolist() == want_rdma
    assert torch.equal(tir, want_tir)
    assert ntpr.dtype == torch.int32 and ntpr.tolist() == want_tir.sum(0).tolist()
    assert ntpe.dtype == torch.int32 and ntpe.tolist() == [int((idx == g).sum()) for g in range(e)]

    # ---- dispatch
    x_arg: Any = x
    if scales is not None:
        # Column-major scales, as DeepEP's test and SGLang pass them.
        x_arg = (x, scales.T.contiguous().T if case.get("colmajor") else scales)
    recv, r_idx, r_w, counts, handle, ev = buf.dispatch(
        x_arg, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=rdma, is_token_in_rank=tir, num_tokens_per_expert=ntpe, topk_idx=idx,
        topk_weights=w, expert_alignment=align, num_worst_tokens=nwt, config=cfg,
        async_finish=case.get("async", False))
    ev.wait()
    recv_x, recv_s = recv if scales is not None else (recv, None)
    expect: List[Tuple[int, int]] = [(s, t) for s in range(r_n) for t in range(ins[s][0].shape[0])
                                     if to_rank(ins[s][2], t, me, e_l)]
    m = len(expect)
    rows = nwt if nwt else m
    assert recv_x.shape == (rows, h) and recv_x.dtype == x.dtype
    assert r_idx.shape == (rows, k) and r_w.shape == (rows, k) and handle.recv_src_idx.shape == (rows,)
    for j, (s, t) in enumerate(expect):
        xs, ss, ids, ws = ins[s]
        assert torch.equal(bits(recv_x[j]), bits(xs[t])), (j, s, t)
        if ss is not None:
            assert torch.equal(bits(recv_s[j]), bits(ss[t])), (j, s, t)
        assert int(handle.recv_src_idx[j]) == t
        for kk in range(k):
            g = int(ids[t, kk])
            local = g >= 0 and g // e_l == me
            assert int(r_idx[j, kk]) == (g - me * e_l if local else -1)
            assert bits(r_w[j, kk:kk + 1]).tolist() == bits(ws[t, kk:kk + 1] if local else torch.zeros(1)).tolist()
    if nwt:
        assert counts == [] and bool((r_idx[m:] == -1).all()) and bool((r_w[m:] == 0).all())
        assert bool((handle.recv_src_idx[m:] == -1).all()) and int(bits(recv_x[m:]).sum()) == 0
    else:
        per = [sum(int((ins[s][2] == me * e_l + le).sum()) for s in range(r_n)) for le in range(e_l)]
        assert counts == [(c + align - 1) // align * align for c in per]
    assert handle.num_recv_tokens == m and handle.num_channels == c_n and handle.num_tokens == n

    # ---- the handle's matrices, from their definitions
    sends = [[sum(to_rank(ins[s][2], t, d, e_l) for t in range(ins[s][0].shape[0])) for d in range(r_n)]
             for s in range(r_n)]
    rpm = [[sum(sends[kk][j] for kk in range(i + 1)) for j in range(r_n)] for i in range(r_n)]
    assert handle.rank_prefix_matrix.tolist() == rpm
    cpm = [[sum(1 for t in range(n) if tir[t, d] and channel_of(t, n, c_n) <= c) for c in range(c_n)]
           for d in range(r_n)]
    assert handle.channel_prefix_matrix.tolist() == cpm
    rcpm = []
    for s in range(r_n):
        n_s = ins[s][0].shape[0]
        rcpm.append([sum(1 for t in range(n_s) if to_rank(ins[s][2], t, me, e_l) and channel_of(t, n_s, c_n) < c)
                     for c in range(c_n)])
    assert handle.recv_channel_prefix_matrix.tolist() == rcpm
    head = [[sum(1 for u in range(t) if tir[u, d] and channel_of(u, n, c_n) == channel_of(t, n, c_n))
             if tir[t, d] else -1 for d in range(r_n)] for t in range(n)]
    assert handle.send_head.tolist() == head
    for name in ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                 "send_head"):
        assert getattr(handle, name).dtype == torch.int32, name

    # ---- cached dispatch: other values, the same way
    if case.get("cached"):
        x2 = (x.float() * -2).to(x.dtype)
        recv2, a, b, c, d, ev2 = buf.dispatch((x2, scales) if scales is not None else x2, handle=handle,
                                              num_worst_tokens=nwt)
        ev2.wait()
        assert (a, b, c, d) == (None, None, None, None)
        recv2_x = recv2[0] if scales is not None else recv2
        assert recv2_x.shape == (rows, h)
        for j, (s, t) in enumerate(expect):
            x2_s = (ins[s][0].float() * -2).to(x.dtype)
            assert torch.equal(bits(recv2_x[j]), bits(x2_s[t]))

    # ---- combine
    y = torch.full((rows, h), 7.0, dtype=torch.bfloat16)     # padding rows must be ignored
    y[:m] = expert_fn(me, dequant(recv_x[:m], recv_s[:m] if recv_s is not None else None))
    bias_kind = case.get("bias")
    gen = torch.Generator().manual_seed(case["seed"] + 77 * me)
    b0 = torch.randn(n, h, generator=gen).to(torch.bfloat16)
    b1 = torch.randn(n, h, generator=gen).to(torch.bfloat16)
    bias = None if bias_kind is None else (b0 if bias_kind == "one" else (b0, b1))
    with_w = case.get("combine_weights", True)
    out, out_w, ev = buf.combine(y, handle, topk_weights=r_w if with_w else None, bias=bias, config=cfg)
    ev.wait()
    assert out.shape == (n, h) and out.dtype == torch.bfloat16
    assert (out_w is None) == (not with_w)
    for t in range(n):
        acc = torch.zeros(h, dtype=torch.float32)
        if bias_kind is not None:
            acc = acc + b0[t].float()
        if bias_kind == "pair":
            acc = acc + b1[t].float()
        acc_w = torch.zeros(k, dtype=torch.float32)
        # Intranode: every rank's row straight into acc. Internode: per node, an fp32 partial from 0,
        # rounded to BF16 (weights not rounded), added for the nodes that hold one of t's ranks.
        for nd in range(m_n):
            part = acc if m_n == 1 else torch.zeros(h, dtype=torch.float32)
            part_w = acc_w if m_n == 1 else torch.zeros(k, dtype=torch.float32)
            used = False
            for d in range(nd * p_n, (nd + 1) * p_n):
                if to_rank(idx, t, d, e_l):
                    used = True
                    part = part + expert_fn(d, dequant(x[t:t + 1], scales[t:t + 1] if scales is not None else None))[0].float()
                    local = torch.tensor([0 <= int(g) and int(g) // e_l == d for g in idx[t]])
                    part_w = part_w + torch.where(local, w[t], torch.zeros(k))
            if m_n == 1:
                acc, acc_w = part, part_w
            elif used:
                acc = acc + part.to(torch.bfloat16).float()
                acc_w = acc_w + part_w
        assert torch.equal(bits(out[t]), bits(acc.to(torch.bfloat16))), f"rank {me} token {t}"
        if with_w:
            assert torch.equal(bits(out_w[t]), bits(acc_w)), f"rank {me} token {t} weights"
    buf.destroy()
    return {"received": m}


BASE: Case = dict(H=256, E=8, K=3, seed=1)

CASES = {
    2: {
        "random": dict(BASE, R=2),
        "nodes2x1_bias": dict(BASE, R=2, P=1, bias="pair", seed=11, cached=True),
        "hot_expert": dict(BASE, R=2, hot=5, N=[9, 4], seed=2),
        "masked": dict(BASE, R=2, neg=0.7, seed=3),
        "empty_rank": dict(BASE, R=2, N=[0, 11], seed=4, cached=True),
        "one_rank": dict(BASE, R=2, one_rank=True, N=[7, 8], seed=5),
        "fp8": dict(BASE, R=2, fp8=True, seed=6, cached=True, colmajor=True),
        "align128_bias": dict(BASE, R=2, align=128, bias="one", seed=7),
        "worst_pair_bias": dict(BASE, R=2, worst=30, bias="pair", cached=True, seed=8),
        "no_weights_k16": dict(BASE, R=2, E=32, K=16, N=[5, 6], neg=0.3, combine_weights=False, seed=9),
        "many_channels_async": dict(BASE, R=2, sms=24, N=[20, 3], **{"async": True}, seed=10),
    },
    3: {
        "random": dict(BASE, R=3, E=9, seed=21, cached=True),
        "fp8_worst": dict(BASE, R=3, E=6, K=2, fp8=True, worst=40, bias="pair", seed=22),
        "empty_and_hot": dict(BASE, R=3, E=6, hot=4, N=[0, 6, 5], seed=23),
    },
    4: {
        # P=2: two nodes of two ranks (the internode mode); P=1: four nodes of one rank.
        "nodes2x2_random": dict(BASE, R=4, P=2, E=16, K=4, seed=51, cached=True, bias="pair"),
        "nodes2x2_fp8_worst": dict(BASE, R=4, P=2, E=16, K=4, fp8=True, worst=50, bias="one", seed=52),
        "nodes2x2_hot_masked": dict(BASE, R=4, P=2, E=8, hot=6, N=[9, 0, 4, 7], seed=53, align=128),
        "nodes2x2_one_rank_empty": dict(BASE, R=4, P=2, E=16, one_rank=True, N=[0, 8, 5, 0], seed=54),
        "nodes2x2_masked_noweights": dict(BASE, R=4, P=2, E=32, K=16, neg=0.6, combine_weights=False, seed=55),
        "nodes4x1_random": dict(BASE, R=4, P=1, E=16, K=4, seed=56, bias="one", cached=True),
        "random": dict(BASE, R=4, E=16, K=4, seed=31),
        "empty_ranks_align": dict(BASE, R=4, N=[0, 12, 0, 5], align=128, cached=True, bias="one", seed=32),
        "one_rank_fp8": dict(BASE, R=4, E=16, one_rank=True, fp8=True, H=384, seed=33),
    },
}


def check_invalid_expert(bad_rank: int, value: int) -> Dict[str, Any]:
    """A bad id on one rank: every rank raises InvalidExpertIndex at the same call (layout, then a
    dispatch given a hand-made layout), and the buffer works for the next call."""
    me, r_n = dist.get_rank(), dist.get_world_size()
    case = dict(BASE, R=r_n, N=[6] * r_n, neg=0.0, seed=41)
    x, _, idx, w = make_inputs(case, me)
    buf = NormalBuffer(hidden=256, backend="reference")
    bad = idx.clone()
    if me == bad_rank:
        bad[4, 2] = value
    with pytest.raises(InvalidExpertIndex) as info:
        buf.get_dispatch_layout(bad, 8)
    assert (info.value.row, info.value.k, info.value.value) == (4, 2, value)
    ntpr, _, ntpe, tir, _ = buf.get_dispatch_layout(idx, 8)
    with pytest.raises(InvalidExpertIndex):
        buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir, num_tokens_per_expert=ntpe,
                     topk_idx=bad, topk_weights=w, config=Config(4))
    recv, _, _, counts, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir,
                                                 num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
    out, _, _ = buf.combine(recv, handle)
    assert torch.equal(out, (x.float() * tir.sum(1, keepdim=True)).to(torch.bfloat16))
    buf.destroy()
    return {"counts": counts}


@pytest.fixture(scope="module")
def pool3() -> Iterator[DistPool]:
    with DistPool(3) as pool:
        yield pool


@pytest.mark.parametrize("name", list(CASES[2]))
def test_two_ranks(pool2: DistPool, name: str) -> None:
    res = pool2.run(run_case, CASES[2][name])
    assert sum(r["received"] for r in res) > 0


@pytest.mark.parametrize("name", list(CASES[3]))
def test_three_ranks(pool3: DistPool, name: str) -> None:
    res = pool3.run(run_case, CASES[3][name])
    assert sum(r["received"] for r in res) > 0


@pytest.mark.parametrize("name", list(CASES[4]))
def test_four_ranks(pool4: DistPool, name: str) -> None:
    res = pool4.run(run_case, CASES[4][name])
    assert sum(r["received"] for r in res) > 0


@pytest.mark.parametrize("bad_rank,value", [(1, 8), (0, -2)])
def test_invalid_expert_id_raises_everywhere(pool2: DistPool, bad_rank: int, value: int) -> None:
    res = pool2.run(check_invalid_expert, bad_rank, value)
    assert sum(sum(r["counts"]) for r in res) > 0
