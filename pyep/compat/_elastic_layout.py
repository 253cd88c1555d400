"""DeepEP V2's dispatch outputs derived from pyep's normal-mode results, on the device only.

pyep's normal dispatch gives the received rows in (source rank, token) order, their local top-k ids
(-1 where the expert is not here, and on padding rows) and the handle's prefix matrices. From those
these functions make what DeepEP V2's `ElasticBuffer.dispatch` and `EPHandle` hold: per-expert and
per-scale-up-rank prefix sums, the source metadata, the expanded (one row per token and local expert)
layout, and where each sent token landed. None of them reads a value on the host (no .item(),
.tolist(), boolean-mask indexing or data-dependent shapes), so a dispatch with do_cpu_sync=False
stays free of host waits and capturable in a CUDA graph; tests/test_compat_elastic.py checks that by
running them under a dispatch mode that refuses host reads.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:
    import torch

__all__ = ["expert_counts", "aligned_prefix", "scaleup_prefix", "src_metadata", "expand_slots", "expand_rows",
           "expand_values", "fold_rows", "reduce_expanded", "dst_slots", "pack_scales", "unpack_scales", "pack_weights",
           "unpack_weights"]


def _align(t: "torch.Tensor", a: int) -> "torch.Tensor":
    return (t + (a - 1)) // a * a


def expert_counts(recv_topk_idx: "torch.Tensor", num_local_experts: int) -> "torch.Tensor":
    """int32 [E_l]: received (token, k) entries per local expert (padding rows carry -1)."""
    import torch
    flat = recv_topk_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_local_experts))
    hist = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=flat.device)
    hist.index_add_(0, key, torch.ones_like(key))
    return hist[:num_local_experts].to(torch.int32)


def aligned_prefix(counts: "torch.Tensor", alignment: int) -> "torch.Tensor":
    """int32 [E_l]: inclusive prefix sum of the counts, each rounded up to the alignment."""
    import torch
    return _align(counts.to(torch.int64), alignment).cumsum(0).to(torch.int32)


def scaleup_prefix(rank_prefix_matrix: "torch.Tensor", rank: int, num_scaleout: int, num_scaleup: int
                   ) -> "torch.Tensor":
    """int32 [num_scaleup]: inclusive prefix sum of the rows received from the sources of each
    scale-up index (source s counts for s % num_scaleup, over every scale-out domain)."""
    import torch
    col = rank_prefix_matrix[:, rank].to(torch.int64)
    per_source = col - torch.cat([col.new_zeros(1), col[:-1]])
    return per_source.view(num_scaleout, num_scaleup).sum(0).cumsum(0).to(torch.int32)


def src_metadata(rank_prefix_matrix: "torch.Tensor", rank: int, recv_src_idx: "torch.Tensor",
                 recv_topk_idx: "torch.Tensor", num_max_tokens_per_rank: int,
                 slots: Optional["torch.Tensor"] = None) -> "torch.Tensor":
    """int32 [rows, 2 + K]: (source rank * num_max_tokens_per_rank + source token index, the row in the
    non-expanded output, then per top-k entry where that (token, expert) sits in recv_x: the expanded
    slot with `slots`, else the row itself), -1 on padding rows and for experts not here."""
    import torch
    ends = rank_prefix_matrix[:, rank].to(torch.int64)
    rows = recv_src_idx.shape[0]
    r = torch.arange(rows, device=ends.device, dtype=torch.int64)
    src = torch.searchsorted(ends, r, right=True)
    real = r < ends[-1]
    gidx = torch.where(real, src * num_max_tokens_per_rank + recv_src_idx.to(torch.int64), torch.full_like(r, -1))
    row = torch.where(real, r, torch.full_like(r, -1))
    if slots is None:
        local = recv_topk_idx >= 0
        slots = torch.where(local, r.unsqueeze(1).expand_as(recv_topk_idx), torch.full_like(recv_topk_idx, -1))
    return torch.cat([gidx.unsqueeze(1), row.unsqueeze(1), slots.to(torch.int64)], dim=1).to(torch.int32)


def expand_slots(recv_topk_idx: "torch.Tensor", counts: "torch.Tensor", alignment: int
                 ) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """The expanded layout: local expert e's rows start at the aligned sum of the experts before it,
    in received-row order. Returns (int64 [rows, K] slot of every (row, k), -1 where the expert is
    not here; int32 [E_l] psum: expert e's start plus its real count, DeepEP V2's expand-mode
    psum_num_recv_tokens_per_expert)."""
    import torch
    e_l = counts.shape[0]
    c64 = counts.to(torch.int64)
    aligned = _align(c64, alignment)
    start = aligned.cumsum(0) - aligned                       # [E_l] aligned start of each expert
    first = c64.cumsum(0) - c64                               # [E_l] first sorted position of each expert
    flat = recv_topk_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, e_l))
    sorted_key, perm = torch.sort(key, stable=True)
    pos = torch.arange(flat.shape[0], device=flat.device, dtype=torch.int64)
    safe = sorted_key.clamp(max=e_l - 1)
    slot_sorted = torch.where(sorted_key < e_l, start[safe] + pos - first[safe], torch.full_like(pos, -1))
    slots = torch.empty_like(slot_sorted).scatter_(0, perm, slot_sorted)
    return slots.view_as(recv_topk_idx), (start + c64).to(torch.int32)


def expand_rows(src: "torch.Tensor", slots: "torch.Tensor", capacity: int, zero: bool) -> "torch.Tensor":
    """[capacity, ...]: row r of src copied to every slot of row r (slots [rows, K], -1 skipped).
    zero: padding rows are 0, else unspecified (as DeepEP V2 without do_zero_padding)."""
    import torch
    # Copied as same-width integers: bit for bit, and index_copy_ has no FP8 kernel on every device.
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[src.element_size()]
    shape = (capacity + 1,) + tuple(src.shape[1:])         # + one row that takes the skipped entries
    out = (torch.zeros if zero else torch.empty)(shape, dtype=bits, device=src.device)
    dst = torch.where(slots >= 0, slots, torch.full_like(slots, capacity))
    raw = src.contiguous().view(bits)
    for k in range(slots.shape[1]):
        out.index_copy_(0, dst[:, k], raw)
    return out[:capacity].view(src.dtype)


def fold_rows(src: "torch.Tensor", slots: "torch.Tensor") -> "torch.Tensor":
    """[rows, K]: value of src (1-D, per expanded slot) at each (row, k) slot, 0 where slot is -1."""
    import torch
    safe = slots.clamp(min=0)
    return torch.where(slots >= 0, src[safe], torch.zeros((), dtype=src.dtype, device=src.device))


def reduce_expanded(x: "torch.Tensor", slots: "torch.Tensor") -> "torch.Tensor":
    """bf16 [rows, H]: per received row, 0 + x[slot_k] for its valid slots in k order, in fp32, rounded
    once -- the rank's partial DeepEP V2 reduces before sending it back."""
    import torch
    rows = slots.shape[0]
    acc = torch.zeros((rows, x.shape[1]), dtype=torch.float32, device=x.device)
    safe = slots.clamp(min=0)
    for k in range(slots.shape[1]):
        acc += torch.where((slots[:, k] >= 0).unsqueeze(1), x[safe[:, k]].float(),
                           torch.zeros((), dtype=torch.float32, device=x.device))
    return acc.to(torch.bfloat16)


