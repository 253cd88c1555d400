"""The reference backend's checks of tensor values, in torch (the kernels make the same checks on the
device): top-k ids outside [-1, E), and layout tensors that contradict topk_idx. Each source rank
reduces its finding to a fixed record that travels in the call's exchange, so every rank sees every
source's record and raises the same error at the same call."""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

from .errors import ERR_EXPERT_COUNT, ERR_IN_RANK, InvalidExpertIndex, NormalModeError, error_from_record

if TYPE_CHECKING:
    import torch

ERR_WORDS = 4   # a record: [has_error / code, a, b, c]


def first_bad_entry(topk_idx: "torch.Tensor", num_experts: int) -> List[int]:
    """[1, row, k, value] of the first (row-major) entry outside [-1, E), or [0, 0, 0, 0]."""
    bad = ((topk_idx < -1) | (topk_idx >= num_experts)).nonzero()
    if bad.shape[0] == 0:
        return [0, 0, 0, 0]
    row, k = (int(v) for v in bad[0])
    return [1, row, k, int(topk_idx[row, k])]


def layout_contradiction(topk_idx: Optional["torch.Tensor"], num_experts: int, num_ranks: int,
                         is_token_in_rank: "torch.Tensor", num_tokens_per_expert: "torch.Tensor",
                         active: Optional["torch.Tensor"] = None) -> List[int]:
    """The first contradiction between the caller's layout tensors and topk_idx, as an error record
    (errors.ERR_IN_RANK / ERR_EXPERT_COUNT), or zeros: a negative count first, then is_token_in_rank
    (row-major), then num_tokens_per_expert (lowest expert). Without topk_idx only the signs can be
    checked. Ids outside [-1, E) count as -1 (they are reported by first_bad_entry). `active` (bool [R]):
    only the columns and experts of active ranks are compared (a layout made with an older mask may
    still name a rank marked since, or leave it out: either way the call drops its tokens)."""
    import torch
    per_expert = num_tokens_per_expert.to(torch.int64)
    neg = (per_expert < 0).nonzero()
    if neg.shape[0]:
        e = int(neg[0])
        return [ERR_EXPERT_COUNT, e, int(per_expert[e]), -1]
    if topk_idx is None:
        return [0, 0, 0, 0]
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    owner = torch.div(torch.where(valid, topk_idx, torch.zeros_like(topk_idx)), num_experts // num_ranks,
                      rounding_mode="floor")
    derived_in = torch.stack([(valid & (owner == r)).any(dim=1) for r in range(num_ranks)], dim=1) \
        if topk_idx.shape[0] else torch.zeros_like(is_token_in_rank)
    cols = active.view(1, -1) if active is not None else torch.ones_like(is_token_in_rank[:1])
    diff = ((derived_in != is_token_in_rank) & cols).nonzero()
    if diff.shape[0]:
        t, r = (int(v) for v in diff[0])
        return [ERR_IN_RANK, t, r, int(is_token_in_rank[t, r])]
    derived = torch.bincount(topk_idx[valid], minlength=num_experts)
    live_e = (active.repeat_interleave(num_experts // num_ranks) if active is not None
              else torch.ones_like(derived, dtype=torch.bool))
    diff_e = ((derived != per_expert) & live_e).nonzero()
    if diff_e.shape[0]:
        e = int(diff_e[0])
        return [ERR_EXPERT_COUNT, e, int(per_expert[e]), int(derived[e])]
    return [0, 0, 0, 0]


def raise_first(records: "torch.Tensor", me: int, num_experts: int, bad_ids: bool) -> None:
    """records int64 [R, ERR_WORDS], one per source rank (every rank holds the same table). Raise on
    every rank when any source has one: this rank's own record if it has one, else the lowest offending
    rank's (with a note naming it). bad_ids: the records are first_bad_entry's, else error records."""
    flagged = [r for r in range(records.shape[0]) if int(records[r, 0])]
    if not flagged:
        return
    src = me if me in flagged else flagged[0]
    words = [int(v) for v in records[src]]
    err: Optional[NormalModeError]
    if bad_ids:
        err = InvalidExpertIndex(words[1], words[2], words[3], num_experts)
    else:
        err = error_from_record(words, num_experts, 0)
    assert err is not None
    err.add_note(f"in the tensors of rank {src} (ranks with this kind of error: {flagged}); every rank raises "
                 f"at this call")
    raise err
