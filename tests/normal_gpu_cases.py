"""Per-rank bodies of the normal-mode GPU tests (tests/test_normal_gpu.py runs them in DistPool workers
over gloo). Each rank drives a native NormalBuffer on its GPU beside a reference NormalBuffer on the
CPU (the same gloo group, the same inputs) and compares everything both return, bit for bit. Here: the
correctness cases and what every case module shares; the drills are tests/normal_gpu_drills.py."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ep_native_cases import setup_device


@dataclass(frozen=True)
class Shape:
    N: int
    H: int
    E: int
    K: int


def make_inputs(seed: int, rank: int, s: Shape, routing: str, world: int):
    """x bf16 [n, H], topk int64 [n, K] (distinct experts per row, -1 allowed), weights fp32 [n, K]."""
    import torch
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    n = 0 if routing == "empty" and rank == world - 1 else s.N
    x = (torch.randn(n, s.H, generator=g) * 2.5).to(torch.bfloat16)
    topk = torch.rand(n, s.E, generator=g).argsort(dim=1)[:, :s.K].to(torch.int64).contiguous()
    if routing == "hot":                 # a third of the tokens include expert E-1
        hot = torch.rand(n, generator=g) < 0.33
        rows = topk[hot]
        rows[~(rows == s.E - 1).any(dim=1), 0] = s.E - 1
        topk[hot] = rows
    elif routing == "masked":            # most entries unused, some tokens go nowhere
        topk[torch.rand(n, s.K, generator=g) < 0.6] = -1
    elif routing == "one_rank":          # every expert lives on rank 0
        e_l = s.E // world
        topk = torch.rand(n, e_l, generator=g).argsort(dim=1)[:, :min(s.K, e_l)].to(torch.int64)
        if topk.shape[1] < s.K:
            topk = torch.cat([topk, torch.full((n, s.K - topk.shape[1]), -1, dtype=torch.int64)], dim=1)
        topk = topk.contiguous()
    w = torch.rand(n, s.K, generator=g)
    return x, topk, w


def new_buffers(s: Shape, **kw: Any) -> Tuple[Any, Any]:
    """Native and reference buffers over the world; kw (ranks_per_node=, transport=) for virtual nodes."""
    import torch.distributed as dist
    from pyep.ep.normal import NormalBuffer
    nat = NormalBuffer(dist.group.WORLD, hidden=s.H, backend="native", **kw)
    ref = NormalBuffer(dist.group.WORLD, hidden=s.H, backend="reference",
                       **{k: v for k, v in kw.items() if k == "ranks_per_node"})
    assert nat.backend_name == "native" and ref.backend_name == "reference"
    return nat, ref


def _bits(t: Any) -> Any:
    import torch
    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(kind).cpu()


def same(tag: str, got: Any, want: Any, rows: Optional[int] = None) -> None:
    if want is None:
        assert got is None, f"{tag}: expected None"
        return
    assert got is not None, f"{tag}: got None"
    assert tuple(got.shape) == tuple(want.shape), f"{tag}: shape {list(got.shape)} != {list(want.shape)}"
    assert got.dtype == want.dtype, f"{tag}: dtype {got.dtype} != {want.dtype}"
    g, w = _bits(got), _bits(want)
    if rows is not None:
        g, w = g[:rows], w[:rows]
    bad = g != w
    assert not bool(bad.any()), f"{tag}: {int(bad.sum())} of {bad.numel()} elements differ, first at {bad.nonzero()[0].tolist()}"


HANDLE_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                 "is_token_in_rank", "send_head")


def compare_dispatch(tag: str, got: Tuple, want: Tuple, cached: bool = False, real: Optional[int] = None) -> None:
    """got/want: dispatch 6-tuples. With num_worst_tokens only the real rows of recv_x are specified
    (a cached dispatch has no handle of its own: the caller passes the real row count)."""
    if real is None and not cached and want[4] is not None:
        real = int((want[4].recv_src_idx >= 0).sum())
    if isinstance(want[0], tuple):
        assert isinstance(got[0], tuple), f"{tag}: expected an (e4m3, scales) pair"
        same(f"{tag} recv_x e4m3", got[0][0], want[0][0], real)
        same(f"{tag} recv_x scales", got[0][1], want[0][1], real)
    else:
        same(f"{tag} recv_x", got[0], want[0], real)
    if cached:
        assert got[1:5] == (None, None, None, None), f"{tag}: cached dispatch returns Nones"
        return
    same(f"{tag} recv_topk_idx", got[1], want[1])
    same(f"{tag} recv_topk_weights", got[2], want[2])
    assert list(got[3]) == list(want[3]), f"{tag}: counts {list(got[3])} != reference {list(want[3])}"
    for name in HANDLE_FIELDS:
        same(f"{tag} handle.{name}", getattr(got[4], name), getattr(want[4], name))


def expert(recv: Any, rank: int) -> Any:
    """BF16 expert input (FP8 dequantised) -> bf16(x * (1 + rank/8)), the same on CPU and GPU."""
    import torch
    from pyep.bench.normal_check import expert_output
    from pyep.ep import fp8
    if isinstance(recv, tuple):
        recv = fp8.dequantize_fp8(recv[0], recv[1].contiguous()).to(torch.bfloat16)
    return expert_output(recv, rank)


def _on(dev: Any, *ts: Any) -> List[Any]:
    return [t.to(dev) if t is not None else None for t in ts]


def run_case(nat: Any, ref: Any, s: Shape, seed: int, routing: str, *, use_fp8: bool = False, alignment: int = 1,
             worst: int = 0, cached: bool = False, config: Any = None, asynchronous: bool = False) -> None:
    """layout, dispatch, (cached dispatch), combine on both backends; every output compared."""
    import torch
    import torch.distributed as dist
    from pyep.ep import fp8
    from pyep.ep.normal import NormalBuffer
    rank, world = dist.get_rank(), dist.get_world_size()
    tag = f"rank {rank} seed {seed} {routing} fp8={use_fp8} align={alignment} worst={worst} cached={cached}"
    x, t, w = make_inputs(seed, rank, s, routing, world)
    xin = fp8.quantize_fp8(x) if use_fp8 else x
    gx = tuple(_on("cuda", *xin)) if use_fp8 else x.cuda()
    gt, gw = _on("cuda", t, w)
    lay_n = nat.get_dispatch_layout(gt, s.E)
    lay_r = ref.get_dispatch_layout(t, s.E)
    for i, name in ((0, "num_tokens_per_rank"), (1, "num_tokens_per_rdma_rank"), (2, "num_tokens_per_expert"),
                    (3, "is_token_in_rank")):
        same(f"{tag} layout {name}", lay_n[i], lay_r[i])
    kw: Dict[str, Any] = dict(expert_alignment=alignment, num_worst_tokens=worst, config=config)
    extra: Dict[str, Any] = dict(async_finish=True, previous_event=NormalBuffer.capture()) if asynchronous else {}
    got = nat.dispatch(gx, num_tokens_per_rank=lay_n[0], num_tokens_per_rdma_rank=lay_n[1], is_token_in_rank=lay_n[3],
                       num_tokens_per_expert=lay_n[2], topk_idx=gt, topk_weights=gw, **kw, **extra)
    if asynchronous:
        got[5].current_stream_wait()
    want = ref.dispatch(xin, num_tokens_per_rank=lay_r[0], num_tokens_per_rdma_rank=lay_r[1], is_token_in_rank=lay_r[3],
                        num_tokens_per_expert=lay_r[2], topk_idx=t, topk_weights=w, **kw)
    torch.cuda.synchronize()
    compare_dispatch(tag, got, want)
    if worst:
        rows = got[0][0].shape[0] if use_fp8 else got[0].shape[0]
        assert list(got[3]) == [] and rows == worst, f"{tag}: {rows} rows, counts {list(got[3])}"
    h_n, h_r = got[4], want[4]
    if cached:
        c_n = nat.dispatch(gx, handle=h_n, config=config, **extra)
        if asynchronous:
            c_n[5].current_stream_wait()
        c_r = ref.dispatch(xin, handle=h_r, config=config)
        torch.cuda.synchronize()
        compare_dispatch(tag + " (cached)", c_n, c_r, cached=True, real=int((h_r.recv_src_idx >= 0).sum()))
    y_r = expert(want[0], rank)
    out_n = nat.combine(y_r.cuda(), h_n, topk_weights=got[2], config=config, **extra)
    if asynchronous:
        out_n[2].current_stream_wait()
    out_r = ref.combine(y_r, h_r, topk_weights=want[2], config=config)
    torch.cuda.synchronize()
    same(f"{tag} combined_x", out_n[0], out_r[0])
    same(f"{tag} combined_topk_weights", out_n[1], out_r[1])


CASES: Dict[str, List[Tuple[int, str, Dict[str, Any]]]] = {
    "all": [(1, "random", {}), (2, "random", dict(use_fp8=True)), (3, "hot", dict(alignment=128)),
            (4, "masked", dict(use_fp8=True, cached=True)), (5, "empty", {}), (6, "one_rank", dict(cached=True)),
            (7, "random", dict(worst=-1)), (8, "masked", dict(use_fp8=True, worst=-1, alignment=128)),
            (9, "random", dict(asynchronous=True, cached=True)), (10, "hot", dict(config="small-ring")),
            (11, "empty", dict(use_fp8=True, cached=True, worst=-1))],
}
CASES["core"] = [c for c in CASES["all"] if c[0] in (1, 2, 4, 5, 7, 10)]


def correctness(shape_args: Tuple[int, int, int, int], cases: str) -> None:
    import torch
    import torch.distributed as dist
    from pyep.ep.normal import Config
    setup_device()
    s = Shape(*shape_args)
    nat, ref = new_buffers(s)
    try:
        for seed, routing, kw in CASES[cases]:
            kw = dict(kw)
            if kw.get("worst") == -1:
                kw["worst"] = s.N * dist.get_world_size()
            if kw.get("config") == "small-ring":      # 8 channels, rings of 32 rows: every ring wraps
                kw["config"] = Config(16, 4, 32)
            run_case(nat, ref, s, seed, routing, **kw)
    finally:
        nat.destroy()
        ref.destroy()
        torch.cuda.synchronize()


def one_copy(shape_args: Tuple[int, int, int, int], cases: str) -> None:
    """correctness with a buffer that has an output pool (one-copy dispatch with a handle,
    normal_direct.cuh); then the pool's ownership: cached dispatches of different tokens whose outputs are
    all kept, until a rank's pool is full and every rank takes the ring path; every kept output still
    equals the reference at the end (a later call never wrote into memory an earlier output lives in);
    once released, outputs are pooled again."""
    import gc

    import torch
    import torch.distributed as dist
    import os

    from pyep.ep.normal.direct_pool import pooled_buffer_bytes
    setup_device()
    s = Shape(*shape_args)
    rank, world = dist.get_rank(), dist.get_world_size()
    before = os.environ.get("PYEP_NORMAL_DIRECT")
    os.environ["PYEP_NORMAL_DIRECT"] = "1"     # the default, unless the run turned it off; read at build
    try:
        nat, ref = new_buffers(s, num_nvl_bytes=pooled_buffer_bytes(world, 24, s.H, s.N))
    finally:
        if before is None:
            del os.environ["PYEP_NORMAL_DIRECT"]
        else:
            os.environ["PYEP_NORMAL_DIRECT"] = before
    try:
        pool = nat.backend._pool
        assert pool is not None, "the buffer has no output pool"

        def pooled(t: Any) -> bool:
            return pool.memory.ptr + pool.lo <= t.data_ptr() < pool.memory.ptr + pool.hi

        for seed, routing, kw in CASES[cases]:
            kw = dict(kw)
            if kw.get("worst") == -1:
                kw["worst"] = s.N * world
            if kw.get("config") == "small-ring":
                from pyep.ep.normal import Config
                kw["config"] = Config(16, 4, 32)
            run_case(nat, ref, s, seed, routing, **kw)
        # The dispatch that makes the handle takes the ring path (its counts come back to the host
        # between its kernels), its BF16 recv_x in the pool while as much stays free behind it (a combine
        # of it pulls); dispatches with the handle are one-copy while the pool has room.
        x, t, w = make_inputs(500, rank, s, "random", world)
        gt, gw = _on("cuda", t, w)
        lay = nat.get_dispatch_layout(gt, s.E)
        first = nat.dispatch(x.cuda(), num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                             num_tokens_per_expert=lay[2], topk_idx=gt, topk_weights=gw)
        lr = ref.get_dispatch_layout(t, s.E)
        first_r = ref.dispatch(x, num_tokens_per_rank=lr[0], is_token_in_rank=lr[3], num_tokens_per_expert=lr[2],
                               topk_idx=t, topk_weights=w)
        assert pooled(first[0]) == nat.backend._pull, f"rank {rank}: a dispatch without a handle, pooled={pooled(first[0])}"
        real = int((first_r[4].recv_src_idx >= 0).sum())
        kept, wanted = [], []
        for i in range(12):
            xi = make_inputs(501 + i, rank, s, "random", world)[0]
            kept.append(nat.dispatch(xi.cuda(), handle=first[4]))
            wanted.append(ref.dispatch(xi, handle=first_r[4]))
        torch.cuda.synchronize()
        nat.backend.check_errors()
        where = [pooled(k[0]) for k in kept]
        assert where[0], f"rank {rank}: the first cached dispatch's outputs are not in the pool"
        assert not all(where), f"rank {rank}: twelve kept dispatches all fit the pool ({pool.held_bytes()} bytes held)"
        for i, (got, want) in enumerate(zip(kept, wanted)):
            compare_dispatch(f"rank {rank} kept dispatch {i} (pooled={where[i]})", got, want, cached=True, real=real)
        del kept, got
        gc.collect()
        again = nat.dispatch(x.cuda(), handle=first[4])
        assert pooled(again[0]), f"rank {rank}: released outputs were not pooled again"
        compare_dispatch(f"rank {rank} after the release", again, ref.dispatch(x, handle=first_r[4]), cached=True,
                         real=real)
        torch.cuda.synchronize()
        nat.backend.check_errors()
    finally:
        nat.destroy()
        ref.destroy()
        torch.cuda.synchronize()


def bulk_copy_setting(setting: str, shape_args: Tuple[int, int, int, int], cases: str) -> None:
    """correctness and one_copy with PYEP_NORMAL_TMA=setting (native_state.bulk_copy_setting, read when a
    buffer is built): the ring path, one-copy dispatch and combine with their row copies by warp loads and
    stores or by the bulk copy engine give the same bits as the reference."""
    import os
    before = os.environ.get("PYEP_NORMAL_TMA")
    os.environ["PYEP_NORMAL_TMA"] = setting
    try:
        correctness(shape_args, cases)
        one_copy(shape_args, cases)
    finally:
        if before is None:
            del os.environ["PYEP_NORMAL_TMA"]
        else:
            os.environ["PYEP_NORMAL_TMA"] = before


@contextmanager
def rank_buffers(shape_args: Tuple[int, int, int, int], **kw: Any) -> Iterator[Tuple[int, int, Shape, Any, Any]]:
    """One case's (rank, world, shape, native buffer, reference buffer); both destroyed afterwards.
    kw: new_buffers'."""
    import torch
    import torch.distributed as dist
    setup_device()
    s = Shape(*shape_args)
    nat, ref = new_buffers(s, **kw)
    try:
        yield dist.get_rank(), dist.get_world_size(), s, nat, ref
    finally:
        nat.destroy()
        ref.destroy()
        torch.cuda.synchronize()


