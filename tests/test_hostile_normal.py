"""Hostile inputs to the normal mode (issue 22 item 6): each case gives NormalBuffer (or its configs, or
peer data) something an attacker or an unlucky user would, asserts a typed error -- never a raw
builtin exception, a hang or a silently accepted value -- and then a correct round trip.

In-process cases (no group): constructor arguments, size hints, Config, peer records. Distributed
cases (2 gloo ranks, reference backend): rank 1 passes the hostile argument while rank 0 makes the call
correctly; rank 1 gets TypeError/ValueError, rank 0 PeerRefusedCall naming rank 1 (the call tags,
tests/test_normal_call_tags.py), and a full round (layout, dispatch, cached dispatch, combine) is then
correct on both. Value cases: rank 1's tensor values contradict each other; every rank raises the
typed value error at that call (the reference sees every source's record), then a correct round."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

from pyep.ep.errors import CallMismatch
from pyep.ep.normal import (Config, InvalidExpertIndex, LayoutMismatch, NormalBuffer, NormalCallMismatch,
                            PeerRefusedCall, WorstTokensExceeded)
from pyep.ep.normal import tags
from pyep.ep.normal.device_records import TAG_RECORD_INTS, DeviceRecords
from pyep.ep.normal.layout import check_rings
from test_normal_call_tags import E, H, _inputs, good_round

BIG = 2 ** 62


# ---------------------------------------------------------------- in-process cases
def _size_hint_ok() -> None:
    assert NormalBuffer.size_hint(7168, 8) > NormalBuffer.size_hint(1024, 8) > 0


LOCAL: List[Tuple[str, type, str, Callable[[], Any], Callable[[], None]]] = [
    ("ctor-num-nvl-bytes-2**62", ValueError, "num_nvl_bytes", lambda: NormalBuffer(None, BIG), _size_hint_ok),
    ("ctor-num-rdma-bytes-2**62", ValueError, "num_rdma_bytes", lambda: NormalBuffer(None, num_rdma_bytes=BIG),
     _size_hint_ok),
    ("ctor-timeout-2**62", ValueError, "timeout_us", lambda: NormalBuffer(None, timeout_us=BIG), _size_hint_ok),
    ("ctor-hidden-bool", TypeError, "hidden", lambda: NormalBuffer(None, hidden=True), _size_hint_ok),
    ("ctor-num-sms-2**40", ValueError, "num_sms", lambda: NormalBuffer(None, num_sms=2 ** 40), _size_hint_ok),
    ("size-hint-hidden-2**62", ValueError, "hidden", lambda: NormalBuffer.size_hint(BIG, 8), _size_hint_ok),
    ("size-hint-ranks-negative", ValueError, "num_ranks", lambda: NormalBuffer.size_hint(128, -1), _size_hint_ok),
    ("size-hint-config-str", TypeError, "config", lambda: NormalBuffer.size_hint(128, 8, "cfg"), _size_hint_ok),
    ("config-num-sms-bool", TypeError, "num_sms", lambda: Config(num_sms=True), lambda: Config(num_sms=24).num_channels()),
    ("config-ring-2**62", ValueError, "recv_tokens", lambda: Config(24, 6, BIG), lambda: Config(24, 6, 512).num_channels()),
    ("config-chunk-float", TypeError, "send_tokens", lambda: Config(24, 6.0), lambda: Config(24, 6).num_channels()),
    ("config-hint-bytes-2**62", ValueError, "hidden_bytes", lambda: Config().get_nvl_buffer_size_hint(BIG, 8),
     lambda: Config().get_nvl_buffer_size_hint(2 * 7168, 8)),
    # The native buffer refuses a config its rings do not fit before anything is launched (check_call).
    ("native-rings-exceed-buffer", ValueError, "rings of this config need",
     lambda: check_rings(Config(24, 6, 4096), 8, 7168, NormalBuffer.size_hint(7168, 8)),
     lambda: check_rings(Config(24, 6, 256), 8, 7168, NormalBuffer.size_hint(7168, 8))),
    ("native-ring-below-32-rows", ValueError, "at least 32", lambda: check_rings(Config(24, 6, 16), 2, 128, 1 << 30),
     lambda: check_rings(Config(24, 6, 32), 2, 128, 1 << 30)),
]


@pytest.mark.parametrize("exc,match,bad,good", [c[1:] for c in LOCAL], ids=[c[0] for c in LOCAL])
def test_hostile_local(exc: type, match: str, bad: Callable[[], Any], good: Callable[[], Any]) -> None:
    with pytest.raises(exc, match=match):
        bad()
    good()


def _records(words: List[int]) -> DeviceRecords:
    rec = torch.zeros(TAG_RECORD_INTS, dtype=torch.int32)
    rec[:len(words)] = torch.tensor(words, dtype=torch.int64).to(torch.int32)
    return DeviceRecords(torch.zeros(8, dtype=torch.int32), rec, lambda: None, 0, 4, 1000)


def test_hostile_peer_tag_random_words() -> None:
    """Random words where a peer's tag should be: a call mismatch naming the peer, not a crash; a good
    tag from the same peer is read afterwards."""
    gen = torch.Generator().manual_seed(1)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (tags.TAG_INTS,), generator=gen).tolist()
    with pytest.raises(NormalCallMismatch, match="not a call tag"):
        tags.decode(words, "w", 0, 3, 5, 4)
    good = tags.CallTag(1, 5, tags.KIND_COMBINE, signature=tags.signature(256, 12), origin=3, reason="ok")
    assert tags.decode(tags.encode(good), "w", 0, 3, 5, 4) == good


def test_hostile_device_record_garbage() -> None:
    """A tag record whose peer tag is garbage (a peer that wrote anything into its slot): reported as a
    call mismatch naming the peer, once; a later well-formed void is reported as what it is."""
    recs = _records([1, 0, 1, 2, 7, 0, tags.KIND_COMBINE] + [0] * 9 + [0x1234] * tags.TAG_INTS)
    err = recs.take_void()
    assert isinstance(err, NormalCallMismatch) and err.peer == 2, err
    assert recs.take_void() is None
    tag = tags.encode(tags.CallTag(0, 8, tags.KIND_COMBINE, tags.STATUS_REFUSED, origin=2, reason="TypeError: x"))
    recs._rec[16:] = tag
    recs._rec[2:7] = [1, 2, 8, 0, tags.KIND_COMBINE]
    recs._rec[0] = 2
    err = recs.take_void()
    assert isinstance(err, PeerRefusedCall) and err.peer == 2 and err.reason == "TypeError: x", err


# ---------------------------------------------------------------- distributed cases (2 ranks)
def _bad_calls(buf: NormalBuffer, other: NormalBuffer) -> List[Tuple[str, str, Callable[[bool], Any]]]:
    """(id, rank 1's error type, call(bad)); every call is made on both ranks, hostile on rank 1 only."""
    x, idx, w = _inputs(6, 21)
    e = E * buf.num_ranks // 2
    ntpr, _, ntpe, tir, _ = buf.get_dispatch_layout(idx, e)
    lay = dict(num_tokens_per_rank=ntpr, is_token_in_rank=tir, num_tokens_per_expert=ntpe)
    recv, _, r_w, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **lay)
    *_, foreign, _ = other.dispatch(x, topk_idx=idx, topk_weights=w, **lay)
    sparse_idx = idx.to_sparse()

    def misaligned(t: torch.Tensor) -> torch.Tensor:
        """The same values in a contiguous view that starts one element past an allocation's start."""
        flat = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
        v = flat[1:1 + t.numel()].view(t.shape).copy_(t)
        assert v.is_contiguous() and v.data_ptr() % 16
        return v
    bias = torch.zeros(x.shape[0], H, dtype=torch.bfloat16)

    def disp(bad: bool, **kw: Any) -> Any:
        args = dict(topk_idx=idx, topk_weights=w, **lay)
        args.update(kw if bad else {})
        return buf.dispatch(args.pop("x", x), **args)
    return [
        ("layout-topk-sparse", "TypeError", lambda b: buf.get_dispatch_layout(sparse_idx if b else idx, e)),
        ("layout-topk-float", "TypeError", lambda b: buf.get_dispatch_layout(idx.float() if b else idx, e)),
        ("layout-experts-2**62", "ValueError", lambda b: buf.get_dispatch_layout(idx, BIG if b else e)),
        ("layout-topk-meta", "ValueError", lambda b: buf.get_dispatch_layout(idx.to("meta") if b else idx, e)),
        ("dispatch-alignment-2**62", "ValueError", lambda b: disp(b, expert_alignment=BIG)),
        ("dispatch-worst-2**62", "ValueError", lambda b: disp(b, num_worst_tokens=BIG)),
        ("dispatch-worst-negative", "ValueError", lambda b: disp(b, num_worst_tokens=-1)),
        ("dispatch-x-sparse", "TypeError", lambda b: disp(b, x=x.to_sparse())),
        ("dispatch-x-misaligned", "ValueError", lambda b: disp(b, x=misaligned(x))),
        ("dispatch-in-rank-int8", "TypeError", lambda b: disp(b, is_token_in_rank=tir.to(torch.int8))),
        ("dispatch-weights-bf16", "TypeError", lambda b: disp(b, topk_weights=w.to(torch.bfloat16))),
        ("dispatch-per-expert-2d", "ValueError", lambda b: disp(b, num_tokens_per_expert=ntpe.view(2, -1))),
        ("dispatch-previous-event-object", "TypeError", lambda b: disp(b, previous_event=object())),
        ("dispatch-async-finish-str", "TypeError", lambda b: disp(b, async_finish="yes")),
        ("cached-foreign-handle", "ValueError", lambda b: buf.dispatch(x, handle=foreign if b else handle)),
        ("cached-handle-as-tuple", "TypeError", lambda b: buf.dispatch(x, handle=tuple(handle) if b else handle)),
        ("combine-x-rows", "ValueError", lambda b: buf.combine(recv[:-1] if b and recv.shape[0] else
                                                               (torch.zeros(recv.shape[0] + 1, H, dtype=torch.bfloat16)
                                                                if b else recv), handle)),
        ("combine-x-misaligned", "ValueError", lambda b: buf.combine(misaligned(recv) if b else recv, handle)),
        ("combine-bias-misaligned", "ValueError", lambda b: buf.combine(recv, handle,
                                                                       bias=misaligned(bias) if b else bias)),
        ("combine-bias-list", "TypeError", lambda b: buf.combine(recv, handle, bias=[None, None] if b else None)),
        ("combine-weights-k17", "ValueError", lambda b: buf.combine(recv, handle, topk_weights=torch.zeros(
            recv.shape[0], 17) if b else r_w)),
        ("combine-config-dict", "TypeError", lambda b: buf.combine(recv, handle, config={"num_sms": 24} if b else None)),
    ]


