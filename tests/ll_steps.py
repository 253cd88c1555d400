"""One low-latency step on the reference definition, shared by the tests that check a call's outcome
and the calls after it bit for bit (tests/test_ll_call_tags.py, tests/test_hostile_ll.py): inputs per
(step, rank), experts that scale their rows by a power of two per expert (exact in bf16, so a row of the
wrong call or expert changes the result), and the expected combine (fp32 over k ascending, one bf16
rounding)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from pyep.ep.errors import CallMismatch

T, H, K = 8, 256, 2


def inputs(step: int, rank: int, e: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    n = 3 + (step + rank) % 5
    x = torch.randn(n, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=gen)[:K] for _ in range(n)])
    idx[0, 1] = -1                                         # an unused slot
    return x, idx, torch.rand(n, K, generator=gen)


def scale(e: torch.Tensor) -> torch.Tensor:
    """Expert e multiplies its rows by 2^-(e % 4): exact in bf16, and different per expert, so a row
    combined from the wrong call or expert changes the result."""
    return torch.pow(2.0, -(e % 4).to(torch.float32))


def expected(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The reference definition: fp32 accumulation over k ascending, one bf16 rounding at the end."""
    acc = torch.zeros(x.shape[0], H)
    for k in range(idx.shape[1]):
        y = (x.float() * scale(idx[:, k].clamp_min(0))[:, None]).to(torch.bfloat16).float()
        acc = torch.where(idx[:, k:k + 1] >= 0, acc + w[:, k:k + 1] * y, acc)
    return acc.to(torch.bfloat16)


def experts(buf: Any, recv: torch.Tensor) -> torch.Tensor:
    first = buf.rank * buf.num_local_experts
    e = torch.arange(first, first + buf.num_local_experts)
    return (recv.float() * scale(e)[:, None, None]).to(torch.bfloat16)


def step(buf: Any, n: int, refuse: Optional[str] = None) -> str:
    """One dispatch + combine of step `n`; refuse: "dispatch" / "combine" makes this rank's call fail
    validation. Returns what happened: "ok", the exception type's name (refused, or raised for a peer)."""
    x, idx, w = inputs(n, buf.rank, buf.config.num_experts)
    try:
        recv, _, h, _, _ = buf.dispatch(x.float() if refuse == "dispatch" else x, idx, use_fp8=False)
        out, _, _ = buf.combine(experts(buf, recv), idx, w.double() if refuse == "combine" else w, h)
    except (TypeError, ValueError, CallMismatch) as exc:
        return type(exc).__name__
    assert torch.equal(out, expected(x, idx, w)), f"rank {buf.rank} step {n}: wrong result, no exception"
    return "ok"