@dataclass
class FirstDispatch:
    """One rank's inputs (CPU and GPU) and the first full dispatch of them on both backends."""
    x: Any
    t: Any
    w: Any
    gx: Any
    layout_ref: Tuple
    nat: Tuple
    ref: Tuple


def first_dispatch(nat: Any, ref: Any, s: Shape, rank: int, world: int, seed: int) -> FirstDispatch:
    """make_inputs(seed, ...) dispatched with top-k and the layout's counts on the native and the reference
    buffer (the handles are out[4])."""
    x, t, w = make_inputs(seed, rank, s, "random", world)
    gx, gt, gw = _on("cuda", x, t, w)
    lay, lr = nat.get_dispatch_layout(gt, s.E), ref.get_dispatch_layout(t, s.E)
    d = nat.dispatch(gx, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                     topk_idx=gt, topk_weights=gw)
    dr = ref.dispatch(x, num_tokens_per_rank=lr[0], is_token_in_rank=lr[3], num_tokens_per_expert=lr[2],
                      topk_idx=t, topk_weights=w)
    return FirstDispatch(x, t, w, gx, lr, d, dr)


def mixed_rows(shape_args: Tuple[int, int, int, int], rounds: int) -> None:
    """Calls of different row kinds back to back with no host wait between them (num_worst_tokens): an
    FP8 dispatch, a combine without weights, a cached BF16 dispatch, a combine with weights. A peer that
    finished one call starts writing the next while this rank may still read the last one, so the
    rings of one call must never overlap another call's (docs/normal_mode.md, "Rings never move")."""
    import torch
    from pyep.ep import fp8
    with rank_buffers(shape_args) as (rank, world, s, nat, ref):
        worst = s.N * world
        got = []
        inputs = [make_inputs(300 + i, rank, s, "hot" if i % 2 else "random", world) for i in range(rounds)]
        for x, t, w in inputs:        # everything queued first: the ranks drift apart freely
            xq = fp8.quantize_fp8(x)
            gt, gw = _on("cuda", t, w)
            lay = nat.get_dispatch_layout(gt, s.E)
            d8 = nat.dispatch(tuple(_on("cuda", *xq)), num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                              num_tokens_per_expert=lay[2], topk_idx=gt, topk_weights=gw, num_worst_tokens=worst)
            c0 = nat.combine(expert(d8[0], rank), d8[4])
            d16 = nat.dispatch(x.cuda(), handle=d8[4])
            c1 = nat.combine(expert(d16[0], rank), d8[4], topk_weights=d8[2])
            got.append((d8[0], c0[0], d16[0], c1[0], c1[1]))
        torch.cuda.synchronize()
        nat.backend.check_errors()
        for i, ((x, t, w), (g8, g_c0, g16, g_c1, g_w1)) in enumerate(zip(inputs, got)):
            xq = fp8.quantize_fp8(x)
            lay = ref.get_dispatch_layout(t, s.E)
            w8 = ref.dispatch(xq, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                              topk_idx=t, topk_weights=w, num_worst_tokens=worst)
            real = int((w8[4].recv_src_idx >= 0).sum())
            tag = f"rank {rank} round {i}"
            same(f"{tag} fp8 recv_x", g8[0], w8[0][0], real)
            same(f"{tag} fp8 recv_scales", g8[1], w8[0][1], real)
            same(f"{tag} combine without weights", g_c0, ref.combine(expert(w8[0], rank), w8[4])[0])
            w16 = ref.dispatch(x, handle=w8[4])
            same(f"{tag} cached bf16 recv_x", g16, w16[0], real)
            c1 = ref.combine(expert(w16[0], rank), w8[4], topk_weights=w8[2])
            same(f"{tag} combine with weights", g_c1, c1[0])
            same(f"{tag} combined weights", g_w1, c1[1])


