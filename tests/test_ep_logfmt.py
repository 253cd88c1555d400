"""LogFMT-10 combine (use_logfmt=True): the format's error bounds (pyep.ep.ll.logfmt), and the reference
backend's LogFMT combine against its BF16 combine in a 2-rank gloo group. The kernels' bits are checked
against the same reference in tests/test_ll_sim.py (CPU) and tests/test_ep_native_gpu.py (GPU).

The bounds, from the format: a cast group's levels are 2^(lb + j * step), step = (log2 amax - lb) / 510
with lb >= log2 amax - 32, so step <= 32 / 510. A value is rounded to the nearer neighbouring level (the
threshold is their linear midpoint to first order in step), so its relative error is at most
(2^step - 1) / (2^step + 1) ~= step * ln2 / 2 <= 2.18 %; a value below the lowest level (possible only
when the 32-octave clip applies) is off by at most 2^lb <= amax * 2^-32 in absolute terms. Groups that
are not cast (a magnitude >= 1, all equal, all zero) are exact. A combine output is a sum of such terms
(w_k >= 0 here), so |out_logfmt - out_bf16| <= eps * sum_k |w_k y_k| + the two bf16 roundings of the
outputs (2^-9 relative each).
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Dict

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pyep.ep.ll import EpBuffer, logfmt
from pyep.ep.ll.errors import CombineAfterRefusal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_STEP = 32.0 / 510.0
EPS = (2 ** MAX_STEP - 1) / (2 ** MAX_STEP + 1) + 1e-6   # 0.02175...: worst case over all groups


def _rows(seed: int, n: int, h: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n, h, generator=g) * 0.1
    y = y.reshape(n, h // 128, 128)
    pick = torch.rand(n, h // 128, generator=g)
    y[pick < 0.1] *= 50.0                                  # >= 1 somewhere: bf16 group
    y[(pick >= 0.1) & (pick < 0.15), 7] = 0.0              # a zero: the 32-octave clip
    y[(pick >= 0.15) & (pick < 0.2)] *= 1e-20              # tiny but normal
    y[(pick >= 0.2) & (pick < 0.22)] = -0.125              # all equal: bf16 group
    return y.reshape(n, h).to(torch.bfloat16)


def _bound(x: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |decode(encode(x)) - x| from the group's step (see the module doc)."""
    xf = x.float().reshape(x.shape[0], -1, 128)
    a = xf.abs()
    amax = a.amax(-1, keepdim=True)
    nz = torch.where(a > 0, a, torch.full_like(a, float("inf"))).amin(-1, keepdim=True)
    has_zero = (a == 0).any(-1, keepdim=True)
    lb = torch.where(has_zero, torch.log2(amax) - 32, torch.maximum(torch.log2(nz), torch.log2(amax) - 32))
    step = (torch.log2(amax) - lb) / 510
    rel = (2 ** step - 1) / (2 ** step + 1) + 1e-6
    floor = torch.exp2(lb) * 1.0001
    return (rel * a + torch.where(a < torch.exp2(lb), floor, torch.zeros_like(a))).reshape(x.shape)


def test_roundtrip_error_within_format_bound() -> None:
    x = _rows(1, 64, 1024)
    y = logfmt.roundtrip(x)
    xf = x.float()
    g = xf.abs().reshape(64, -1, 128)
    cast = ((g.amax(-1) < 1) & (g.amax(-1) > g.amin(-1))).repeat_interleave(128, 1)
    assert bool(cast.any()) and bool((~cast).any())
    assert torch.equal(y[~cast], xf[~cast]), "groups sent as bf16 must be exact"
    err = (y - xf).abs()
    assert bool((err[cast] <= _bound(x)[cast]).all()), float((err - _bound(x))[cast].max())
    assert bool((torch.sign(y) * torch.sign(xf) >= 0).all()), "a sign flipped"
    assert bool((y[xf == 0] == 0).all())
    nz = cast & (xf.abs() > 0)
    rel = (err[nz] / xf.abs()[nz])
    big = nz & (xf.abs() >= xf.abs().reshape(64, -1, 128).amax(-1).repeat_interleave(128, 1) * 2 ** -31)
    assert float((err[big] / xf.abs()[big]).max()) <= EPS
    assert float(rel.median()) < 0.01


