"""The normal mode's active_ranks mask and elastic membership on the reference backend (issue 26;
docs/elastic.md, "Normal mode"):

- on gloo ranks, a mask that leaves a rank out gives the survivors exactly what a run without that
  rank gives (its tokens never sent, nothing routed to it), bit for bit: layout, received rows, top-k,
  per-expert counts, combine; the tokens routed to it are counted dropped on the events and the handle;
- a store-based buffer (threads on one TCPStore) marks a rank that stops answering, keeps computing
  the definition (pyep.ep.elastic.drill_normal) for the survivors, and re-admits a restarted process of
  that rank, after which every rank computes the full definition again;
- forged or malformed store records (another job's secret, no MAC) never change membership;
- a native backend that takes no mask (the internode kernels) refuses one that leaves a rank out
  (ElasticUnsupported), never ignores it; the native intranode kernels take one (set_mask, read on the
  GPU; tests/test_normal_elastic_gpu.py runs them) and refuse taking a rank back on a group.
The drill (`pyep drill --mode normal`): tests/test_normal_drill.py.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.distributed as dist

from store_util import client_store, master_store, run_threads
from multiproc import DistPool
from pyep.ep.elastic import drill_normal as dn
from pyep.ep.normal import NormalBuffer

SECRET = b"normal-elastic-test-secret-0123456789"
OTHER_JOB = b"another-job-secret-0123456789abcdef"
A: Dict[str, Any] = {"seed": 3, "T": 10, "H": 128, "E": 6, "K": 3}


@pytest.fixture(scope="module")
def pool3() -> Any:
    with DistPool(3) as pool:
        yield pool


# ---------------------------------------------------------------------------------------- gloo masks
def _gloo_step(masked: int, with_mask: bool) -> Dict[str, Any]:
    """One step on this gloo rank. with_mask: every rank passes active_ranks with `masked` left out.
    Else the oracle run: rank `masked` has no tokens and nobody routes to it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    e_l = A["E"] // world
    x, idx, w = dn.inputs(A["seed"], 1, rank, A["T"], A["H"], A["E"], A["K"])
    mask = torch.ones(world, dtype=torch.int32)
    if with_mask:
        mask[masked] = 0
    else:
        idx = torch.where(idx.div(e_l, rounding_mode="floor") == masked, torch.full_like(idx, -1), idx)
        if rank == masked:
            x, idx, w = x[:0], idx[:0], w[:0]
    buf = NormalBuffer(hidden=A["H"], backend="reference", timeout_us=20_000_000,
                       active_ranks=mask if with_mask else None)
    ntpr, _, ntpe, in_rank, ev0 = buf.get_dispatch_layout(idx, A["E"])
    recv_x, r_idx, r_w, counts, handle, ev1 = buf.dispatch(
        x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx,
        topk_weights=w)
    y = dn.expert(recv_x, rank)
    out, out_w, ev2 = buf.combine(y, handle, topk_weights=r_w)
    cached_x, *_ = buf.dispatch(x, handle=handle)
    res = {"ntpr": ntpr, "ntpe": ntpe, "in_rank": in_rank, "recv_x": recv_x.view(torch.int16), "r_idx": r_idx,
           "r_w": r_w, "counts": counts, "out": out.view(torch.int16), "out_w": out_w,
           "cached": cached_x.view(torch.int16), "handle": list(handle), "drop": [ev0.num_dropped_tokens, ev1.num_dropped_tokens,
                                                         ev2.num_dropped_tokens, handle.num_dropped_tokens],
           "mask": buf.get_active_ranks(), "routed": [int(dn.routed(
               dn.inputs(A["seed"], 1, rank, A["T"], A["H"], A["E"], A["K"])[1], d, e_l).sum()) for d in range(world)]}
    if with_mask:
        # every rank takes the rank back (collective): the next layout counts it again, drops nothing
        buf.update_ep_member(None)
        ntpr2, _, _, _, ev = buf.get_dispatch_layout(idx, A["E"])
        res["back"] = (buf.get_active_ranks().tolist(), ntpr2.tolist(), ev.num_dropped_tokens.tolist())
    buf.destroy()
    return res