def traced_combine(shape_args: Tuple[int, int, int, int]) -> None:
    """PYEP_NORMAL_TRACE=1 (read when a buffer is built): the combines run the traced kernel, give the
    reference's bits, and last_combine_trace() names every block: a reducer per channel over this rank's
    tokens, a sender per channel over the rows it returns to its peers, each split within its span."""
    import os
    import torch
    os.environ["PYEP_NORMAL_TRACE"] = "1"
    try:
        with rank_buffers(shape_args) as (rank, world, s, nat, ref):
            f = first_dispatch(nat, ref, s, rank, world, 41)
            d, dr, lr = f.nat, f.ref, f.layout_ref
            for i in range(3):   # the first through the Python path, the next through the fast path
                got = nat.combine(expert(d[0], rank), d[4], topk_weights=d[2])
                blocks = nat.backend.last_combine_trace()
                same(f"rank {rank} traced combine {i}", got[0], ref.combine(expert(dr[0], rank), dr[4],
                                                                            topk_weights=dr[2])[0])
                channels = d[4].num_channels
                red = [b for b in blocks if b.role == "reduce"]
                send = [b for b in blocks if b.role == "send"]
                assert len(red) == len(send) == channels, (rank, i, blocks)
                assert sum(b.items for b in red) == s.N, (rank, i, red)
                own = int(lr[3][:, rank].sum())
                assert sum(b.items for b in send) == int(d[0].shape[0]) - own, (rank, i, send, own)
                for b in blocks:
                    assert 0 < b.start_ns < b.end_ns and b.warps > 0, (rank, i, b)
                    assert b.wait_ns + b.work_ns + b.sync_ns <= b.warps * b.duration_ns, (rank, i, b)
            torch.cuda.synchronize()
    finally:
        del os.environ["PYEP_NORMAL_TRACE"]


