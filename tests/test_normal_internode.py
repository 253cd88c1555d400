"""The normal mode across (virtual) nodes on the CPU: the reference backend with 2 nodes x 2 ranks
(4 gloo ranks) through the DeepEP shim (Buffer.get_dispatch_layout's num_tokens_per_rdma_rank,
dispatch / internode_dispatch, cached dispatch, combine / internode_combine, the BF16 per-node combine
order), the argument checks that only exist across nodes, node detection, and hash-stable rounds.
The per-token oracle of every internode case (layout, rows, handle, combine order) is in
tests/test_normal_reference.py (the nodes* cases)."""
from __future__ import annotations

import hashlib
import os
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

from pyep.compat import deep_ep
from pyep.ep.normal import LayoutMismatch, NormalBuffer
from pyep.ep.normal.contract import combine_order
from pyep.ep.normal.topology import NodeLayout, layout_from_nodes

H, E, K, N = 256, 16, 4, 20


def _inputs(rank: int, seed: int = 0):
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    x = (torch.randn(N, H, generator=gen) * (rank + 1)).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)])
    idx[torch.rand(N, K, generator=gen) < 0.25] = -1
    w = torch.rand(N, K, generator=gen)
    return x, idx, w


def check_shim_virtual_nodes() -> Dict[str, Any]:
    """DeepEP's internode test flow, condensed, on 2 virtual nodes of 2 ranks."""
    rank, r_n = dist.get_rank(), dist.get_world_size()
    os.environ["PYEP_VIRTUAL_NODE_SIZE"] = "2"
    try:
        buffer = deep_ep.Buffer(dist.group.WORLD, int(1e9), int(1e9), backend="reference")
    finally:
        del os.environ["PYEP_VIRTUAL_NODE_SIZE"]
    nb = buffer.normal_buffer()
    assert (nb.num_nodes, nb.ranks_per_node) == (2, 2)
    x, idx, w = _inputs(rank)
    ntpr, rdma, ntpe, tir, _ = buffer.get_dispatch_layout(idx, E)
    rank_idx = torch.where(idx >= 0, idx // (E // r_n), -1)
    want_rdma = torch.stack([((rank_idx // 2) == n).any(dim=1) for n in range(2)], dim=1).sum(0).to(torch.int)
    assert torch.equal(rdma, want_rdma)
    recv, r_idx, r_w, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=rdma, is_token_in_rank=tir,
        num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
    recv2, *_ = buffer.internode_dispatch(
        x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=rdma, is_token_in_rank=tir,
        num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
    assert torch.equal(recv, recv2)
    assert handle.num_nodes == 2
    # Rows by (source, token): rank_prefix_matrix bounds every source's rows, sources ascending.
    col = handle.rank_prefix_matrix[:, rank].tolist()
    assert col[-1] == recv.shape[0] and sum(counts) == int((r_idx >= 0).sum())
    cached, *_ = buffer.dispatch(x, handle=handle)
    assert torch.equal(cached, recv)
    # Every row is x_s / (s+1) * (s+1) of its source; combine of recv sums the copies per node.
    out, out_w, _ = buffer.combine(recv, handle, topk_weights=r_w)
    out2, _, _ = buffer.internode_combine(recv, handle, topk_weights=r_w)
    assert torch.equal(out, out2)
    per_node = torch.stack([tir[:, 2 * n:2 * n + 2].sum(1) for n in range(2)], dim=1).float()
    want = torch.zeros(N, H)
    for n in range(2):
        part = (x.float() * per_node[:, n:n + 1]).to(torch.bfloat16).float()
        want = want + torch.where(per_node[:, n:n + 1] > 0, part, torch.zeros_like(part))
    assert torch.equal(out, want.to(torch.bfloat16))
    # Each (t, k) weight comes back from the one rank holding expert k; the other rows carry 0.
    assert torch.equal(out_w, torch.where(idx >= 0, w, torch.zeros_like(w)))
    buffer.destroy()
    return {"rows": int(recv.shape[0])}


def check_internode_arguments() -> Dict[str, Any]:
    rank = dist.get_rank()
    buf = NormalBuffer(hidden=H, backend="reference", ranks_per_node=2)
    x, idx, w = _inputs(rank, 3)
    ntpr, rdma, ntpe, tir, _ = buf.get_dispatch_layout(idx, E)
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank is None"):
        buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir, num_tokens_per_expert=ntpe,
                     topk_idx=idx, topk_weights=w)
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank"):
        buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=rdma[:1], is_token_in_rank=tir,
                     num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
    # A claim that does not match is_token_in_rank on one rank: every rank raises at this call.
    bad = rdma.clone()
    if rank == 3:
        bad[0] += 1
    with pytest.raises(LayoutMismatch, match=r"num_tokens_per_rdma_rank\[0\]") as claim:
        buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=bad, is_token_in_rank=tir,
                     num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
    assert "in the tensors of rank 3" in "".join(claim.value.__notes__)
    recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=rdma,
                                            is_token_in_rank=tir, num_tokens_per_expert=ntpe, topk_idx=idx,
                                            topk_weights=w)
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank"):
        buf.dispatch(x, handle=handle, num_tokens_per_rdma_rank=rdma)
    buf.destroy()
    return {"rows": int(recv.shape[0])}


def check_hash_stable(rounds: int) -> Dict[str, Any]:
    """The same inputs give the same bytes every round (the GPU test runs 1,000 rounds)."""
    rank = dist.get_rank()
    buf = NormalBuffer(hidden=H, backend="reference", ranks_per_node=2)
    x, idx, w = _inputs(rank, 5)
    digests = set()
    for _ in range(rounds):
        ntpr, rdma, ntpe, tir, _ = buf.get_dispatch_layout(idx, E)
        recv, _, r_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=rdma,
                                                  is_token_in_rank=tir, num_tokens_per_expert=ntpe,
                                                  topk_idx=idx, topk_weights=w)
        out, out_w, _ = buf.combine(recv, handle, topk_weights=r_w, bias=x)
        hsh = hashlib.sha256()
        for t in (recv, out, out_w):
            hsh.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        digests.add(hsh.hexdigest())
    buf.destroy()
    return {"digests": len(digests)}


def test_shim_on_two_virtual_nodes(pool4: Any) -> None:
    res = pool4.run(check_shim_virtual_nodes, timeout_s=120)
    assert sum(r["rows"] for r in res) > 0


def test_internode_argument_checks(pool4: Any) -> None:
    res = pool4.run(check_internode_arguments, timeout_s=120)
    assert sum(r["rows"] for r in res) > 0


def test_hash_stable_rounds(pool4: Any) -> None:
    assert all(r["digests"] == 1 for r in pool4.run(check_hash_stable, 20, timeout_s=120))


def test_node_layout() -> None:
    lay = NodeLayout(8, 2)
    assert lay.num_nodes == 4 and lay.internode and lay.node(5) == 2 and lay.local(5) == 1
    assert lay.forwarder(5, 0) == 1 and lay.forwarder(5, 3) == 7 and list(lay.ranks(1)) == [2, 3]
    assert not NodeLayout(4, 4).internode
    assert layout_from_nodes([0, 0, 1, 1]) == NodeLayout(4, 2)
    with pytest.raises(ValueError, match="unequal"):
        layout_from_nodes([0, 0, 0, 1])
    with pytest.raises(ValueError, match="rank 1 is on node 1"):
        layout_from_nodes([0, 1, 0, 1])
    with pytest.raises(ValueError, match="divide"):
        NodeLayout(6, 4)


def test_combine_order() -> None:
    assert combine_order(4, 4) == [[0, 1, 2, 3]]
    assert combine_order(4, 2) == [[0, 1], [2, 3]]
    assert combine_order(3, 1) == [[0], [1], [2]]


def test_relay_drains_only_on_the_softnic_with_lazy_loading() -> None:
    """GPU run 1 of the native path: every count exchange ended in "quiet timeout" because the host,
    after launching the spinning relay kernel, launched kernels not yet loaded (lazy loading holds
    the context lock while the device drains, so the softnic's progress thread could not queue the
    copy the kernel waited for). The relay must wait for its kernels exactly in that configuration."""
    from pyep.ep.normal.internode_relay import drain_after_launch
    for transport in ("emulated", "emulated-internode"):
        assert drain_after_launch(transport, None)          # torch's default: LAZY
        assert drain_after_launch(transport, "LAZY")
        assert drain_after_launch(transport, " lazy ")
        assert not drain_after_launch(transport, "EAGER")
        assert not drain_after_launch(transport, "eager")
    for transport in ("ibgda", "auto"):                     # a real NIC needs no host thread
        assert not drain_after_launch(transport, None)
        assert not drain_after_launch(transport, "LAZY")
