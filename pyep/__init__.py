"""pyep: a userspace IBGDA RDMA engine for NVIDIA GPUs and mlx5 NICs, and MoE expert-parallel
dispatch/combine built on it. `pyep.availability()` says which parts this installation has."""
from __future__ import annotations

from ._native import Availability, availability
from ._version import __version__


def __getattr__(name: str):
    # Lazy: importing pyep must not import torch or initialise CUDA.
    if name in ("EpBuffer",):
        from .ep.ll.buffer import EpBuffer
        return EpBuffer
    if name == "NormalBuffer":
        from .ep.normal.buffer import NormalBuffer
        return NormalBuffer
    raise AttributeError(f"module 'pyep' has no attribute {name!r}")


__all__ = ["Availability", "availability", "EpBuffer", "NormalBuffer", "__version__"]
