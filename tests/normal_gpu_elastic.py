"""Per-rank bodies of the native normal mode's active_ranks tests (tests/test_normal_elastic_gpu.py; issue
26, docs/elastic.md "Normal mode"). Each rank drives a native NormalBuffer on its GPU beside a reference
NormalBuffer on the CPU with the same mask and inputs, and compares what both return, bit for bit: the
reference backend is the definition of a call among the survivors. `nodes`: the buffers' node keywords
(empty: one node; {"ranks_per_node": 1, "transport": "emulated-internode"}: one rank per virtual node,
the native internode path with its column relay on the softnic)."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

from ep_native_cases import setup_device
from normal_gpu_cases import Shape, _on, compare_dispatch, expert, make_inputs, same


def _masks(world: int, out: List[int]) -> Tuple[Any, Any]:
    import torch
    m = torch.ones(world, dtype=torch.int32)
    for r in out:
        m[r] = 0
    return m.cuda(), m.clone()


def _layout_kw(lay: Tuple[Any, ...]) -> Dict[str, Any]:
    kw = dict(num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2])
    if lay[1] is not None:      # across nodes
        kw["num_tokens_per_rdma_rank"] = lay[1]
    return kw


def _buffers(s: Shape, nodes: Optional[Dict[str, Any]], gmask: Any, cmask: Any, timeout_us: int) -> Tuple[Any, Any]:
    from pyep.ep.normal import NormalBuffer
    import torch.distributed as dist
    kw = dict(nodes or {})
    nat = NormalBuffer(dist.group.WORLD, hidden=s.H, backend="native", active_ranks=gmask, timeout_us=timeout_us, **kw)
    kw.pop("transport", None)
    ref = NormalBuffer(dist.group.WORLD, hidden=s.H, backend="reference", active_ranks=cmask, **kw)
    return nat, ref


def _round(nat: Any, ref: Any, s: Shape, seed: int, fp8: bool, tag: str, layout_from: str = "both") -> Dict[str, Any]:
    """layout, dispatch, cached dispatch and combine on both; every output and every dropped count
    compared. layout_from="native_before": the native dispatch uses a layout made before this call
    (done by the caller: see silent_rank), so the layouts are not compared."""
    import torch
    import torch.distributed as dist
    from pyep.ep import fp8 as f8
    rank, world = dist.get_rank(), dist.get_world_size()
    x, t, w = make_inputs(seed, rank, s, "random", world)
    xin = f8.quantize_fp8(x) if fp8 else x
    gx = tuple(_on("cuda", *xin)) if fp8 else x.cuda()
    gt, gw = _on("cuda", t, w)
    lay_n = nat.get_dispatch_layout(gt, s.E)
    lay_r = ref.get_dispatch_layout(t, s.E)
    torch.cuda.synchronize()
    for i, name in ((0, "num_tokens_per_rank"), (1, "num_tokens_per_rdma_rank"), (2, "num_tokens_per_expert"),
                    (3, "is_token_in_rank")):
        if lay_r[i] is not None:
            same(f"{tag} layout {name}", lay_n[i], lay_r[i])
    same(f"{tag} layout dropped", lay_n[4].num_dropped_tokens, lay_r[4].num_dropped_tokens)
    got = nat.dispatch(gx, topk_idx=gt, topk_weights=gw, **_layout_kw(lay_n))
    want = ref.dispatch(xin, topk_idx=t, topk_weights=w, **_layout_kw(lay_r))
    torch.cuda.synchronize()
    compare_dispatch(tag, got, want)
    same(f"{tag} dispatch dropped", got[5].num_dropped_tokens, want[5].num_dropped_tokens)
    same(f"{tag} handle dropped", got[4].num_dropped_tokens, want[4].num_dropped_tokens)
    c_n = nat.dispatch(gx, handle=got[4])
    c_r = ref.dispatch(xin, handle=want[4])
    torch.cuda.synchronize()
    compare_dispatch(tag + " (cached)", c_n, c_r, cached=True, real=int((want[4].recv_src_idx >= 0).sum()))
    y = expert(want[0], rank)
    out_n = nat.combine(y.cuda(), got[4], topk_weights=got[2])
    out_r = ref.combine(y, want[4], topk_weights=want[2])
    torch.cuda.synchronize()
    same(f"{tag} combined_x", out_n[0], out_r[0])
    same(f"{tag} combined_topk_weights", out_n[1], out_r[1])
    same(f"{tag} combine dropped", out_n[2].num_dropped_tokens, out_r[2].num_dropped_tokens)
    return {"dropped": want[5].num_dropped_tokens.tolist()}


def static_mask(shape_args: Tuple[int, int, int, int], masked: int, nodes: Optional[Dict[str, Any]] = None) -> List[int]:
    """Every rank passes the same mask that leaves `masked` out: the native calls give what the reference
    gives for it (nothing sent to or awaited from it; its tokens dropped and counted), for BF16 and FP8,
    cached dispatch and combine; the masked rank itself moves nothing. Then the mask changes in place (a
    second rank out) and the next calls follow it with no other call. Returns the dropped counts."""
    import torch
    import torch.distributed as dist
    setup_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    s = Shape(*shape_args)
    gmask, cmask = _masks(world, [masked])
    nat, ref = _buffers(s, nodes, gmask, cmask, 5_000_000)
    try:
        r1 = _round(nat, ref, s, 41, False, f"rank {rank} mask -{masked} bf16")
        _round(nat, ref, s, 42, True, f"rank {rank} mask -{masked} fp8")
        other = (masked + 1) % world
        gmask[other] = 0              # in place, as a caller may: the kernels read it on the GPU
        cmask[other] = 0
        _round(nat, ref, s, 43, False, f"rank {rank} mask -{masked},-{other}")
        assert nat.get_active_ranks().tolist() == cmask.tolist()
        return r1["dropped"]
    finally:
        nat.destroy()
        ref.destroy()
        torch.cuda.synchronize()


def take_back(shape_args: Tuple[int, int, int, int], masked: int, nodes: Optional[Dict[str, Any]] = None) -> int:
    """A live rank left out by the mask (set in place on every rank) for two rounds, then set back to 1 and
    taken back (take_back_ranks, on every rank alike, between calls): the rounds after are bit-equal to
    the reference with every rank -- its count slots and stream counters, several calls old, were set in
    step on both sides. Twice. Returns the rounds run."""
    import torch
    import torch.distributed as dist
    setup_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    s = Shape(*shape_args)
    gmask, cmask = _masks(world, [])
    nat, ref = _buffers(s, nodes, gmask, cmask, 5_000_000)
    rounds = 0
    try:
        for i in range(2):
            gmask[masked] = cmask[masked] = 0
            for j in range(2):
                _round(nat, ref, s, 90 + 4 * i + j, j == 1, f"rank {rank} out {masked} #{i}.{j}")
            gmask[masked] = cmask[masked] = 1
            nat.take_back_ranks([masked])
            for j in range(2):
                _round(nat, ref, s, 92 + 4 * i + j, j == 0, f"rank {rank} back {masked} #{i}.{j}")
            rounds += 4
        assert nat.get_active_ranks().tolist() == [1] * world
        return rounds
    finally:
        nat.destroy()
        ref.destroy()
        torch.cuda.synchronize()


def silent_rank(shape_args: Tuple[int, int, int, int], timeout_us: int, nodes: Optional[Dict[str, Any]] = None
                ) -> Dict[str, Any]:
    """A rank goes silent in a dispatch (it sleeps instead of calling it): with a mask, every other rank's
    dispatch completes among the survivors within about the timeout -- no error -- with exactly what the
    reference gives with that rank masked; the rank is marked in every survivor's mask, and the later
    calls (layout, dispatch, cached dispatch, combine) run among the survivors without waiting for it.
    The silent rank takes part only in the reference calls afterwards (a masked gloo rank)."""
    import torch
    import torch.distributed as dist
    setup_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    s = Shape(*shape_args)
    victim = world - 1
    gmask, _ = _masks(world, [])
    _, cmask = _masks(world, [victim])
    nat, ref = _buffers(s, nodes, gmask, cmask, timeout_us)
    out: Dict[str, Any] = {"rank": rank}
    try:
        x, t, w = make_inputs(51, rank, s, "random", world)
        gx, gt, gw = _on("cuda", x, t, w)
        lay = nat.get_dispatch_layout(gt, s.E)      # made while every rank is active
        torch.cuda.synchronize()
        dist.barrier()
        if rank == victim:
            time.sleep(3 * timeout_us / 1e6)
        else:
            start = time.monotonic()
            got = nat.dispatch(gx, topk_idx=gt, topk_weights=gw, **_layout_kw(lay))
            torch.cuda.synchronize()
            out["took_s"] = time.monotonic() - start
            out["mask"] = nat.get_active_ranks().tolist()
        lay_r = ref.get_dispatch_layout(t, s.E)
        want = ref.dispatch(x, topk_idx=t, topk_weights=w, **_layout_kw(lay_r))
        if rank != victim:
            tag = f"rank {rank} silent {victim}"
            compare_dispatch(tag, got, want)
            same(f"{tag} dispatch dropped", got[5].num_dropped_tokens, want[5].num_dropped_tokens)
            y = expert(want[0], rank)
            # The combine of that dispatch's handle, and later rounds, among the survivors only.
            out_n = nat.combine(y.cuda(), got[4], topk_weights=got[2])
        out_r = ref.combine(expert(want[0], rank), want[4], topk_weights=want[2])
        if rank != victim:
            torch.cuda.synchronize()
            same(f"{tag} combined_x", out_n[0], out_r[0])
            same(f"{tag} combine dropped", out_n[2].num_dropped_tokens, out_r[2].num_dropped_tokens)
        for seed in (52, 53):
            if rank == victim:      # reference calls only: the native buffer left it out
                xv, tv, wv = make_inputs(seed, rank, s, "random", world)
                if seed == 53:      # the survivors' round of this seed is FP8 (the tags must agree)
                    from pyep.ep import fp8 as f8
                    xv = f8.quantize_fp8(xv)
                lv = ref.get_dispatch_layout(tv, s.E)
                dv = ref.dispatch(xv, topk_idx=tv, topk_weights=wv, **_layout_kw(lv))
                ref.dispatch(xv, handle=dv[4])
                ref.combine(expert(dv[0], rank), dv[4], topk_weights=dv[2])
            else:
                t0 = time.monotonic()
                _round(nat, ref, s, seed, seed == 53, f"rank {rank} after silent {victim} seed {seed}")
                out[f"round_{seed}_s"] = time.monotonic() - t0
        return out
    finally:
        nat.destroy()        # local (a synchronisation and the release of this rank's memory)
        ref.destroy()
        torch.cuda.synchronize()


def shim_mask(shape_args: Tuple[int, int, int, int], masked: int, virtual_node_size: int = 0) -> List[List[int]]:
    """The DeepEP shim's one mask per Buffer on the native kernels: low_latency_update_mask_buffer
    leaves `masked` out of the Buffer's normal-mode calls (what the reference gives with it masked), an
    unmask and low_latency_clean_mask_buffer take it back (streams restarted on both sides, the full
    definition again), twice. virtual_node_size: the Buffer on virtual nodes of that many ranks (the
    internode kernels; an elastic Buffer runs them rank to rank). Returns what
    low_latency_query_mask_buffer said after each change."""
    import os

    import torch
    import torch.distributed as dist
    from pyep.compat import deep_ep
    from pyep.ep.normal import NormalBuffer
    from pyep.transport.base import VIRTUAL_NODE_ENV
    setup_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    s = Shape(*shape_args)
    nodes: Dict[str, Any] = {}
    if virtual_node_size:
        os.environ[VIRTUAL_NODE_ENV] = str(virtual_node_size)     # read when the Buffer's buffers are made
        nodes = {"ranks_per_node": virtual_node_size}
    try:
        buf = deep_ep.Buffer(dist.group.WORLD, int(2e8), 0, enable_shrink=True, timeout_us=5_000_000,
                             explicitly_destroy=True)
        buf.normal_buffer()
    finally:
        os.environ.pop(VIRTUAL_NODE_ENV, None)
    _, cmask = _masks(world, [])
    ref = NormalBuffer(dist.group.WORLD, hidden=s.H, backend="reference", active_ranks=cmask, **nodes)
    status = torch.zeros(world, dtype=torch.int32, device="cuda")
    seen: List[List[int]] = []
    try:
        nat = buf.normal_buffer()
        assert nat.backend_name == "native" and nat.takes_active_ranks, nat.describe()
        assert nat.num_nodes == (world // virtual_node_size if virtual_node_size else 1), nat.describe()
        steps = [("mask", lambda: buf.low_latency_update_mask_buffer(masked, True), 0),
                 ("clean", buf.low_latency_clean_mask_buffer, 1),
                 ("mask again", lambda: buf.low_latency_update_mask_buffer(masked, True), 0),
                 ("unmask", lambda: buf.low_latency_update_mask_buffer(masked, False), 1)]
        for i, (what, change, entry) in enumerate(steps):
            change()
            cmask[masked] = entry
            buf.low_latency_query_mask_buffer(status)
            seen.append(status.tolist())
            _round(nat, ref, s, 71 + i, i % 2 == 1, f"rank {rank} shim {what} {masked}")
            assert nat.get_active_ranks().tolist() == cmask.tolist(), (what, nat.get_active_ranks().tolist())
        return seen
    finally:
        buf.destroy()
        ref.destroy()
        torch.cuda.synchronize()