# ---------------------------------------------------------------------- for the drills
# (normal_gpu_drills.py) and the internode cases (normal_internode_gpu_cases.py)
def _layout_ref(t: Any, e: int, world: int) -> Tuple[Any, Any, Any]:
    """The layout tensors computed on the host (pyep.bench.normal_check, ids out of range count as -1)."""
    from pyep.bench.normal_check import layout
    return layout(t, e, world)


def _hash(*ts: Any) -> Any:
    """A position-weighted checksum of the bytes (int64 on the device), cheap enough per round."""
    import torch
    acc = torch.zeros((), dtype=torch.int64, device="cuda")
    for t in ts:
        v = _bits_dev(t).reshape(-1).to(torch.int64)
        pos = torch.arange(v.numel(), device=v.device, dtype=torch.int64) % 1021 + 1
        acc = acc * 1_000_003 + (v * pos).sum()
    return acc


def _bits_dev(t: Any) -> Any:
    import torch
    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(kind)


def assert_broken(nat: Any, topk_idx: Any, num_experts: int, rank: int) -> None:
    """After a peer timeout the buffer refuses every call (BufferBroken) until clean()."""
    from pyep.ep.normal import BufferBroken
    try:
        nat.get_dispatch_layout(topk_idx, num_experts)
        raise AssertionError(f"rank {rank}: a broken buffer accepted a call")
    except BufferBroken:
        pass


