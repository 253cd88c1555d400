"""Per-rank drills of the native normal mode's call gates (tests/test_normal_gpu_tags.py runs them in
DistPool workers over gloo, ranks sharing the GPUs there are): a call refused on one rank's host while
its peers make it, ranks at different calls (an extra call, a call counter moved), and layout tensors
that contradict topk_idx. Intranode (p = None) and across virtual nodes (ranks_per_node = p, the relay
on the softnic). After each drill the buffer is compared with the reference bit for bit
(normal_gpu_cases.run_case)."""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from normal_gpu_cases import _on, assert_broken, make_inputs, rank_buffers, run_case

TIMEOUT_US = 20_000_000      # a rank left waiting would show as a call that takes this long


def _kw(p: Optional[int]) -> Dict[str, Any]:
    """new_buffers' arguments: intranode (p None) or virtual nodes of p ranks, the relay on the softnic."""
    kw: Dict[str, Any] = dict(timeout_us=TIMEOUT_US)
    if p is not None:
        kw.update(ranks_per_node=p, transport="emulated-internode")
    return kw


def _layout(nat: Any, gt: Any, e: int) -> Dict[str, Any]:
    lay = nat.get_dispatch_layout(gt, e)
    return dict(num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1], num_tokens_per_expert=lay[2],
                is_token_in_rank=lay[3])


def _dispatched(nat: Any, s: Any, rank: int, world: int, seed: int) -> Tuple[Any, ...]:
    """A drill's inputs on the GPU, their layout and one eager dispatch: (gx, gt, gw, layout kwargs,
    recv_x, recv_topk_weights, handle)."""
    import torch
    x, t, w = make_inputs(seed, rank, s, "random", world)
    gx, gt, gw = _on("cuda", x, t, w)
    lay = _layout(nat, gt, s.E)
    recv, _, rw, _, h, _ = nat.dispatch(gx, topk_idx=gt, topk_weights=gw, **lay)
    torch.cuda.synchronize()
    return gx, gt, gw, lay, recv, rw, h


def _expect_refusal(call: Callable[[], Any], deferred: bool, bad: int, rank: int, name: str) -> None:
    """The peer's side: PeerRefusedCall naming `bad`, at the call (a dispatch that waits on the host for
    counts) or at the event wait (every other call: nothing synchronises the host with the device)."""
    import torch
    from pyep.ep.normal import PeerRefusedCall
    try:
        res = call()
        assert deferred, f"rank {rank} {name}: a host-waited dispatch returned from a void call"
        res[-1].wait()
        torch.cuda.synchronize()
        res[-1].wait()           # the kernels have run now: the record is there
        raise AssertionError(f"rank {rank} {name}: rank {bad}'s refusal raised nothing")
    except PeerRefusedCall as exc:
        assert exc.peer == bad and exc.rank == rank, f"rank {rank} {name}: {exc}"