def _value_calls(buf: NormalBuffer) -> List[Tuple[str, type, Callable[[], Any]]]:
    """(id, error, call): rank 1's tensor values are hostile; the reference raises on every rank."""
    x, idx, w = _inputs(6, 22)
    e = E * buf.num_ranks // 2
    ntpr, _, ntpe, tir, _ = buf.get_dispatch_layout(idx, e)
    me = dist.get_rank()

    def hostile(t: torch.Tensor, change: Callable[[torch.Tensor], None]) -> torch.Tensor:
        t = t.clone()
        if me == 1:
            change(t)
        return t

    def disp(**kw: Any) -> Any:
        args = dict(num_tokens_per_rank=ntpr, is_token_in_rank=tir, num_tokens_per_expert=ntpe, topk_idx=idx,
                    topk_weights=w)
        args.update(kw)
        return buf.dispatch(x, **args)

    def flip(t: torch.Tensor) -> None:
        t[0, 1] = ~t[0, 1]
    bad_ids = hostile(idx, lambda t: t.__setitem__((1, 0), e + 5))
    return [
        ("values-per-expert-contradicts-topk", LayoutMismatch,
         lambda: disp(num_tokens_per_expert=hostile(ntpe, lambda t: t.__setitem__(0, t[0] + 1)))),
        ("values-in-rank-contradicts-topk", LayoutMismatch, lambda: disp(is_token_in_rank=hostile(tir, flip))),
        ("values-per-rank-contradicts-in-rank", LayoutMismatch,
         lambda: disp(num_tokens_per_rank=hostile(ntpr, lambda t: t.__setitem__(1, t[1] + 3)))),
        ("values-per-expert-negative-no-topk", LayoutMismatch,
         lambda: buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir,
                              num_tokens_per_expert=hostile(ntpe, lambda t: t.__setitem__(2, -4)))),
        ("values-worst-tokens-too-few", WorstTokensExceeded, lambda: disp(num_worst_tokens=1)),
        ("values-layout-id-out-of-range", InvalidExpertIndex, lambda: buf.get_dispatch_layout(bad_ids, e)),
    ]


