"""Per-rank body of the native call-tag GPU test (tests/test_ep_native_gpu.py, test_refused_calls_and_tags):
docs/ll_kernels.md, "Call tags", on the GPU. One rank's dispatch or combine is refused by validation while
its peers' are not; a rank's call numbers are put two calls ahead of its peers' (the same buffer half,
so only the tags tell). Every rank gets a typed error for that call, nobody is marked, the combine of a
failed dispatch is skipped on every rank (NaN), and every call after it equals the reference backend
bit for bit (tests/ep_native_cases.py: run_case)."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest


def _refuse_or_raise(nat: Any, rank: int, refuser: int, what: str, x: Any, topk: Any, w: Any, sync: bool) -> str:
    """One dispatch + combine on the native buffer where rank `refuser` gets `what` ("dispatch" /
    "combine") refused. sync: synchronise after the dispatch (the test's doing, never the library's), so
    the peers see the failure in the record when their combine starts; without it they find it later
    (the combine's event, the next combine) and the skipped combine wrote NaN."""
    import torch
    from pyep.ep.errors import CallMismatch
    try:
        recv, _, h, _, _ = nat.dispatch(x.float() if (rank, what) == (refuser, "dispatch") else x, topk,
                                        use_fp8=False)
        if sync:
            torch.cuda.synchronize()
        y = torch.zeros(nat.num_local_experts, recv.shape[1], recv.shape[2], dtype=torch.bfloat16, device="cuda")
        out, ev, _ = nat.combine(y, topk, w.double() if (rank, what) == (refuser, "combine") else w, h)
        torch.cuda.synchronize()
        if what == "dispatch":
            assert bool(torch.isnan(out.float()).all()), f"rank {rank}: the skipped combine wrote numbers"
        ev.wait()    # the record is complete after a host wait: the error of this call is raised here
    except (TypeError, ValueError, CallMismatch) as exc:
        return type(exc).__name__
    return "ok"


def refused_calls_and_tags(transport: str) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from ep_native_cases import Shape, check_no_timeouts, make_inputs, new_buffers, run_case, setup_device
    from pyep.ep.ll.errors import LLCallMismatch
    setup_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    s = Shape(8, 256, 4 * world, 3)
    nat, ref = new_buffers(s, transport)
    assert nat.backend_name == "native"
    seen: Dict[str, List[str]] = {}
    seed = 100
    run_case(nat, ref, s, seed, s.T, "uniform")
    for refuser, what, sync in ((0, "dispatch", True), (world - 1, "combine", True), (0, "dispatch", False),
                                (world - 1, "combine", False)):
        seed += 1
        x, topk, w = make_inputs(seed, rank, s, s.T, "uniform")
        got = _refuse_or_raise(nat, rank, refuser, what, x.cuda(), topk.cuda(), w.cuda(), sync)
        want = "TypeError" if rank == refuser else "PeerRefusedCall"
        assert got == want, f"rank {rank}: {what} refused by rank {refuser} (sync={sync}): got {got}, want {want}"
        seen.setdefault(f"{what} sync={sync}", []).append(got)
        check_no_timeouts(f"rank {rank} after a refused {what}", nat)
        for mode in ("plain", "hook", "async"):
            seed += 1
            run_case(nat, ref, s, seed, s.T, "uniform", mode=mode)

    # Rank 0's call numbers two ahead (same buffer half): only the tags tell the calls apart.
    if rank == 0:
        nat._seq += 2
    x, topk, w = make_inputs(seed + 1, rank, s, s.T, "uniform")
    recv, _, h, _, _ = nat.dispatch(x.cuda(), topk.cuda(), use_fp8=False)
    torch.cuda.synchronize()
    with pytest.raises(LLCallMismatch) as ei:
        nat.combine(torch.zeros_like(recv), topk.cuda(), w.cuda(), h)
    assert ei.value.kind == "dispatch" and ei.value.peer_call == ei.value.my_call + (-2 if rank == 0 else 2), \
        str(ei.value)
    seen["mismatch"] = [str(ei.value)]
    check_no_timeouts(f"rank {rank} after a call mismatch", nat)
    nat.clean()                     # collective: every rank takes the largest call number
    for mode in ("plain", "hook", "async"):
        seed += 1
        run_case(nat, ref, s, seed + 10, s.T, "uniform", mode=mode)
    nat.destroy()
    ref.destroy()
    torch.cuda.synchronize()
    return seen
