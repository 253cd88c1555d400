"""Per-rank drills of the native normal mode's C++ fast path (pyep/ep/normal/native_fast.py,
engine/bindings/normal_fast_bind.cpp), run by tests/test_normal_gpu.py in DistPool workers over gloo.
Every output is compared with the reference backend's bit for bit (normal_gpu_cases)."""
from __future__ import annotations

from typing import Any, Optional, Tuple

from normal_gpu_cases import compare_dispatch, expert, first_dispatch, rank_buffers, same

TIMEOUT_US = 20_000_000


def _subclass() -> Any:
    import torch

    class Sub(torch.Tensor):
        """A tensor subclass: valid input, which the fast path leaves to the Python path."""
    return Sub


def _calls(nat: Any) -> int:
    fast = nat.backend.fast
    return int(fast.calls) if fast is not None else 0


def fast_path(shape_args: Tuple[int, int, int, int], pooled: bool) -> None:
    """After the Python path's first plain cached dispatch and combine of a handle and config, the same
    calls go through the fast path (its count grows by one a call) and equal the reference: BF16 and
    FP8 with column-major scales, combine with and without weights, the default config and DeepEP's
    Config(24, 8, 256); pooled: a buffer with an output pool (one-copy outputs from the fast path).
    Then what the fast path leaves to the Python path: x of a tensor subclass (the call is made, the next
    one is fast again); one rank's x of the wrong length, then one rank's x off a 16-byte boundary, is
    refused and its peers, whose call went through the fast path, raise PeerRefusedCall at the event;
    after clean() the old handle raises ValueError."""
    import torch
    import torch.distributed as dist

    from pyep.ep import fp8
    from pyep.ep.normal import Config
    from pyep.ep.normal.direct_pool import pooled_buffer_bytes
    kw: dict = dict(timeout_us=TIMEOUT_US)
    if pooled:
        kw["num_nvl_bytes"] = pooled_buffer_bytes(dist.get_world_size(), 24, shape_args[1], shape_args[0])
    with rank_buffers(shape_args, **kw) as (rank, world, s, nat, ref):
        assert (nat.backend._pool is not None) == pooled, f"rank {rank}: output pool {nat.backend._pool}"
        f = first_dispatch(nat, ref, s, rank, world, 7)
        x, gx, first, first_r = f.x, f.gx, f.nat, f.ref
        hn, hr = first[4], first_r[4]
        real = int((hr.recv_src_idx >= 0).sum())
        q = fp8.quantize_fp8(x)
        qg = (q[0].cuda(), q[1].cuda().T.contiguous().T)     # column-major scales, as DeepEP's test passes
        y = expert(first_r[0], rank)
        gy = y.cuda()
        for config in (None, Config(24, 8, 256)):
            for name, xin, gin in (("bf16", x, gx), ("fp8", q, qg)):
                start = _calls(nat)
                got = _cached(nat, ref, gin, xin, hn, hr, real, f"rank {rank} {name} config={config}", 3, config)
                assert _calls(nat) - start >= 2, f"rank {rank} {name} config={config}: {_calls(nat) - start} fast calls"
                if pooled:
                    pool = nat.backend._pool
                    p0 = got[0][0] if name == "fp8" else got[0]
                    assert pool.memory.ptr + pool.lo <= p0.data_ptr() < pool.memory.ptr + pool.hi, \
                        f"rank {rank} {name}: a fast cached dispatch's outputs are not in the pool"
            for weights in ((first[2], first_r[2]), (None, None)):
                start = _calls(nat)
                for i in range(3):
                    out = nat.combine(gy, hn, topk_weights=weights[0], config=config)
                    out_r = ref.combine(y, hr, topk_weights=weights[1], config=config)
                    torch.cuda.synchronize()
                    out[2].wait()
                    same(f"rank {rank} combine config={config} weights={weights[0] is not None} call {i}", out[0],
                         out_r[0])
                    same(f"rank {rank} combined weights call {i}", out[1], out_r[1])
                assert _calls(nat) - start >= 2, f"rank {rank} combine: {_calls(nat) - start} fast calls"

        # Declined but valid: x of a tensor subclass (left to the Python path), then fast again.
        start = _calls(nat)
        got = nat.dispatch(gx.as_subclass(_subclass()), handle=hn)
        torch.cuda.synchronize()
        got[5].wait()
        compare_dispatch(f"rank {rank} x of a tensor subclass", got, ref.dispatch(x, handle=hr), cached=True, real=real)
        assert _calls(nat) == start, f"rank {rank}: the fast path took a tensor subclass"
        _fast_again(nat, ref, gx, x, hn, hr, rank, real)

        # One rank refuses (x one token short); its peers' calls are fast and void.
        _refused_by_one_rank(nat, rank, world - 1, lambda: nat.dispatch(gx[:-1], handle=hn), "x of N - 1 tokens",
                             lambda: nat.dispatch(gx, handle=hn))
        _fast_again(nat, ref, gx, x, hn, hr, rank, real)

        # One rank's x starts 2 bytes past a 16-byte boundary (the rows move in 16-byte vectors): the fast
        # path declines it, the Python path refuses it, and the peers' fast calls are void.
        flat = torch.empty(gx.numel() + 8, dtype=gx.dtype, device=gx.device)
        odd = flat[1:1 + gx.numel()].view_as(gx)
        odd.copy_(gx)
        msg = _refused_by_one_rank(nat, rank, 0, lambda: nat.dispatch(odd, handle=hn), "x off a 16-byte boundary",
                                   lambda: nat.dispatch(gx, handle=hn))
        assert msg is None or "16-byte" in msg, msg
        _fast_again(nat, ref, gx, x, hn, hr, rank, real)

        # After clean() the handle is of an old generation: the Python path refuses it.
        torch.cuda.synchronize()
        nat.clean()
        start = _calls(nat)
        try:
            nat.dispatch(gx, handle=hn)
            raise AssertionError(f"rank {rank}: a handle made before clean() was accepted")
        except ValueError as exc:
            assert "stale" in str(exc), str(exc)
        assert _calls(nat) == start


