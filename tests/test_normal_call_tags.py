"""Call-tagged exchanges of the normal mode on the reference backend over gloo (docs/normal_mode.md,
"Call-tagged exchanges"): a call refused on one rank's host while its peers make it raises
PeerRefusedCall on every peer at that call (none waits for the refusing rank, none times out) and the
following calls are correct on every rank; ranks at different calls raise NormalCallMismatch naming
both calls, the buffer then refuses calls until clean(), after which calls are correct again. The tag
codec itself (tags.py) is checked without processes."""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

from pyep.ep.errors import CallMismatch
from pyep.ep.normal import BufferBroken, Config, NormalBuffer, NormalCallMismatch, PeerRefusedCall
from pyep.ep.normal import tags

H, E, K = 256, 8, 3
TIMEOUT_US = 120_000_000   # a rank left waiting would show as a TimeoutError long after the test's bound


def _inputs(n: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 100 * dist.get_rank())
    x = torch.randn(n, H, generator=gen).to(torch.bfloat16)
    e = E * dist.get_world_size() // 2
    idx = torch.stack([torch.randperm(e, generator=gen)[:K] for _ in range(n)]) if n else \
        torch.zeros((0, K), dtype=torch.int64)
    return x, idx, torch.rand(n, K, generator=gen)


def good_round(buf: NormalBuffer, seed: int) -> None:
    """layout, dispatch, cached dispatch, combine, each checked against what the contract gives when
    every rank sends its rows back unchanged: combine = x * (ranks the token went to)."""
    x, idx, w = _inputs(5 + seed % 3, seed)
    e = E * buf.num_ranks // 2
    ntpr, _, ntpe, tir, _ = buf.get_dispatch_layout(idx, e)
    recv, _, r_w, counts, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir,
                                                   num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
    assert sum(counts) == int(ntpe.sum()) or dist.get_world_size() > 1
    again, *_ = buf.dispatch(x, handle=handle)
    assert torch.equal(again, recv)
    out, out_w, _ = buf.combine(recv, handle, topk_weights=r_w)
    assert torch.equal(out, (x.float() * tir.sum(1, keepdim=True)).to(torch.bfloat16))
    assert torch.equal(out_w, torch.where(tir.any(1, keepdim=True), w, torch.zeros_like(w)))


def _refusals(buf: NormalBuffer, other: NormalBuffer) -> List[Tuple[str, str, Callable[[bool], Any]]]:
    """(id, the refusing rank's error type, call(bad)) for each kind of call: bad=True on the refusing
    rank, False on the others."""
    x, idx, w = _inputs(6, 7)
    e = E * buf.num_ranks // 2
    ntpr, _, ntpe, tir, _ = buf.get_dispatch_layout(idx, e)
    layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=tir, num_tokens_per_expert=ntpe)
    recv, _, r_w, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
    *_, foreign, _ = other.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
    return [
        ("layout-experts", "ValueError", lambda bad: buf.get_dispatch_layout(idx, e + 1 if bad else e)),
        ("dispatch-dtype", "TypeError", lambda bad: buf.dispatch(x.float() if bad else x, topk_idx=idx,
                                                                 topk_weights=w, **layout)),
        ("dispatch-alignment", "ValueError", lambda bad: buf.dispatch(
            x, topk_idx=idx, topk_weights=w, expert_alignment=2 ** 62 if bad else 1, **layout)),
        ("cached-tokens", "ValueError", lambda bad: buf.dispatch(x[:-1] if bad else x, handle=handle)),
        ("combine-channels", "ValueError", lambda bad: buf.combine(recv, handle, config=Config(8) if bad else None)),
        ("combine-foreign-handle", "ValueError", lambda bad: buf.combine(recv, foreign if bad else handle)),
        ("combine-not-a-tensor", "TypeError", lambda bad: buf.combine("x" if bad else recv, handle)),  # type: ignore
    ]


