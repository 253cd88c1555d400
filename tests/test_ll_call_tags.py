"""Call-tagged exchanges on the reference backend (docs/elastic.md, "Call-tagged exchanges"): one rank's
dispatch or combine is refused by validation while its peers' are not. Before, the next calls paired
messages of different calls and every rank returned wrong numbers without an exception; now the refusing
rank takes part in that call's exchange with an abort marker, every rank gets a typed error for that
call (the refuser its own TypeError/ValueError, the others PeerRefusedCall naming it), no rank times
out or is marked, and every later call equals the reference definition bit for bit. On gloo groups of 2
and 3 ranks, and on a store-based buffer (the store mailbox). Also: a peer at another call number
(CallMismatch on every rank, nothing used), and clean() putting the call numbers back in step."""
from __future__ import annotations

import datetime
import threading
from typing import Any, Dict, List

import pytest
import torch.distributed as dist

from pyep.ep.errors import CallMismatch
from pyep.ep.ll import EpBuffer
from pyep.ep.ll.errors import CombineOfFailedDispatch, LLCallMismatch, PeerRefusedCall

from ll_steps import H, T, experts as _experts, inputs as _inputs, step as _step


def _not_marked(buf: EpBuffer) -> None:
    table = buf.transport_table()
    assert all(p.kind != "inactive" for p in table), f"rank {buf.rank} marked a peer: {table}"


