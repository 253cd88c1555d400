"""Bounds of the normal mode that the kernels are built for (engine/kernels/normal_launch.h) and that
both the buffer layout (layout.py) and the performance configuration (config.py) are checked against."""
from __future__ import annotations

MAX_CHANNELS = 64        # engine/kernels/normal_launch.h kMaxChannels
MAX_RANKS = 8            # one NVLink domain (ranks of one node) per buffer
MAX_TOPK = 16
MAX_LOCAL_EXPERTS = 1024
DEFAULT_NUM_SMS = 24
