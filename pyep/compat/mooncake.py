"""Drop-in for Mooncake EP's `mooncake.mooncake_ep_buffer.Buffer` on top of pyep.

    from pyep.compat.mooncake import Buffer
    buf = Buffer(group, Buffer.get_ep_buffer_size_hint(T, H, R, E))
    recv_x, recv_count, handle, event, hook = buf.dispatch(x, topk_idx, active_ranks, T, E, timeout_us)
    out, event, hook = buf.combine(y, topk_idx, topk_weights, active_ranks, timeout_us, handle)

active_ranks (int32 [R], on the device) is updated in place: a rank that misses timeout_us is set to
0 and skipped from then on. timeout_us must be positive: pyep never waits forever, so Mooncake's
"-1 = no timeout" is refused rather than silently replaced.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Tuple, Union

from ..ep.config import DEFAULT_TIMEOUT_US
from ..ep.config import size_hint as _size_hint
from ..ep.handle import Handle
from ._shapes import EventOverlap, ShapeBuffers, hidden_of, template_config

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

RecvX = Union["torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]]


def _timeout(timeout_us: object) -> int:
    if isinstance(timeout_us, bool) or not isinstance(timeout_us, int):
        raise TypeError(f"timeout_us must be an int (microseconds), got {type(timeout_us).__name__}")
    if timeout_us <= 0:
        raise ValueError(f"timeout_us must be > 0 microseconds, got {timeout_us} (pyep bounds every "
                         f"wait; there is no 'wait forever')")
    return timeout_us


class Buffer:
    def __init__(self, group: Optional["dist.ProcessGroup"] = None, num_ep_buffer_bytes: int = 0, *,
                 backend: str = "auto", transport: str = "auto", device_name: str = "mlx5_0",
                 timeout_us: int = DEFAULT_TIMEOUT_US, allow_nvlink: bool = True) -> None:
        if isinstance(num_ep_buffer_bytes, bool) or not isinstance(num_ep_buffer_bytes, int) \
                or num_ep_buffer_bytes < 0:
            raise ValueError(f"num_ep_buffer_bytes must be an int >= 0, got {num_ep_buffer_bytes!r}")
        self._buffers = ShapeBuffers(group, template_config(
            backend=backend, transport=transport, device_name=device_name, timeout_us=timeout_us,
            num_qps_per_peer=None, allow_nvlink=allow_nvlink,
            num_buffer_bytes=num_ep_buffer_bytes or None))

    @staticmethod
    def get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                num_experts: int) -> int:
        return _size_hint(num_max_dispatch_tokens_per_rank, hidden, num_experts, num_ranks)

    def dispatch(self, x: "torch.Tensor", topk_idx: "torch.Tensor", active_ranks: "torch.Tensor",
                 num_max_dispatch_tokens_per_rank: int, num_experts: int, timeout_us: int,
                 use_fp8: bool = True, async_finish: bool = False, return_recv_hook: bool = False
                 ) -> Tuple[RecvX, "torch.Tensor", Handle, EventOverlap, Optional[Callable[[], None]]]:
        if active_ranks is None:
            raise TypeError("active_ranks is required (int32 [num_ranks], 1 = active)")
        buf = self._buffers.get((num_max_dispatch_tokens_per_rank, hidden_of(x), num_experts), "dispatch")
        recv, count, handle, event, hook = buf.dispatch(
            x, topk_idx, use_fp8=use_fp8, active_ranks=active_ranks, timeout_us=_timeout(timeout_us),
            async_finish=async_finish, return_recv_hook=return_recv_hook)
        return recv, count, handle, EventOverlap(event), hook

    def combine(self, x: "torch.Tensor", topk_idx: "torch.Tensor", topk_weights: "torch.Tensor",
                active_ranks: "torch.Tensor", timeout_us: int, handle: Handle, zero_copy: bool = False,
                async_finish: bool = False, return_recv_hook: bool = False,
                out: Optional["torch.Tensor"] = None
                ) -> Tuple["torch.Tensor", EventOverlap, Optional[Callable[[], None]]]:
        if active_ranks is None:
            raise TypeError("active_ranks is required (int32 [num_ranks], 1 = active)")
        buf = self._buffers.for_handle(handle, "combine")
        combined, event, hook = buf.combine(
            x, topk_idx, topk_weights, handle, active_ranks=active_ranks,
            timeout_us=_timeout(timeout_us), zero_copy=zero_copy, async_finish=async_finish,
            return_recv_hook=return_recv_hook, out=out)
        return combined, EventOverlap(event), hook

    def get_next_combine_buffer(self, handle: Handle) -> "torch.Tensor":
        return self._buffers.for_handle(handle, "get_next_combine_buffer").get_next_combine_buffer(handle)

    def update_ep_member(self) -> None:
        """Collective: re-admit restarted ranks on every buffer of this instance."""
        if self._buffers.destroyed:
            raise RuntimeError("update_ep_member() called after destroy()")
        for buf in self._buffers.buffers.values():
            buf.update_ep_member()

    def destroy(self) -> None:
        self._buffers.destroy()
