"""Per-rank bodies of the native EP GPU tests (tests/test_ep_native_gpu.py runs them in DistPool workers
over gloo). Each rank drives a native EpBuffer on its GPU next to a reference EpBuffer on the CPU
(pyep.ep.ll.reference over the same gloo group) and compares what both return."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import pytest


@dataclass(frozen=True)
class Shape:
    T: int
    H: int
    E: int
    K: int


def setup_device() -> int:
    import torch
    import torch.distributed as dist
    dev = dist.get_rank() % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    return dev


def rank_device(backend: str) -> Any:
    """Where a per-rank check's tensors live: the CPU for the reference backend; this rank's GPU for
    the native one (setup_device: rank % device_count, so ranks may share a GPU). The compat checks
    (tests/test_compat_*.py) run on either."""
    import torch
    if backend == "reference":
        return torch.device("cpu")
    if backend != "native":
        raise ValueError(f"backend must be 'reference' or 'native', got {backend!r}")
    return torch.device("cuda", setup_device())


def make_inputs(seed: int, rank: int, s: Shape, n: int, routing: str):
    """x bf16 [n, H], topk int64 [n, K] (distinct experts per row, -1 allowed), weights fp32 [n, K]."""
    import torch
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    x = (torch.randn(n, s.H, generator=g) * 2.5).to(torch.bfloat16)
    if n:
        x[0, :64] = 0              # an all-zero FP8 group exercises the amax floor
    topk = torch.rand(n, s.E, generator=g).argsort(dim=1)[:, :s.K].to(torch.int64).contiguous()
    if routing == "one":           # every token to expert 0 (slot 0), nothing else
        topk[:, 0] = 0
        topk[:, 1:] = -1
    elif routing == "sparse":      # most entries unused
        topk[torch.rand(n, s.K, generator=g) < 0.6] = -1
    elif routing == "hot":         # half the tokens hit the last expert
        hot = torch.rand(n, generator=g) < 0.5
        col = topk[hot]
        col[(col == s.E - 1).any(dim=1) == False, 0] = s.E - 1  # noqa: E712
        topk[hot] = col
    elif routing in ("zipf", "bench-hot"):   # the benchmark's skewed routings (pyep.bench.routing)
        from pyep.bench.config import RoutingSpec
        from pyep.bench.routing import make_batch
        spec = RoutingSpec("zipf", 1.2) if routing == "zipf" else RoutingSpec("hot", 0.25)
        topk = make_batch(spec, n, 128, s.E, s.K, seed=seed, rank=rank).topk_idx.to(torch.int64).contiguous()
    w = torch.rand(n, s.K, generator=g)
    return x, topk, w


def expert_fn(recv: Any, counts: Any, e_offset: int) -> Any:
    """A stand-in expert: dequantised input times a per-expert factor, as bf16 [E_l, R*T, H]. Uses only
    ops on existing tensors, so it can sit inside a CUDA-graph capture."""
    import torch
    if isinstance(recv, tuple):
        q, sc = recv
        groups = q.shape[-1] // 128
        if sc.dtype == torch.int32:   # UE8M0: four exponent bytes per int32, group 4j lowest
            wd = sc.to(torch.int64) & 0xFFFFFFFF
            b = torch.stack([(wd >> (8 * i)) & 0xFF for i in range(4)], dim=-1)
            sc = (b.reshape(*sc.shape[:-1], sc.shape[-1] * 4)[..., :groups].to(torch.int32) << 23).view(torch.float32)
        qf = q.to(torch.float32).reshape(*q.shape[:-1], groups, 128)
        y = (qf * sc.unsqueeze(-1)).reshape(q.shape)
    else:
        y = recv.float()
    factor = 1.0 + (torch.arange(y.shape[0], dtype=torch.float32, device=y.device) + e_offset) / 16.0
    return (y * factor.view(-1, 1, 1)).to(torch.bfloat16)


def _cpu(t: Any) -> Any:
    return t.detach().cpu() if t is not None else None


def compare_dispatch(tag: str, got: Tuple, want: Tuple, use_fp8: bool) -> None:
    import torch
    g_recv, g_cnt, g_h = got[0], _cpu(got[1]), got[2]
    w_recv, w_cnt, w_h = want[0], want[1], want[2]
    assert torch.equal(g_cnt, w_cnt), f"{tag}: recv_count {g_cnt.tolist()} != reference {w_cnt.tolist()}"
    assert torch.equal(_cpu(g_h.layout_range), w_h.layout_range), f"{tag}: layout_range differs"
    g_slot, w_slot = _cpu(g_h.extras["topk_slot"]), w_h.extras["topk_slot"]
    g_src = _cpu(g_h.src_info)
    if use_fp8:
        gq, gs = _cpu(g_recv[0]), _cpu(g_recv[1])
        wq, ws = w_recv
    else:
        gx = _cpu(g_recv)
    for e, n in enumerate(w_cnt.tolist()):
        assert torch.equal(g_src[e, :n], w_h.src_info[e, :n]), f"{tag}: src_info of local expert {e} differs"
        assert torch.equal(g_slot[e, :n], w_slot[e, :n]), f"{tag}: top-k slots of local expert {e} differ"
        if use_fp8:
            assert torch.equal(gq[e, :n].view(torch.uint8), wq[e, :n].view(torch.uint8)), \
                f"{tag}: FP8 payload of local expert {e} differs"
            assert torch.equal(gs[e, :n].contiguous().view(torch.int32), ws[e, :n].contiguous().view(torch.int32)), \
                f"{tag}: scales of local expert {e} differ"
        else:
            assert torch.equal(gx[e, :n].view(torch.int16), w_recv[e, :n].view(torch.int16)), \
                f"{tag}: BF16 payload of local expert {e} differs"


def check_no_timeouts(tag: str, nat: Any) -> None:
    """A peer the native buffer marked inactive timed out (timeout_us) in some call: its rows were
    dropped, so a later output mismatch is a stall (e.g. the softnic's work not getting the GPU), not
    a data bug. Name it so the two are not confused."""
    dead = [(p.rank, p.detail) for p in nat.transport_table() if p.kind == "inactive"]
    assert not dead, f"{tag}: peers marked inactive after a timeout: {dead}"


def compare_combine(tag: str, got: Any, want: Any) -> None:
    import torch
    got = _cpu(got)
    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
        diff = (got.float() - want.float()).abs()
        raise AssertionError(f"{tag}: combine output differs from the reference (max |diff| {diff.max().item():.3g}, "
                             f"{int((diff > 0).sum())} of {diff.numel()} elements)")


def new_buffers(shape: Shape, transport: str, **kw: Any):
    import torch.distributed as dist
    from pyep.ep.ll import EpBuffer
    common = dict(num_max_dispatch_tokens_per_rank=shape.T, hidden=shape.H, num_experts=shape.E,
                  max_topk=max(shape.K, 1), **kw)
    nat = EpBuffer(dist.group.WORLD, backend="native", transport=transport, **common)
    ref = EpBuffer(dist.group.WORLD, backend="reference", **{k: v for k, v in common.items()
                                                            if k not in ("ranks_per_node", "num_qps_per_peer")})
    return nat, ref


def run_case(nat: Any, ref: Any, shape: Shape, seed: int, n: int, routing: str, *, use_fp8: bool = False,
             round_scale: bool = False, use_ue8m0: bool = False, mode: str = "plain", zero_copy: bool = False,
             use_logfmt: bool = False) -> None:
    """One dispatch + combine on both backends; mode: plain, hook, async. use_logfmt: LogFMT combine, the
    expert outputs scaled by 2^-6 (exact) so that most groups are cast (|y| < 1) and some are not."""
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    tag = (f"rank {rank} seed {seed} n={n} {routing} fp8={use_fp8}/{round_scale}/{use_ue8m0} {mode} zc={zero_copy}"
           f" logfmt={use_logfmt}")
    x, topk, w = make_inputs(seed, rank, shape, n, routing)
    dx, dtopk, dw = x.cuda(), topk.cuda(), w.cuda()
    stats = torch.zeros(nat.num_local_experts, dtype=torch.int32, device="cuda")
    kw = dict(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
    got = nat.dispatch(dx, dtopk, async_finish=mode == "async", return_recv_hook=mode == "hook",
                       cumulative_local_expert_recv_stats=stats, **kw)
    if mode == "hook":
        got[4]()
    elif mode == "async":
        got[3].current_stream_wait()
    want = ref.dispatch(x, topk, **kw)
    torch.cuda.synchronize()
    compare_dispatch(tag, got, want, use_fp8)
    assert torch.equal(stats.cpu(), got[1].cpu()), f"{tag}: cumulative stats {stats.tolist()} != recv_count"
    e_off = rank * nat.num_local_experts
    y_n = expert_fn(got[0], got[1], e_off)
    y_r = expert_fn(want[0], want[1], e_off)
    if use_logfmt:
        y_n, y_r = y_n * 2.0 ** -6, y_r * 2.0 ** -6
    if zero_copy:
        nat.get_next_combine_buffer(got[2]).copy_(y_n)
    out = nat.combine(y_n, dtopk, dw, got[2], zero_copy=zero_copy, async_finish=mode == "async",
                      return_recv_hook=mode == "hook", use_logfmt=use_logfmt)
    if mode == "hook":
        out[2]()
    elif mode == "async":
        out[1].wait()
    ref_out = ref.combine(y_r, topk, w, want[2], use_logfmt=use_logfmt)
    torch.cuda.synchronize()
    check_no_timeouts(tag, nat)
    compare_combine(tag, out[0], ref_out[0])


def correctness(shape_args: Tuple[int, int, int, int], transport: str, ranks_per_node: Optional[int],
                virtual_env: Optional[str], cases: str) -> Dict[str, Any]:
    """The main matrix for one shape and transport setting."""
    import torch
    setup_device()
    if virtual_env is not None:
        os.environ["PYEP_VIRTUAL_NODE_SIZE"] = virtual_env
    try:
        shape = Shape(*shape_args)
        kw = {"ranks_per_node": ranks_per_node} if ranks_per_node else {}
        nat, ref = new_buffers(shape, transport, **kw)
    finally:
        os.environ.pop("PYEP_VIRTUAL_NODE_SIZE", None)
    table = [p.kind for p in nat.transport_table()]
    T = shape.T
    full = [(1, T, "uniform", {}), (2, T // 2 + 1, "uniform", dict(use_fp8=True)),
            (3, T, "sparse", dict(use_fp8=True, round_scale=True)),
            (4, T, "one", dict(use_fp8=True, round_scale=True, use_ue8m0=True)),
            (5, 0, "uniform", {}), (6, T, "hot", dict(mode="hook")),
            (7, T, "uniform", dict(use_fp8=True, mode="async")), (8, T - 1, "sparse", dict(zero_copy=True)),
            (9, T, "uniform", dict(use_fp8=True, use_ue8m0=True, round_scale=True, mode="hook")),
            (10, T, "zipf", dict(use_fp8=True)), (11, T, "bench-hot", {})]
    if shape.H % 512 == 0:   # LogFMT: native bits == reference LogFMT bits (pyep.ep.ll.logfmt)
        full += [(12, T, "uniform", dict(use_logfmt=True)), (13, T, "hot", dict(use_logfmt=True, mode="hook")),
                 (14, T - 1, "zipf", dict(use_logfmt=True, use_fp8=True, zero_copy=True, mode="async"))]
    chosen = full if cases == "all" else [c for c in full if c[0] in (1, 3, 4, 5, 10, 12, 13, 14)]
    for seed, n, routing, kw in chosen:
        run_case(nat, ref, shape, seed, n, routing, **kw)
    two_in_flight(nat, ref, shape)
    repeated_combine(nat, ref, shape)
    nat.destroy()
    ref.destroy()
    torch.cuda.synchronize()
    return {"transports": table}


def two_in_flight(nat: Any, ref: Any, shape: Shape) -> None:
    """dispatch A, dispatch B (hooks), receive both, combine A, combine B: both buffer halves live."""
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    ins = [make_inputs(s, rank, shape, shape.T, "uniform") for s in (21, 22)]
    got = [nat.dispatch(x.cuda(), t.cuda(), use_fp8=False, return_recv_hook=True) for x, t, _ in ins]
    for g in got:
        g[4]()
    want = [ref.dispatch(x, t, use_fp8=False) for x, t, _ in ins]
    outs = []
    for g, (x, t, w) in zip(got, ins):
        y = expert_fn(g[0], g[1], rank * nat.num_local_experts)
        outs.append(nat.combine(y, t.cuda(), w.cuda(), g[2])[0])
    torch.cuda.synchronize()
    check_no_timeouts(f"rank {rank} in-flight", nat)
    for i, (g, wnt, (x, t, w)) in enumerate(zip(got, want, ins)):
        compare_dispatch(f"rank {rank} in-flight #{i}", g, wnt, False)
        y = expert_fn(wnt[0], wnt[1], rank * nat.num_local_experts)
        compare_combine(f"rank {rank} in-flight #{i}", outs[i], ref.combine(y, t, w, wnt[2])[0])
    torch.cuda.synchronize()


def repeated_combine(nat: Any, ref: Any, shape: Shape, times: int = 6) -> None:
    """One handle combined several times, queued with no host wait in between (DeepEP's own test combines
    a handle twice, its benchmarks many times): a fast peer's next combine must not land on rows this rank
    is still reducing, nor restage a NIC row before the NIC read it. The second and later combines wait
    on the device for every destination's acknowledgement (ll_ack.cuh; docs/ll_kernels.md). Combine #3
    goes through the receive hook, and a combine with that hook uncalled is refused on every rank."""
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    x, t, w = make_inputs(23, rank, shape, shape.T, "uniform")
    g = nat.dispatch(x.cuda(), t.cuda(), use_fp8=False)
    want = ref.dispatch(x, t, use_fp8=False)
    e_off = rank * nat.num_local_experts
    outs = []
    for j in range(times):
        y = expert_fn(g[0], g[1], e_off) * 2.0 ** (j % 4)   # exact: both sides scale the same bits
        zc = j % 3 == 2
        if zc:
            nat.get_next_combine_buffer(g[2]).copy_(y)
        if j == 3:
            out, _, hook = nat.combine(y, t.cuda(), w.cuda(), g[2], return_recv_hook=True)
            try:
                nat.combine(y, t.cuda(), w.cuda(), g[2])
            except ValueError as exc:
                assert "hook" in str(exc), exc
            else:
                raise AssertionError(f"rank {rank}: a combine with the previous combine's hook uncalled ran")
            hook()
            outs.append(out)
        else:
            outs.append(nat.combine(y, t.cuda(), w.cuda(), g[2], zero_copy=zc)[0])
    torch.cuda.synchronize()
    check_no_timeouts(f"rank {rank} repeated combine", nat)
    for j, out in enumerate(outs):
        y = expert_fn(want[0], want[1], e_off) * 2.0 ** (j % 4)
        compare_combine(f"rank {rank} repeated combine #{j}", out, ref.combine(y, t, w, want[2])[0])


def device_value_checks(transport: str) -> Dict[str, Any]:
    """check_values=True on the GPU: a bad expert id is found by the dispatch kernel, routed as -1 and
    raised from the pinned error record when the next combine has done its exchange (its output stands),
    at event.wait() and at the receive hook, naming row, slot and value; the outputs equal the reference
    on the sanitised routing; the buffer works afterwards."""
    import torch
    import torch.distributed as dist
    from pyep.ep.ll.errors import DuplicateExpertIndex, InvalidExpertIndex
    from pyep.ep.ll.validate import sanitize_topk
    setup_device()
    rank = dist.get_rank()
    s = Shape(8, 256, 4 * dist.get_world_size(), 3)
    nat, ref = new_buffers(s, transport)
    assert nat.backend_name == "native"
    seen: Dict[str, Any] = {}

    def both(x, topk, **kw):
        """Native dispatch+combine of (x, topk) next to the reference on the sanitised ids."""
        clean = sanitize_topk(topk, s.E)
        got = nat.dispatch(x.cuda(), topk.cuda(), use_fp8=False, **kw)
        return got, clean

    def finish(tag, got, x, topk, clean, w, raises=None):
        want = ref.dispatch(x, clean, use_fp8=False)
        torch.cuda.synchronize()
        compare_dispatch(tag, got, want, False)
        y_n = expert_fn(got[0], got[1], rank * nat.num_local_experts)
        out = torch.empty(x.shape[0], s.H, dtype=torch.bfloat16, device="cuda")
        if raises is None:
            nat.combine(y_n, topk.cuda(), w.cuda(), got[2], out=out)   # bad ids: -1 in combine too
        else:
            with pytest.raises(raises) as ei:
                nat.combine(y_n, topk.cuda(), w.cuda(), got[2], out=out)
            seen["next_call"] = str(ei.value)
        ref_out = ref.combine(expert_fn(want[0], want[1], rank * nat.num_local_experts), clean, w, want[2])[0]
        torch.cuda.synchronize()
        check_no_timeouts(tag, nat)
        compare_combine(tag, out, ref_out)

    # 1. The next combine raises once its exchange is done (the test synchronises first so the record is
    #    surely visible; the library itself never does). Not the next dispatch: its peers' combine of
    #    that dispatch would wait for a handle this rank never got.
    x, topk, w = make_inputs(41, rank, s, s.T, "uniform")
    bad = topk.clone()
    bad[rank + 1, 1] = s.E + rank
    bad[5, 0] = -9
    got, clean = both(x, bad)
    torch.cuda.synchronize()
    finish(f"rank {rank} bad id, next combine", got, x, bad, clean, w, raises=InvalidExpertIndex)
    assert f"topk_idx[{rank + 1}, 1] = {s.E + rank}" in seen["next_call"], seen["next_call"]

    # 2. event.wait() raises (async_finish), once.
    x, topk, w = make_inputs(42, rank, s, s.T, "uniform")
    dup = topk.clone()
    dup[2, 2] = dup[2, 0]
    got, clean = both(x, dup, async_finish=True)
    with pytest.raises(DuplicateExpertIndex) as ei:
        got[3].wait()
    assert (ei.value.row, ei.value.k, ei.value.first_k) == (2, 2, 0), str(ei.value)
    seen["event"] = str(ei.value)
    got[3].wait()
    finish(f"rank {rank} duplicate, event", got, x, dup, clean, w)

    # 3. The receive hook raises after launching the receive half.
    x, topk, w = make_inputs(43, rank, s, s.T, "uniform")
    bad = topk.clone()
    bad[s.T - 1, 2] = -(2 ** 40)
    got, clean = both(x, bad, return_recv_hook=True)
    torch.cuda.synchronize()          # the send kernel has written the record
    with pytest.raises(InvalidExpertIndex, match=rf"topk_idx\[{s.T - 1}, 2\] = {-(2 ** 40)}"):
        got[4]()
    finish(f"rank {rank} bad id, hook", got, x, bad, clean, w)

    # 4. Good calls afterwards, in every mode: nothing pending, bitwise equal to the reference.
    for seed, mode in ((44, "plain"), (45, "hook"), (46, "async")):
        run_case(nat, ref, s, seed, s.T, "uniform", mode=mode)
    nat.destroy()
    ref.destroy()
    torch.cuda.synchronize()
    return seen
