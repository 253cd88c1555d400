"""DeepEP V1 figures measured separately on the 8x H200 machine (shared/REFERENCE.md, section 5), and
DeepEP's low-latency buffer sizes. They are facts about runs this benchmark did not repeat: they are
shown as a labelled static row, only where the setting matches the one they were measured in.
This module is the one place these numbers live."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

LABEL = "DeepEP (measured separately, REFERENCE.md)"
SOURCE = ("DeepEP V1 commit 567632d, NVSHMEM 3.4.5, IBGDA disabled, NVLink P2P; 8x H200 SXM NVSwitch; "
          "low-latency mode, FP8 dispatch / BF16 combine, per-kernel times")

# Range = (low, high) microseconds as measured over repeated runs.
Range = Tuple[float, float]


@dataclass(frozen=True)
class DeepEpLowLatency:
    world_size: int
    gpu_substring: str
    tokens: int
    hidden: int
    topk: int
    experts: int
    dispatch_us: Range
    combine_us: Range
    dispatch_combine_us: float          # the whole dispatch + combine call (wall)
    dispatch_combine_gbps: float
    dispatch_send_us: Range
    dispatch_recv_us: Range
    combine_send_us: Range
    combine_recv_us: Range


DEEPEP_LL_8XH200 = DeepEpLowLatency(
    world_size=8, gpu_substring="H200", tokens=128, hidden=7168, topk=8, experts=288,
    dispatch_us=(36.0, 41.0), combine_us=(66.0, 68.0), dispatch_combine_us=110.5,
    dispatch_combine_gbps=199.0, dispatch_send_us=(28.0, 30.0), dispatch_recv_us=(8.0, 8.0),
    combine_send_us=(51.0, 54.0), combine_recv_us=(10.0, 10.0))

# Token sweep (per kernel, dispatch / combine microseconds), same machine and shape except T.
# (T=128 is the ranges of DEEPEP_LL_8XH200.)
DEEPEP_LL_SWEEP_8XH200: Dict[int, Tuple[float, float]] = {1: (16.9, 12.3), 32: (23.3, 25.7),
                                                          256: (68.0, 131.1)}

# DeepEP's low-latency buffer for T=128, H=7168, as reported (2.147 GB, 1.908 GB; decimal GB): its
# combine receive area is indexed [expert][token].
DEEPEP_LL_BUFFER_BYTES: Dict[Tuple[int, int, int], int] = {
    (128, 7168, 288): 2_147_000_000,
    (128, 7168, 256): 1_908_000_000,
}


# DeepEP's internode normal mode, published (REFERENCE.md section 5, "Published elsewhere"): RDMA GB/s
# per rank, as its tests/test_internode.py counts them (bytes_per_rank of the tokens' node fan-out).
DEEPEP_INTERNODE_RDMA_GBPS: Range = (43.0, 58.0)
DEEPEP_INTERNODE_LABEL = "DeepEP internode normal mode, published (REFERENCE.md section 5)"


def deepep_row(world_size: int, gpu_name: str, tokens: int, hidden: int, topk: int, experts: int,
               use_fp8: bool) -> Optional[DeepEpLowLatency]:
    """The DeepEP row for this setting, or None where the measured setting does not match."""
    ref = DEEPEP_LL_8XH200
    if (world_size == ref.world_size and ref.gpu_substring in gpu_name and tokens == ref.tokens
            and hidden == ref.hidden and topk == ref.topk and experts == ref.experts and use_fp8):
        return ref
    return None


def deepep_buffer_bytes(tokens: int, hidden: int, experts: int) -> Optional[int]:
    return DEEPEP_LL_BUFFER_BYTES.get((tokens, hidden, experts))


def fmt_range(r: Range) -> str:
    lo, hi = r
    return f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"


def midpoint(r: Range) -> float:
    return (r[0] + r[1]) / 2.0
