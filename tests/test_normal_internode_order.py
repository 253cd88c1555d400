"""CPU tests of the staged internode path's device bookkeeping (pyep/ep/normal/internode_order.py): the
row map from the intranode kernels' (forwarder, source node, token) order to the contract's (source
rank, token) order, the recv_channel_prefix_matrix and the per-expert counts, against a direct
per-row construction on random routings (including empty sources and num_worst_tokens padding)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pyep.ep.normal import internode_order as order


def random_records(m_n: int, p: int, e_n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    r_n = m_n * p
    mi = order.meta_ints(r_n, e_n)
    n_s = [int(v) for v in torch.randint(0, 9, (r_n,), generator=g)]
    n_s[1] = 0                                                # an empty source
    in_rank = [torch.rand(n, r_n, generator=g) < 0.4 for n in n_s]
    rec = torch.zeros(r_n, mi, dtype=torch.int32)
    for s in range(r_n):
        rec[s, 0] = n_s[s]
        rec[s, 1:1 + r_n] = in_rank[s].sum(0).to(torch.int32)
        rec[s, 1 + r_n:1 + r_n + e_n] = torch.randint(0, 5, (e_n,), generator=g)
    # as the node's notify gathers them: [forwarder l][source node a]
    gathered = rec.view(m_n, p, mi).transpose(0, 1).reshape(p, m_n * mi).contiguous()
    return rec, gathered, in_rank, mi


@pytest.mark.parametrize("m_n,p,seed", [(2, 2, 1), (2, 1, 2), (4, 2, 3), (3, 4, 4)])
@pytest.mark.parametrize("pad", [0, 5])
def test_row_map_and_prefixes(m_n, p, seed, pad):
    e_n = 4 * m_n * p
    rec, gathered, in_rank, mi = random_records(m_n, p, e_n, seed)
    r_n = m_n * p
    assert torch.equal(order.records_by_source(gathered, m_n, p, mi), rec)
    c_n = 3
    for me in range(r_n):
        # the contract's rows for `me`: (s, t) ascending
        want = [(s, t) for s in range(r_n) for t in range(in_rank[s].shape[0]) if in_rank[s][t, me]]
        # the intranode kernels' rows: forwarder l, source node a, token t
        kernel = [(a * p + l, t) for l in range(p) for a in range(m_n)
                  for t in range(in_rank[a * p + l].shape[0]) if in_rank[a * p + l][t, me]]
        rows = len(want) + pad
        rmap = order.row_map(rec, me, m_n, p, rows)
        placed = [None] * len(want)
        for i, st in enumerate(kernel):
            placed[int(rmap[i])] = st
        assert placed == want
        assert rmap[len(want):].tolist() == list(range(len(want), rows))
        rpm = order.rank_prefix(rec, r_n)
        src = torch.tensor([t for _, t in want] + [-1] * pad, dtype=torch.int32)
        rcp = order.recv_channel_prefix(rec, rpm, me, src, c_n)
        for s in range(r_n):
            n = in_rank[s].shape[0]
            per = max(1, -(-n // c_n))
            chans = [t // per for (s2, t) in want if s2 == s]
            expect = [sum(1 for ch in chans if ch < c) for c in range(c_n)]
            assert rcp[s].tolist() == expect, (me, s)
        e_l = e_n // r_n
        got = order.expert_counts(rec, me, r_n, e_n, 4)
        raw = rec[:, 1 + r_n + me * e_l:1 + r_n + (me + 1) * e_l].sum(0).tolist()
        assert got == [(v + 3) // 4 * 4 for v in raw]


def test_node_local_ids():
    ids = torch.tensor([[0, 5, 9, -1], [15, 8, 12, 4]])
    # 2 nodes x 2 ranks, 4 experts per rank: node 1 holds experts 8..15
    assert order.node_local_ids(ids, 1, 2, 4).tolist() == [[-1, -1, 1, -1], [7, 0, 4, -1]]