def check_refusal_on_one_rank(bad_rank: int) -> Dict[str, Any]:
    me = dist.get_rank()
    buf = NormalBuffer(hidden=H, backend="reference", timeout_us=TIMEOUT_US)
    other = NormalBuffer(hidden=H, backend="reference", timeout_us=TIMEOUT_US)
    seen: Dict[str, str] = {}
    slowest = 0.0
    for i, (name, kind, call) in enumerate(_refusals(buf, other)):
        start = time.monotonic()
        if me == bad_rank:
            with pytest.raises((TypeError, ValueError)) as own:
                call(True)
            assert type(own.value).__name__ == kind, (name, own.value)
        else:
            with pytest.raises(PeerRefusedCall) as peer:
                call(False)
            err = peer.value
            assert isinstance(err, CallMismatch) and err.peer == bad_rank and err.rank == me, (name, err)
            assert err.reason.startswith(kind + ":"), (name, err.reason)
            seen[name] = str(err)
        slowest = max(slowest, time.monotonic() - start)
        good_round(buf, seed=i)          # the ranks are in step again: every later call is correct
    other.destroy()
    buf.destroy()
    return {"seen": seen, "slowest_s": slowest}


@pytest.mark.parametrize("world,bad_rank", [(2, 1), (4, 2)], ids=["2ranks", "4ranks"])
def test_a_call_refused_on_one_rank_raises_on_every_rank(request: pytest.FixtureRequest, world: int,
                                                         bad_rank: int) -> None:
    pool = request.getfixturevalue(f"pool{world}")
    res = pool.run(check_refusal_on_one_rank, bad_rank)
    for r, out in enumerate(res):
        if r != bad_rank:
            assert len(out["seen"]) == 7 and all(f"rank {bad_rank} refused" in m for m in out["seen"].values())
        # Nobody waited for the refusing rank: a wait would end in a TimeoutError after 120 s.
        assert out["slowest_s"] < TIMEOUT_US / 1e6 / 4


def check_ranks_at_different_calls() -> Dict[str, Any]:
    me = dist.get_rank()
    buf = NormalBuffer(hidden=H, backend="reference", timeout_us=TIMEOUT_US)
    x, idx, w = _inputs(6, 3)
    e = E * buf.num_ranks // 2
    ntpr, _, ntpe, tir, _ = buf.get_dispatch_layout(idx, e)
    # Rank 1 makes a call its peers do not make: its layout meets their dispatch.
    with pytest.raises(NormalCallMismatch) as mismatch:
        if me == 1:
            buf.get_dispatch_layout(idx, e)
        else:
            buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir, num_tokens_per_expert=ntpe,
                         topk_idx=idx, topk_weights=w)
    text = str(mismatch.value)
    assert "get_dispatch_layout #2" in text and "dispatch #2" in text, text
    # The ranks no longer agree on the calls: every call is refused (nothing is exchanged) until clean().
    with pytest.raises(BufferBroken, match="clean"):
        buf.get_dispatch_layout(idx, e)
    buf.clean()
    good_round(buf, seed=11)
    # Shapes the ranks must agree on are part of the tag: a combine of another hidden size.
    x2 = torch.zeros(4, 128 if me == 0 else 256, dtype=torch.bfloat16)
    idx2 = torch.full((4, K), -1, dtype=torch.int64)
    n2, _, e2, t2, _ = buf.get_dispatch_layout(idx2, e)
    with pytest.raises(NormalCallMismatch, match="different shapes"):
        buf.dispatch(x2, num_tokens_per_rank=n2, is_token_in_rank=t2, num_tokens_per_expert=e2)
    buf.clean()
    good_round(buf, seed=12)
    buf.destroy()
    return {"text": text}


def test_ranks_at_different_calls_raise_call_mismatch_then_clean(pool2: Any) -> None:
    res = pool2.run(check_ranks_at_different_calls)
    assert all("nothing of this exchange was used" in r["text"] for r in res)


# ---------------------------------------------------------------- the codec (no processes)
def _tag(**kw: Any) -> tags.CallTag:
    base = dict(epoch=2, call=9, kind=tags.KIND_COMBINE, signature=tags.signature(256, 12, 3, 5))
    base.update(kw)
    return tags.CallTag(**base)


