"""Routing generators of `pyep bench`: distinct experts per token, zipf skew, exact hot-expert
fraction, dropped entries, reproducibility."""
from __future__ import annotations

import pytest
import torch

from pyep.bench.config import RoutingSpec
from pyep.bench.routing import make_batch, make_topk, popularity_order, zipf_probabilities


def _distinct_rows(idx: torch.Tensor) -> bool:
    for row in idx.tolist():
        vals = [v for v in row if v >= 0]
        if len(vals) != len(set(vals)):
            return False
    return True


@pytest.mark.parametrize("spec", [RoutingSpec("uniform"), RoutingSpec("zipf", 1.2), RoutingSpec("zipf", 3.0),
                                  RoutingSpec("hot", 0.5), RoutingSpec("hot", 1.0)])
def test_distinct_experts_in_range(spec: RoutingSpec) -> None:
    idx = make_topk(spec, 512, 32, 8, seed=3, rank=1, hot_expert=5)
    assert idx.shape == (512, 8) and idx.dtype == torch.int64
    assert int(idx.min()) >= 0 and int(idx.max()) < 32
    assert _distinct_rows(idx)


def test_k_equals_e_is_a_permutation() -> None:
    idx = make_topk(RoutingSpec("uniform"), 64, 8, 8, seed=0, rank=0)
    assert all(sorted(r) == list(range(8)) for r in idx.tolist())


def test_uniform_is_roughly_uniform() -> None:
    idx = make_topk(RoutingSpec("uniform"), 4000, 16, 4, seed=1, rank=0)
    counts = torch.bincount(idx.reshape(-1), minlength=16).float()
    expected = 4000 * 4 / 16
    assert float((counts - expected).abs().max()) < 0.15 * expected


def test_zipf_skew_follows_popularity() -> None:
    e, k, n, s = 64, 4, 20000, 1.2
    idx = make_topk(RoutingSpec("zipf", s), n, e, k, seed=7, rank=0)
    counts = torch.bincount(idx.reshape(-1), minlength=e).float()
    order = popularity_order(e, 7)
    by_rank = counts[order]
    # The most popular expert is chosen far more often than the median and the least popular ones.
    assert float(by_rank[0]) > 10 * float(by_rank[e // 2])
    assert float(by_rank[:8].sum()) > 10 * float(by_rank[-8:].sum())
    # Counts decrease with popularity rank (compare averages of 8-expert blocks).
    blocks = by_rank.reshape(8, 8).mean(dim=1)
    assert all(float(blocks[i]) > float(blocks[i + 1]) for i in range(7))
    # No expert can be picked twice by one token, so no expert exceeds n.
    assert float(counts.max()) <= n


def test_zipf_s0_is_uniform_and_probabilities_sum_to_one() -> None:
    p = zipf_probabilities(10, 1.5, seed=2)
    assert abs(float(p.sum()) - 1.0) < 1e-12
    assert float(p.max()) == pytest.approx(1.0 / sum(1.0 / i ** 1.5 for i in range(1, 11)))
    idx = make_topk(RoutingSpec("zipf", 0.0), 4000, 16, 4, seed=1, rank=0)
    counts = torch.bincount(idx.reshape(-1), minlength=16).float()
    assert float(counts.max() / counts.min()) < 1.35


def test_popularity_is_shared_across_ranks_draws_are_not() -> None:
    a = make_topk(RoutingSpec("zipf", 2.0), 2000, 32, 2, seed=5, rank=0)
    b = make_topk(RoutingSpec("zipf", 2.0), 2000, 32, 2, seed=5, rank=1)
    assert not torch.equal(a, b)
    top_a = int(torch.bincount(a.reshape(-1), minlength=32).argmax())
    top_b = int(torch.bincount(b.reshape(-1), minlength=32).argmax())
    assert top_a == top_b == int(popularity_order(32, 5)[0])


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 1.0])
def test_hot_expert_fraction_is_exact(fraction: float) -> None:
    n, hot = 200, 3
    idx = make_topk(RoutingSpec("hot", fraction), n, 16, 4, seed=11, rank=2, hot_expert=hot)
    hits = int((idx == hot).any(dim=1).sum())
    assert hits == round(fraction * n)
    assert int((idx == hot).sum()) == hits          # at most once per token
    assert _distinct_rows(idx)
    if 0 < fraction < 1:
        # The hot expert lands in every slot position somewhere, not always slot 0.
        slots = (idx == hot).nonzero()[:, 1]
        assert len(set(slots.tolist())) > 1


def test_drop_fraction_sets_exact_number_of_minus_one() -> None:
    idx = make_topk(RoutingSpec("uniform"), 50, 16, 4, seed=0, rank=0, drop_fraction=0.25)
    assert int((idx == -1).sum()) == 50
    assert int((idx >= 0).sum()) == 150


def test_reproducible_and_seed_sensitive() -> None:
    a = make_batch(RoutingSpec("hot", 0.3), 16, 256, 8, 2, seed=1, rank=0)
    b = make_batch(RoutingSpec("hot", 0.3), 16, 256, 8, 2, seed=1, rank=0)
    c = make_batch(RoutingSpec("hot", 0.3), 16, 256, 8, 2, seed=2, rank=0)
    assert torch.equal(a.topk_idx, b.topk_idx) and torch.equal(a.x, b.x)
    assert torch.equal(a.topk_weights, b.topk_weights)
    assert not torch.equal(a.x, c.x)
    assert a.x.dtype == torch.bfloat16 and a.x.shape == (16, 256)
    assert a.topk_weights.dtype == torch.float32 and float(a.topk_weights.min()) > 0
    assert a.num_valid() == 32


def test_zero_tokens() -> None:
    b = make_batch(RoutingSpec("zipf", 1.0), 0, 128, 8, 2, seed=0, rank=0)
    assert b.topk_idx.shape == (0, 2) and b.x.shape == (0, 128) and b.num_valid() == 0


def test_bad_routing_input() -> None:
    with pytest.raises(ValueError, match="k must be"):
        make_topk(RoutingSpec("uniform"), 4, 8, 9, seed=0, rank=0)
    with pytest.raises(ValueError, match="hot_expert"):
        make_topk(RoutingSpec("hot", 0.5), 4, 8, 2, seed=0, rank=0, hot_expert=8)
    with pytest.raises(ValueError, match="experts - 1"):
        make_topk(RoutingSpec("hot", 0.5), 4, 8, 8, seed=0, rank=0)
    with pytest.raises(ValueError, match="unknown routing"):
        RoutingSpec.parse("gauss")
    with pytest.raises(ValueError, match="not a number"):
        RoutingSpec.parse("zipf:abc")
    with pytest.raises(ValueError, match="hot-expert fraction"):
        RoutingSpec.parse("hot:1.5")
    with pytest.raises(ValueError, match="no parameter"):
        RoutingSpec.parse("uniform:2")
    assert RoutingSpec.parse("zipf", zipf_s=1.7) == RoutingSpec("zipf", 1.7)
    assert RoutingSpec.parse("hot:0.3").label == "hot:0.3"
