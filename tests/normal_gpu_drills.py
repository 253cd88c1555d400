"""Per-rank drills of the normal-mode GPU tests (tests/test_normal_gpu.py runs them in DistPool workers over
gloo): CUDA graph capture and replay, a thousand rounds hash-stable, a bad expert id, an absent peer, the
DeepEP shim, and the kernel names a profiler sees. Inputs, buffers and the bit-for-bit comparison are
tests/normal_gpu_cases.py's."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from ep_native_cases import setup_device
from normal_gpu_cases import (Shape, _layout_ref, _on, assert_broken, expert, hash_stable_rounds, make_inputs,
                              new_buffers, run_case, same, warm_and_capture)


def graph_case(shape_args: Tuple[int, int, int, int], replays: int) -> None:
    """dispatch + expert + combine captured in one CUDA graph with num_worst_tokens (the host never
    waits), replayed with new token values; then a cached dispatch + combine captured with a handle."""
    import torch
    import torch.distributed as dist
    setup_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    s = Shape(*shape_args)
    worst = s.N * world
    nat, ref = new_buffers(s)
    try:
        x, t, w = make_inputs(1, rank, s, "random", world)
        n_rank, n_exp, in_rank = (v.cuda() for v in _layout_ref(t, s.E, world))
        gx, gt, gw = _on("cuda", x, t, w)
        args = dict(num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_exp,
                    topk_idx=gt, topk_weights=gw, num_worst_tokens=worst)

        def step() -> Tuple[Any, Any, Any]:
            recv, _i, rw, _c, h, _e = nat.dispatch(gx, **args)
            out, ow, _ = nat.combine(expert(recv, rank), h, topk_weights=rw)
            return out, ow, h
        graph, (out, ow, handle) = warm_and_capture(step)
        for i in range(replays):
            # New tokens and a new routing each replay: every replay is a new call of the count exchange
            # (its call number lives on the device, not in the captured arguments).
            x_i, t_i, w_i = make_inputs(100 + i, rank, s, "hot" if i % 2 else "random", world)
            for dst, src in zip((gx, gt, gw, n_rank, n_exp, in_rank), (x_i, t_i, w_i, *_layout_ref(t_i, s.E, world))):
                dst.copy_(src.to(dst.device))
            graph.replay()
            torch.cuda.synchronize()
            lay = ref.get_dispatch_layout(t_i, s.E)
            want = ref.dispatch(x_i, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                                num_tokens_per_expert=lay[2], topk_idx=t_i, topk_weights=w_i, num_worst_tokens=worst)
            want_out = ref.combine(expert(want[0], rank), want[4], topk_weights=want[2])
            same(f"rank {rank} graph replay {i} combined_x", out, want_out[0])
            same(f"rank {rank} graph replay {i} combined_topk_weights", ow, want_out[1])
        # A cached dispatch + combine captured with the handle of an eager dispatch.
        for dst, src in zip((gx, gt, gw, n_rank, n_exp, in_rank), (x, t, w, *_layout_ref(t, s.E, world))):
            dst.copy_(src.to(dst.device))
        recv0, _i, rw0, _c, h0, _e = nat.dispatch(gx, **args)
        torch.cuda.synchronize()
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            recv_c = nat.dispatch(gx, handle=h0)[0]
            out_c = nat.combine(expert(recv_c, rank), h0)[0]
        x_j = make_inputs(200, rank, s, "random", world)[0]
        gx.copy_(x_j.cuda())
        g2.replay()
        torch.cuda.synchronize()
        nat.backend.check_errors()          # anything the kernels recorded (a handle/count mismatch...)
        lay = ref.get_dispatch_layout(t, s.E)
        want = ref.dispatch(x_j, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                            topk_idx=t, topk_weights=w, num_worst_tokens=worst)
        real = int((want[4].recv_src_idx >= 0).sum())
        same(f"rank {rank} cached graph recv_x", recv_c, want[0], real)
        same(f"rank {rank} cached graph combined_x", out_c, ref.combine(expert(want[0], rank), want[4])[0])
        del graph, g2
    finally:
        nat.destroy()
        ref.destroy()
        torch.cuda.synchronize()


def stability(shape_args: Tuple[int, int, int, int], rounds: int) -> List[int]:
    """`hash_stable_rounds` on one node's buffers."""
    import torch
    import torch.distributed as dist
    setup_device()
    s = Shape(*shape_args)
    nat, ref = new_buffers(s)
    try:
        return [hash_stable_rounds(nat, ref, s, dist.get_rank(), dist.get_world_size(), rounds)]
    finally:
        nat.destroy()
        ref.destroy()
        torch.cuda.synchronize()


