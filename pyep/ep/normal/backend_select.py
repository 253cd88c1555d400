"""Which backend a NormalBuffer runs on: the native kernels (intranode, or staged across nodes) where
every rank of the group can run them, else the reference over torch.distributed (contract.py)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from .._dist import all_reduce_min_bounded as all_reduce_min
from .._dist import group_device
from .contract import NormalBackend
from .topology import NodeLayout

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("pyep.ep.normal")


def _native_class(nodes: NodeLayout) -> Any:
    """The native backend for the group: the staged internode one when it spans nodes."""
    if nodes.internode:
        from .native_internode import NormalInternodeBackend
        return NormalInternodeBackend
    from .native import NormalNativeBackend
    return NormalNativeBackend


def _native_unavailable_reason(group: "dist.ProcessGroup", kwargs: dict) -> Optional[str]:
    """Local check (no communication): can this process run the native backend? None if yes.
    unavailable_reason takes the constructor's arguments."""
    import torch
    try:
        cls = _native_class(kwargs["nodes"])
    except ImportError as exc:
        return f"the native normal backend is not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    return cls.unavailable_reason(group, **kwargs)


def make_backend(group: "dist.ProcessGroup", backend: str, kwargs: dict) -> NormalBackend:
    """The backend NormalBuffer(backend=...) runs on: "reference", "native" (BackendUnavailable when this
    process cannot run it), or "auto" -- native only where every rank of the group can run it (one
    bounded all-reduce of the local answers), else the reference. `kwargs` are the native backend's
    constructor arguments, with "mask" and "elastic" taken out here."""
    import torch
    from .reference import NormalReferenceBackend
    nodes: NodeLayout = kwargs["nodes"]
    mask = kwargs.pop("mask")
    elastic = kwargs.pop("elastic")
    if nodes.internode:   # an elastic internode buffer runs rank to rank (native_internode.py)
        kwargs["elastic"] = elastic
    if backend == "reference":
        return NormalReferenceBackend(group, timeout_us=kwargs["timeout_us"], nodes=nodes, mask=mask)
    reason = _native_unavailable_reason(group, kwargs)
    if backend == "native":
        if reason is not None:
            from ..backend import BackendUnavailable
            raise BackendUnavailable(f"NormalBuffer(backend='native') cannot run here: {reason}")
        return _native_class(nodes)(group, **kwargs)
    # "auto": every rank must pick the same backend, so agree on the local answers first.
    flag = torch.tensor([0 if reason else 1], dtype=torch.int32, device=group_device(group))
    all_reduce_min(flag, group, kwargs["timeout_us"], "NormalBuffer backend selection")
    if int(flag.item()) == 1:
        return _native_class(nodes)(group, **kwargs)
    log.info("NormalBuffer: using the reference backend (%s)", reason or "another rank cannot run the native one")
    return NormalReferenceBackend(group, timeout_us=kwargs["timeout_us"], nodes=nodes, mask=mask)