@pytest.mark.parametrize("masked", [2, 0])
def test_mask_gives_what_a_run_without_the_rank_gives(pool3: DistPool, masked: int) -> None:
    got = pool3.run(_gloo_step, masked, True, timeout_s=120)
    want = pool3.run(_gloo_step, masked, False, timeout_s=120)
    for r in range(3):
        g, o = got[r], want[r]
        assert g["mask"].tolist() == [0 if d == masked else 1 for d in range(3)]
        assert g["back"] == ([1, 1, 1], g["routed"], [0, 0, 0])
        if r == masked:
            # The masked rank sends and receives nothing; every token it routed anywhere is dropped.
            assert g["recv_x"].shape[0] == 0 and g["ntpr"].tolist() == [0, 0, 0]
            assert g["drop"][1].tolist() == g["routed"] and g["out"].abs().sum() == 0
            continue
        for k in ("ntpr", "ntpe", "in_rank", "recv_x", "r_idx", "r_w", "out", "out_w", "cached"):
            assert torch.equal(g[k], o[k]), (r, k)
        assert g["counts"] == o["counts"]
        for i, (gt, ot) in enumerate(zip(g["handle"], o["handle"])):   # prefix matrices, src idx, send_head
            assert torch.equal(gt, ot), (r, "handle", i)
        assert g["ntpr"][masked] == 0 and not bool(g["in_rank"][:, masked].any())
        want_drop = [g["routed"][d] if d == masked else 0 for d in range(3)]
        # layout and dispatch count the tokens routed to the masked rank; the combine drops nothing more
        assert [t.tolist() for t in g["drop"]] == [want_drop, want_drop, [0, 0, 0], want_drop]
        assert want_drop[masked] > 0


def test_maskless_native_backend_refuses_a_mask_that_leaves_a_rank_out() -> None:
    from pyep.ep.normal.errors import ElasticUnsupported
    buf = NormalBuffer.__new__(NormalBuffer)

    class Native:
        name = "native"
    buf._backend, buf._mask = Native(), torch.tensor([1, 0], dtype=torch.int32)
    with pytest.raises(ElasticUnsupported, match=r"active_ranks mask that leaves ranks \[1\] out.*native"):
        buf._check_mask_supported()
    assert isinstance(ElasticUnsupported("x", "native"), NotImplementedError)
    buf._mask = torch.ones(2, dtype=torch.int32)
    buf._check_mask_supported()        # all active: nothing to refuse


# ---------------------------------------------------------------------------------------- store buffers
def _master() -> Any:
    return master_store(60.0)


def _client(port: int) -> Any:
    return client_store(port, 60.0)


def _threads(fns: List[Callable[[], Any]], timeout_s: float = 240.0) -> List[Any]:
    return run_threads(fns, timeout_s)


def _store_buf(port: int, prefix: str, rank: int, world: int, timeout_us: int = 1_000_000) -> NormalBuffer:
    return NormalBuffer(store=_client(port), rank=rank, world_size=world, store_prefix=prefix, backend="reference",
                        hidden=A["H"], timeout_us=timeout_us, job_secret=SECRET, rejoin_lead_calls=1)


def _steps(buf: NormalBuffer, world: int, count: int, stop: Any = None) -> List[List[int]]:
    """`count` checked steps (or until `stop()` says so); returns the mask after each."""
    a = dict(A)
    masks = []
    for _ in range(count):
        if stop is not None and stop(buf):
            break
        step = buf.next_call
        got, handle, out, drop = dn._step(buf, a, step, buf.rank, world, False, "")
        after = [bool(v) for v in buf.get_active_ranks().tolist()]
        dn.check_step(a, step, buf.rank, world, after, got, handle, out, drop)
        masks.append([int(v) for v in after])
    return masks


