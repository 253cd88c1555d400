"""The softnic: a software mlx5 NIC executing the WQEs pyep posts (transport="emulated").

A `SoftNic` is a NIC provider like the real DevX one: create CQs and RC QPs, register memory, take QPs
through RST->INIT->RTR->RTS, exchange connect blobs with peers, then post WQEs into the rings (from GPU
kernels, or from CPU threads through `HostQp`). Its progress thread executes them and writes real
CQEs, error CQEs with mlx5 syndromes included. See docs/softnic.md.
"""
from __future__ import annotations

from .host_qp import HostQp
from .nic import HostBuffer, SoftNic, parse_connect_blob
from .store import agree_fabric_id, exchange_blobs, new_fabric_id
from .types import (RDMA_ACCESS, Access, ConnectAttr, CqInfo, CqStats, MrInfo, PeerInfo, Placement, PostStatus,
                    QpError, QpInfo, QpState, QpStats, RawCqe, SoftNicConfig, SoftNicError, Syndrome, vendor_syndromes)

__all__ = [
    "Access", "ConnectAttr", "CqInfo", "CqStats", "HostBuffer", "HostQp", "MrInfo", "PeerInfo", "Placement",
    "PostStatus", "QpError", "QpInfo", "QpState", "QpStats", "RawCqe", "RDMA_ACCESS", "SoftNic", "SoftNicConfig",
    "SoftNicError", "Syndrome", "agree_fabric_id", "exchange_blobs", "new_fabric_id", "parse_connect_blob",
    "vendor_syndromes",
]