def run_hostile_cases() -> Dict[str, str]:
    """Every distributed case on this rank: "ok", or what went wrong."""
    me = dist.get_rank()
    buf = NormalBuffer(hidden=H, backend="reference", timeout_us=120_000_000)
    other = NormalBuffer(hidden=H, backend="reference", timeout_us=120_000_000)
    out: Dict[str, str] = {}
    for i, (name, kind, call) in enumerate(_bad_calls(buf, other)):
        try:
            call(me == 1)
            out[name] = "accepted"
        except PeerRefusedCall as exc:
            out[name] = "ok" if me == 0 and exc.peer == 1 and exc.reason.startswith(kind) else f"wrong refusal: {exc}"
        except (TypeError, ValueError) as exc:
            out[name] = "ok" if me == 1 and type(exc).__name__ == kind else f"{type(exc).__name__}: {exc}"
        except Exception as exc:   # noqa: BLE001 - what the case must not raise is the finding
            out[name] = f"untyped {type(exc).__name__}: {exc}"
        good_round(buf, seed=100 + i)
    for i, (name, exc_type, call) in enumerate(_value_calls(buf)):
        try:
            call()
            out[name] = "accepted"
        except exc_type as exc:
            out[name] = "ok" if not isinstance(exc, CallMismatch) else f"{exc}"
        except Exception as exc:   # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {exc}"
        good_round(buf, seed=200 + i)
    other.destroy()
    buf.destroy()
    return out


