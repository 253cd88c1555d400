"""The real-NIC model of `pyep bench --mode normal` across nodes: bytes and times from its definitions."""
from __future__ import annotations

import io
from math import comb

import pytest

from pyep.bench.normal_internode_model import combine_row_bytes, dispatch_row_bytes, model, render


def test_model_counts_rows_and_bytes() -> None:
    d = model(tokens=4096, hidden=7168, topk=8, experts=256, num_ranks=16, ranks_per_node=8)
    p_node = 1 - comb(128, 8) / comb(256, 8)
    assert d["num_nodes"] == 2 and d["p_node"] == pytest.approx(p_node)
    rows = 4096 * p_node
    s = d["dispatch_bf16"]
    assert s["rdma_bytes"] == pytest.approx(rows * dispatch_row_bytes(7168, 8, False))
    assert s["rdma_us"] == pytest.approx(s["rdma_bytes"] / 50e3)
    assert s["staged_us"] == pytest.approx(s["rdma_us"] + s["nvl_us"])
    assert s["pipelined_us"] == pytest.approx(max(s["rdma_us"], s["nvl_us"]))
    # FP8 rows are about half as large; combine rows carry BF16 partials + fp32 weights.
    assert d["dispatch_fp8"]["rdma_bytes"] < 0.6 * s["rdma_bytes"]
    assert combine_row_bytes(7168, 8) == 2 * 7168 + 32
    # DeepEP's count (test_internode.py): every node a token reaches, its own included, x 2H; FP8 x
    # (1+4/128)/2; received rows x 2H for NVL; both over the staged time.
    assert s["deepep_rdma_bytes"] == pytest.approx(4096 * p_node * 2 * 7168 * 2)
    p_rank = 1 - comb(240, 8) / comb(256, 8)
    assert s["deepep_nvl_bytes"] == pytest.approx(4096 * 16 * p_rank * 7168 * 2)
    assert d["dispatch_fp8"]["deepep_rdma_bytes"] == pytest.approx(s["deepep_rdma_bytes"] * 1.03125 / 2)
    assert d["combine"]["deepep_rdma_bytes"] == pytest.approx(s["deepep_rdma_bytes"])
    assert s["deepep_rdma_gbps"] == pytest.approx(s["deepep_rdma_bytes"] / s["staged_us"] / 1e3)
    assert 43 <= s["deepep_rdma_gbps"] <= 60          # DeepEP's published 43-58 GB/s at its shape
    # One rank per node: no NVLink stage.
    one = model(tokens=128, hidden=128, topk=2, experts=8, num_ranks=2, ranks_per_node=1)
    assert one["combine"]["nvl_bytes"] == 0
    with pytest.raises(ValueError):
        model(tokens=1, hidden=128, topk=1, experts=6, num_ranks=4, ranks_per_node=3)


def test_render() -> None:
    from rich.console import Console
    out = io.StringIO()
    render(Console(file=out, width=200), model(1024, 7168, 8, 64, 4, 2))
    assert "real-NIC model" in out.getvalue() and "43-58 GB/s" in out.getvalue()
    assert "DeepEP-count GB/s" in out.getvalue() and "RDMA / NVL" in out.getvalue()