@pytest.mark.parametrize("dead", [2, 1])
def test_store_buffer_marks_a_silent_rank_and_readmits_its_restart(dead: int) -> None:
    """Rank `dead` makes 2 steps and goes silent (its process 'dies'); the others mark it in step 3, keep
    computing the survivors' definition (its tokens dropped and counted), then a new process of that
    rank (generation 2) joins and every rank computes the full definition again. A dead rank in the
    middle (1) checks that each survivor's per-destination header still reaches the right rank."""
    master = _master()
    prefix = f"t/normal-rejoin-{dead}"
    world = 3
    bufs = _threads([lambda r=r: _store_buf(master.port, prefix, r, world) for r in range(world)])
    _threads([lambda b=b: _steps(b, world, 2) for b in bufs])
    assert all(b.generation == 1 for b in bufs)
    # the dead rank is gone: the survivors' next steps mark it (once, within its timeout) and go on
    live = [b for b in bufs if b.rank != dead]
    survivor_masks = _threads([lambda b=b: _steps(b, world, 3) for b in live])
    for masks in survivor_masks:
        assert masks == [[0 if r == dead else 1 for r in range(world)]] * 3
    newcomer: List[Any] = []

    def restart() -> Any:
        nb = _store_buf(master.port, prefix, dead, world)
        assert nb.joining and nb.generation == 2
        with pytest.raises(Exception, match="not admitted yet"):
            nb.get_active_ranks()
        # The survivors' counters are in place before the newcomer says it is ready: a survivor's call #A
        # starts on that record, and its first writes into our buffer must not be overwritten by them.
        take, ready_then = nb.backend.take_step_state, []

        def take_before_ready(epoch: int, calls: int) -> None:
            ready_then.append(master.check([f"{prefix}/ready/{dead}/2"]))
            take(epoch, calls)
        nb.backend.take_step_state = take_before_ready
        at = nb.join(120.0)
        assert ready_then == [False]
        newcomer.append(nb)
        return at, _steps(nb, world, 5)

    def survive(b: NormalBuffer) -> List[List[int]]:
        # keep stepping until rank 2 is back, then 4 more steps together
        before = _steps(b, world, 400, stop=lambda x: bool(x.get_active_ranks()[dead]))
        return before + _steps(b, world, 4)

    owners = [(b._owner, b._epoch, b.backend.epoch) for b in live]
    out = _threads([lambda: survive(live[0]), lambda: survive(live[1]), restart])
    # The survivors' state other than the mask is untouched by the rejoin: same buffer, same generation
    # (clean count), one call counter running on (3 calls a step), no reset; the newcomer took it.
    assert [(b._owner, b._epoch, b.backend.epoch) for b in live] == owners
    for b in [*live, *newcomer]:
        assert b.backend.calls == 3 * (b.next_call - 1)
    at, new_masks = out[2]
    assert new_masks == [[1, 1, 1]] * 5          # steps A .. A+4
    for masks in out[:2]:
        assert masks[-5:] == [[1, 1, 1]] * 5      # step A (admitted in its layout call) .. A+4
    assert live[0].next_call == live[1].next_call == newcomer[0].next_call == at + 5
    for b in [*bufs, *newcomer]:
        b.destroy()


def test_a_rank_that_dies_again_after_its_rejoin_is_marked_and_taken_back_again() -> None:
    """A flaky rank: generation 2 rejoins, dies too, and generation 3 comes back. The survivor marks each
    death within its timeout and admits each restart; every step is checked against the definition."""
    master = _master()
    prefix, world, dead = "t/normal-rejoin-twice", 2, 1
    bufs = _threads([lambda r=r: _store_buf(master.port, prefix, r, world) for r in range(world)])
    _threads([lambda b=b: _steps(b, world, 2) for b in bufs])
    live = bufs[0]
    procs = [bufs[1]]
    for gen in (2, 3):
        assert _steps(live, world, 2) == [[1, 0]] * 2          # the last process of rank 1 went silent

        def restart(g: int = gen) -> Any:
            nb = _store_buf(master.port, prefix, dead, world)
            assert nb.joining and nb.generation == g
            nb.join(120.0)
            procs.append(nb)
            return _steps(nb, world, 3)

        def survive() -> List[List[int]]:
            before = _steps(live, world, 400, stop=lambda x: bool(x.get_active_ranks()[dead]))
            return before + _steps(live, world, 2)
        out = _threads([survive, restart])
        assert out[0][-3:] == [[1, 1]] * 3 and out[1] == [[1, 1]] * 3
        assert live.next_call == procs[-1].next_call
    assert live.generation == 1 and procs[-1].generation == 3
    for b in [live, *procs]:
        b.destroy()


def _forge(store: Any, prefix: str, secret: Any) -> List[str]:
    """A forger (another job's secret, or no MAC at all) claims a restarted generation 2 of rank 1 and
    writes every record of the admission, plus mail rows for the survivors' next calls."""
    from pyep.ep.elastic.membership import _AT, Announcement
    from pyep.ep.records import RecordCodec
    codec = RecordCodec(secret) if secret is not None else None
    fp = f"normal hidden={A['H']} ranks=2"
    writes = {
        f"{prefix}/gen/1/2": (1, 2, b"n" * 16), f"{prefix}/annidx/1": (1, 2, b"n" * 16),
        f"{prefix}/ann/1/2": (1, 2, Announcement(1, 2, 2, fp, "reference", b"").encode()),
        f"{prefix}/prepared/1/2/0": (0, 1, b""), f"{prefix}/at/1/2": (0, 1, _AT.pack(3, 0)),
        f"{prefix}/act/1/2/0": (0, 1, b""), f"{prefix}/ready/1/2": (1, 2, b""),
        f"{prefix}/alive/1": (1, 1, b"\x00" * 8),
    }
    for call in range(1, 40):
        for stage in ("tag", "hdr", "data"):
            writes[f"{prefix}/mail/0/n0.{call}.{stage}/1.1"] = (1, 1, b"\x01" * 64)
    for key, (writer, gen, payload) in writes.items():
        store.set(key, codec.seal(key, writer, gen, 0, payload) if codec else payload)
    return list(writes)


