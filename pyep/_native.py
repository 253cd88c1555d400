"""Loads the native engine (pyep._engine) and reports which parts of it this build has."""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

log = logging.getLogger("pyep")


@dataclass(frozen=True)
class Availability:
    engine: bool          # host engine: PRM encoders, softnic, DevX host code
    cuda: bool            # CUDA kernels compiled in (GPU build)
    rdma_core: bool       # built against rdma-core headers (static layout checks, DevX provider)
    reason: str           # why something is missing, in words

    def describe(self) -> str:
        parts = [f"engine={'yes' if self.engine else 'no'}", f"cuda={'yes' if self.cuda else 'no'}",
                 f"rdma_core={'yes' if self.rdma_core else 'no'}"]
        return ", ".join(parts) + (f" ({self.reason})" if self.reason else "")


def load() -> Optional[ModuleType]:
    try:
        return importlib.import_module("pyep._engine")
    except ImportError as exc:
        log.debug("pyep._engine not importable: %s", exc)
        return None


def engine() -> ModuleType:
    """The native module, or a clear error saying how to build it."""
    mod = load()
    if mod is None:
        raise RuntimeError("pyep's native engine is not built: run `pip install -e .` (or "
                           "`python setup.py build_ext --inplace`) in the pyep checkout")
    return mod


def availability() -> Availability:
    mod = load()
    if mod is None:
        return Availability(False, False, False, "native engine not built; only the reference backend works")
    cuda = bool(getattr(mod, "has_cuda", False))
    rdma = bool(getattr(mod, "has_rdma_core", False))
    reason = []
    if not cuda:
        reason.append("host-only build: no CUDA kernels (built without a CUDA torch/nvcc)")
    if not rdma:
        reason.append("built without rdma-core headers: no DevX provider")
    return Availability(True, cuda, rdma, "; ".join(reason))
