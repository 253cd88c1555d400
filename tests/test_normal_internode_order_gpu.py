"""GPU test of the staged internode dispatch's bookkeeping kernels (engine/kernels/normal_internode_order.cu)
against their torch specification (pyep/ep/normal/internode_order.py, itself checked on the CPU by
tests/test_normal_internode_order.py): row map, rank_prefix_matrix, the per-expert counts through pinned
host words, and the recv_channel_prefix_matrix, for every rank of several node layouts (up to 32 x 8 =
256 ranks, the kernels' table bound), with num_worst_tokens padding and with fewer rows than sent
(rows past num_worst_tokens dropped). One process: the kernels only read the records."""
from __future__ import annotations

import pytest
from multiproc import usable_gpus

pytestmark = pytest.mark.gpu
requires_gpus = pytest.mark.skipif(usable_gpus("relay") < 1, reason="needs a CUDA GPU and the CUDA build of pyep._engine")


@requires_gpus
@pytest.mark.parametrize("m_n,p,seed", [(2, 2, 1), (2, 1, 2), (4, 2, 3), (3, 4, 4), (2, 8, 5), (32, 8, 6)])
def test_order_kernels_match_the_torch_specification(m_n, p, seed):
    import torch
    from pyep._native import load
    from pyep.ep.normal import internode_order as order
    from test_normal_internode_order import random_records
    r = load().relay
    r_n, e_n, c_n, align = m_n * p, 4 * m_n * p, 5, 4
    e_l = e_n // r_n
    rec, gathered, in_rank, mi = random_records(m_n, p, e_n, seed)
    g_dev = gathered.cuda()
    stream = torch.cuda.current_stream().cuda_stream
    host = torch.zeros(1 + e_l, dtype=torch.int32, pin_memory=True)
    mes = range(r_n) if r_n <= 16 else (0, 1, 77, r_n - 1)
    for ticket, me in enumerate(mes, start=1):
        s = r.InterStatic()
        s.rank, s.num_ranks, s.node, s.num_nodes, s.ranks_per_node = me, r_n, me // p, m_n, p
        total = sum(int(rec[src, 1 + me]) for src in range(r_n))
        for rows in sorted({total, total + 7, max(total - 3, 0)}):
            rmap = torch.empty(max(rows, 1), dtype=torch.int32, device="cuda")
            rpm = torch.empty((r_n, r_n), dtype=torch.int32, device="cuda")
            host[0] = 0
            r.order(s, g_dev.data_ptr(), mi, rows, rmap.data_ptr(), rpm.data_ptr(), host.data_ptr(), ticket, e_n,
                    align, stream)
            # recv_src as the intranode dispatch leaves it: each source's tokens ascending, garbage past the
            # real rows (num_worst_tokens padding), and only `rows` of them when more were sent.
            want = [t for src in range(r_n) for t in range(in_rank[src].shape[0]) if in_rank[src][t, me]]
            src_idx = torch.tensor((want + [12345] * 7)[:rows] or [0], dtype=torch.int32)
            rcp = torch.empty((r_n, c_n), dtype=torch.int32, device="cuda")
            r.recv_prefix(s, g_dev.data_ptr(), mi, rpm.data_ptr(), src_idx.cuda().data_ptr(), rows, c_n,
                          rcp.data_ptr(), stream)
            torch.cuda.synchronize()
            where = f"{m_n}x{p} rank {me} rows {rows} (real {total})"
            assert int(host[0]) == ticket, where
            assert torch.equal(rpm.cpu(), order.rank_prefix(rec, r_n)), where
            assert rmap[:rows].cpu().tolist() == order.row_map(rec, me, m_n, p, rows).tolist(), where
            assert host[1:].tolist() == order.expert_counts(rec, me, r_n, e_n, align), where
            spec = order.recv_channel_prefix(rec, order.rank_prefix(rec, r_n), me, src_idx[:rows], c_n)
            assert rcp.cpu().tolist() == spec.tolist(), where