def invalid_expert(shape_args: Tuple[int, int, int, int]) -> None:
    """Every rank passes one id >= E (symmetric, so no rank waits on a peer that raised): the layout and
    a dispatch report InvalidExpertIndex at the latest at the next call (the dispatch: or when its event
    is waited on), and the buffer keeps working afterwards."""
    import torch
    import torch.distributed as dist
    from pyep.ep.normal import InvalidExpertIndex
    setup_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    s = Shape(*shape_args)
    nat, ref = new_buffers(s)
    try:
        x, t, w = make_inputs(5, rank, s, "random", world)
        bad = t.clone()
        bad[2, 1] = s.E + 3
        gx, gt, gw, gbad = _on("cuda", x, t, w, bad)
        caught: List[Any] = []
        try:
            nat.get_dispatch_layout(gbad, s.E)
            torch.cuda.synchronize()
            nat.get_dispatch_layout(gt, s.E)          # the next call raises at the latest
        except InvalidExpertIndex as exc:
            caught.append(exc)
        assert caught, f"rank {rank}: layout with id {s.E + 3} raised nothing"
        assert (caught[0].row, caught[0].k, caught[0].value) == (2, 1, s.E + 3), str(caught[0])
        n_rank, n_exp, in_rank = (v.cuda() for v in _layout_ref(bad, s.E, world))
        caught.clear()
        try:
            res = nat.dispatch(gx, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_exp,
                               topk_idx=gbad, topk_weights=gw, async_finish=True)
            res[5].wait()
            torch.cuda.synchronize()
            nat.get_dispatch_layout(gt, s.E)
        except InvalidExpertIndex as exc:
            caught.append(exc)
        assert caught, f"rank {rank}: dispatch with id {s.E + 3} raised nothing"
        dist.barrier()
        run_case(nat, ref, s, 6, "random", cached=True)     # still works, still bit for bit
    finally:
        nat.destroy()
        ref.destroy()
        torch.cuda.synchronize()


def peer_timeout(shape_args: Tuple[int, int, int, int], timeout_us: int) -> float:
    """The last rank skips one dispatch (it sleeps instead): every other rank's dispatch raises
    PeerTimeout naming it within the timeout (the host's wait for the counts ends because the notify
    kernel gives up on its own), later calls raise BufferBroken, and after clean() on every rank the
    buffer is bit for bit right again. Returns the seconds the failed call took."""
    import time

    import torch
    import torch.distributed as dist
    from pyep.ep.normal import NormalBuffer, PeerTimeout
    setup_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    s = Shape(*shape_args)
    nat = NormalBuffer(dist.group.WORLD, hidden=s.H, backend="native", timeout_us=timeout_us)
    ref = NormalBuffer(dist.group.WORLD, hidden=s.H, backend="reference")
    victim = world - 1
    took = 0.0
    try:
        x, t, w = make_inputs(21, rank, s, "random", world)
        gx, gt, gw = _on("cuda", x, t, w)
        lay = nat.get_dispatch_layout(gt, s.E)
        if rank == victim:
            time.sleep(3 * timeout_us / 1e6)
        else:
            start = time.monotonic()
            try:
                nat.dispatch(gx, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                             topk_idx=gt, topk_weights=gw)
                torch.cuda.synchronize()
                raise AssertionError(f"rank {rank}: dispatch with rank {victim} absent raised nothing")
            except PeerTimeout as exc:
                took = time.monotonic() - start
                assert exc.peer == victim, f"rank {rank}: {exc} names rank {exc.peer}, not {victim}"
            assert_broken(nat, gt, s.E, rank)
        torch.cuda.synchronize()
        nat.clean()
        run_case(nat, ref, s, 22, "random", cached=True)
    finally:
        nat.destroy()
        ref.destroy()
        torch.cuda.synchronize()
    return took