def dst_slots(is_token_in_rank: "torch.Tensor", rank_prefix_matrix: "torch.Tensor", rank: int) -> "torch.Tensor":
    """int32 [N, R]: the row at destination d where this rank's token t landed, -1 if not sent there."""
    import torch
    sel = is_token_in_rank.to(torch.int64)
    if rank > 0:
        base = rank_prefix_matrix[rank - 1].to(torch.int64)
    else:
        base = torch.zeros(rank_prefix_matrix.shape[1], dtype=torch.int64, device=sel.device)
    pos = sel.cumsum(0) - 1 + base.unsqueeze(0)
    return torch.where(is_token_in_rank, pos, torch.full_like(pos, -1)).to(torch.int32)


def pack_scales(sf: "torch.Tensor", hidden: int) -> "torch.Tensor":
    """DeepEP V2's scale factors are opaque 4-byte packs [N, S] (fp32, or int32 of four UE8M0 bytes),
    S <= hidden / 128; pyep moves fp32 [N, hidden / 128] bit for bit. Same bits, padded with zeros."""
    import torch
    want = hidden // 128
    if sf.dim() != 2 or sf.element_size() != 4 or sf.dtype not in (torch.float32, torch.int32):
        raise ValueError(f"scale factors must be fp32 or int32 packs [N, S], got {sf.dtype} {list(sf.shape)}")
    if sf.shape[1] > want:
        raise ValueError(f"scale factors have {sf.shape[1]} packs a token; pyep carries at most hidden / 128 = "
                         f"{want}")
    packs = sf if sf.dtype == torch.float32 else sf.view(torch.float32)
    if packs.shape[1] == want:
        return packs
    out = torch.zeros((packs.shape[0], want), dtype=torch.float32, device=packs.device)
    out[:, :packs.shape[1]] = packs
    return out


def unpack_scales(recv: "torch.Tensor", like: "torch.Tensor", col_major: bool) -> "torch.Tensor":
    """The received packs in the caller's dtype and width; col_major: DeepEP V2's TMA-aligned
    column-major layout (storage [S, rows rounded up to 4], viewed [rows, S])."""
    import torch
    packs = recv[:, :like.shape[1]]
    if like.dtype != torch.float32:
        packs = packs.contiguous().view(like.dtype)
    if not col_major:
        return packs.contiguous()
    rows, s = packs.shape
    store = torch.empty((s, (rows + 3) // 4 * 4), dtype=packs.dtype, device=packs.device)
    out = store[:, :rows].t()
    out.copy_(packs)
    return out


def pack_weights(topk_weights: "torch.Tensor") -> "torch.Tensor":
    """fp32 [N, K] as bf16 [N, 128] bit for bit (K <= 64), a row a cached dispatch can carry."""
    import torch
    n, k = topk_weights.shape
    out = torch.zeros((n, 128), dtype=torch.bfloat16, device=topk_weights.device)
    out[:, :2 * k] = topk_weights.contiguous().view(torch.bfloat16)
    return out


def unpack_weights(recv: "torch.Tensor", num_topk: int, recv_topk_idx: "torch.Tensor") -> "torch.Tensor":
    """The weights pack_weights sent, 0 where the expert is not here (as a dispatch gives them)."""
    import torch
    w = recv[:, :2 * num_topk].contiguous().view(torch.float32)
    return torch.where(recv_topk_idx >= 0, w, torch.zeros((), dtype=torch.float32, device=w.device))


def expand_values(values: "torch.Tensor", slots: "torch.Tensor", capacity: int) -> "torch.Tensor":
    """1-D [capacity]: values[r, k] at slot [r, k] (slots -1 skipped), 0 elsewhere."""
    import torch
    out = torch.zeros(capacity + 1, dtype=values.dtype, device=values.device)
    dst = torch.where(slots >= 0, slots, torch.full_like(slots, capacity))
    out.index_copy_(0, dst.reshape(-1), values.reshape(-1))
    return out[:capacity]