def test_tag_round_trip_and_verdicts() -> None:
    mine = _tag()
    refused = _tag(status=tags.STATUS_REFUSED, signature=(), reason="TypeError: x \x07 é" + "z" * 300)
    back = tags.decode(tags.encode(refused), "w", 0, 1, 9, 2)
    assert back.reason.startswith("TypeError: x   é") and len(back.reason.encode()) <= tags.REASON_BYTES
    assert tags.verdict("w", 0, mine, [mine, mine]) is None
    err = tags.verdict("w", 0, mine, [mine, back])
    assert isinstance(err, PeerRefusedCall) and err.peer == 1
    proxy = _tag(status=tags.STATUS_PROXY, origin=3, reason="ValueError: v")
    err = tags.verdict("w", 0, mine, [mine, proxy])
    assert isinstance(err, PeerRefusedCall) and (err.peer, err.via) == (3, 1)
    for other, match in [(_tag(call=10), "sent call 10"), (_tag(epoch=3), "generation 3"),
                         (_tag(kind=tags.KIND_CACHED), "cached dispatch"),
                         (_tag(signature=tags.signature(256, 12, 3, 6)), "different shapes"),
                         (_tag(status=tags.STATUS_NOTICE, call=11), "another call")]:
        err = tags.verdict("w", 0, mine, [mine, other])
        assert isinstance(err, NormalCallMismatch) and match in str(err), (other, err)
    # A mismatch wins over a refusal: the ranks are not at the same call, whoever refused.
    assert type(tags.verdict("w", 0, mine, [mine, back, _tag(call=8)])) is NormalCallMismatch


@pytest.mark.parametrize("field,value", [(0, 0x1234), (3, 99), (4, 7), (5, 17), (tags.OFF_REASON_LEN, 500)],
                         ids=["magic", "kind", "status", "origin", "reason-length"])
def test_malformed_peer_tags_are_call_mismatches(field: int, value: int) -> None:
    words = tags.encode(_tag())
    words[field] = value
    with pytest.raises(NormalCallMismatch, match="not a call tag"):
        tags.decode(words, "w", 0, 1, 9, 4)
    with pytest.raises(NormalCallMismatch, match="not a call tag"):
        tags.decode(words[:10], "w", 0, 1, 9, 4)


# ---------------------------------------------------------------- the device words (g++, no GPU)
HARNESS = r"""
#include <cstdio>
#include <vector>
#include "kernels/normal_tags.h"
using namespace pyep::normal;
int bad = 0;
#define CHECK(c, ...) do { if (!(c)) { std::printf(__VA_ARGS__); std::printf("\n"); ++bad; } } while (0)
int main() {
    // Call numbers from clean(): 1, 2, 3 ...; parity alternates; 0 never appears, also across the wrap.
    for (uint32_t s0 : {0u, 1u, 0x7ffffffeu, 0xfffffff0u}) {
        uint32_t prev = s0;
        for (int i = 0; i < 40; ++i) {
            const uint32_t s = next_call(prev);
            CHECK(s != 0u, "zero after %u", prev);
            CHECK(prev == 0u || (s & 1u) != (prev & 1u), "parity repeats %u -> %u", prev, s);
            prev = s;
        }
    }
    CHECK(next_call(0u) == 1u && next_call(0xffffffffu) == 2u && next_call(41u) == 42u, "next_call");
    // The gate's view of a peer, along real call sequences (a fresh start and one across the wrap):
    // `back1`/`back2` are the peer's flags before it posts call s.
    for (uint32_t s0 : {0u, 0xfffffffbu}) {
        // The two flags before the first call: "nothing yet" after clean(), or the two calls before s0.
        std::vector<uint32_t> seq = s0 ? std::vector<uint32_t>{s0 - 1u, s0} : std::vector<uint32_t>{0u, 0u};
        uint32_t c = s0;
        for (int i = 0; i < 12; ++i) seq.push_back(c = next_call(c));
        for (size_t i = 2; i + 2 < seq.size(); ++i) {
            const uint32_t s = seq[i], b1 = seq[i - 1], b2 = seq[i - 2], n1 = seq[i + 1], n2 = seq[i + 2];
            CHECK(gate_classify(b2, b1, s) == kGateWait, "s=%u: a peer not there yet is waited for", s);
            CHECK(gate_classify(s, b1, s) == kGateArrived, "s=%u: arrived", s);
            CHECK(gate_classify(s, n1, s) == kGateArrived, "s=%u: arrived, already posted the next", s);
            // A peer one call ahead that never posted s (its call s went elsewhere): found, and named.
            CHECK(gate_classify(b2, n1, s) == kGateOther && gate_peer_call(b2, n1) == n1, "s=%u: ahead by one", s);
            CHECK(gate_classify(n2, n1, s) == kGateOther && gate_peer_call(n2, n1) == n2, "s=%u: ahead by two", s);
            if (i >= 4) CHECK(gate_classify(seq[i - 4], seq[i - 3], s) == kGateOther, "s=%u: behind by two", s);
        }
    }
    CHECK(gate_classify(0u, 0u, 7u) == kGateOther, "zeroed flags at call 7 (a peer that cleaned alone)");
    CHECK(call_is_after(3u, 2u) && call_is_after(2u, 0xffffffffu) && !call_is_after(7u, 9u) && !call_is_after(5u, 5u),
          "call order across the wrap");
    CHECK(gate_classify(0u, 0u, 1u) == kGateWait && gate_classify(0u, 1u, 2u) == kGateWait, "first calls");
    // The relay's count record: call number, 3 bits of generation, the call's kind, status, 24 bits of rows.
    for (uint32_t s : {1u, 2u, 0x80000001u, 0xffffffffu})
        for (uint32_t e : {0u, 5u, 7u, 8u + 6u})
            for (int k : {kKindLayout, kKindDispatch, kKindCached, kKindCombine})
                for (int st : {kTagOk, kTagRefused, kTagProxy, kTagNotice})
                    for (uint32_t r : {0u, 1u, 12345u, kRecordMaxRows}) {
                        const uint64_t rec = relay_count_record(s, e, k, st, r);
                        CHECK(record_seq(rec) == s && record_epoch(rec) == (e & 7u) && record_kind(rec) == k &&
                              record_status(rec) == st && record_rows(rec) == r, "record %u %u %d %d %u", s, e, k, st, r);
                        CHECK(record_seq(0ull) != s, "a zeroed slot never names a call");
                    }
    std::printf("%s\n", bad ? "FAIL" : "OK");
    return bad ? 1 : 0;
}
"""