def deep_ep_shim(shape_args: Tuple[int, int, int, int]) -> None:
    """Code written for DeepEP's intranode path, run through pyep.compat.deep_ep on the native kernels:
    the calls DeepEP's tests/test_intranode.py makes (layout, BF16 and FP8 dispatch, cached dispatch,
    combine with weights, the event), compared bit for bit with the same shim on the reference."""
    import torch
    import torch.distributed as dist
    from pyep.compat import deep_ep
    from pyep.ep.normal import NormalBuffer
    setup_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    s = Shape(*shape_args)
    nvl = NormalBuffer.size_hint(s.H, world)
    bufs = {name: deep_ep.Buffer(dist.group.WORLD, nvl, 0, low_latency_mode=False, backend=name)
            for name in ("native", "reference")}
    try:
        x, t, w = make_inputs(31, rank, s, "random", world)
        outs = {}
        for name, buf in bufs.items():
            dev = "cuda" if name == "native" else "cpu"
            dx, dt, dw = _on(dev, x, t, w)
            n_rank, n_rdma, n_exp, in_rank, ev = buf.get_dispatch_layout(dt, s.E)
            assert n_rdma is None
            recv_x, recv_idx, recv_w, counts, handle, ev = buf.dispatch(
                dx, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_exp,
                topk_idx=dt, topk_weights=dw, config=deep_ep.Buffer.get_dispatch_config(world), async_finish=True)
            ev.current_stream_wait()
            fx = (dx.to(torch.float8_e4m3fn), torch.ones(dx.shape[0], s.H // 128, device=dev))
            f_recv, _, _, _, _, _ = buf.dispatch(fx, handle=handle)
            combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w,
                                                  config=deep_ep.Buffer.get_combine_config(world))
            if name == "native":
                torch.cuda.synchronize()
                raw = buf.get_local_buffer_tensor(torch.uint8)
                assert raw.is_cuda and raw.numel() > 0
            outs[name] = [t_.cpu() if t_ is not None else None for t_ in
                          (recv_x, recv_idx, recv_w, torch.tensor(counts), f_recv[0].view(torch.uint8), f_recv[1],
                           combined, combined_w, *handle)]
        for i, (a, b) in enumerate(zip(outs["native"], outs["reference"])):
            same(f"rank {rank} deep_ep shim output {i}", a, b)
    finally:
        for buf in bufs.values():
            buf.destroy()
        torch.cuda.synchronize()


def kernel_names(shape_args: Tuple[int, int, int, int]) -> Dict[str, int]:
    """What DeepEP-style profiling helpers look for: one kernel per dispatch call and one per combine
    call whose names contain 'dispatch' / 'combine', and no other kernel of the calls matching them."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    setup_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    s = Shape(*shape_args)
    nat, ref = new_buffers(s)
    try:
        x, t, w = make_inputs(41, rank, s, "random", world)
        gx, gt, gw = _on("cuda", x, t, w)
        run_case(nat, ref, s, 41, "random")           # warm up (and one more bit-for-bit check)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            lay = nat.get_dispatch_layout(gt, s.E)
            recv, _, recv_w, _, handle, _ = nat.dispatch(gx, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                                                         num_tokens_per_expert=lay[2], topk_idx=gt, topk_weights=gw)
            nat.combine(recv, handle, topk_weights=recv_w)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = [n for n in names if not n.lower().startswith(("memset", "memcpy"))]
        counts = {word: sum(word in n for n in kernels) for word in ("dispatch", "combine")}
        assert counts == {"dispatch": 1, "combine": 1}, f"rank {rank}: kernels {kernels}"
        return counts
    finally:
        nat.destroy()
        ref.destroy()
        torch.cuda.synchronize()
