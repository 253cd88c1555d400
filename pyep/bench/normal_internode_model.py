"""Analytic model of the normal mode across nodes on real NICs (docs/normal_internode.md): bytes per NIC
and per NVLink for each stage of dispatch and combine, and the time they take at a given NIC and
NVLink bandwidth. On the softnic the measured figures time the emulator (cudaMemcpyAsync per RDMA
write), not a NIC; this model is what a ConnectX run should approach, and it is printed beside them.

Routing: uniform top-k over E experts (K distinct per token), E/R experts per rank, P ranks per node,
M = R/P nodes. A token reaches a node with probability p_node = 1 - C(E - E/M, K) / C(E, K) and a
rank with p_rank = 1 - C(E - E/R, K) / C(E, K). Per rank and call:
  RDMA rows out   = N * p_node * (M - 1)        (once per remote node, to the column peer there)
  NVLink rows out = N * M * P * p_rank * (P-1)/P (the forwarder hands every row it relays, and its own
                                                 rows, to the other ranks of its node that need them)
DeepEP's published internode normal figures (reference_numbers.py): 43-58 GB/s RDMA per rank, counted
as test_internode.py counts: every node a token reaches, the own node included (N * p_node * M tokens),
x 2H (x (1+4/128)/2 for FP8), over the time. Each stage also gives that count (deepep_*), so the
model's expectation sits beside the measured rows in the same units (normal_internode_report.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from math import comb
from typing import Any, Dict

from .normal import bytes_per_rank
from .reference_numbers import DEEPEP_INTERNODE_RDMA_GBPS

NIC_GBPS = 50.0
NVL_GBPS = 400.0
# stage -> the benchmark phase whose bytes DeepEP's count gives it
PHASE_OF_STAGE = {"dispatch_bf16": "cached_bf16", "dispatch_fp8": "cached_fp8", "combine": "combine"}


def _align16(v: int) -> int:
    return (v + 15) // 16 * 16


def dispatch_row_bytes(hidden: int, topk: int, fp8: bool) -> int:
    """Relay row: payload, FP8 scales, top-k ids (int64) and weights, the source token index."""
    payload = hidden + 4 * (hidden // 128) if fp8 else 2 * hidden
    return _align16(payload + 12 * topk + 4)


def combine_row_bytes(hidden: int, topk: int) -> int:
    """Combine relay row: the node's BF16 partial sum and its fp32 top-k weights."""
    return _align16(2 * hidden + 4 * topk)


@dataclass(frozen=True)
class StageModel:
    rdma_bytes: float          # per rank = per NIC (one NIC per GPU)
    nvl_bytes: float           # per rank, out over NVLink
    rdma_us: float
    nvl_us: float
    staged_us: float           # RDMA stage, then the NVLink stage (pyep's relay + intranode kernels)
    pipelined_us: float        # both overlapped (DeepEP's fused kernels): the slower stage
    rdma_gbps_staged: float    # RDMA bytes / staged time
    deepep_rdma_bytes: float   # test_internode.py's count: node fan-out (own node included) x 2H (FP8: x factor)
    deepep_nvl_bytes: float    # test_internode.py's count: received rows x 2H (FP8: x factor)
    deepep_rdma_gbps: float    # deepep_rdma_bytes / staged time: comparable with DeepEP's "RDMA" lines
    deepep_nvl_gbps: float     # deepep_nvl_bytes / staged time: its "NVL" lines


def _probability(experts: int, span: int, topk: int) -> float:
    return 1.0 - comb(experts - span, topk) / comb(experts, topk) if topk <= experts else 1.0


def model(tokens: int, hidden: int, topk: int, experts: int, num_ranks: int, ranks_per_node: int,
          nic_gbps: float = NIC_GBPS, nvl_gbps: float = NVL_GBPS) -> Dict[str, Any]:
    if num_ranks % ranks_per_node or experts % num_ranks:
        raise ValueError("ranks_per_node must divide the ranks and the ranks must divide the experts")
    m = num_ranks // ranks_per_node
    p_node = _probability(experts, experts // m, topk)
    p_rank = _probability(experts, experts // num_ranks, topk)
    rdma_rows = tokens * p_node * (m - 1)
    nvl_rows = tokens * m * ranks_per_node * p_rank * (ranks_per_node - 1) / ranks_per_node
    fanout_rows = tokens * p_node * m                  # test_internode.py's num_rdma_token_sent
    recv_rows = tokens * num_ranks * p_rank            # rows a rank receives, on average

    def stage(key: str, rdma_row: int, nvl_row: int) -> StageModel:
        rb, nb = rdma_rows * rdma_row, nvl_rows * nvl_row
        r_us, n_us = rb / nic_gbps / 1e3, nb / nvl_gbps / 1e3
        staged = r_us + n_us
        d_rdma = bytes_per_rank(fanout_rows, hidden)[PHASE_OF_STAGE[key]]
        d_nvl = bytes_per_rank(recv_rows, hidden)[PHASE_OF_STAGE[key]]

        def rate(b: float) -> float:
            return b / staged / 1e3 if staged else 0.0
        return StageModel(rb, nb, r_us, n_us, staged, max(r_us, n_us), rate(rb), d_rdma, d_nvl, rate(d_rdma),
                          rate(d_nvl))

    return {
        "num_nodes": m, "ranks_per_node": ranks_per_node, "p_node": p_node, "p_rank": p_rank,
        "nic_gbps": nic_gbps, "nvl_gbps": nvl_gbps, "deepep_rdma_gbps": list(DEEPEP_INTERNODE_RDMA_GBPS),
        "dispatch_bf16": asdict(stage("dispatch_bf16", dispatch_row_bytes(hidden, topk, False), 2 * hidden)),
        "dispatch_fp8": asdict(stage("dispatch_fp8", dispatch_row_bytes(hidden, topk, True),
                                     hidden + 4 * (hidden // 128))),
        "combine": asdict(stage("combine", combine_row_bytes(hidden, topk), 2 * hidden)),
    }


def render(console: Any, doc: Dict[str, Any]) -> None:
    from .tables import emit, table
    t = table()
    for col in ("stage", "MB per\nNIC", "MB per\nNVLink", "RDMA\nus", "NVLink\nus", "staged\nus", "pipelined\nus",
                "RDMA GB/s\n(staged)", "DeepEP-count GB/s\nRDMA / NVL"):
        t.add_column(col, justify="right")
    for key in ("dispatch_bf16", "dispatch_fp8", "combine"):
        s = doc[key]
        t.add_row(key, f"{s['rdma_bytes'] / 1e6:.2f}", f"{s['nvl_bytes'] / 1e6:.2f}", f"{s['rdma_us']:.1f}",
                  f"{s['nvl_us']:.1f}", f"{s['staged_us']:.1f}", f"{s['pipelined_us']:.1f}",
                  f"{s['rdma_gbps_staged']:.1f}", f"{s['deepep_rdma_gbps']:.1f} / {s['deepep_nvl_gbps']:.1f}")
    emit(console, f"real-NIC model: {doc['num_nodes']} nodes x {doc['ranks_per_node']} ranks, "
                  f"{doc['nic_gbps']:.0f} GB/s per NIC, {doc['nvl_gbps']:.0f} GB/s NVLink (not measured)", t,
         f"DeepEP internode normal mode, published: {doc['deepep_rdma_gbps'][0]:.0f}-"
         f"{doc['deepep_rdma_gbps'][1]:.0f} GB/s RDMA per rank; the softnic figures above time the emulator, not a NIC")