def refusals(shape_args: Tuple[int, int, int, int], p: Optional[int]) -> Dict[str, float]:
    """The last rank refuses each kind of call on its host (bad arguments), the others make it: they
    raise PeerRefusedCall naming it, none waits out the timeout, and every later call is bit for bit
    the reference's. The last case leaves a combine's refusal for the next call to raise: that call is
    made on every rank (this rank's results of it are dropped) and raises it."""
    import torch
    from pyep.ep.normal import Config, PeerRefusedCall
    took: Dict[str, float] = {}
    with rank_buffers(shape_args, **_kw(p)) as (rank, world, s, nat, ref):
        bad = world - 1
        gx, gt, gw, lay, recv, rw, h = _dispatched(nat, s, rank, world, 3)
        worst = s.N * world
        cases: List[Tuple[str, bool, Callable[[bool], Any]]] = [
            ("dispatch", False, lambda b: nat.dispatch(gx.float() if b else gx, topk_idx=gt, topk_weights=gw, **lay)),
            ("dispatch-worst", True, lambda b: nat.dispatch(gx, topk_idx=gt, topk_weights=gw, num_worst_tokens=worst,
                                                            expert_alignment=2 ** 62 if b else 1, async_finish=True,
                                                            **lay)),
            ("cached", True, lambda b: nat.dispatch(gx[:-1] if b else gx, handle=h, async_finish=True)),
            ("combine", True, lambda b: nat.combine(recv, h, config=Config(8) if b else None, topk_weights=rw,
                                                    async_finish=True)),
        ]
        for i, (name, deferred, call) in enumerate(cases):
            start = time.monotonic()
            if rank == bad:
                try:
                    call(True)
                    raise AssertionError(f"rank {rank} {name}: bad arguments accepted")
                except (TypeError, ValueError):
                    pass
            else:
                _expect_refusal(lambda: call(False), deferred, bad, rank, name)
            took[name] = time.monotonic() - start
            assert took[name] < TIMEOUT_US / 1e6 / 4, f"rank {rank} {name}: took {took[name]:.1f} s"
            run_case(nat, ref, s, 10 + i, "random", cached=True)
        # Delivered by the next call: the combine's refusal is still pending when the next dispatch
        # starts; that dispatch is made on every rank and then raises it.
        if rank == bad:
            try:
                nat.combine(recv, h, config=Config(8))
            except ValueError:
                pass
        else:
            nat.combine(recv, h, topk_weights=rw)
            torch.cuda.synchronize()
        try:
            nat.dispatch(gx, topk_idx=gt, topk_weights=gw, **lay)
            assert rank == bad, f"rank {rank}: the pending refusal was not raised by the next call"
        except PeerRefusedCall as exc:
            assert rank != bad and exc.peer == bad and "which was made" in "".join(exc.__notes__), str(exc)
        run_case(nat, ref, s, 30, "masked", cached=True)
    return took


def extra_call(shape_args: Tuple[int, int, int, int], p: Optional[int]) -> float:
    """The last rank makes a combine its peers do not make (they go on to a dispatch): every rank
    raises NormalCallMismatch naming both calls -- the dispatching ranks at the dispatch, the last rank
    at its next call --, well within the timeout; calls are then refused (BufferBroken) until clean(),
    after which they are bit for bit right again."""
    import torch
    from pyep.ep.normal import NormalCallMismatch
    start = time.monotonic()
    with rank_buffers(shape_args, **_kw(p)) as (rank, world, s, nat, ref):
        gx, gt, gw, lay, recv, rw, h = _dispatched(nat, s, rank, world, 4)
        if rank == world - 1:
            nat.combine(recv, h, topk_weights=rw)
            torch.cuda.synchronize()
        try:
            nat.dispatch(gx, topk_idx=gt, topk_weights=gw, **lay)
            raise AssertionError(f"rank {rank}: ranks at different calls, nothing raised")
        except NormalCallMismatch as exc:
            assert "combine" in str(exc) or "dispatch" in str(exc), str(exc)
        took = time.monotonic() - start
        assert took < TIMEOUT_US / 1e6 / 4, f"rank {rank}: the mismatch took {took:.1f} s"
        assert_broken(nat, gt, s.E, rank)
        nat.clean()
        run_case(nat, ref, s, 40, "random", cached=True)
    return took


def moved_counter(shape_args: Tuple[int, int, int, int]) -> float:
    """Mutation (intranode): the last rank's device call number is moved one call ahead, as if it had
    made a call its peers never saw. Every rank's next dispatch raises NormalCallMismatch (the peers
    find it from its flags; it learns from their NOTICE) long before the timeout, not PeerTimeout."""
    import torch
    import torch.distributed as dist
    from pyep.ep.normal import NormalCallMismatch
    with rank_buffers(shape_args, **_kw(None)) as (rank, world, s, nat, ref):
        x, t, w = make_inputs(5, rank, s, "random", world)
        gx, gt, gw = _on("cuda", x, t, w)
        lay = _layout(nat, gt, s.E)
        nat.dispatch(gx, topk_idx=gt, topk_weights=gw, **lay)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == world - 1:
            nat.backend._ws[1] += 1          # normal_tags.h kWsSeq
            torch.cuda.synchronize()
        start = time.monotonic()
        try:
            nat.dispatch(gx, topk_idx=gt, topk_weights=gw, **lay)
            raise AssertionError(f"rank {rank}: call numbers that disagree raised nothing")
        except NormalCallMismatch:
            took = time.monotonic() - start
        assert took < TIMEOUT_US / 1e6 / 4, f"rank {rank}: took {took:.1f} s"
        nat.clean()
        run_case(nat, ref, s, 50, "hot", cached=True)
    return took


