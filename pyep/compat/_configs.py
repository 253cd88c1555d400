"""Normal-mode configs for the DeepEP shims: DeepEP's `Buffer.get_dispatch_config(num_ranks)` answers for
its rank counts up to 160 (Megatron-LM and vLLM ask for the group size, across nodes too), pyep's
table covers one node of 1, 2, 4 or 8 ranks."""
from __future__ import annotations

import math

from ..ep.config import MAX_HIDDEN
from ..ep.normal.buffer import NormalBuffer
from ..ep.normal.config import Config, default_config
from ..ep.normal.limits import MAX_CHANNELS, MAX_RANKS

__all__ = ["normal_config", "clamp_num_sms", "normal_hidden", "theoretical_num_sms", "expected_groups"]


def normal_config(num_ranks: int, num_sms: int, combine: bool) -> Config:
    """The config for a group of num_ranks: pyep's tuned one inside a node; across nodes (a multiple of
    8 ranks, DeepEP's layout of 8 GPUs a node) the one of the 8-rank node whose kernels the staged
    internode path runs (its relay takes the RDMA fields' defaults)."""
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    if num_ranks <= MAX_RANKS:
        return default_config(num_ranks, num_sms, combine)
    if num_ranks % MAX_RANKS:
        raise ValueError(f"no config for {num_ranks} ranks: across nodes DeepEP's layout is {MAX_RANKS} ranks a "
                         f"node, so the rank count must be a multiple of {MAX_RANKS} (inside a node: 1, 2, 4 or 8)")
    return default_config(MAX_RANKS, num_sms, combine)


def clamp_num_sms(num_sms: int) -> int:
    """An SM count pyep's normal kernels run: even (a sender and a receiver per channel), 2 to
    2 * MAX_CHANNELS. DeepEP V2's analytical counts and callers' values land in that range."""
    n = max(2, min(int(num_sms), 2 * MAX_CHANNELS))
    return n + (n % 2)


def normal_hidden(num_bytes: int, num_ranks: int) -> int:
    """The largest hidden (a multiple of 128, <= MAX_HIDDEN) whose default-config native buffer fits in
    num_bytes. DeepEP sizes its normal mode by bytes alone and takes any hidden that fits; pyep's
    NormalBuffer wants an upper bound on hidden, and this is the one those bytes give. 0 if none fits."""
    for hidden in range(MAX_HIDDEN, 0, -128):
        if NormalBuffer.size_hint(hidden, num_ranks) <= num_bytes:
            return hidden
    return 0


# Link speeds the SM estimate assumes when the caller gives none: an H100/H200 NVLink4 direction
# (about 450 GB/s nominal, ~400 achieved by copies) and a ConnectX-7 port (400 Gb/s, ~45 GB/s achieved).
DEFAULT_NVLINK_GBS = 400.0
DEFAULT_RDMA_GBS = 45.0


def expected_groups(num_experts: int, num_topk: int, num_groups: int) -> float:
    """Expected number of distinct groups (of num_experts / num_groups consecutive experts) a token's
    num_topk distinct experts fall in, experts drawn uniformly: each group is missed with probability
    C(E - E/g, K) / C(E, K)."""
    if num_groups <= 1:
        return 1.0
    per = num_experts // num_groups
    return num_groups * (1.0 - math.comb(num_experts - per, num_topk) / math.comb(num_experts, num_topk))


def theoretical_num_sms(*, num_ranks: int, num_nodes: int, num_experts: int, num_topk: int, nvlink_gbs: float,
                        rdma_gbs: float, sm_read_gbs: float, sm_write_gbs: float, prefer_overlap: bool,
                        device_sms: int) -> int:
    """SMs for pyep's normal kernels to keep the busiest link full, for a balanced gate (in rows a
    source token moves). Per token the sender reads it once and writes one row per destination rank
    (h of them on average); receivers read and write those h rows; h * (1 - 1/R) cross NVLink, and
    across M nodes g * (1 - 1/M) rows cross RDMA (g = nodes hit). The time per token is the slower
    link's; the senders and the receivers each need enough SMs to copy their rows in that time, and
    pyep pairs one sender with one receiver SM per channel. Even, at least 4, at most the device's and
    the kernels' limit; without prefer_overlap at least 64 (as DeepEP V2)."""
    cap = min(device_sms, 2 * MAX_CHANNELS)
    hit = expected_groups(num_experts, num_topk, num_ranks)
    nvl_rows = hit * (1.0 - 1.0 / num_ranks)
    t = nvl_rows / (nvlink_gbs or DEFAULT_NVLINK_GBS)
    if num_nodes > 1:
        rdma_rows = expected_groups(num_experts, num_topk, num_nodes) * (1.0 - 1.0 / num_nodes)
        t = max(t, rdma_rows / (rdma_gbs or DEFAULT_RDMA_GBS))
    if t <= 0.0:
        return cap - cap % 2
    senders = max(1.0 / sm_read_gbs, hit / sm_write_gbs) / t
    receivers = max(hit / sm_read_gbs, hit / sm_write_gbs) / t
    sms = 2 * math.ceil(max(senders, receivers, 2.0))
    if not prefer_overlap:
        sms = max(sms, 64)
    return clamp_num_sms(min(sms, cap))
