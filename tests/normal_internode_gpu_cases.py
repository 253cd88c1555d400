"""Per-rank bodies of the native internode normal-mode GPU tests (tests/test_normal_internode_native_gpu.py):
a native NormalBuffer over virtual nodes (ranks_per_node=P, the column relay on the softnic: transport
"emulated-internode") beside a reference NormalBuffer with the same nodes, the same inputs, every
output compared bit for bit (BF16) / byte for byte (FP8) by tests/normal_gpu_cases.run_case."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Tuple

from ep_native_cases import setup_device
from normal_gpu_cases import Shape, _on, expert, hash_stable_rounds, make_inputs, new_buffers, run_case, same

TRANSPORT = "emulated-internode"

# (seed, routing, options); worst=-1: num_worst_tokens = N * world.
CASES: List[Tuple[int, str, Dict[str, Any]]] = [
    (1, "random", {}), (2, "random", dict(use_fp8=True)), (3, "hot", dict(alignment=128)),
    (4, "masked", dict(use_fp8=True, cached=True)), (5, "empty", {}), (6, "one_rank", dict(cached=True)),
    (7, "random", dict(worst=-1)), (8, "masked", dict(use_fp8=True, worst=-1, alignment=128)),
    (9, "random", dict(asynchronous=True, cached=True)), (10, "hot", dict(config="small-ring")),
    (11, "empty", dict(use_fp8=True, cached=True, worst=-1)), (12, "one_rank", dict(worst=-1, cached=True)),
]


def _buffers(s: Shape, p: int, **kw: Any) -> Tuple[Any, Any]:
    nat, ref = new_buffers(s, ranks_per_node=p, transport=TRANSPORT, **kw)
    assert nat.num_nodes == ref.num_nodes > 1, (nat.num_nodes, ref.num_nodes)
    return nat, ref


def correctness(shape_args: Tuple[int, int, int, int], p: int) -> int:
    """Every case of CASES on both backends; then a combine with a bias pair. Returns the cases run."""
    import torch
    import torch.distributed as dist
    from pyep.ep.normal import Config
    setup_device()
    s = Shape(*shape_args)
    nat, ref = _buffers(s, p)
    try:
        for seed, routing, kw in CASES:
            kw = dict(kw)
            if kw.get("worst") == -1:
                kw["worst"] = s.N * dist.get_world_size()
            if kw.get("config") == "small-ring":      # 8 channels, NVLink rings of 32 rows, RDMA rings of 8
                kw["config"] = Config(16, 4, 32, 3, 8)
            run_case(nat, ref, s, seed, routing, **kw)
        bias_case(nat, ref, s)
        return len(CASES) + 1
    finally:
        nat.destroy()
        ref.destroy()
        torch.cuda.synchronize()


def bias_case(nat: Any, ref: Any, s: Shape) -> None:
    """combine(bias=(b0, b1)): 0 + bias_0 + bias_1 + the node partials in node order, bit for bit."""
    import torch
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    x, t, w = make_inputs(61, rank, s, "hot", world)
    g = torch.Generator().manual_seed(61 + rank)
    b0 = torch.randn(x.shape[0], s.H, generator=g).to(torch.bfloat16)
    b1 = torch.randn(x.shape[0], s.H, generator=g).to(torch.bfloat16)
    outs = []
    for buf, dev in ((nat, "cuda"), (ref, "cpu")):
        dx, dt, dw, d0, d1 = _on(dev, x, t, w, b0, b1)
        lay = buf.get_dispatch_layout(dt, s.E)
        recv, _i, rw, _c, h, _e = buf.dispatch(dx, num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1],
                                               is_token_in_rank=lay[3], num_tokens_per_expert=lay[2], topk_idx=dt,
                                               topk_weights=dw)
        y = expert(recv.cpu(), rank).to(dev)
        outs.append(buf.combine(y, h, topk_weights=rw, bias=(d0, d1)))
    torch.cuda.synchronize()
    same(f"rank {rank} combine with bias", outs[0][0], outs[1][0])
    same(f"rank {rank} combine weights with bias", outs[0][1], outs[1][1])


def stability(shape_args: Tuple[int, int, int, int], p: int, rounds: int) -> int:
    """`hash_stable_rounds` across `p` virtual nodes' buffers."""
    import torch
    import torch.distributed as dist
    setup_device()
    s = Shape(*shape_args)
    nat, ref = _buffers(s, p)
    try:
        hash_stable_rounds(nat, ref, s, dist.get_rank(), dist.get_world_size(), rounds, internode=True)
        return rounds
    finally:
        nat.destroy()
        ref.destroy()
        torch.cuda.synchronize()


def fault(shape_args: Tuple[int, int, int, int], kind: str, timeout_us: int) -> Dict[str, Any]:
    """2 nodes x 1 rank. kind "dropped": rank 1 skips a dispatch (sleeps): rank 0 gets PeerTimeout naming
    rank 1 within the timeout, then BufferBroken, and after clean() on both a correct call.
    kind "bad_rkey": rank 0's relay QP uses a wrong rkey for rank 1: rank 0 gets RelayError naming rank
    1 and the QP, rank 1 PeerTimeout naming rank 0 (its peer's count record never arrives)."""
    import torch
    import torch.distributed as dist
    from pyep.ep.normal import BufferBroken, NormalBuffer, PeerTimeout
    from pyep.ep.normal.internode_relay import RelayError
    setup_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    s = Shape(*shape_args)
    nat = NormalBuffer(dist.group.WORLD, hidden=s.H, backend="native", ranks_per_node=1, transport=TRANSPORT,
                       timeout_us=timeout_us)
    peer = 1 - rank
    try:
        x, t, w = make_inputs(21, rank, s, "random", world)
        gx, gt, gw = _on("cuda", x, t, w)
        lay = nat.get_dispatch_layout(gt, s.E)
        torch.cuda.synchronize()
        if kind == "bad_rkey" and rank == 0:
            nat.backend.relay._tables["rkeys"][1] ^= 0x5A5A
        if kind == "dropped" and rank == 1:
            time.sleep(3 * timeout_us / 1e6)
            return {"error": "dropped", "took": 0.0}
        start = time.monotonic()
        err: Any = None
        try:
            nat.dispatch(gx, num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1], is_token_in_rank=lay[3],
                         num_tokens_per_expert=lay[2], topk_idx=gt, topk_weights=gw)
            torch.cuda.synchronize()
            nat.get_dispatch_layout(gt, s.E)
            raise AssertionError(f"rank {rank}: {kind} raised nothing")
        except (PeerTimeout, RelayError) as exc:
            err = exc
            took = time.monotonic() - start
            assert exc.peer == peer, f"rank {rank}: {exc} names rank {exc.peer}, not {peer}"
            if kind == "bad_rkey" and rank == 0:
                assert isinstance(exc, RelayError) and exc.qpn != 0, exc
            assert took < 2 * timeout_us / 1e6 + 10, took
        try:
            nat.get_dispatch_layout(gt, s.E)
            raise AssertionError(f"rank {rank}: a broken buffer accepted a call")
        except BufferBroken:
            pass
        torch.cuda.synchronize()
        return {"error": type(err).__name__, "took": took}
    finally:
        nat.destroy()
        torch.cuda.synchronize()