# ------------------------------------------------------------------ gloo groups (run on every rank)
def refused_calls(plan: Dict[int, Dict[int, str]], steps: int, timeout_us: int) -> List[str]:
    """Steps 0..steps-1; plan[step][rank] = "dispatch" / "combine": that rank's call of that step is
    refused. Returns what every step did on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = EpBuffer(backend="reference", num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=4 * world,
                   timeout_us=timeout_us)
    got = [_step(buf, s, plan.get(s, {}).get(rank)) for s in range(steps)]
    _not_marked(buf)
    buf.destroy()
    return got


def _expect(plan: Dict[int, Dict[int, str]], steps: int, world: int) -> List[List[str]]:
    """Every rank of a step with a refusal raises: the refuser its TypeError, the others PeerRefusedCall
    (a refused combine's peers still finish their exchange first: its result is not returned)."""
    out = []
    for r in range(world):
        row = []
        for s in range(steps):
            who = plan.get(s, {})
            row.append("ok" if not who else ("TypeError" if r in who else "PeerRefusedCall"))
        out.append(row)
    return out


@pytest.mark.parametrize("plan", [
    {1: {0: "dispatch"}},
    {1: {1: "combine"}},
    {0: {0: "dispatch"}, 2: {1: "combine"}, 3: {0: "dispatch", 1: "dispatch"}},
], ids=["dispatch-refused", "combine-refused", "mixed"])
def test_refused_call_two_ranks(pool2: Any, plan: Dict[int, Dict[int, str]]) -> None:
    steps = 6
    got = pool2.run(refused_calls, plan, steps, 20_000_000, timeout_s=240)
    assert got == _expect(plan, steps, 2)


def test_refused_call_three_ranks() -> None:
    from multiproc import run_distributed
    plan = {1: {2: "dispatch"}, 3: {0: "combine"}, 4: {1: "dispatch", 2: "combine"}}
    steps = 7
    got = run_distributed(refused_calls, 3, plan, steps, 20_000_000, timeout_s=300)
    # Step 4: rank 1 refused its dispatch, so every rank's dispatch failed (rank 2 never gets to refuse
    # its combine: the combine of a failed dispatch raises before it is checked).
    want = _expect(plan, steps, 3)
    want[2][4] = "PeerRefusedCall"
    assert got == want


def which_error(refuse_rank: int) -> List[str]:
    """The errors' content: the refuser's own, and PeerRefusedCall naming it, its call and its reason."""
    rank = dist.get_rank()
    buf = EpBuffer(backend="reference", num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=8)
    x, idx, w = _inputs(5, rank, 8)
    seen = []
    if rank == refuse_rank:
        with pytest.raises(TypeError, match="x must have dtype"):
            buf.dispatch(x.float(), idx, use_fp8=False)
        seen.append("refused")
    else:
        recv, _, h, _, _ = buf.dispatch(x, idx, use_fp8=False)
        with pytest.raises(PeerRefusedCall) as ei:
            buf.combine(_experts(buf, recv), idx, w, h)
        err = ei.value
        assert isinstance(err, CallMismatch) and isinstance(err, LLCallMismatch)
        assert (err.kind, err.peer, err.my_call, err.rank) == ("dispatch", refuse_rank, 1, rank)
        assert "TypeError" in err.reason and f"rank {refuse_rank} refused" in str(err)
        seen.append(str(err))
        # The handle of the failed dispatch stays refused, with nothing exchanged (its peers skip it too).
        with pytest.raises(CombineOfFailedDispatch):
            buf.combine(_experts(buf, recv), idx, w, h)
    assert _step(buf, 6) == "ok"
    buf.destroy()
    return seen


def test_peer_refused_call_names_rank_call_and_reason(pool2: Any) -> None:
    got = pool2.run(which_error, 1, timeout_s=120)
    assert got[1] == ["refused"] and "dispatch #1: rank 1 refused this call" in got[0][0]


def skipped_call(skipper: int) -> List[str]:
    """Rank `skipper` makes one dispatch more than its peer (it calls dispatch twice in a row and
    combines only the second): from then on its calls carry other numbers than its peer's. Every rank
    gets CallMismatch naming both calls instead of another call's data; clean() (collective) takes
    every rank to the largest call number, and the calls after it are exact."""
    rank = dist.get_rank()
    buf = EpBuffer(backend="reference", num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=8)
    assert _step(buf, 0) == "ok"
    x, idx, w = _inputs(1, rank, 8)
    if rank == skipper:
        buf.dispatch(x, idx, use_fp8=False)               # a dispatch its peer never makes
    seen = []
    for step in (2, 3):
        seen.append(_step(buf, step))
    assert seen == ["LLCallMismatch", "LLCallMismatch"], seen
    buf.clean()
    assert [_step(buf, s) for s in (4, 5, 6)] == ["ok"] * 3
    _not_marked(buf)
    buf.destroy()
    return seen


def test_call_mismatch_on_every_rank_and_clean_realigns(pool2: Any) -> None:
    got = pool2.run(skipped_call, 0, timeout_s=120)
    assert got == [["LLCallMismatch"] * 2] * 2


# ------------------------------------------------------------------ store-based buffer (the mailbox)
def test_refused_call_on_a_store_marks_nobody() -> None:
    """A store-based buffer (ranks as threads of this process): rank 1 refuses dispatch #2. Before, its
    peer waited out the timeout for mail that never came and marked rank 1 dead; now rank 1's abort
    marker is that call's mail: rank 0 gets PeerRefusedCall at once, nobody is marked, and the next
    calls are exact."""
    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    outs: List[Any] = [None, None]
    errs: List[BaseException] = []

    def run(r: int) -> None:
        try:
            store = dist.TCPStore("127.0.0.1", master.port, 1, is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=30))
            buf = EpBuffer(store=store, rank=r, world_size=2, store_prefix="t/tags", backend="reference",
                           num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=8, timeout_us=2_000_000,
                           job_secret=b"ll-call-tags-test-secret")
            got = [_step(buf, s, "dispatch" if (s, r) == (1, 1) else None) for s in range(4)]
            assert buf.backend.inactive_ranks() == [], f"rank {r} marked {buf.backend.inactive_ranks()}"
            outs[r] = got
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errs.append(exc)
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errs:
        raise errs[0]
    assert outs == [["ok", "PeerRefusedCall", "ok", "ok"], ["ok", "TypeError", "ok", "ok"]]
