"""Routing generators: which experts each token picks (topk_idx), plus the token data and weights.

Everything is drawn on the CPU from explicit torch.Generator seeds, so a run is reproducible and the
same on every device. The popularity order of experts (zipf) and the hot expert are the same on every
rank -- a skewed load is skewed globally, as it is in a real MoE layer -- while each rank's tokens are
its own draw.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import RoutingSpec

if TYPE_CHECKING:
    import torch

# Keeps log(-log(u)) finite: u is drawn in [0, 1).
_EPS = 1e-12


@dataclass
class RoutedBatch:
    x: "torch.Tensor"             # bf16 [N, H]
    topk_idx: "torch.Tensor"      # int64 [N, K], -1 = no expert
    topk_weights: "torch.Tensor"  # fp32 [N, K], positive (also where topk_idx is -1)

    def to(self, device: "torch.device") -> "RoutedBatch":
        return RoutedBatch(self.x.to(device).contiguous(), self.topk_idx.to(device).contiguous(),
                           self.topk_weights.to(device).contiguous())

    def num_valid(self) -> int:
        return int((self.topk_idx >= 0).sum().item())


def _generator(*parts: int) -> "torch.Generator":
    import torch
    seed = 0
    for p in parts:   # a simple polynomial mix: distinct (seed, rank, T, ...) give distinct streams
        seed = (seed * 1_000_003 + int(p) + 1) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


def popularity_order(experts: int, seed: int) -> "torch.Tensor":
    """int64 [E]: expert ids from most to least popular (zipf). The same on every rank."""
    import torch
    return torch.randperm(experts, generator=_generator(seed, 0x5EED))


def zipf_probabilities(experts: int, s: float, seed: int) -> "torch.Tensor":
    """fp64 [E]: the single-draw probability of each expert id under zipf(s)."""
    import torch
    order = popularity_order(experts, seed)
    ranked = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    p = torch.empty(experts, dtype=torch.float64)
    p[order] = ranked / ranked.sum()
    return p


def _distinct_by_keys(keys: "torch.Tensor", k: int) -> "torch.Tensor":
    """The k largest keys per row: k distinct column ids per row, in random order when keys are."""
    import torch
    return torch.topk(keys, k, dim=1).indices.to(torch.int64)


def uniform_topk(n: int, experts: int, k: int, gen: "torch.Generator") -> "torch.Tensor":
    import torch
    return _distinct_by_keys(torch.rand(n, experts, generator=gen), k)


def zipf_topk(n: int, experts: int, k: int, s: float, seed: int, gen: "torch.Generator") -> "torch.Tensor":
    # Gumbel-top-k draws k experts without replacement, each next one with probability proportional
    # to its zipf weight among those left (the successive-sampling model of a skewed router).
    import torch
    logp = torch.log(zipf_probabilities(experts, s, seed)).to(torch.float32)
    u = torch.rand(n, experts, generator=gen).clamp(_EPS, 1.0 - _EPS)
    gumbel = -torch.log(-torch.log(u))
    return _distinct_by_keys(logp.unsqueeze(0) + gumbel, k)


def hot_topk(n: int, experts: int, k: int, fraction: float, hot: int,
             gen: "torch.Generator") -> "torch.Tensor":
    """round(fraction * n) tokens (a random subset) include expert `hot` in a random slot; every other
    token avoids it, so exactly that many tokens hit the hot expert."""
    import torch
    n_hot = int(round(fraction * n))
    keys = torch.rand(n, experts, generator=gen)
    keys[:, hot] = -1.0               # the hot expert is never drawn at random
    if n_hot < n and k > experts - 1:
        raise ValueError(f"hot routing: tokens that avoid the hot expert need k ({k}) <= experts - 1")
    idx = _distinct_by_keys(keys, min(k, experts - 1)) if k <= experts - 1 else None
    out = torch.empty(n, k, dtype=torch.int64)
    hot_rows = torch.randperm(n, generator=gen)[:n_hot]
    is_hot = torch.zeros(n, dtype=torch.bool)
    is_hot[hot_rows] = True
    if idx is not None:
        out[~is_hot] = idx[~is_hot]
    if n_hot:
        others = _distinct_by_keys(keys[is_hot], k - 1) if k > 1 else torch.empty(n_hot, 0, dtype=torch.int64)
        slot = torch.randint(0, k, (n_hot,), generator=gen)
        hot_part = torch.full((n_hot, k), hot, dtype=torch.int64)
        col = torch.arange(k).unsqueeze(0)
        # Slots left of the hot one take others[:, j], slots right of it others[:, j - 1].
        src = torch.where(col < slot.unsqueeze(1), col, col - 1).clamp_min(0)
        if k > 1:
            gathered = torch.gather(others, 1, src.clamp_max(k - 2))
            hot_part = torch.where(col == slot.unsqueeze(1), hot_part, gathered)
        out[is_hot] = hot_part
    return out


def drop_entries(topk_idx: "torch.Tensor", fraction: float, gen: "torch.Generator") -> "torch.Tensor":
    """Sets round(fraction * N * K) random entries to -1 (tokens that skip a slot)."""
    import torch
    n_drop = int(round(fraction * topk_idx.numel()))
    if n_drop == 0:
        return topk_idx
    flat = topk_idx.clone().reshape(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[:n_drop]] = -1
    return flat.reshape(topk_idx.shape)


def make_topk(spec: RoutingSpec, n: int, experts: int, k: int, *, seed: int, rank: int,
              hot_expert: int = 0, drop_fraction: float = 0.0) -> "torch.Tensor":
    """int64 [n, k] expert ids, distinct per token (before drops)."""
    if n < 0:
        raise ValueError(f"number of tokens must be >= 0, got {n}")
    if not 1 <= k <= experts:
        raise ValueError(f"k must be in [1, experts={experts}], got {k}")
    if not 0 <= hot_expert < experts:
        raise ValueError(f"hot_expert must be in [0, {experts}), got {hot_expert}")
    gen = _generator(seed, rank, n, _label_code(spec.label))
    if spec.kind == "uniform":
        idx = uniform_topk(n, experts, k, gen)
    elif spec.kind == "zipf":
        idx = zipf_topk(n, experts, k, spec.param, seed, gen)
    else:
        idx = hot_topk(n, experts, k, spec.param, hot_expert, gen)
    return drop_entries(idx, drop_fraction, gen)


def _label_code(label: str) -> int:
    # Python's hash() of a str is salted per process; ranks must agree, so fold the bytes instead.
    code = 0
    for b in label.encode():
        code = (code * 131 + b) % (2**31 - 1)
    return code


def make_batch(spec: RoutingSpec, n: int, hidden: int, experts: int, k: int, *, seed: int, rank: int,
               hot_expert: int = 0, drop_fraction: float = 0.0) -> RoutedBatch:
    """Tokens x ~ N(0, 1) in bf16, routing per `spec`, weights uniform in (0.05, 1]."""
    import torch
    topk_idx = make_topk(spec, n, experts, k, seed=seed, rank=rank, hot_expert=hot_expert,
                         drop_fraction=drop_fraction)
    gen = _generator(seed, rank, n, hidden, 0xDA7A)
    x = torch.randn(n, hidden, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    w = 0.05 + 0.95 * torch.rand(n, k, generator=gen, dtype=torch.float32)
    return RoutedBatch(x, topk_idx, w)
