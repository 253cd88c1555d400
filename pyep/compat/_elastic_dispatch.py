"""ElasticBuffer.dispatch, fresh and cached, on pyep's NormalBuffer (see pyep.compat.elastic)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ..ep.normal.buffer import NormalBuffer
from ..ep.normal.limits import MAX_TOPK
from . import _elastic_layout as lay
from ._elastic_handle import EPHandle, check_count, check_stats

if TYPE_CHECKING:
    import torch

    from .elastic import ElasticBuffer

Result = Tuple[Any, Optional["torch.Tensor"], Optional["torch.Tensor"], EPHandle, Any]


def _tensors(x: Any) -> List[Any]:
    return list(x) if isinstance(x, tuple) else [x]


def _recv_x(recv: Any, sf: Optional["torch.Tensor"], col_major: bool) -> Tuple["torch.Tensor", Any]:
    """(data, scale factors in the caller's dtype and layout, or None) from pyep's received x."""
    if sf is None:
        return recv, None
    data, packs = recv
    return data, lay.unpack_scales(packs, sf, col_major)


def _expand(data: "torch.Tensor", scales: Optional["torch.Tensor"], weights: Optional["torch.Tensor"],
            slots: "torch.Tensor", capacity: int, zero: bool, col_major: bool
            ) -> Tuple[Any, Optional["torch.Tensor"]]:
    x_out = lay.expand_rows(data, slots, capacity, zero)
    if scales is not None:
        sf_out = lay.expand_rows(scales.contiguous(), slots, capacity, zero)
        x_out = (x_out, lay.unpack_scales(sf_out, sf_out, col_major) if col_major else sf_out)
    w_out = lay.expand_values(weights, slots, capacity) if weights is not None else None
    return x_out, w_out


def fresh_dispatch(buf: "ElasticBuffer", nb: NormalBuffer, data: "torch.Tensor", sf: Optional["torch.Tensor"],
                   topk_idx: Any, topk_weights: Any, stats: Any, num_experts: Any, num_max_tokens_per_rank: Any,
                   expert_alignment: Any, num_sms: int, events: List[Any], copy_topk: bool, cpu_sync: bool,
                   flags: Dict[str, bool]) -> Result:
    import torch
    if topk_idx is None:
        raise ValueError("dispatch without a handle needs topk_idx")
    if num_experts is None:
        raise ValueError("dispatch without a handle needs num_experts")
    check_count("num_experts", num_experts, 1)
    if num_experts % buf.num_ranks:
        raise ValueError(f"num_experts={num_experts} must be a multiple of the {buf.num_ranks} ranks")
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
        raise TypeError(f"topk_idx must be a torch.Tensor [num_tokens, num_topk], got "
                        f"{getattr(topk_idx, 'shape', type(topk_idx).__name__)}")
    n, k = (int(v) for v in topk_idx.shape)
    t_max = buf.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
    check_count("num_max_tokens_per_rank", t_max, 1)
    if n > t_max:
        raise ValueError(f"x has {n} tokens but num_max_tokens_per_rank is {t_max} (the bound every rank shares)")
    alignment = check_count("expert_alignment", 1 if expert_alignment is None else expert_alignment, 1)
    e_l = num_experts // buf.num_ranks
    if stats is not None:
        check_stats(stats, e_l, nb.device)
    async_, expand = flags["async_"], flags["expand"]
    config = buf._config(num_sms, num_experts, k, combine=False)
    # The shim reads the caller's tensors (scale packs, weights) before pyep's calls.
    buf._pre_wait(nb, events)
    x_in: Any = data if sf is None else (data, lay.pack_scales(sf, int(data.shape[1])))
    weights = topk_weights if topk_weights is not None else torch.zeros((n, k), dtype=torch.float32,
                                                                       device=topk_idx.device)
    prev = buf._after_pre(events, async_)
    ntpr, ntprr, ntpe, in_rank, lev = nb.get_dispatch_layout(topk_idx, num_experts, prev, async_,
                                                             flags["alloc"] and async_ and prev is not None)
    worst = 0 if cpu_sync else t_max * buf.num_ranks
    recv, ridx, rw, counts_list, nh, nev = nb.dispatch(
        x_in, None, ntpr, ntprr, in_rank, ntpe, topk_idx, weights, alignment, worst, config,
        lev if async_ else None, async_, flags["alloc"] and async_)
    with buf._on(nb, async_):
        rows_data, scales = _recv_x(recv, sf, flags["col_major"] and not expand)
        counts = lay.expert_counts(ridx, e_l)
        rpm = nh.rank_prefix_matrix
        psum_up = lay.scaleup_prefix(rpm, buf.rank_idx, buf.num_scaleout_ranks, buf.num_scaleup_ranks)
        w_rows = rw if topk_weights is not None else None
        if expand:
            slots, psum_e = lay.expand_slots(ridx, counts, alignment)
            rows = int(ridx.shape[0])
            # Without the host's counts: every received (row, k) entry, plus each expert's padding.
            capacity = sum(counts_list) if cpu_sync else rows * k + e_l * (alignment - 1)
            out_x, out_w = _expand(rows_data, scales, w_rows, slots, capacity, flags["zero"], flags["col_major"])
            out_idx, kept_idx = None, ridx
        else:
            slots, psum_e, capacity = None, lay.aligned_prefix(counts, alignment), 0
            out_x = rows_data if scales is None else (rows_data, scales)
            # The caller may rewrite recv_topk_idx in place (vLLM makes the ids global): keep a copy.
            out_idx, out_w, kept_idx = ridx, w_rows, ridx.clone()
        meta = lay.src_metadata(rpm, buf.rank_idx, nh.recv_src_idx, ridx, t_max, slots)
        dst = lay.dst_slots(in_rank, rpm, buf.rank_idx)
        if stats is not None:
            stats.add_(counts)
    rows = int(ridx.shape[0])
    handle = EPHandle(
        do_expand=expand, num_experts=num_experts, expert_alignment=alignment, num_max_tokens_per_rank=t_max,
        num_sms=config.num_sms, topk_idx=topk_idx.clone() if copy_topk else topk_idx,
        num_recv_tokens=nh.num_recv_tokens if cpu_sync else rows,
        num_expanded_tokens=capacity, num_recv_tokens_per_expert_list=list(counts_list),
        psum_num_recv_tokens_per_scaleup_rank=psum_up, psum_num_recv_tokens_per_expert=psum_e,
        num_unaligned_recv_tokens_per_expert=counts, recv_src_metadata=meta, dst_buffer_slot_idx=dst,
        normal=nh, recv_topk_idx=kept_idx, slots=slots, expand_capacity=capacity, owner=buf._owner)
    outs = [out_idx, out_w, meta, dst, psum_up, psum_e, counts, kept_idx, slots] + _tensors(out_x)
    event = buf._event(nb, async_, nev.wait, outs, [stats] + _tensors(recv))
    return out_x, out_idx, out_w, handle, event


def cached_dispatch(buf: "ElasticBuffer", nb: NormalBuffer, data: "torch.Tensor", sf: Optional["torch.Tensor"],
                    topk_idx: Any, topk_weights: Any, stats: Any, num_experts: Any, num_max_tokens_per_rank: Any,
                    expert_alignment: Any, events: List[Any], handle: Any, do_cpu_sync: Any,
                    flags: Dict[str, bool]) -> Result:
    import torch
    hd = buf._own(handle, "dispatch")
    if topk_idx is not None:
        raise ValueError("cached dispatch (handle given) reuses the handle's topk_idx: pass topk_idx=None")
    if do_cpu_sync:
        raise ValueError("cached dispatch cannot do a CPU sync (as DeepEP V2): pass do_cpu_sync=None or False")
    for name, given, own in (("num_experts", num_experts, hd.num_experts),
                             ("num_max_tokens_per_rank", num_max_tokens_per_rank, hd.num_max_tokens_per_rank),
                             ("expert_alignment", expert_alignment, hd.expert_alignment)):
        if given is not None and given != own:
            raise ValueError(f"cached dispatch: {name}={given} differs from the handle's {own}")
    if flags["expand"] != hd.do_expand:
        raise ValueError(f"cached dispatch: do_expand={flags['expand']} differs from the handle's {hd.do_expand}")
    k = hd.num_topk
    if topk_weights is not None:
        if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32 \
                or tuple(topk_weights.shape) != (hd.normal.num_tokens, k):
            raise ValueError(f"cached dispatch: topk_weights must be fp32 [{hd.normal.num_tokens}, {k}], got "
                             f"{getattr(topk_weights, 'dtype', type(topk_weights).__name__)} "
                             f"{list(getattr(topk_weights, 'shape', []))}")
        if k > MAX_TOPK:
            raise ValueError(f"cached dispatch carries at most {MAX_TOPK} weights a token, the handle has {k}")
    if stats is not None:
        check_stats(stats, hd.num_experts // buf.num_ranks, nb.device)
    async_ = flags["async_"]
    buf._pre_wait(nb, events)
    x_in: Any = data if sf is None else (data, lay.pack_scales(sf, int(data.shape[1])))
    # pyep's cached dispatch moves rows only: the weights ride in a second one, as bf16 bits.
    packed_w = lay.pack_weights(topk_weights) if topk_weights is not None else None
    prev = buf._after_pre(events, async_)
    alloc = flags["alloc"] and async_ and prev is not None
    recv, _, _, _, _, nev = nb.dispatch(x_in, hd.normal, previous_event=prev, async_finish=async_,
                                        allocate_on_comm_stream=alloc)
    wrecv = None
    if packed_w is not None:
        wrecv, _, _, _, _, nev = nb.dispatch(packed_w, hd.normal,
                                             previous_event=nev if async_ else None, async_finish=async_,
                                             allocate_on_comm_stream=flags["alloc"] and async_)
    with buf._on(nb, async_):
        rows_data, scales = _recv_x(recv, sf, flags["col_major"] and not hd.do_expand)
        w_rows = lay.unpack_weights(wrecv, k, hd.recv_topk_idx) if wrecv is not None else None
        if hd.do_expand:
            out_x, out_w = _expand(rows_data, scales, w_rows, hd.slots, hd.expand_capacity, flags["zero"],
                                   flags["col_major"])
            out_idx = None
        else:
            out_x = rows_data if scales is None else (rows_data, scales)
            out_idx, out_w = hd.recv_topk_idx.clone(), w_rows
        if stats is not None:
            stats.add_(hd.num_unaligned_recv_tokens_per_expert)
    outs = [out_idx, out_w] + _tensors(out_x)
    event = buf._event(nb, async_, nev.wait, outs, [stats, wrecv] + _tensors(recv))
    return out_x, out_idx, out_w, hd, event
