"""The low-latency mode (decode): `EpBuffer` with DeepEP's low-latency / Mooncake EP contract.
docs/ll_kernels.md is its protocol page; contract.py is what every backend (reference.py, native.py)
implements. Importing this package does not import torch."""
from __future__ import annotations

from ..backend import BackendUnavailable, CompletedEvent, PeerTransport
from ..config import DEFAULT_TIMEOUT_US, MAX_HIDDEN, MAX_TOPK
from .config import EpConfig
from .buffer import EpBuffer
from .contract import CombineOptions, CombineResult, DispatchOptions, DispatchResult, EpBackend
from .handle import Handle
from .layout import size_hint

__all__ = ["EpBuffer", "EpConfig", "Handle", "size_hint", "EpBackend", "DispatchOptions",
           "CombineOptions", "DispatchResult", "CombineResult", "PeerTransport", "CompletedEvent",
           "BackendUnavailable", "DEFAULT_TIMEOUT_US", "MAX_HIDDEN", "MAX_TOPK"]
