"""Hostile and unlucky inputs to the low-latency mode (issue 22, item 6): sizes and counts beyond what can
be allocated or addressed, wrong shapes, dtypes, devices and layouts, out-of-range and repeated expert
ids, bad flags, handles and statistics tensors, calls refused on one rank only. Each case asserts a typed
error (or the documented behaviour) and then a correct round trip (tests/ll_steps.py: bit-equal to the
reference definition) on the same two gloo ranks, so a refusal never leaves the ranks out of step."""
from __future__ import annotations

import datetime
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
import torch.distributed as dist

from ll_steps import H, T, expected, experts, inputs, step
from pyep.ep.errors import CallMismatch
from pyep.ep.ll import EpBuffer
from pyep.ep.ll.config import MAX_BUFFER_BYTES, MAX_EXPERTS, MAX_TIMEOUT_US, MAX_TOKENS_PER_RANK, EpConfig
from pyep.ep.ll.errors import DuplicateExpertIndex, InvalidExpertIndex, PeerRefusedCall
from pyep.ep.ll.validate import sanitize_topk

E = 8


def _buf(**kw: Any) -> EpBuffer:
    args = dict(backend="reference", num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E)
    args.update(kw)
    return EpBuffer(**args)


def _config(**kw: Any) -> Callable[[EpBuffer], None]:
    """A buffer (or config) that must be refused before anything is allocated or exchanged."""
    def case(_: EpBuffer) -> None:
        EpBuffer(backend="reference", **{**dict(num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E), **kw})
    return case


def _dispatch(change: Callable[[torch.Tensor, torch.Tensor], Tuple[Any, Any, Dict[str, Any]]],
              only_rank: Any = None) -> Callable[[EpBuffer], None]:
    """A dispatch with hostile arguments (on every rank, or on `only_rank`; the other ranks then get
    PeerRefusedCall at their combine of that call)."""
    def case(buf: EpBuffer) -> None:
        x, idx, w = inputs(90, buf.rank, E)
        if only_rank is None or buf.rank == only_rank:
            bx, bidx, kw = change(x, idx)
            buf.dispatch(bx, bidx, **kw)
        else:
            recv, _, h, _, _ = buf.dispatch(x, idx, use_fp8=False)
            buf.combine(experts(buf, recv), idx, w, h)
        raise AssertionError("the hostile call was accepted")
    return case


def _combine(change: Callable[[EpBuffer, Any, Any, Any, Any], None]) -> Callable[[EpBuffer], None]:
    def case(buf: EpBuffer) -> None:
        x, idx, w = inputs(91, buf.rank, E)
        recv, _, h, _, _ = buf.dispatch(x, idx, use_fp8=False)
        change(buf, experts(buf, recv), idx, w, h)
    return case


def _values(bad_entry: Tuple[int, int, int], exc: type) -> Callable[[EpBuffer], None]:
    """Bad expert ids: routed as -1 (the documented behaviour: the result equals the reference on the
    sanitised ids), reported when the combine has done its exchange."""
    def case(buf: EpBuffer) -> None:
        x, idx, w = inputs(92, buf.rank, E)
        row, k, value = bad_entry
        bad = idx.clone()
        bad[row, k] = idx[row, 0] if value == -99 else value
        recv, _, h, _, _ = buf.dispatch(x, bad, use_fp8=False)
        out = torch.empty(x.shape[0], H, dtype=torch.bfloat16)
        with pytest.raises(exc):
            buf.combine(experts(buf, recv), bad, w, h, out=out)
        assert torch.equal(out, expected(x, sanitize_topk(bad, E), w)), "bad ids were not routed as -1"
    return case


def _nan_weights(buf: EpBuffer) -> None:
    """Values are arithmetic, not checked (docs/ll_kernels.md): a NaN weight makes its token's output
    NaN and no other."""
    x, idx, w = inputs(93, buf.rank, E)
    w[1, 0] = float("nan")
    recv, _, h, _, _ = buf.dispatch(x, idx, use_fp8=False)
    out, _, _ = buf.combine(experts(buf, recv), idx, w, h)
    assert bool(torch.isnan(out[1]).all()) and not bool(torch.isnan(torch.cat([out[:1], out[2:]])).any())