def warm_and_capture(step: Callable[[], Any]) -> Tuple[Any, Any]:
    """Run `step` once on a side stream (the allocator's first blocks, every kernel loaded, lazy
    initialisation: none of it may happen inside a capture), then capture it in a CUDA graph.
    Returns (graph, what the captured step returned: the tensors a replay rewrites)."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    torch.cuda.synchronize()
    return graph, outputs


def hash_stable_rounds(nat, ref, s: Shape, rank: int, world: int, rounds: int, internode: bool = False) -> int:
    """The same layout + dispatch + combine `rounds` times on `nat`: every round's output hash equals the
    first, and the first equals the reference's. `internode` also passes the layout's per-RDMA-rank counts.
    Returns the first round's hash."""
    import torch

    def counts(lay):
        extra = {"num_tokens_per_rdma_rank": lay[1]} if internode else {}
        return dict(num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2], **extra)

    x, t, w = make_inputs(3, rank, s, "random", world)
    gx, gt, gw = _on("cuda", x, t, w)
    hashes = []
    for _ in range(rounds):
        lay = nat.get_dispatch_layout(gt, s.E)
        recv, ri, rw, _c, h, _e = nat.dispatch(gx, topk_idx=gt, topk_weights=gw, **counts(lay))
        out, ow, _ = nat.combine(expert(recv, rank), h, topk_weights=rw)
        hashes.append(_hash(recv, ri, rw, h.recv_src_idx, h.send_head, out, ow))
    got = torch.stack(hashes).cpu()
    bad = (got != got[0]).nonzero().flatten().tolist()
    assert not bad, f"rank {rank}: output hash changed in rounds {bad[:10]} (of {rounds})"
    lay = ref.get_dispatch_layout(t, s.E)
    want = ref.dispatch(x, topk_idx=t, topk_weights=w, **counts(lay))
    want_out = ref.combine(expert(want[0], rank), want[4], topk_weights=want[2])
    ref_hash = _hash(*_on("cuda", want[0], want[1], want[2], want[4].recv_src_idx, want[4].send_head,
                          want_out[0], want_out[1]))
    assert int(ref_hash) == int(got[0]), f"rank {rank}: native hash differs from the reference's"
    return int(got[0])
