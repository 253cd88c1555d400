"""Per-rank bodies of the native internode normal-mode GPU tests (tests/test_normal_internode_native_gpu.py):
a native NormalBuffer over virtual nodes (ranks_per_node=P, the column relay on the softnic: transport
"emulated-internode") beside a reference NormalBuffer with the same nodes, the same inputs, every
output compared bit for bit (BF16) / byte for byte (FP8) by tests/normal_gpu_cases.run_case."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Tuple

from ep_native_cases import setup_device
from normal_gpu_cases import (HANDLE_FIELDS, Shape, _layout_ref, _on, assert_broken, compare_dispatch, expert,
                              hash_stable_rounds, make_inputs, new_buffers, run_case, same, warm_and_capture)

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
    from pyep.ep.normal import NormalBuffer, PeerTimeout
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
        assert_broken(nat, gt, s.E, rank)
        torch.cuda.synchronize()
        return {"error": type(err).__name__, "took": took}
    finally:
        nat.destroy()
        torch.cuda.synchronize()


# ---------------------------------------------------------------------- CUDA graphs
def _layout4(t: Any, e: int, world: int, p: int) -> Tuple[Any, Any, Any, Any]:
    """(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank) on the host."""
    import torch
    per_rank, per_expert, in_rank = _layout_ref(t, e, world)
    per_node = in_rank.view(-1, world // p, p).any(dim=2).sum(dim=0).to(torch.int32)
    return per_rank, per_node, per_expert, in_rank


def _layout_kw(lay: Tuple[Any, Any, Any, Any]) -> Dict[str, Any]:
    return dict(num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1], num_tokens_per_expert=lay[2],
                is_token_in_rank=lay[3])


def _refused(capture: Any, what: str, match: str) -> None:
    """`capture()` inside a torch.cuda.graph raises NotCapturable naming `match`; the capture (which
    holds one harmless op before the refused call) still ends and replays: nothing was launched."""
    import torch
    from pyep.ep.normal.native_internode import NotCapturable
    scratch = torch.zeros(4, device="cuda")
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            scratch.add_(1)
            capture()
        raise AssertionError(f"{what}: captured without NotCapturable")
    except NotCapturable as exc:
        assert match in str(exc), f"{what}: {exc}"
    g.replay()
    torch.cuda.synchronize()
    assert float(scratch.sum()) == 4.0, f"{what}: the capture around the refused call is broken"
    del g


def graph_case(shape_args: Tuple[int, int, int, int], p: int, replays: int) -> int:
    """The staged internode path in CUDA graphs (docs/normal_internode.md, "CUDA graphs"):
    1. a dispatch without num_worst_tokens inside a capture: NotCapturable, nothing launched;
    2. warm-up, then dispatch + expert + combine with num_worst_tokens captured in one graph, replayed
       `replays` times with new tokens and routings written into the captured inputs: recv_x, ids,
       weights, the handle and the combined output bit-equal to the reference at every replay (every
       replay is a new call of the relay's count exchange and of the node notify: their call numbers
       live on the device);
    3. eager dispatch + cached dispatch + combine, then the cached dispatch + combine captured with that
       handle and replayed with new x; then the first graph replayed again (eager calls, both graphs'
       replays and the counters all interleave);
    4. on a draining softnic (lazy module loading): a capture of a kind never run eagerly (FP8 cached
       dispatch) is refused with NotCapturable;
    5. a replay with a bad expert id: InvalidExpertIndex at the next call, and the graph still correct
       after it. Returns the replays checked."""
    import torch
    import torch.distributed as dist
    from pyep.ep import fp8
    from pyep.ep.normal import InvalidExpertIndex
    setup_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    s = Shape(*shape_args)
    worst = s.N * world
    nat, ref = _buffers(s, p)
    checked = 0
    try:
        x, t, w = make_inputs(1, rank, s, "random", world)
        lay = _layout4(t, s.E, world, p)
        gx, gt, gw = _on("cuda", x, t, w)
        glay = tuple(v.cuda() for v in lay)
        statics = (gx, gt, gw, *glay)

        def load(x_i: Any, t_i: Any, w_i: Any) -> Tuple[Any, Any, Any, Any]:
            lay_i = _layout4(t_i, s.E, world, p)
            for dst, src in zip(statics, (x_i, t_i, w_i, *lay_i)):
                dst.copy_(src.to(dst.device))
            return lay_i

        # 1. a host-waiting dispatch is refused inside a capture
        _refused(lambda: nat.dispatch(gx, topk_idx=gt, topk_weights=gw, **_layout_kw(glay)),
                 "dispatch without num_worst_tokens", "num_worst_tokens")

        def step() -> Tuple[Any, ...]:
            recv, idx, rw, counts, h, _e = nat.dispatch(gx, topk_idx=gt, topk_weights=gw, num_worst_tokens=worst,
                                                        **_layout_kw(glay))
            out, ow, _ = nat.combine(expert(recv, rank), h, topk_weights=rw)
            return (recv, idx, rw, counts, h), out, ow

        # 2. warm-up (loads every kernel; the allocator's first blocks), capture, replays
        graph, (got_d, out, ow) = warm_and_capture(step)

        def replay_and_check(g: Any, i: int, routing: str) -> None:
            x_i, t_i, w_i = make_inputs(100 + i, rank, s, routing, world)
            lay_i = load(x_i, t_i, w_i)
            g.replay()
            # The stream the replay ran on, as the relay's own drain does: a device-wide wait is not needed.
            torch.cuda.current_stream().synchronize()
            want = ref.dispatch(x_i, topk_idx=t_i, topk_weights=w_i, num_worst_tokens=worst, **_layout_kw(lay_i))
            want_out = ref.combine(expert(want[0], rank), want[4], topk_weights=want[2])
            tag = f"rank {rank} graph replay {i} ({routing})"
            compare_dispatch(tag, got_d, want)
            same(f"{tag} combined_x", out, want_out[0])
            same(f"{tag} combined_topk_weights", ow, want_out[1])

        routings = ("random", "hot", "masked", "one_rank")
        for i in range(replays):
            replay_and_check(graph, i, routings[i % len(routings)])
            checked += 1

        # 3. eager dispatch + cached dispatch + combine (the warm-up of the cached kinds), then captured
        lay = load(x, t, w)
        recv0, _i, rw0, _c, h0, _e = nat.dispatch(gx, topk_idx=gt, topk_weights=gw, num_worst_tokens=worst,
                                                  **_layout_kw(glay))
        want0 = ref.dispatch(x, topk_idx=t, topk_weights=w, num_worst_tokens=worst, **_layout_kw(lay))
        real = int((want0[4].recv_src_idx >= 0).sum())
        recv_e = nat.dispatch(gx, handle=h0)[0]
        out_e = nat.combine(expert(recv_e, rank), h0)[0]
        torch.cuda.synchronize()
        same(f"rank {rank} eager cached recv_x", recv_e, want0[0], real)
        same(f"rank {rank} eager cached combined_x", out_e, ref.combine(expert(want0[0], rank), want0[4])[0])
        for name in HANDLE_FIELDS:
            same(f"rank {rank} eager handle.{name}", getattr(h0, name), getattr(want0[4], name))
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            recv_c = nat.dispatch(gx, handle=h0)[0]
            out_c = nat.combine(expert(recv_c, rank), h0)[0]
        torch.cuda.synchronize()
        for j in range(max(2, replays // 5)):
            x_j = make_inputs(200 + j, rank, s, "random", world)[0]
            gx.copy_(x_j.cuda())
            g2.replay()
            torch.cuda.current_stream().synchronize()
            want_c = ref.dispatch(x_j, handle=want0[4])[0]
            same(f"rank {rank} cached graph replay {j} recv_x", recv_c, want_c, real)
            same(f"rank {rank} cached graph replay {j} combined_x", out_c,
                 ref.combine(expert(want_c, rank), want0[4])[0])
            checked += 1
        for i in range(replays, replays + 4):    # the first graph again, after eager and cached calls
            replay_and_check(graph, i, routings[i % len(routings)])
            checked += 1

        # 4. an unwarmed kind on a draining softnic
        if nat.backend.relay.drains:
            x8 = fp8.quantize_fp8(gx)
            _refused(lambda: nat.dispatch(x8, handle=h0), "an FP8 cached dispatch never run eagerly",
                     "CUDA_MODULE_LOADING")

        # 5. an error recorded during a replay surfaces at the next call; the graph keeps working
        x_b, t_b, w_b = make_inputs(300, rank, s, "random", world)
        bad = t_b.clone()
        bad[2, 1] = s.E + 3                     # every rank: nobody waits on a peer that raised
        load(x_b, bad, w_b)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        caught: List[Any] = []
        try:
            nat.get_dispatch_layout(gt, s.E)
        except InvalidExpertIndex as exc:
            caught.append(exc)
        assert caught and (caught[0].row, caught[0].k, caught[0].value) == (2, 1, s.E + 3), \
            f"rank {rank}: the replay's bad id was not reported at the next call ({caught})"
        torch.cuda.synchronize()
        replay_and_check(graph, replays + 4, "random")
        checked += 1
        del graph, g2
        return checked
    finally:
        nat.destroy()
        ref.destroy()
        torch.cuda.synchronize()
