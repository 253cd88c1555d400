"""The per-call entry points run with torch's Python-level dispatch off (pyep.ep.backend.torch_function_off).

A program that sets a default device (DeepEP's tests: torch.set_default_device("cuda")) puts a
__torch_function__ mode on, and every tensor method pyep's host path uses then costs microseconds more:
a cached normal dispatch spent 170-340 us on the host under DeepEP's test instead of about 70. Here a
counting mode stands in for that one: it must see no op of layout, dispatch, cached dispatch, combine,
an LL round trip or the DeepEP V2 shim's dispatch and combine, and the results must equal those of the
same calls without any mode.
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from pyep.ep.backend import torch_function_off


class CountingMode(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_the_decorator_turns_modes_off_for_the_call_only() -> None:
    seen: List[bool] = []

    @torch_function_off
    def call(fail: bool) -> torch.Tensor:
        """doc"""
        seen.append(torch._C._is_torch_function_enabled())
        t = torch.ones(3).view(3, 1).t()
        if fail:
            raise ValueError("inside")
        return t

    with CountingMode() as mode:
        out = call(False)
        assert mode.ops == [] and seen == [False]
        assert torch._C._is_torch_function_enabled()
        with pytest.raises(ValueError, match="inside"):
            call(True)
        assert torch._C._is_torch_function_enabled()
        torch.ones(1)
        assert mode.ops == ["ones"]
    assert out.shape == (1, 3) and call.__name__ == "call" and call.__doc__ == "doc"


def _round_trips(counting: bool) -> Dict[str, Any]:
    from pyep.ep.ll import EpBuffer
    from pyep.ep.normal import NormalBuffer
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7 + rank)
    n, h, e, k = 12, 256, 8, 3
    x = torch.randn((n, h), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(torch.int64)
    w = torch.rand((n, k), generator=g)
    from pyep.compat.deep_ep import ElasticBuffer
    nb = NormalBuffer(hidden=h, backend="reference")
    v2 = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=n, hidden=h, explicitly_destroy=True,
                       backend="reference")
    ll = EpBuffer(None, num_max_dispatch_tokens_per_rank=n, hidden=h, num_experts=e, backend="reference",
                  max_topk=k)
    mode = CountingMode()
    # DeepEP's init_dist sets a default device and dtype; "meta" stands in for the GPU here, so an
    # allocation that relied on the default device would land there and fail the call.
    torch.set_default_device("meta")
    torch.set_default_dtype(torch.bfloat16)
    try:
        if counting:
            mode.__enter__()
        ntpr, _, ntpe, tir, _ = nb.get_dispatch_layout(idx, e)
        recv, ridx, rw, counts, handle, _ = nb.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir,
                                                        num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
        again = nb.dispatch(x, handle=handle)[0]
        combined, cw, _ = nb.combine(recv, handle, topk_weights=rw)
        lrecv, lcount, lhandle, _, _ = ll.dispatch(x, idx, use_fp8=False)
        lout, _, _ = ll.combine(lrecv, idx, w, lhandle)
        vrecv, vidx, vw, vhandle, _ = v2.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e)
        vout, _, _ = v2.combine(vrecv, vhandle, topk_weights=vw)
    finally:
        if counting:
            mode.__exit__(None, None, None)
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)
    nb.destroy()
    ll.destroy()
    v2.destroy()
    return {"ops": mode.ops, "tensors": [t.cpu() for t in (recv, ridx, rw, again, combined, cw, lrecv, lcount, lout,
                                                             vrecv, vidx, vw, vout)],
            "counts": counts}


def test_no_torch_function_dispatch_inside_calls(pool2: Any) -> None:
    with_mode = pool2.run(_round_trips, True)
    without = pool2.run(_round_trips, False)
    for a, b in zip(with_mode, without):
        assert a["ops"] == [], a["ops"][:10]
        assert a["counts"] == b["counts"]
        for ta, tb in zip(a["tensors"], b["tensors"]):
            assert ta.dtype == tb.dtype and torch.equal(ta, tb)
