"""The normal-mode benchmark's correctness guard: an in-process oracle of pyep/ep/normal/contract.py.

Every rank gathers all ranks' inputs (tokens, top-k ids and weights) and computes, without the buffer,
what the contract says it must receive: rows, top-k ids/weights, source indices, per-expert counts and
every handle tensor. The expert is a per-rank scale (bf16(x * (1 + rank/8))) so a combine that adds the
wrong rank's row is caught, and the combined result is computed in the contract's fp32 order. Dispatch
(BF16, FP8, cached) and combine are compared bit for bit: a wrong kernel must not produce a speed
table. The pure functions here are what tests/test_bench_normal.py checks by hand.

Across nodes (ranks_per_node < ranks) the contract changes in two places only, and so does the
oracle: the layout also reports num_tokens_per_rdma_rank, and combine adds one BF16 partial per node
in the order of contract.combine_order. Rows, top-k, counts and every handle tensor keep their
one-node definitions (contract.py; tests/test_normal_reference.py checks them per token on 2 x 2 nodes).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from .guard import CheckResult

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pyep.bench")


def expert_factor(rank: int) -> float:
    """Exact in bf16 for every rank count the mode runs (1 + rank/8 has at most 9 significant bits up to
    rank 255), so bf16 x * factor is exact in fp32 and its rounding is the same on CPU and GPU."""
    return 1.0 + rank / 8.0


def expert_output(recv_x: "torch.Tensor", rank: int) -> "torch.Tensor":
    """What the stand-in expert of `rank` returns for received BF16 rows: bf16(x * factor)."""
    import torch
    return (recv_x.to(torch.float32) * expert_factor(rank)).to(torch.bfloat16)


def token_channels(n: int, num_channels: int, device: Any = "cpu") -> "torch.Tensor":
    """int64 [n]: the channel of each token; channel c covers [c*P, (c+1)*P) with P = ceil(n/C)."""
    import torch
    if num_channels < 1:
        raise ValueError(f"num_channels must be >= 1, got {num_channels}")
    per = max(1, -(-n // num_channels))
    return torch.arange(n, device=device, dtype=torch.int64) // per


def layout(topk_idx: "torch.Tensor", num_experts: int, num_ranks: int) -> Tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank bool [N, R])."""
    import torch
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    idx = torch.where(valid, topk_idx, torch.zeros_like(topk_idx))
    per_expert = torch.zeros(num_experts, dtype=torch.int64, device=topk_idx.device)
    per_expert.scatter_add_(0, idx[valid], torch.ones_like(idx[valid]))
    owner = idx // (num_experts // num_ranks)
    in_rank = torch.zeros(topk_idx.shape[0], num_ranks, dtype=torch.bool, device=topk_idx.device)
    for r in range(num_ranks):
        in_rank[:, r] = ((owner == r) & valid).any(dim=1)
    return in_rank.sum(dim=0).to(torch.int32), per_expert.to(torch.int32), in_rank