def _stale(buf: EpBuffer, y: Any, idx: Any, w: Any, h: Any) -> None:
    """Two more calls (both combined): h's buffer half was reused, so its combine is refused (on every
    rank: no rank combines it)."""
    for n in (94, 95):
        x2, i2, w2 = inputs(n, buf.rank, E)
        r2, _, h2, _, _ = buf.dispatch(x2, i2, use_fp8=False)
        buf.combine(experts(buf, r2), i2, w2, h2)
    buf.combine(y, idx, w, h)


def _lead_calls(buf: EpBuffer) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    EpBuffer(store=store, rank=0, world_size=1, store_prefix=f"hostile/{buf.rank}", backend="reference",
             num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E, rejoin_lead_calls=2 ** 62)


BIG = dict(num_max_dispatch_tokens_per_rank=MAX_TOKENS_PER_RANK, hidden=16384, num_experts=MAX_EXPERTS)
CASES: Dict[str, Tuple[Callable[[EpBuffer], None], Any]] = {
    # sizes and counts of the buffer (EpConfig / EpBuffer)
    "num_buffer_bytes=2**62": (_config(num_buffer_bytes=2 ** 62), ValueError),
    "num_buffer_bytes over the bound": (_config(num_buffer_bytes=MAX_BUFFER_BYTES + 1), ValueError),
    "num_buffer_bytes float": (_config(num_buffer_bytes=1e9), TypeError),
    "tokens per rank 2**40": (_config(num_max_dispatch_tokens_per_rank=2 ** 40), ValueError),
    "tokens per rank past the count field": (_config(num_max_dispatch_tokens_per_rank=MAX_TOKENS_PER_RANK + 1),
                                             ValueError),
    "num_experts 2**62": (_config(num_experts=2 ** 62), ValueError),
    "hidden 100": (_config(hidden=100), ValueError),
    "max_topk 17": (_config(max_topk=17), ValueError),
    "config timeout 2**62": (_config(timeout_us=2 ** 62), ValueError),
    "shape beyond any GPU memory": (_config(**BIG), ValueError),
    "rejoin_lead_calls 2**62": (_lead_calls, ValueError),
    # dispatch arguments (every rank refuses the same call)
    "x float32": (_dispatch(lambda x, i: (x.float(), i, {})), TypeError),
    "x on the meta device": (_dispatch(lambda x, i: (x.to("meta"), i, {})), ValueError),
    "x wrong hidden": (_dispatch(lambda x, i: (x[:, :128].contiguous(), i, {})), ValueError),
    "x non-contiguous": (_dispatch(lambda x, i: (torch.cat([x, x], 1)[:, ::2], i, {})), ValueError),
    "x more tokens than T": (_dispatch(lambda x, i: (torch.zeros(T + 1, H, dtype=torch.bfloat16),
                                                     torch.zeros(T + 1, 2, dtype=torch.int64), {})), ValueError),
    "topk int32": (_dispatch(lambda x, i: (x, i.int(), {})), TypeError),
    "topk K past max_topk": (_dispatch(lambda x, i: (x, torch.full((x.shape[0], 17), -1), {})), ValueError),
    "use_fp8=1 (an int)": (_dispatch(lambda x, i: (x, i, {"use_fp8": 1})), TypeError),
    "active_ranks bool": (_dispatch(lambda x, i: (x, i, {"active_ranks": torch.ones(2, dtype=torch.bool)})),
                          TypeError),
    "active_ranks wrong length": (_dispatch(lambda x, i: (x, i, {"active_ranks": torch.ones(3, dtype=torch.int32)})),
                                  ValueError),
    "per-call timeout 2**62": (_dispatch(lambda x, i: (x, i, {"timeout_us": 2 ** 62})), ValueError),
    "per-call timeout past an hour": (_dispatch(lambda x, i: (x, i, {"timeout_us": MAX_TIMEOUT_US + 1})), ValueError),
    "cumulative stats wrong shape": (_dispatch(lambda x, i: (x, i, {"cumulative_local_expert_recv_stats":
                                                                    torch.zeros(E, dtype=torch.int32)})), ValueError),
    "wait stats int32": (_dispatch(lambda x, i: (x, i, {"dispatch_wait_recv_cost_stats":
                                                        torch.zeros(2, dtype=torch.int32)})), TypeError),
    # one rank only: its peer is not left waiting, it gets PeerRefusedCall for that call
    "refused on rank 0 only (dtype)": (_dispatch(lambda x, i: (x.half(), i, {}), only_rank=0),
                                       {0: TypeError, 1: PeerRefusedCall}),
    "refused on rank 1 only (timeout)": (_dispatch(lambda x, i: (x, i, {"timeout_us": 0}), only_rank=1),
                                         {0: PeerRefusedCall, 1: ValueError}),
    # values (checked in the kernels / by the oracle, reported after the combine's exchange)
    "expert id 2**40": (_values((2, 1, 2 ** 40), InvalidExpertIndex), None),
    "expert id -5": (_values((3, 0, -5), InvalidExpertIndex), None),
    "expert id repeated in a row": (_values((1, 1, -99), DuplicateExpertIndex), None),
    "NaN weight": (_nan_weights, None),
    # combine arguments and handles
    "combine weights float64": (_combine(lambda b, y, i, w, h: b.combine(y, i, w.double(), h)), TypeError),
    "combine handle as a tuple": (_combine(lambda b, y, i, w, h: b.combine(y, i, w, tuple(h))), TypeError),
    "combine handle of another buffer": (_combine(lambda b, y, i, w, h: b.combine(y, i, w, _other(h))), ValueError),
    "combine stale handle": (_combine(_stale), ValueError),
    "combine async and hook": (_combine(lambda b, y, i, w, h: b.combine(y, i, w, h, async_finish=True,
                                                                        return_recv_hook=True)), ValueError),
    "combine out of the wrong shape": (_combine(lambda b, y, i, w, h: b.combine(y, i, w, h, out=_short_out())),
                                       ValueError),
}