def test_device_call_words(tmp_path: Any) -> None:
    """engine/kernels/normal_tags.h compiled with g++: the call numbers' wrap, what a gate concludes from
    a peer's flags (in step, one or two calls ahead or behind, across the wrap), the relay's records."""
    import os
    import shutil
    import subprocess
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to compile engine/kernels/normal_tags.h on the host")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src, exe = tmp_path / "tags.cpp", tmp_path / "tags"
    src.write_text(HARNESS)
    subprocess.run(["g++", "-std=c++17", "-O1", "-I", os.path.join(root, "engine"), str(src), "-o", str(exe)],
                   check=True, capture_output=True, timeout=120)
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr


# ---------------------------------------------------------------- the native backends' host side (no GPU)
def _native_refusals(monkeypatch: pytest.MonkeyPatch, capturing: bool) -> Tuple[List[Any], Any, Any]:
    """An intranode and an internode native backend made without a GPU, their gates recorded."""
    from types import SimpleNamespace

    from pyep.ep.normal import native, native_internode
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(native_internode, "stream_capturing", lambda: capturing)
    launched: List[Any] = []
    intra = native.NormalNativeBackend.__new__(native.NormalNativeBackend)
    intra._broken = False
    intra.gate = lambda kind, sig, **kw: launched.append(("node", kind, kw["status"], kw["reason"]))
    inter = native_internode.NormalInternodeBackend.__new__(native_internode.NormalInternodeBackend)
    inter._broken = False
    inter.node = intra
    inter.relay = SimpleNamespace(gate=lambda kind, **kw: launched.append(("column", kind, kw["status"])))
    return launched, intra, inter