def per_node(in_rank: "torch.Tensor", ranks_per_node: int) -> Optional["torch.Tensor"]:
    """num_tokens_per_rdma_rank, int32 [M]: tokens with a rank on node n (ranks [n*P, (n+1)*P));
    None on one node (P >= R), as the layout returns it there."""
    import torch
    n, r = in_rank.shape
    if ranks_per_node >= r:
        return None
    return in_rank.reshape(n, r // ranks_per_node, ranks_per_node).any(dim=2).sum(dim=0).to(torch.int32)


def check_layout(got: Sequence[Any], topk_idx: "torch.Tensor", num_experts: int, num_ranks: int,
                 ranks_per_node: int) -> List[str]:
    """got: get_dispatch_layout's (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
    is_token_in_rank, ...). Problems, [] when all equal the oracle bit for bit."""
    want_rank, want_exp, want_in = layout(topk_idx, num_experts, num_ranks)
    problems = [diff("layout num_tokens_per_rank", got[0], want_rank),
                diff("layout num_tokens_per_expert", got[2], want_exp),
                diff("layout is_token_in_rank", got[3], want_in)]
    want_rdma = per_node(want_in, ranks_per_node)
    if want_rdma is None:
        if got[1] is not None:
            problems.append("layout num_tokens_per_rdma_rank: a tensor on one node, expected None")
    else:
        problems.append(diff("layout num_tokens_per_rdma_rank", got[1], want_rdma))
    return [p for p in problems if p]


def channel_prefix(in_rank: "torch.Tensor", num_channels: int) -> "torch.Tensor":
    """int32 [R, C]: [d][c] = tokens for destination d in channels 0..c (inclusive)."""
    import torch
    n, r = in_rank.shape
    chan = token_channels(n, num_channels, in_rank.device)
    per = torch.zeros(num_channels, r, dtype=torch.int64, device=in_rank.device)
    per.index_add_(0, chan, in_rank.to(torch.int64))
    return per.cumsum(dim=0).T.contiguous().to(torch.int32)


def send_head(in_rank: "torch.Tensor", num_channels: int) -> "torch.Tensor":
    """int32 [N, R]: position of token t in its (channel, -> d) stream from 0, -1 where not sent."""
    import torch
    n, _ = in_rank.shape
    chan = token_channels(n, num_channels, in_rank.device)
    out = torch.full(in_rank.shape, -1, dtype=torch.int32, device=in_rank.device)
    for c in range(num_channels):
        rows = (chan == c).nonzero().flatten()
        if rows.numel() == 0:
            continue
        sel = in_rank[rows]
        pos = sel.to(torch.int64).cumsum(dim=0) - 1
        out[rows] = torch.where(sel, pos, torch.full_like(pos, -1)).to(torch.int32)
    return out


@dataclass
class Expected:
    """What this rank must get from a dispatch (not cached, no num_worst_tokens) and a combine."""
    recv_x: "torch.Tensor"                 # bf16 [M, H], rows by (source rank, source token)
    recv_topk_idx: "torch.Tensor"          # int64 [M, K]
    recv_topk_weights: "torch.Tensor"      # fp32 [M, K]
    recv_src_idx: "torch.Tensor"           # int32 [M]
    num_recv_tokens_per_expert: List[int]
    rank_prefix_matrix: "torch.Tensor"     # int32 [R, R]
    channel_prefix_matrix: "torch.Tensor"  # int32 [R, C] (this rank's tokens)
    recv_channel_prefix_matrix: "torch.Tensor"  # int32 [R, C], [s][c] counted from source s's first row
    send_head: "torch.Tensor"              # int32 [N, R]
    is_token_in_rank: "torch.Tensor"       # bool [N, R]
    combined_x: "torch.Tensor"             # bf16 [N, H] (experts: expert_output of each rank)
    combined_topk_weights: "torch.Tensor"  # fp32 [N, K]


def expected(rank: int, xs: Sequence["torch.Tensor"], topks: Sequence["torch.Tensor"],
             weights: Sequence["torch.Tensor"], num_experts: int, num_channels: int,
             expert_alignment: int = 1, ranks_per_node: Optional[int] = None) -> Expected:
    """xs/topks/weights: every rank's inputs, in rank order (all on one device). ranks_per_node: the
    node size P (None: one node); it only changes the combine order (contract.combine_order)."""
    import torch
    from ..ep.normal.contract import combine_order
    num_ranks = len(xs)
    e_l = num_experts // num_ranks
    lo, hi = rank * e_l, (rank + 1) * e_l
    lays = [layout(t, num_experts, num_ranks) for t in topks]
    per_rank = torch.stack([lay[0] for lay in lays]).to(torch.int64)          # [source, dest]
    rank_prefix = per_rank.cumsum(dim=0).to(torch.int32)
    rows_x, rows_i, rows_w, rows_s, chan_rows = [], [], [], [], []
    for s in range(num_ranks):
        mine = lays[s][2][:, rank]
        src = mine.nonzero().flatten()
        idx = topks[s][src]
        local = (idx >= lo) & (idx < hi)
        rows_x.append(xs[s][src])
        rows_i.append(torch.where(local, idx - lo, torch.full_like(idx, -1)))
        rows_w.append(torch.where(local, weights[s][src], torch.zeros_like(weights[s][src])))
        rows_s.append(src.to(torch.int32))
        prefix_s = channel_prefix(lays[s][2], num_channels)[rank].to(torch.int64)
        exclusive = torch.cat([prefix_s.new_zeros(1), prefix_s[:-1]])
        chan_rows.append(exclusive)   # relative to source s's first row, as DeepEP's kernels keep it
    counts = torch.stack([lay[1] for lay in lays]).to(torch.int64).sum(dim=0)[lo:hi].tolist()
    align = expert_alignment
    me = lays[rank][2]
    return Expected(
        recv_x=torch.cat(rows_x), recv_topk_idx=torch.cat(rows_i), recv_topk_weights=torch.cat(rows_w),
        recv_src_idx=torch.cat(rows_s), num_recv_tokens_per_expert=[(c + align - 1) // align * align for c in counts],
        rank_prefix_matrix=rank_prefix, channel_prefix_matrix=channel_prefix(me, num_channels),
        recv_channel_prefix_matrix=torch.stack(chan_rows).to(torch.int32), send_head=send_head(me, num_channels),
        is_token_in_rank=me, **_combined(xs[rank], topks[rank], weights[rank], me, num_experts,
                                         combine_order(num_ranks, ranks_per_node or num_ranks)))


def _combined(x: "torch.Tensor", topk: "torch.Tensor", w: "torch.Tensor", in_rank: "torch.Tensor",
              num_experts: int, groups: Sequence[Sequence[int]]) -> Dict[str, "torch.Tensor"]:
    """The contract's combine without bias. One group (one node): acc = 0, then + rank d's row for d
    ascending where the token went. Several (one per node, contract.combine_order): per group an fp32
    partial from 0 over its ranks ascending, rounded to BF16 (weights not rounded), added to acc for
    the groups that hold one of the token's ranks, in group order."""
    import torch
    e_l = num_experts // in_rank.shape[1]
    one = len(groups) == 1
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    acc_w = torch.zeros(w.shape, dtype=torch.float32, device=x.device)
    for ranks in groups:
        part = acc if one else torch.zeros_like(acc)
        part_w = acc_w if one else torch.zeros_like(acc_w)
        for d in ranks:
            sel = in_rank[:, d:d + 1]
            part = torch.where(sel, part + expert_output(x, d).to(torch.float32), part)
            local = (topk >= d * e_l) & (topk < (d + 1) * e_l)
            part_w = torch.where(sel, part_w + torch.where(local, w, torch.zeros_like(w)), part_w)
        if one:
            acc, acc_w = part, part_w
        else:
            touched = in_rank[:, list(ranks)].any(dim=1, keepdim=True)
            acc = torch.where(touched, acc + part.to(torch.bfloat16).to(torch.float32), acc)
            acc_w = torch.where(touched, acc_w + part_w, acc_w)
    return {"combined_x": acc.to(torch.bfloat16), "combined_topk_weights": acc_w}


# ---------------------------------------------------------------------- comparisons
def _bits(t: "torch.Tensor") -> "torch.Tensor":
    """An integer view with the same bytes, so that comparisons are bitwise (NaN == NaN, -0 != 0)."""
    import torch
    size = t.element_size()
    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return t.detach().contiguous().view(kind).cpu()


def diff(name: str, got: Optional["torch.Tensor"], want: "torch.Tensor") -> Optional[str]:
    """None when got equals want bit for bit, else a one-line description of the first difference."""
    if got is None:
        return f"{name}: missing (None)"
    if tuple(got.shape) != tuple(want.shape):
        return f"{name}: shape {list(got.shape)}, expected {list(want.shape)}"
    if got.dtype != want.dtype:
        return f"{name}: dtype {got.dtype}, expected {want.dtype}"
    g, w = _bits(got), _bits(want)
    bad = (g != w)
    if not bool(bad.any()):
        return None
    first = [int(v) for v in bad.nonzero()[0].tolist()]
    return f"{name}: {int(bad.sum())} of {bad.numel()} elements differ, first at {first}"


def check_dispatch(got: Dict[str, Any], exp: Expected, fp8: Optional[Tuple["torch.Tensor", "torch.Tensor"]] = None,
                   cached: bool = False) -> List[str]:
    """got: recv_x (bf16, or the (e4m3, scales) pair when fp8 gives the expected pair), recv_topk_idx,
    recv_topk_weights, counts, handle. A cached dispatch only has recv_x."""
    problems: List[Optional[str]] = []
    recv = got["recv_x"]
    if fp8 is not None:
        if not isinstance(recv, tuple) or len(recv) != 2:
            return [f"recv_x: expected an (e4m3, scales) pair, got {type(recv).__name__}"]
        problems += [diff("recv_x (e4m3)", recv[0], fp8[0]), diff("recv_x scales", recv[1].contiguous(), fp8[1])]
    else:
        problems.append(diff("recv_x", recv, exp.recv_x))
    if not cached:
        problems += [diff("recv_topk_idx", got["recv_topk_idx"], exp.recv_topk_idx),
                     diff("recv_topk_weights", got["recv_topk_weights"], exp.recv_topk_weights)]
        if list(got["counts"]) != exp.num_recv_tokens_per_expert:
            problems.append(f"num_recv_tokens_per_expert_list: {list(got['counts'])}, "
                            f"expected {exp.num_recv_tokens_per_expert}")
        h = got["handle"]
        for name in ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                     "recv_src_idx", "is_token_in_rank", "send_head"):
            problems.append(diff(f"handle.{name}", getattr(h, name), getattr(exp, name)))
    return [p for p in problems if p]


def check_combine(combined_x: "torch.Tensor", combined_w: Optional["torch.Tensor"], exp: Expected) -> List[str]:
    problems = [diff("combined_x", combined_x, exp.combined_x)]
    if combined_w is not None:
        problems.append(diff("combined_topk_weights", combined_w, exp.combined_topk_weights))
    else:
        problems.append("combined_topk_weights: None although topk_weights were passed")
    return [p for p in problems if p]


# ---------------------------------------------------------------------- the guard
@dataclass
class GuardInputs:
    """This rank's batch as the timing loops use it (all on the buffer's device)."""
    x: "torch.Tensor"
    x_fp8: Tuple["torch.Tensor", "torch.Tensor"]
    topk_idx: "torch.Tensor"
    topk_weights: "torch.Tensor"
    num_experts: int


def gather_inputs(inp: GuardInputs, sync: Any) -> Tuple[List["torch.Tensor"], List["torch.Tensor"], List["torch.Tensor"]]:
    """Every rank's (x, topk_idx, weights) on this rank's device. Bytes travel as uint8/int64 so any
    process-group backend can carry them (through host memory where the group cannot reach the
    device); waits are bounded by the Sync."""
    import torch

    def gather(t: "torch.Tensor", what: str) -> List["torch.Tensor"]:
        src = t.contiguous()
        flat = src.view(torch.uint8) if src.dtype != torch.int64 else src
        return [o.view(src.dtype) for o in sync.gather_on_device(flat, what)]
    return (gather(inp.x, "guard: tokens"), gather(inp.topk_idx, "guard: top-k ids"),
            gather(inp.topk_weights, "guard: top-k weights"))


def run_guard(buf: Any, inp: GuardInputs, rank: int, sync: Any, ranks_per_node: Optional[int] = None,
              pool_input: bool = False) -> Tuple[CheckResult, Dict[str, Any]]:
    """One layout, BF16 dispatch, FP8 dispatch, cached BF16 dispatch and combine on `buf` (default
    config), each compared with the oracle for the node size ranks_per_node (None: one node). Returns
    the check (not yet agreed over ranks) and what the timing loops reuse: the layout, the handle, the
    expert output, the received rows and (across nodes) the RDMA tokens of DeepEP's count: the sum of
    num_tokens_per_rdma_rank, a token once per node it reaches. With pool_input the expert output is
    written into a tensor from buf.get_combine_input (the pull combine), as an expert GEMM with out= does."""
    from ..ep import fp8
    node_size = ranks_per_node or sync.world_size
    xs, topks, ws = gather_inputs(inp, sync)
    lay = buf.get_dispatch_layout(inp.topk_idx, inp.num_experts)
    n_tok, n_exp, in_rank = lay[0], lay[2], lay[3]
    problems: List[str] = check_layout(lay, inp.topk_idx, inp.num_experts, sync.world_size, node_size)
    counts = dict(num_tokens_per_rank=n_tok, num_tokens_per_rdma_rank=lay[1], is_token_in_rank=in_rank,
                  num_tokens_per_expert=n_exp)
    out = buf.dispatch(inp.x, topk_idx=inp.topk_idx, topk_weights=inp.topk_weights, **counts)
    sync.device_wait("guard: BF16 dispatch")
    handle = out[4]
    exp = expected(rank, xs, topks, ws, inp.num_experts, int(handle.num_channels), ranks_per_node=node_size)
    got = {"recv_x": out[0], "recv_topk_idx": out[1], "recv_topk_weights": out[2], "counts": out[3], "handle": handle}
    problems += [f"BF16 dispatch {p}" for p in check_dispatch(got, exp)]
    q_out = buf.dispatch(inp.x_fp8, topk_idx=inp.topk_idx, topk_weights=inp.topk_weights, **counts)
    sync.device_wait("guard: FP8 dispatch")
    want_q = fp8.quantize_fp8(exp.recv_x)
    got_q = {"recv_x": q_out[0], "recv_topk_idx": q_out[1], "recv_topk_weights": q_out[2], "counts": q_out[3],
             "handle": q_out[4]}
    problems += [f"FP8 dispatch {p}" for p in check_dispatch(got_q, exp, fp8=want_q)]
    cached = buf.dispatch(inp.x, handle=handle)
    sync.device_wait("guard: cached dispatch")
    problems += [f"cached dispatch {p}" for p in check_dispatch({"recv_x": cached[0]}, exp, cached=True)]
    expert_out = expert_output(out[0], rank) if not isinstance(out[0], tuple) else None
    if expert_out is None:
        problems.append("BF16 dispatch returned a tuple")
        expert_out = expert_output(exp.recv_x, rank)
    if pool_input:
        expert_out = buf.get_combine_input(handle).copy_(expert_out)
    comb_x, comb_w, _ = buf.combine(expert_out, handle, topk_weights=out[2])
    sync.device_wait("guard: combine")
    problems += [f"combine {p}" for p in check_combine(comb_x, comb_w, exp)]
    num_recv = int(exp.recv_x.shape[0])
    if problems:
        for p in problems:
            log.error("normal-mode guard, rank %d: %s", rank, p)
        detail = f"rank {rank}: " + "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
        check = CheckResult(False, detail, exact_fraction=0.0)
    else:
        check = CheckResult(True, "layout, BF16/FP8/cached dispatch and combine (+weights) bitwise equal "
                                  "to the contract oracle", max_abs_diff=0.0, exact_fraction=1.0)
    rdma = per_node(layout(inp.topk_idx, inp.num_experts, sync.world_size)[2], node_size)
    reuse = {"counts": counts, "handle": handle, "expert_out": expert_out, "recv_topk_weights": out[2],
             "num_recv_tokens": num_recv, "num_rdma_tokens": int(rdma.sum()) if rdma is not None else 0}
    return check, reuse
