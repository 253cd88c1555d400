"""GPU case of pull combine (engine/kernels/normal_pull.cuh; docs/normal_mode.md, "Pull combine"), run by
tests/test_normal_gpu.py in every rank of a DistPool world."""
from __future__ import annotations

from typing import Any, List, Tuple

from ep_native_cases import setup_device
from normal_gpu_cases import Shape, expert, first_dispatch, make_inputs, new_buffers, same


def _pulled_words(nat: Any) -> List[int]:
    """This rank's pulled[2 * MAX_CHANNELS][R] words (layout.py), flattened, read from the device."""
    import torch
    from pyep.ep.devmem import DeviceArray
    from pyep.ep.normal import layout
    b = nat.backend
    off = 4 * layout.control_words(b.num_ranks)["pulled"]
    n = 4 * 2 * layout.MAX_CHANNELS * b.num_ranks
    raw = torch.as_tensor(DeviceArray(b._buf + off, n, owner=b._mem), dtype=torch.uint8, device=b.device)
    return raw.view(torch.int32).cpu().tolist()


def _call_number(nat: Any) -> int:
    return int(nat.backend._ws[1])   # normal_tags.h kWsSeq: the latest call's number


def pull_combine(shape_args: Tuple[int, int, int, int]) -> None:
    """On a buffer with an output pool: cached dispatches hand their outputs out of the pool, and combines
    of them pull -- bit for bit the reference's, every block's pulled[] word of every peer at the call
    number -- first on the Python path, then on the C++ fast path; the same values copied out of the pool
    push (the pulled[] words stay); get_combine_input's tensor pulls; a combine with weights pushes."""
    import torch
    import torch.distributed as dist
    from pyep.ep.normal.direct_pool import pooled_buffer_bytes
    setup_device()
    s = Shape(*shape_args)
    rank, world = dist.get_rank(), dist.get_world_size()
    nat, ref = new_buffers(s, num_nvl_bytes=pooled_buffer_bytes(world, 24, s.H, s.N))
    try:
        assert nat.backend._pool is not None and nat.backend._pull, "the buffer has no output pool or pull is off"
        first = first_dispatch(nat, ref, s, rank, world, seed=700)
        h_n, h_r = first.nat[4], first.ref[4]
        peers = [d for d in range(world) if d != rank]

        def pulled_at(call: int) -> bool:
            w = _pulled_words(nat)
            blocks = 2 * h_n.num_channels
            return all(w[b * world + d] == call for b in range(blocks) for d in peers)

        def combine_and_check(x_n: Any, x_r: Any, tag: str, pulls: bool, w_n: Any = None, w_r: Any = None) -> None:
            before = _pulled_words(nat)
            out_n = nat.combine(x_n, h_n, topk_weights=w_n)
            out_r = ref.combine(x_r, h_r, topk_weights=w_r)
            torch.cuda.synchronize()
            nat.backend.check_errors()
            same(f"rank {rank} {tag} combined_x", out_n[0], out_r[0])
            same(f"rank {rank} {tag} combined_topk_weights", out_n[1], out_r[1])
            if pulls:
                assert pulled_at(_call_number(nat)), f"rank {rank} {tag}: the combine did not pull"
            else:
                assert _pulled_words(nat) == before, f"rank {rank} {tag}: a push combine moved pulled[]"

        fast_calls = lambda: nat.backend.fast.calls if nat.backend.fast is not None else 0   # noqa: E731
        for i in range(4):   # the first call with the handle on the Python path, then the fast path
            x, _, _ = make_inputs(710 + i, rank, s, "random", world)
            got = nat.dispatch(x.cuda(), handle=h_n)
            want = ref.dispatch(x, handle=h_r)
            pool = nat.backend._pool
            assert pool.memory.ptr + pool.lo <= got[0].data_ptr() < pool.memory.ptr + pool.hi, "not pooled"
            taken = fast_calls()
            combine_and_check(got[0], want[0], f"pooled recv_x {i}", True)
            if i >= 2:
                assert fast_calls() > taken, f"rank {rank}: combine {i} did not take the fast path"
            combine_and_check(got[0].clone(), want[0], f"recv_x copied out {i}", False)
        y_r = expert(first.ref[0], rank)
        y_n = nat.get_combine_input(h_n)
        pool = nat.backend._pool
        assert pool.memory.ptr + pool.lo <= y_n.data_ptr() < pool.memory.ptr + pool.hi, "get_combine_input not pooled"
        y_n.copy_(y_r.cuda())
        combine_and_check(y_n, y_r, "get_combine_input", True)
        combine_and_check(y_n, y_r, "with weights", False, first.nat[2], first.ref[2])
    finally:
        nat.destroy()
        ref.destroy()
        torch.cuda.synchronize()
