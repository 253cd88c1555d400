"""Bounds of the normal mode that the kernels are built for (engine/kernels/normal_launch.h) and that
both the buffer layout (layout.py) and the performance configuration (config.py) are checked against."""
from __future__ import annotations

MAX_CHANNELS = 64        # engine/kernels/normal_launch.h kMaxChannels
MAX_RANKS = 8            # one NVLink domain (ranks of one node) per buffer
MAX_TOPK = 16
MAX_LOCAL_EXPERTS = 1024
DESC_INTS = 16           # normal_launch.h kDescInts: int32 words of a one-copy output descriptor
DEFAULT_NUM_SMS = 24
# Documented bounds of the arguments (docs/normal_mode.md "Bounds"): beyond them a call is refused with
# ValueError before anything is sent. Row counts and aligned expert counts are int32 on the device, and
# a relay count record keeps 24 bits of rows (normal_internode.h).
MAX_TOKENS = (1 << 24) - 1         # tokens of a rank (x's rows) and num_worst_tokens
MAX_EXPERT_ALIGNMENT = 1 << 16
MAX_BUFFER_BYTES = 1 << 38         # num_nvl_bytes / num_rdma_bytes (256 GiB: more than any GPU holds)
MAX_TIMEOUT_US = 3_600_000_000     # one hour
MAX_RING_TOKENS = 1 << 16          # Config's chunk and ring sizes (rows)
MAX_GROUP_RANKS = 256              # a group's ranks: 32 nodes of 8 (native_internode.py MAX_NODES, NODE_SIZES)