@pytest.mark.parametrize("secret", [None, OTHER_JOB], ids=["unsealed", "another-jobs-secret"])
def test_forged_records_never_change_membership(secret: Any) -> None:
    """A forger writes mail rows in rank 1's name for the next calls (read by rank 0 before rank 1's own
    rows replace them), then -- rank 1 dead and marked -- a whole admission of a phantom generation 2 of
    rank 1. Rank 0 refuses every record: no rank is marked while both live, the phantom is never
    admitted, every step stays the definition."""
    master = _master()
    prefix = f"t/normal-forged-{secret is None}"
    bufs = _threads([lambda r=r: _store_buf(master.port, prefix, r, 2) for r in range(2)])
    keys = _forge(_client(master.port), prefix, secret)
    masks = _threads([lambda b=b: _steps(b, 2, 4) for b in bufs])
    assert masks == [[[1, 1]] * 4] * 2
    bufs[1].destroy()                   # rank 1 stops answering
    assert _steps(bufs[0], 2, 1) == [[1, 0]]
    _forge(_client(master.port), prefix, secret)
    assert _steps(bufs[0], 2, 6) == [[1, 0]] * 6
    assert bufs[0].generation == 1 and bufs[0].poll_rejoin() == []
    refused = {e.key for e in bufs[0].rejected_records}
    assert f"{prefix}/annidx/1" in refused and refused <= set(keys), refused - set(keys)
    bufs[0].destroy()


def test_maskless_native_refuses_a_caller_held_mask_and_checks_update_ep_member() -> None:
    """A native backend without takes_mask (the internode kernels): update_ep_member copies the mask
    into the buffer's own tensor and refuses one that leaves a rank out. Calls themselves read no mask."""
    from pyep.ep.normal.errors import ElasticUnsupported
    buf = NormalBuffer.__new__(NormalBuffer)

    class Native:
        name = "native"

        def pending_error(self) -> None:
            return None
    buf._backend, buf._mask, buf._destroyed, buf._member = Native(), torch.ones(2, dtype=torch.int32), False, None
    buf._num_ranks = 2
    assert buf._begin("dispatch") is None
    buf.update_ep_member(torch.ones(2, dtype=torch.int32))
    with pytest.raises(ElasticUnsupported, match=r"ranks \[1\]"):
        buf.update_ep_member(torch.tensor([1, 0], dtype=torch.int32))


def test_newcomer_that_dies_before_confirming_does_not_stop_the_survivor() -> None:
    """A restarted process of rank 1 announces itself and dies before join(): the survivor waits for
    its confirmation at the agreed step (bounded), goes on without it, and later admits a newer process
    of rank 1 that does join."""
    master = _master()
    prefix = "t/normal-dead-newcomer"
    bufs = _threads([lambda r=r: _store_buf(master.port, prefix, r, 2) for r in range(2)])
    _threads([lambda b=b: _steps(b, 2, 1) for b in bufs])
    bufs[1].destroy()
    assert _steps(bufs[0], 2, 1) == [[1, 0]]
    bufs[0]._member.timeout_s = 2.0           # the handshake's bound, short for the test
    ghost = _store_buf(master.port, prefix, 1, 2)     # announces (generation 2), never joins
    assert ghost.joining and ghost.generation == 2
    assert _steps(bufs[0], 2, 6) == [[1, 0]] * 6       # the admission step timed out inside; no raise
    assert bufs[0].poll_rejoin() == []

    def restart() -> Any:
        nb = _store_buf(master.port, prefix, 1, 2)
        assert nb.generation == 3
        nb.join(120.0)
        return nb, _steps(nb, 2, 4)      # step A .. A+3

    out = _threads([lambda: _steps(bufs[0], 2, 400, stop=lambda x: bool(x.get_active_ranks()[1]))
                    + _steps(bufs[0], 2, 3), restart])
    # the survivor ran step A in its first loop (admitted in its layout call), then A+1 .. A+3
    assert out[0][-4:] == [[1, 1]] * 4 and out[1][1] == [[1, 1]] * 4
    for b in (bufs[0], out[1][0]):
        b.destroy()


