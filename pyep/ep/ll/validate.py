"""Argument checks of the low-latency mode. EpBuffer runs them before any communication or kernel
launch, so a rejected call changes no state (the generic checks are pyep.ep.validate).

Nothing here reads tensor values (a device sync on GPU) except strict mode (check_values="strict"):
by default the expert ids are checked by the dispatch kernel and reported later (pyep.ep.ll.errors)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Tuple

from .config import MAX_TIMEOUT_US, EpConfig
from ..validate import check_bool, check_tensor, check_timeout as _check_timeout
from .handle import Handle

if TYPE_CHECKING:
    import torch


def check_timeout(name: str, value: Any, default: int) -> int:
    """pyep.ep.validate.check_timeout, bounded by MAX_TIMEOUT_US (a wait the kernels carry in ns)."""
    timeout = _check_timeout(name, value, default)
    if timeout > MAX_TIMEOUT_US:
        raise ValueError(f"{name} must be at most {MAX_TIMEOUT_US} microseconds (an hour), got {timeout}")
    return timeout


def _capturing(t: "torch.Tensor") -> bool:
    import torch
    return bool(t.is_cuda and torch.cuda.is_current_stream_capturing())


def find_bad_entry(topk_idx: "torch.Tensor", num_experts: int) -> Optional[Tuple[int, int, int, int]]:
    """The first (row-major) entry of topk_idx the kernels treat as an error: an id outside [-1, E),
    or an expert an earlier slot of the same row names. Returns (row, k, value, earlier slot or -1),
    or None. Reads topk_idx on the host (strict mode and the reference backend only)."""
    bad = bad_entry_mask(topk_idx, num_experts)
    hit = bad.reshape(-1).nonzero()
    if hit.numel() == 0:
        return None
    k_n = topk_idx.shape[1]
    pos = int(hit[0])
    row, k = divmod(pos, k_n)
    vals = topk_idx[row].tolist()
    value = int(vals[k])
    first_k = vals.index(value) if 0 <= value < num_experts and vals.index(value) < k else -1
    return row, k, value, first_k


def bad_entry_mask(topk_idx: "torch.Tensor", num_experts: int) -> "torch.Tensor":
    """bool [N, K]: entries the kernels treat as -1 although they are not -1 (the definition of the
    device-side check: out of [-1, E), or a repeat of an earlier slot's expert in the same row)."""
    import torch
    out_of_range = (topk_idx < -1) | (topk_idx >= num_experts)
    k_n = topk_idx.shape[1]
    same = topk_idx.unsqueeze(2) == topk_idx.unsqueeze(1)            # [N, k, j]
    earlier = torch.ones(k_n, k_n, dtype=torch.bool, device=topk_idx.device).tril(-1)
    dup = (same & earlier).any(dim=2) & (topk_idx >= 0) & ~out_of_range
    return out_of_range | dup


def sanitize_topk(topk_idx: "torch.Tensor", num_experts: int) -> "torch.Tensor":
    """topk_idx with every entry the kernels treat as an error replaced by -1 (what they route)."""
    import torch
    return torch.where(bad_entry_mask(topk_idx, num_experts), torch.full_like(topk_idx, -1), topk_idx)


def check_topk_values(name: str, topk_idx: "torch.Tensor", num_experts: int) -> None:
    """Strict mode (check_values="strict"): every entry in [-1, E) and no expert twice in one row,
    checked on the host before launch (one device sync), raising the errors the device check reports
    later in the default mode (pyep.ep.ll.errors)."""
    if topk_idx.numel() == 0 or _capturing(topk_idx):
        return
    found = find_bad_entry(topk_idx, num_experts)
    if found is not None:
        from .errors import ERR_EXPERT_DUPLICATE, ERR_EXPERT_RANGE, make_error
        row, k, value, first_k = found
        code = ERR_EXPERT_DUPLICATE if first_k >= 0 else ERR_EXPERT_RANGE
        err = make_error(code, row, k, value, first_k, num_experts)
        assert err is not None
        raise err


def check_active_ranks(active_ranks: Any, num_ranks: int, device: "torch.device") -> None:
    import torch
    if active_ranks is None:
        return
    check_tensor("active_ranks", active_ranks, dtype=torch.int32, shape=(num_ranks,), device=device)


def check_wait_stats(name: str, stats: Any, num_ranks: int, device: "torch.device") -> None:
    """*_wait_recv_cost_stats: the caller's int64 [R] that a call adds each source's receive wait to
    (nanoseconds; docs/ll_kernels.md)."""
    import torch
    if stats is not None:
        check_tensor(name, stats, dtype=torch.int64, shape=(num_ranks,), device=device)


def validate_dispatch(cfg: EpConfig, num_ranks: int, device: "torch.device", x: Any, topk_idx: Any, *,
                      use_fp8: Any, round_scale: Any, use_ue8m0: Any, active_ranks: Any,
                      timeout_us: Any, async_finish: Any, return_recv_hook: Any,
                      cumulative_local_expert_recv_stats: Any, dispatch_wait_recv_cost_stats: Any = None) -> int:
    """Checks a dispatch call; returns the timeout to use (microseconds)."""
    import torch
    t_max, h, e = cfg.num_max_dispatch_tokens_per_rank, cfg.hidden, cfg.num_experts
    for name, flag in (("use_fp8", use_fp8), ("round_scale", round_scale), ("use_ue8m0", use_ue8m0),
                       ("async_finish", async_finish), ("return_recv_hook", return_recv_hook)):
        check_bool(name, flag)
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0=True requires round_scale=True (UE8M0 stores power-of-two scales)")
    if (round_scale or use_ue8m0) and not use_fp8:
        raise ValueError("round_scale/use_ue8m0 only apply to FP8 dispatch: pass use_fp8=True")
    if async_finish and return_recv_hook:
        raise ValueError("async_finish and return_recv_hook are exclusive: with a hook the receive "
                         "half runs when you call it, there is nothing left to wait for")
    check_tensor("x", x, dtype=torch.bfloat16, shape=(None, h), device=device)
    n = x.shape[0]
    if n > t_max:
        raise ValueError(f"x has {n} tokens, more than num_max_dispatch_tokens_per_rank={t_max}")
    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must have shape [{n}, K], got {list(topk_idx.shape)}")
    k = topk_idx.shape[1]
    if not 1 <= k <= cfg.max_topk:
        raise ValueError(f"topk_idx has K={k} columns; K must be in [1, {cfg.max_topk}]")
    check_tensor("topk_idx", topk_idx, dtype=torch.int64, shape=(n, k), device=device)
    check_active_ranks(active_ranks, num_ranks, device)
    if cumulative_local_expert_recv_stats is not None:
        check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                     dtype=torch.int32, shape=(e // num_ranks,), device=device)
    check_wait_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, num_ranks, device)
    timeout = check_timeout("timeout_us", timeout_us, cfg.timeout_us)
    if cfg.check_values == "strict":
        check_topk_values("topk_idx", topk_idx, e)
    return timeout


def validate_handle(handle: Any, cfg: EpConfig, num_ranks: int, *, owner: str, epoch: int,
                    last_seq: int) -> Handle:
    if not isinstance(handle, Handle):
        raise TypeError(f"handle must be the pyep Handle returned by dispatch, got "
                        f"{type(handle).__name__}")
    if handle.owner != owner:
        raise ValueError("handle was issued by another EpBuffer (each buffer's combine needs the "
                         "handle of its own dispatch)")
    if handle.epoch != epoch:
        raise ValueError(f"handle is stale: it predates update_ep_member()/clean() (handle epoch "
                         f"{handle.epoch}, buffer epoch {epoch})")
    if handle.seq < last_seq - 1:
        raise ValueError(f"handle is stale: it belongs to dispatch #{handle.seq} whose buffer half "
                         f"was reused by dispatch #{handle.seq + 2}; at most two dispatch results may "
                         f"be in flight (latest dispatch is #{last_seq})")
    shape = (handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts, handle.num_ranks)
    want = (cfg.num_max_dispatch_tokens_per_rank, cfg.hidden, cfg.num_experts, num_ranks)
    if shape != want:
        raise ValueError(f"handle shape (T, H, E, R)={shape} does not match this buffer's {want}")
    return handle


def validate_combine(cfg: EpConfig, num_ranks: int, device: "torch.device", x: Any, topk_idx: Any,
                     topk_weights: Any, handle: Any, *, owner: str, epoch: int, last_seq: int,
                     active_ranks: Any, timeout_us: Any, zero_copy: Any, async_finish: Any,
                     return_recv_hook: Any, out: Any, use_logfmt: Any = False,
                     combine_wait_recv_cost_stats: Any = None) -> Tuple[Handle, int]:
    """Checks a combine call; returns (handle, timeout in microseconds)."""
    import torch
    for name, flag in (("zero_copy", zero_copy), ("async_finish", async_finish),
                       ("return_recv_hook", return_recv_hook), ("use_logfmt", use_logfmt)):
        check_bool(name, flag)
    if use_logfmt and cfg.hidden % 512:
        raise ValueError(f"use_logfmt=True needs hidden to be a multiple of 512 (LogFMT packs 512 channels "
                         f"per warp round), got {cfg.hidden}")
    if async_finish and return_recv_hook:
        raise ValueError("async_finish and return_recv_hook are exclusive")
    h = validate_handle(handle, cfg, num_ranks, owner=owner, epoch=epoch, last_seq=last_seq)
    e_l = cfg.num_experts // num_ranks
    rows = num_ranks * cfg.num_max_dispatch_tokens_per_rank
    check_tensor("x", x, dtype=torch.bfloat16, shape=(e_l, rows, cfg.hidden), device=device)
    n, k = h.num_tokens, h.num_topk
    check_tensor("topk_idx", topk_idx, dtype=torch.int64, shape=(n, k), device=device)
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(n, k), device=device)
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(n, cfg.hidden), device=device)
    check_active_ranks(active_ranks, num_ranks, device)
    check_wait_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, num_ranks, device)
    timeout = check_timeout("timeout_us", timeout_us, cfg.timeout_us)
    if cfg.check_values == "strict":
        check_topk_values("topk_idx", topk_idx, cfg.num_experts)
    return h, timeout
