"""Drop-in for Mooncake EP's `mooncake.mooncake_ep_buffer.Buffer` (the API SGLang's Mooncake
dispatcher calls) on top of pyep.

    from pyep.compat.mooncake import Buffer     # or: pyep.compat.install_mooncake_alias()
    buf = Buffer(group, Buffer.get_ep_buffer_size_hint(T, H, R, E))
    recv_x, recv_count, handle, event, hook = buf.dispatch(x, topk_idx, active_ranks, T, E, timeout_us)
    out, event, hook = buf.combine(y, topk_idx, topk_weights, active_ranks, timeout_us, handle)
    buf.update_ep_member()                      # collective, after restarted ranks rejoined

active_ranks (int32 [R], 1 = active, on the buffer's device) is read on every call and updated in
place: a rank that misses timeout_us is set to 0 and neither sent to nor waited for from then on; the
caller sets it back to 1 (and calls update_ep_member) when the rank is back. timeout_us <= 0 is
Mooncake's "no timeout" (SGLang passes -1 on the first call, while kernels warm up): pyep bounds every
wait, so it becomes NO_TIMEOUT_BOUND_US, logged once per Buffer.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple, Union

from ..ep.config import DEFAULT_TIMEOUT_US
from ..ep.ll.layout import size_hint as _size_hint
from ..ep.ll.handle import Handle
from ._events import EventOverlap
from ._shapes import DEFAULT_MAX_SHAPES, ShapeBuffers, check_max_shapes, hidden_of, template_config

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("pyep.compat.mooncake")
RecvX = Union["torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]]
Hook = Optional[Callable[[], None]]
__all__ = ["Buffer", "EventOverlap", "NO_TIMEOUT_BOUND_US"]
# What "no timeout" becomes: ten minutes covers first-call JIT compilation, CUDA-graph capture and
# connection warm-up on a loaded node, yet a rank that died still surfaces (as a timed-out peer
# marked 0 in active_ranks) instead of hanging the job forever.
NO_TIMEOUT_BOUND_US = 600_000_000


class Buffer:
    """Mooncake EP's Buffer: `Buffer(group, num_ep_buffer_bytes=0)`; pyep's options are keyword-only."""

    def __init__(self, group: Optional["dist.ProcessGroup"] = None, num_ep_buffer_bytes: int = 0, *,
                 backend: str = "auto", transport: str = "auto", device_name: str = "mlx5_0",
                 timeout_us: int = DEFAULT_TIMEOUT_US, allow_nvlink: bool = True,
                 max_ll_shapes: int = DEFAULT_MAX_SHAPES) -> None:
        import torch.distributed as dist
        from ..ep._dist import resolve_group
        if isinstance(num_ep_buffer_bytes, bool) or not isinstance(num_ep_buffer_bytes, int) \
                or num_ep_buffer_bytes < 0:
            raise ValueError(f"num_ep_buffer_bytes must be an int >= 0, got {num_ep_buffer_bytes!r}")
        check_max_shapes(max_ll_shapes)
        template = template_config(backend=backend, transport=transport, device_name=device_name,
                                   timeout_us=timeout_us, allow_nvlink=allow_nvlink,
                                   num_buffer_bytes=num_ep_buffer_bytes or None)
        self.group = resolve_group(group)
        self.backend = self.group            # Mooncake's attribute: the group's c10d backend object
        self.rank: int = dist.get_rank(self.group)
        self.group_size: int = dist.get_world_size(self.group)
        self.num_ep_buffer_bytes = num_ep_buffer_bytes
        self._unbounded_logged = False
        self._buffers = ShapeBuffers(self.group, template, max_shapes=max_ll_shapes)

    def _timeout(self, timeout_us: Any) -> int:
        if isinstance(timeout_us, bool) or not isinstance(timeout_us, int):
            raise TypeError(f"timeout_us must be an int (microseconds; -1 = no timeout), got "
                            f"{type(timeout_us).__name__}")
        if timeout_us > 0:
            return timeout_us
        if not self._unbounded_logged:
            self._unbounded_logged = True
            log.info("timeout_us=%d (Mooncake: no timeout) -> %d us: pyep bounds every wait "
                     "(pyep.compat.mooncake.NO_TIMEOUT_BOUND_US)", timeout_us, NO_TIMEOUT_BOUND_US)
        else:
            log.debug("timeout_us=%d -> %d us", timeout_us, NO_TIMEOUT_BOUND_US)
        return NO_TIMEOUT_BOUND_US

    @staticmethod
    def get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                num_experts: int) -> int:
        """Bytes pyep's buffer needs for this shape (Mooncake's argument order)."""
        return _size_hint(num_max_dispatch_tokens_per_rank, hidden, num_experts, num_ranks)

    def dispatch(self, x: "torch.Tensor", topk_idx: "torch.Tensor", active_ranks: "torch.Tensor",
                 num_max_dispatch_tokens_per_rank: int, num_experts: int, timeout_us: int,
                 use_fp8: bool = True, async_finish: bool = False, return_recv_hook: bool = False
                 ) -> Tuple[RecvX, "torch.Tensor", Handle, EventOverlap, Hook]:
        if active_ranks is None:
            raise TypeError("active_ranks is required (int32 [num_ranks], 1 = active)")
        timeout = self._timeout(timeout_us)
        buf = self._buffers.get((num_max_dispatch_tokens_per_rank, hidden_of(x), num_experts), "dispatch")
        recv, count, handle, event, hook = buf.dispatch(
            x, topk_idx, use_fp8=use_fp8, active_ranks=active_ranks, timeout_us=timeout,
            async_finish=async_finish, return_recv_hook=return_recv_hook)
        keep = (x, topk_idx, recv, count, handle) if async_finish else None
        return recv, count, handle, EventOverlap(event, keep), hook

    def combine(self, x: "torch.Tensor", topk_idx: "torch.Tensor", topk_weights: "torch.Tensor",
                active_ranks: "torch.Tensor", timeout_us: int, handle: Handle, zero_copy: bool = False,
                async_finish: bool = False, return_recv_hook: bool = False,
                out: Optional["torch.Tensor"] = None
                ) -> Tuple["torch.Tensor", EventOverlap, Hook]:
        if active_ranks is None:
            raise TypeError("active_ranks is required (int32 [num_ranks], 1 = active)")
        timeout = self._timeout(timeout_us)
        buf = self._buffers.for_handle(handle, "combine")
        combined, event, hook = buf.combine(
            x, topk_idx, topk_weights, handle, active_ranks=active_ranks, timeout_us=timeout,
            zero_copy=zero_copy, async_finish=async_finish, return_recv_hook=return_recv_hook, out=out)
        keep = (x, topk_idx, topk_weights, handle, combined) if async_finish else None
        return combined, EventOverlap(event, keep), hook

    def get_next_combine_buffer(self, handle: Handle) -> "torch.Tensor":
        return self._buffers.for_handle(handle, "get_next_combine_buffer").get_next_combine_buffer(handle)

    def update_ep_member(self, active_ranks: Optional["torch.Tensor"] = None) -> None:
        """Collective: re-admit restarted ranks on every buffer of this instance (Mooncake re-exchanges
        its RDMA metadata here). Earlier handles go stale. active_ranks (pyep extension) also becomes
        the membership a call without one uses."""
        if self._buffers.destroyed:
            raise RuntimeError("update_ep_member() called after destroy()")
        for buf in self._buffers.buffers.values():
            buf.update_ep_member(active_ranks)

    def destroy(self) -> None:
        """pyep extension (Mooncake frees on garbage collection): release every buffer now."""
        self._buffers.destroy()
