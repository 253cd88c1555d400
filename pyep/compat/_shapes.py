"""Shared by the drop-in shims: DeepEP and Mooncake pass the shape (T, E; H from x) on every call
instead of at construction, so a shim keeps one EpBuffer per shape, created on first use (a
collective, like the call that triggers it)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple, Union

from ..ep.buffer import EpBuffer
from ..ep.config import MAX_TOPK, EpConfig
from ..ep.handle import Handle

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("pyep.compat")
ShapeKey = Tuple[int, int, int]   # (num_max_dispatch_tokens_per_rank, hidden, num_experts)


def hidden_of(x: Any) -> int:
    import torch
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must have shape [N, hidden], got {list(x.shape)}")
    return int(x.shape[1])


def handle_key(handle: Any) -> ShapeKey:
    if not isinstance(handle, Handle):
        raise TypeError(f"handle must be the handle returned by dispatch, got {type(handle).__name__}")
    return (handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)


@dataclass
class ShapeBuffers:
    """EpBuffers of one shim instance, keyed by shape."""

    group: Optional["dist.ProcessGroup"]
    template: EpConfig                      # transport/backend settings; shape fields replaced
    buffers: Dict[ShapeKey, EpBuffer] = field(default_factory=dict)
    destroyed: bool = False

    def get(self, key: ShapeKey, what: str) -> EpBuffer:
        if self.destroyed:
            raise RuntimeError(f"{what}() called after destroy()")
        buf = self.buffers.get(key)
        if buf is None:
            t, h, e = key
            cfg = EpConfig(num_max_dispatch_tokens_per_rank=t, hidden=h, num_experts=e,
                           max_topk=self.template.max_topk, transport=self.template.transport,
                           allow_nvlink=self.template.allow_nvlink, device_name=self.template.device_name,
                           timeout_us=self.template.timeout_us,
                           num_qps_per_peer=self.template.num_qps_per_peer,
                           num_buffer_bytes=self.template.num_buffer_bytes,
                           ranks_per_node=self.template.ranks_per_node, backend=self.template.backend,
                           check_values=self.template.check_values)
            buf = EpBuffer.from_config(cfg, self.group)
            log.debug("created EpBuffer for T=%d H=%d E=%d", t, h, e)
            self.buffers[key] = buf
        return buf

    def for_handle(self, handle: Any, what: str) -> EpBuffer:
        key = handle_key(handle)
        if self.destroyed:
            raise RuntimeError(f"{what}() called after destroy()")
        buf = self.buffers.get(key)
        if buf is None:
            raise ValueError(f"{what}: handle was issued by another Buffer (no buffer of shape "
                             f"T={key[0]}, H={key[1]}, E={key[2]} here)")
        return buf

    def destroy(self) -> None:
        for buf in self.buffers.values():
            buf.destroy()
        self.buffers.clear()
        self.destroyed = True


def template_config(*, backend: str, transport: str, device_name: str, timeout_us: int,
                    num_qps_per_peer: Optional[int], allow_nvlink: bool,
                    num_buffer_bytes: Optional[int], check_values: Union[bool, str] = True) -> EpConfig:
    # A template: the shape only has to pass validation; ShapeBuffers builds a config per call shape.
    return EpConfig(num_max_dispatch_tokens_per_rank=1, hidden=128, num_experts=1, max_topk=MAX_TOPK,
                    transport=transport, allow_nvlink=allow_nvlink, device_name=device_name,
                    timeout_us=timeout_us, num_qps_per_peer=num_qps_per_peer,
                    num_buffer_bytes=num_buffer_bytes, backend=backend, check_values=check_values)


class EventOverlap:
    """DeepEP/Mooncake's event wrapper: current_stream_wait() and `with event:` overlap blocks."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def current_stream_wait(self) -> None:
        self.event.current_stream_wait()

    def wait(self) -> None:
        self.event.wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.event.current_stream_wait()
