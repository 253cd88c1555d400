"""Low-latency MoE expert-parallel dispatch/combine. Importing this package does not import torch."""
from __future__ import annotations

from .backend import (BackendUnavailable, CombineOptions, CombineResult, CompletedEvent, DispatchOptions,
                      DispatchResult, EpBackend, PeerTransport)
from .buffer import EpBuffer
from .config import DEFAULT_TIMEOUT_US, MAX_HIDDEN, MAX_TOPK, EpConfig, size_hint
from .handle import Handle

__all__ = ["EpBuffer", "EpConfig", "Handle", "size_hint", "EpBackend", "DispatchOptions",
           "CombineOptions", "DispatchResult", "CombineResult", "PeerTransport", "CompletedEvent",
           "BackendUnavailable", "DEFAULT_TIMEOUT_US", "MAX_HIDDEN", "MAX_TOPK"]