def layout_values(shape_args: Tuple[int, int, int, int], p: Optional[int]) -> List[str]:
    """The last rank passes layout tensors that contradict topk_idx (num_tokens_per_expert,
    is_token_in_rank, num_tokens_per_rank, num_tokens_per_rdma_rank across nodes): its kernels find it
    and it raises LayoutMismatch at the event wait; its peers' calls are unaffected; later calls are
    bit for bit right."""
    import torch
    from pyep.ep.normal import LayoutMismatch
    seen: List[str] = []
    with rank_buffers(shape_args, **_kw(p)) as (rank, world, s, nat, ref):
        x, t, w = make_inputs(6, rank, s, "random", world)
        gx, gt, gw = _on("cuda", x, t, w)
        good = _layout(nat, gt, s.E)
        flips = ["num_tokens_per_expert", "is_token_in_rank", "num_tokens_per_rank"]
        if p is not None:
            flips.append("num_tokens_per_rdma_rank")
        for i, name in enumerate(flips):
            lay = dict(good)
            if rank == world - 1:
                v = lay[name].clone()
                if v.dtype == torch.bool:
                    v[0, 0] = ~v[0, 0]
                else:
                    v[0] += 1
                lay[name] = v
            res = nat.dispatch(gx, topk_idx=gt, topk_weights=gw, async_finish=True, **lay)
            torch.cuda.synchronize()
            try:
                res[-1].wait()
                assert rank != world - 1, f"rank {rank}: {name} that contradicts topk_idx was accepted"
            except LayoutMismatch as exc:
                assert rank == world - 1 and name in str(exc), f"rank {rank}: {exc}"
                seen.append(name)
            run_case(nat, ref, s, 60 + i, "random")
    return seen


def void_handle(shape_args: Tuple[int, int, int, int], p: Optional[int]) -> str:
    """The last rank refuses a num_worst_tokens dispatch: its peers' dispatch is void, yet returns (the
    host does not wait), with a handle. A combine with that handle is void on every rank too: the peers
    raise the "handle of a void dispatch" error, the last rank (combining with an older handle)
    PeerRefusedCall; nothing hangs and the next calls are right. Returns the error this rank saw."""
    from pyep.ep.normal import NormalModeError, PeerRefusedCall
    with rank_buffers(shape_args, **_kw(p)) as (rank, world, s, nat, ref):
        bad = world - 1
        gx, gt, gw, lay, recv, rw, h = _dispatched(nat, s, rank, world, 7)
        if rank == bad:
            try:
                nat.dispatch(gx, topk_idx=gt, topk_weights=gw, num_worst_tokens=s.N * world, expert_alignment=2 ** 62,
                             **lay)
                raise AssertionError("bad alignment accepted")
            except ValueError:
                pass
            out = nat.combine(recv, h, topk_weights=rw, async_finish=True)
        else:
            got = nat.dispatch(gx, topk_idx=gt, topk_weights=gw, num_worst_tokens=s.N * world, async_finish=True,
                               **lay)
            try:
                got[-1].wait()
                raise AssertionError(f"rank {rank}: the void dispatch raised nothing")
            except PeerRefusedCall:
                pass
            out = nat.combine(got[0], got[4], topk_weights=got[2], async_finish=True)
        start = time.monotonic()
        try:
            out[-1].wait()
            raise AssertionError(f"rank {rank}: a combine with a void dispatch's handle raised nothing")
        except PeerRefusedCall as exc:
            assert rank == bad, f"rank {rank}: {exc}"
            seen = "PeerRefusedCall"
        except NormalModeError as exc:
            assert rank != bad and "which was void" in str(exc), f"rank {rank}: {exc}"
            seen = "void handle"
        assert time.monotonic() - start < TIMEOUT_US / 1e6 / 4
        run_case(nat, ref, s, 70, "random", cached=True)
    return seen