def test_native_refusal_launches_the_calls_gates_in_their_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused call launches REFUSED gates where the call has gates, in the order the call's own run
    (a dispatch: the column's count exchange, then the node; a combine: the node, then the column), and
    none for get_dispatch_layout, which exchanges nothing natively (a gate would pair with the peers'
    next call)."""
    launched, intra, inter = _native_refusals(monkeypatch, capturing=False)
    for backend in (intra, inter):
        assert backend.refuse(tags.KIND_LAYOUT, "ValueError: e") is None
    assert launched == []
    intra.refuse(tags.KIND_COMBINE, "TypeError: x")
    assert launched == [("node", tags.KIND_COMBINE, tags.STATUS_REFUSED, "TypeError: x")]
    launched.clear()
    inter.refuse(tags.KIND_CACHED, "ValueError: h")
    assert [(w, k) for w, k, *_ in launched] == [("column", tags.KIND_CACHED), ("node", tags.KIND_CACHED)]
    launched.clear()
    inter.refuse(tags.KIND_COMBINE, "ValueError: c")
    assert [(w, k) for w, k, *_ in launched] == [("node", tags.KIND_COMBINE), ("column", tags.KIND_COMBINE)]
    launched.clear()
    intra._broken = inter._broken = True        # a broken buffer exchanges nothing
    intra.refuse(tags.KIND_DISPATCH, "x")
    inter.refuse(tags.KIND_DISPATCH, "x")
    assert launched == []


def test_native_refusal_inside_a_capture_launches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    launched, intra, inter = _native_refusals(monkeypatch, capturing=True)
    intra.refuse(tags.KIND_DISPATCH, "x")
    inter.refuse(tags.KIND_COMBINE, "x")
    assert launched == []


def test_native_pending_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """pending_error: a void call is returned (the value error noted on it); a call mismatch or a timeout
    breaks the buffer and raises, and then every call raises BufferBroken."""
    from pyep.ep.normal import BufferBroken, PeerTimeout, native
    from pyep.ep.normal.device_records import TAG_RECORD_INTS, DeviceRecords
    b = native.NormalNativeBackend.__new__(native.NormalNativeBackend)
    b._broken = False
    err = torch.zeros(8, dtype=torch.int32)
    rec = torch.zeros(TAG_RECORD_INTS, dtype=torch.int32)
    b.records = DeviceRecords(err, rec, lambda: None, 0, 2, 1000)
    assert b.pending_error() is None

    def void(kind: int, status: int, count: int) -> None:
        words = tags.encode(tags.CallTag(0, 4, tags.KIND_COMBINE, status, origin=1, reason="ValueError: v"))
        rec[16:] = torch.tensor(words, dtype=torch.int64).to(torch.int32)
        rec[1:7] = torch.tensor([count - 1 if kind == 1 else count, kind, 1, 4, 0, tags.KIND_COMBINE])
        rec[0] = count
    void(1, tags.STATUS_REFUSED, 1)
    err[:4] = torch.tensor([6, 3, 1, 1])                       # is_token_in_rank contradicted topk_idx
    got = b.pending_error()
    assert isinstance(got, PeerRefusedCall) and got.peer == 1 and "is_token_in_rank" in "".join(got.__notes__)
    assert b.pending_error() is None and not b._broken
    void(2, tags.STATUS_NOTICE, 2)
    with pytest.raises(NormalCallMismatch):
        b.pending_error()
    with pytest.raises(BufferBroken):
        b.pending_error()
    b._broken = False
    err[:4] = torch.tensor([3, 1, 0, -1])                      # a peer timed out
    with pytest.raises(PeerTimeout):
        b.check_errors()
    assert b._broken
    # A one-copy descriptor outside the pool, and a lost path record: both break the buffer too.
    from pyep.ep.normal.errors import ERR_DIRECT_DESC, ERR_LOST_PATH, BadOutputDescriptor, LostDispatchPath
    for words, exc in (([ERR_DIRECT_DESC, 1, 2, 99], BadOutputDescriptor),
                       ([ERR_LOST_PATH, 1, 7, 0], LostDispatchPath)):
        b._broken = False
        err[:4] = torch.tensor(words)
        with pytest.raises(exc, match="rank 1's"):
            b.pending_error()
        with pytest.raises(BufferBroken, match="one-copy descriptor"):
            b.pending_error()


def test_reference_refusal_that_meets_no_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused call whose peers never make it (they must: the refusal takes part in the call): its
    tag exchange times out; the refusal returns that for the caller's note and the buffer refuses
    every call until clean() (gloo's exchange is left pending with nothing to pair with)."""
    from pyep.ep.normal import BufferBroken
    from pyep.ep.normal.reference import NormalReferenceBackend
    b = NormalReferenceBackend.__new__(NormalReferenceBackend)
    b.rank, b.num_ranks, b.epoch, b.calls, b._broken, b.timeout_us = 0, 2, 0, 3, None, 1000
    b.device = torch.device("cpu")
    b._mail, b.mask, b.grace_until = None, torch.ones(2, dtype=torch.int32), 0

    def silent(*_: Any) -> Any:
        raise TimeoutError("normal combine #4 (call tags): ranks [0, 1] did not all take part within 1000 us")
    monkeypatch.setattr(b, "_fixed", silent)
    got = b.refuse(tags.KIND_COMBINE, "TypeError: x")
    assert isinstance(got, TimeoutError)
    with pytest.raises(BufferBroken, match="found no peers"):
        b.check_errors()
