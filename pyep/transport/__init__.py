"""Transports of the low-latency EP buffer: local copy, NVLink (CUDA IPC), and the NIC path (IBGDA on
a real mlx5 NIC, or emulated on the softnic). `base` holds the interface and the selection rules."""
from __future__ import annotations

from .base import KINDS, PeerLink, RankInfo, Transport, node_ids, plan_transports

__all__ = ["KINDS", "PeerLink", "RankInfo", "Transport", "node_ids", "plan_transports"]