def _short_out() -> torch.Tensor:
    return torch.zeros(1, H, dtype=torch.bfloat16)


def _other(h: Any) -> Any:
    from dataclasses import replace
    return replace(h, owner="another buffer")


def run_case(name: str) -> str:
    rank = dist.get_rank()
    case, want = CASES[name]
    buf = _buf()
    assert step(buf, 0) == "ok"
    exc = want.get(rank) if isinstance(want, dict) else want
    if exc is None:
        case(buf)
    else:
        with pytest.raises(exc):
            case(buf)
    # The round trip after it: the ranks are still in step, nothing is pending, nobody is marked.
    assert [step(buf, n) for n in (1, 2, 3)] == ["ok"] * 3
    assert all(p.kind != "inactive" for p in buf.transport_table())
    buf.destroy()
    return "ok"


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_hostile_ll(pool2: Any, name: str) -> None:
    assert pool2.run(run_case, name, timeout_s=120) == ["ok", "ok"]


def test_config_bounds_name_the_limit() -> None:
    """The messages say what the bound is (a user can act on them)."""
    with pytest.raises(ValueError, match=str(MAX_BUFFER_BYTES)):
        EpConfig(num_buffer_bytes=2 ** 62)
    with pytest.raises(ValueError, match=str(MAX_TOKENS_PER_RANK)):
        EpConfig(num_max_dispatch_tokens_per_rank=MAX_TOKENS_PER_RANK + 1)
    with pytest.raises(ValueError, match="more than the"):
        EpConfig(**BIG).check_group_size(2)
    assert issubclass(PeerRefusedCall, CallMismatch)