DIST_IDS = [
    "layout-topk-sparse", "layout-topk-float", "layout-experts-2**62", "layout-topk-meta", "dispatch-alignment-2**62",
    "dispatch-worst-2**62", "dispatch-worst-negative", "dispatch-x-sparse", "dispatch-x-misaligned",
    "dispatch-in-rank-int8", "dispatch-weights-bf16", "dispatch-per-expert-2d", "dispatch-previous-event-object",
    "dispatch-async-finish-str", "cached-foreign-handle", "cached-handle-as-tuple", "combine-x-rows",
    "combine-x-misaligned", "combine-bias-misaligned", "combine-bias-list", "combine-weights-k17",
    "combine-config-dict", "values-per-expert-contradicts-topk", "values-in-rank-contradicts-topk",
    "values-per-rank-contradicts-in-rank", "values-per-expert-negative-no-topk", "values-worst-tokens-too-few",
    "values-layout-id-out-of-range",
]


@pytest.fixture(scope="module")
def hostile_results(pool2: Any) -> List[Dict[str, str]]:
    return pool2.run(run_hostile_cases)


@pytest.mark.parametrize("case", DIST_IDS)
def test_hostile_distributed(hostile_results: List[Dict[str, str]], case: str) -> None:
    for rank, res in enumerate(hostile_results):
        assert res.get(case) == "ok", f"rank {rank}: {case}: {res.get(case)}"