def _refused_by_one_rank(nat: Any, rank: int, bad: int, bad_call: Any, what: str, good_call: Any) -> Any:
    """Rank `bad` makes bad_call, which must raise ValueError on the Python path (never the fast path);
    the others make good_call through the fast path and must get PeerRefusedCall naming `bad` at its
    event. Returns the bad rank's error text (None elsewhere), after a barrier."""
    import torch
    import torch.distributed as dist
    from pyep.ep.normal import PeerRefusedCall
    msg = None
    start = _calls(nat)
    if rank == bad:
        try:
            bad_call()
            raise AssertionError(f"rank {rank}: {what} was accepted")
        except ValueError as exc:
            msg = str(exc)
        assert _calls(nat) == start, f"rank {rank}: the fast path took {what}"
    else:
        res = good_call()
        assert _calls(nat) == start + 1, f"rank {rank}: the good call did not take the fast path"
        torch.cuda.synchronize()
        try:
            res[5].wait()
            raise AssertionError(f"rank {rank}: rank {bad}'s refusal of {what} raised nothing")
        except PeerRefusedCall as exc:
            assert exc.peer == bad, str(exc)
    dist.barrier()
    return msg


def _cached(nat: Any, ref: Any, gin: Any, xin: Any, hn: Any, hr: Any, real: int, what: str, calls: int,
            config: Optional[Any] = None) -> Any:
    """`calls` cached dispatches of gin (native) and xin (reference), each equal to the reference's;
    returns the last native result."""
    import torch
    for i in range(calls):
        got = nat.dispatch(gin, handle=hn, config=config)
        want = ref.dispatch(xin, handle=hr, config=config)
        torch.cuda.synchronize()
        got[5].wait()
        compare_dispatch(f"{what} call {i}", got, want, cached=True, real=real)
    return got


def _fast_again(nat: Any, ref: Any, gx: Any, x: Any, hn: Any, hr: Any, rank: int, real: int) -> None:
    """Two cached dispatches after a declined call: the first may take the Python path (it reports
    what the device recorded), the second is fast, both equal the reference."""
    start = _calls(nat)
    _cached(nat, ref, gx, x, hn, hr, real, f"rank {rank} after a declined call", 2)
    assert _calls(nat) > start, f"rank {rank}: no fast call after a declined one"