def test_store_buffer_refuses_what_it_does_not_implement() -> None:
    """A store-based buffer refuses nodes that do not divide its ranks (ValueError), and the native
    kernels where they cannot run (no GPU here) BackendUnavailable, before any key is written; a mask of
    the wrong shape or values is refused like the LL buffer's."""
    from pyep.ep.backend import BackendUnavailable
    master = _master()
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match=r"store=\.\.\., backend='native'\) cannot run here"):
            NormalBuffer(store=_client(master.port), rank=0, world_size=2, backend="native", job_secret=SECRET)
    with pytest.raises(ValueError, match="3 ranks per node do not divide the 4 ranks"):
        NormalBuffer(store=_client(master.port), rank=0, world_size=4, ranks_per_node=3, job_secret=SECRET)
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match=r"store=\.\.\., backend='native'\) cannot run here"):
            NormalBuffer(store=_client(master.port), rank=0, world_size=2, ranks_per_node=1, backend="native",
                         job_secret=SECRET)
    for bad, exc in ((torch.ones(3, dtype=torch.int32), ValueError), (torch.ones(2, dtype=torch.int64), ValueError),
                     (torch.tensor([1, 2], dtype=torch.int32), ValueError), ([1, 1], TypeError)):
        with pytest.raises(exc, match="active_ranks"):
            NormalBuffer(store=_client(master.port), rank=0, world_size=2, active_ranks=bad, job_secret=SECRET)
    assert master.num_keys() == 0      # nothing was written to the store


def test_mailbox_marks_a_silent_source_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 waits for rank 1 (alive: it beats, itself waiting on dead rank 2, and sends at 1.5 timeouts)
    and rank 2 (dead: no heartbeat). At the deadline rank 2 is marked; rank 1 gets one more timeout and
    its rows are used; the exchange returns when they arrive -- not a second timeout later, kept waiting
    for rank 2 by rank 1's heartbeat. A fake clock: no timing of the machine is involved."""
    import struct

    from pyep.ep.control import StoreControl
    from pyep.ep.elastic import mailbox as mb
    master = _master()
    c = [StoreControl(_client(master.port), r, 3, "t/silent", SECRET) for r in range(3)]
    box = mb.StoreMailbox(c[0])
    timeout_s = 1.0
    sent: List[int] = []

    class Clock:
        t = 0.0

        def monotonic(self) -> float:
            return self.t

        def time(self) -> float:
            return 1e9 + self.t

        def sleep(self, d: float) -> None:
            self.t += d
            c[1].put(c[1].key("alive", 1), struct.pack("<d", self.time()))
            if self.t >= 1.5 * timeout_s and not sent:
                c[1].put(c[1].key("mail", 0, "x", "1.1"), b"\x07" * 4)
                sent.append(1)
    clock = Clock()
    monkeypatch.setattr(mb, "time", clock)
    active = torch.ones(3, dtype=torch.bool)
    recv, lens, late = box.exchange(torch.zeros((0, 4), dtype=torch.uint8), torch.zeros(3, dtype=torch.int64), 4,
                                    int(timeout_s * 1e6), "test exchange", "x", active, None)
    assert late == [2] and active.tolist() == [True, True, False] and lens.tolist() == [0, 1, 0]
    assert recv.reshape(-1).tolist() == [7, 7, 7, 7]
    assert 1.5 * timeout_s <= clock.t < 2 * timeout_s, clock.t


def test_act_record_payload_checked() -> None:
    """What a newcomer takes from a survivor's act record (the call counters and the mask) is checked
    before it is used: a wrong size, negative counters or mask bytes other than 0/1 raise MembershipError."""
    from pyep.ep.elastic.membership import MembershipError
    from pyep.ep.normal.buffer_member import _STEP, _decode_act
    epoch, calls, mask = _decode_act(_STEP.pack(2, 33) + b"\x01\x00\x01", 3, 0)
    assert (epoch, calls, mask.tolist()) == (2, 33, [1, 0, 1])
    for bad in (_STEP.pack(2, 33) + b"\x01\x00", _STEP.pack(-1, 33) + b"\x01\x01\x01",
                _STEP.pack(0, 3) + b"\x01\x02\x01", b""):
        with pytest.raises(MembershipError, match="act record of rank 1"):
            _decode_act(bad, 3, 1)


