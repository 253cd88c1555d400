"""Transports of the low-latency EP buffer: local copy, NVLink (CUDA IPC), and the NIC path (IBGDA on
a real mlx5 NIC, or emulated on the softnic). `base` holds the interface and the selection rules.
Beside them: connect (the QP set-up every NIC link uses), qp_dump (what every QP of a running job is
doing, `pyep qp dump`) and loopback (GPU-posted RDMA write latency and bandwidth, `pyep qp loopback`)."""
from __future__ import annotations

from .base import KINDS, PeerLink, RankInfo, Transport, node_ids, plan_transports

__all__ = ["KINDS", "PeerLink", "RankInfo", "Transport", "node_ids", "plan_transports"]
