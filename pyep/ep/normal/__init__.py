"""DeepEP's normal (high-throughput) mode: `NormalBuffer` with get_dispatch_layout, dispatch (also cached)
and combine, inside a node (docs/normal_mode.md) and across nodes (docs/normal_internode.md).
contract.py is the semantic spec every backend follows. Importing this package does not import torch."""
from __future__ import annotations

from .buffer import NormalBuffer
from .config import Config, default_config
from .contract import NormalBackend
from .errors import (BufferBroken, ElasticUnsupported, InvalidExpertIndex, LayoutMismatch, NormalCallMismatch,
                     NormalModeError, NotCapturable, PeerRefusedCall, PeerTimeout, WorstTokensExceeded)
from .events import NormalEvent
from .handle import NormalHandle

__all__ = ["NormalBuffer", "Config", "default_config", "NormalBackend", "NormalHandle", "NormalEvent",
           "NormalModeError", "InvalidExpertIndex", "WorstTokensExceeded", "PeerTimeout", "BufferBroken",
           "NotCapturable", "LayoutMismatch", "NormalCallMismatch", "PeerRefusedCall", "ElasticUnsupported"]