def test_message_sizes_and_table_match_the_kernel() -> None:
    x = _rows(2, 16, 2048)
    msgs, wire = logfmt.encode(x)
    g = x.float().abs().reshape(16, -1, 128)
    cast = ((g.amax(-1) < 1) & (g.amax(-1) > g.amin(-1))).sum(1).numpy()
    assert np.array_equal(wire, logfmt.meta_bytes(2048) + 160 * cast + 256 * (16 - cast))
    assert msgs.shape[1] == logfmt.message_bytes(2048) and wire.max() <= msgs.shape[1]
    src = open(os.path.join(ROOT, "engine", "kernels", "ll_logfmt.cuh")).read()
    body = src[src.index("kLfLog2Mant[128] = {"):]
    words = [int(v, 16) for v in re.findall(r"0x([0-9a-f]{8})", body[:body.index("};")])]
    assert words == logfmt.LOG2_MANT.view(np.uint32).tolist()
    for h in logfmt.EXP2_POLY_HEX[1:]:
        assert h + "f" in src, f"exp2 coefficient {h} differs from the kernel's"
    assert abs(float(logfmt.LN2_OVER_8) - math.log(2) / 8) < 1e-8
    with pytest.raises(ValueError, match="multiple of 512"):
        logfmt.encode(x[:, :384])


def check_reference_combine() -> Dict[str, Any]:
    rank, r_n = dist.get_rank(), dist.get_world_size()
    T, H, E, K = 16, 1024, 8, 4
    buf = EpBuffer(backend="reference", num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E)
    gen = torch.Generator().manual_seed(40 + rank)
    n = T - rank
    x = (torch.randn(n, H, generator=gen) * 0.1).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)])
    idx[1, 2] = -1
    w = torch.rand(n, K, generator=gen) + 0.1
    recv, count, handle, _, _ = buf.dispatch(x, idx, use_fp8=False)
    e_l = E // r_n
    ys = torch.stack([_rows(100 + rank * 10 + e, r_n * T, H) for e in range(e_l)])
    out_bf, _, _ = buf.combine(ys, idx, w, handle)
    out_lf, _, _ = buf.combine(ys, idx, w, handle, use_logfmt=True)
    out_abs, _, _ = buf.combine(ys.abs(), idx, w, handle)
    lf2, _, hook = buf.combine(ys, idx, w, handle, use_logfmt=True, return_recv_hook=True)
    hook()
    assert torch.equal(lf2, out_lf), "the hook path must give the same bits"
    diff = (out_lf.float() - out_bf.float()).abs()
    bound = EPS * out_abs.float() * (1 + 2 ** -8) + 2 ** -8 * out_bf.float().abs() + 1e-30
    assert bool((diff <= bound).all()), float((diff - bound).max())
    nz = out_bf.float().abs() > 1e-3
    rel = diff[nz] / out_bf.float().abs()[nz]
    with pytest.raises(TypeError, match="use_logfmt"):
        buf.combine(ys, idx, w, handle, use_logfmt=1)
    buf.destroy()
    return {"max_rel": float(rel.max()), "mean_rel": float(rel.mean()), "differs": bool((diff > 0).any())}


def test_reference_logfmt_combine_error_vs_bf16(pool2: Any) -> None:
    res = pool2.run(check_reference_combine)
    for r in res:
        assert r["differs"], "LogFMT changed nothing: was it applied?"
        assert r["mean_rel"] < 0.01, r


def check_hidden_rule() -> str:
    buf = EpBuffer(backend="reference", num_max_dispatch_tokens_per_rank=4, hidden=384, num_experts=4)
    x = torch.randn(2, 384).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, 3]])
    recv, _, handle, _, _ = buf.dispatch(x, idx, use_fp8=False)
    with pytest.raises(ValueError, match="multiple of 512"):
        buf.combine(recv, idx, torch.ones(2, 2), handle, use_logfmt=True)
    # A refused combine stands for its handle's combine on every rank (CombineAfterRefusal); the
    # inputs are intact, so dispatching again and combining works.
    with pytest.raises(CombineAfterRefusal):
        buf.combine(recv, idx, torch.ones(2, 2), handle)
    recv, _, handle, _, _ = buf.dispatch(x, idx, use_fp8=False)
    out, _, _ = buf.combine(recv, idx, torch.ones(2, 2), handle)
    assert out.shape == (2, 384)
    buf.destroy()
    return "ok"


def test_use_logfmt_needs_hidden_multiple_of_512(pool2: Any) -> None:
    assert pool2.run(check_hidden_rule) == ["ok", "ok"]