def test_store_buffer_refusal_and_clean() -> None:
    """The call tags work over the store mailbox too: a call refused on one rank's host makes its peer
    raise PeerRefusedCall for that call (nobody waits, nobody is marked) and the next steps pair
    correctly; clean() (collective) starts a new generation on both, and steps go on."""
    from pyep.ep.normal import PeerRefusedCall
    master = _master()
    bufs = _threads([lambda r=r: _store_buf(master.port, "t/normal-refuse", r, 2) for r in range(2)])
    _threads([lambda b=b: _steps(b, 2, 2) for b in bufs])

    def layout(b: NormalBuffer) -> str:
        _, idx, _ = dn.inputs(1, 1, b.rank, A["T"], A["H"], A["E"], A["K"])
        try:
            b.get_dispatch_layout(idx, A["E"] + 1 if b.rank == 0 else A["E"])   # rank 0: E not divisible by 2
        except PeerRefusedCall as exc:
            return f"peer {exc.peer}"
        except ValueError:
            return "refused"
        return "ran"
    assert _threads([lambda b=b: layout(b) for b in bufs]) == ["refused", "peer 0"]
    assert _threads([lambda b=b: _steps(b, 2, 2) for b in bufs]) == [[[1, 1]] * 2] * 2
    _threads([lambda b=b: b.clean() for b in bufs])
    assert [b.backend.epoch for b in bufs] == [1, 1]
    assert _threads([lambda b=b: _steps(b, 2, 2) for b in bufs]) == [[[1, 1]] * 2] * 2
    for b in bufs:
        b.destroy()


class _MaskNative:
    """A native intranode backend's mask side, without a GPU (the "device" is the CPU here)."""
    name = "native"
    takes_mask = True

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._mask = None
        self.sets: List[Any] = []

    def set_mask(self, mask: Any) -> None:
        self._mask = mask
        self.sets.append(mask)

    def pending_error(self) -> None:
        return None


def _mask_buffer() -> Any:
    buf = NormalBuffer.__new__(NormalBuffer)
    buf._backend, buf._mask, buf._destroyed, buf._member = _MaskNative(), torch.ones(3, dtype=torch.int32), False, None
    buf._num_ranks = 3
    return buf


def test_native_mask_first_update_attaches_it_and_takes_no_rank_back() -> None:
    """update_ep_member on a native intranode buffer: all active and no mask yet changes nothing; the first
    mask that leaves a rank out becomes the kernels' (set_mask) and the buffer's; a later one may leave
    more out (copied in place, the kernels keep reading the same tensor) but not take a rank back: that
    is refused before anything changes."""
    from pyep.ep.normal.errors import ElasticUnsupported
    buf = _mask_buffer()
    buf.update_ep_member(None)
    assert buf._backend.sets == []
    buf.update_ep_member(torch.tensor([1, 0, 1], dtype=torch.int32))
    assert len(buf._backend.sets) == 1 and buf._mask is buf._backend.sets[0]
    assert buf.get_active_ranks().tolist() == [1, 0, 1]
    held = buf._mask
    buf.update_ep_member(torch.tensor([1, 0, 0], dtype=torch.int32))
    assert buf._mask is held and held.tolist() == [1, 0, 0] and len(buf._backend.sets) == 1
    with pytest.raises(ElasticUnsupported, match=r"taking ranks \[1, 2\] back"):
        buf.update_ep_member(None)
    assert held.tolist() == [1, 0, 0]


def test_native_mask_at_construction() -> None:
    """active_ranks= goes to a native intranode backend as is (its kernels read the caller's tensor); a
    native backend without takes_mask refuses it; no mask leaves a native buffer without one (a silent
    peer then voids the call with PeerTimeout, as before)."""
    from pyep.ep.normal.errors import ElasticUnsupported
    buf = _mask_buffer()
    buf._attach_native_mask(None)
    assert buf._backend.sets == []
    mine = torch.tensor([1, 1, 0], dtype=torch.int32)
    buf._attach_native_mask(mine)
    assert buf._backend.sets == [mine] and buf._mask is mine

    class Internode:
        name = "native-internode"
    buf._backend = Internode()
    buf._attach_native_mask(None)
    with pytest.raises(ElasticUnsupported, match="active_ranks="):
        buf._attach_native_mask(mine)
