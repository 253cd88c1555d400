"""Drop-in for DeepEP's low-latency `deep_ep.Buffer` API on top of pyep.

    from pyep.compat.deep_ep import Buffer
    buf = Buffer(group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                 low_latency_mode=True)
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(x, topk_idx, T, E)
    out, event, hook = buf.low_latency_combine(y, topk_idx, topk_weights, handle)

Only the low-latency mode exists here; the normal (high-throughput) mode raises. The handle unpacks
like DeepEP's 5-tuple (src_info, layout_range, T, H, E).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple, Union

from ..ep.config import DEFAULT_TIMEOUT_US
from ..ep.config import size_hint as _size_hint
from ..ep.handle import Handle
from ._shapes import EventOverlap, ShapeBuffers, hidden_of, template_config

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("pyep.compat.deep_ep")
RecvX = Union["torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]]


class Buffer:
    def __init__(self, group: Optional["dist.ProcessGroup"] = None, num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = True,
                 num_qps_per_rank: Optional[int] = None, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, *, backend: str = "auto",
                 transport: str = "auto", device_name: str = "mlx5_0",
                 timeout_us: int = DEFAULT_TIMEOUT_US) -> None:
        if not low_latency_mode:
            raise ValueError("pyep.compat.deep_ep implements only the low-latency mode: pass "
                             "low_latency_mode=True")
        for name, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if allow_mnnvl:
            raise ValueError("allow_mnnvl=True (multi-node NVLink) is not supported by pyep")
        if num_nvl_bytes:
            log.debug("num_nvl_bytes=%d is a normal-mode buffer size; the low-latency mode does not "
                      "use it", num_nvl_bytes)
        self._explicitly_destroy = explicitly_destroy
        self._buffers = ShapeBuffers(group, template_config(
            backend=backend, transport=transport, device_name=device_name, timeout_us=timeout_us,
            num_qps_per_peer=num_qps_per_rank, allow_nvlink=allow_nvlink_for_low_latency_mode,
            num_buffer_bytes=num_rdma_bytes or None))

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes pyep's low-latency buffer needs (DeepEP's argument order)."""
        return _size_hint(num_max_dispatch_tokens_per_rank, hidden, num_experts, num_ranks)

    def low_latency_dispatch(self, x: "torch.Tensor", topk_idx: "torch.Tensor",
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional["torch.Tensor"] = None,
                             dispatch_wait_recv_cost_stats: Optional["torch.Tensor"] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False
                             ) -> Tuple[RecvX, "torch.Tensor", Handle, EventOverlap, Optional[Callable[[], None]]]:
        if dispatch_wait_recv_cost_stats is not None:
            raise ValueError("dispatch_wait_recv_cost_stats is not supported by pyep; pass None")
        buf = self._buffers.get((num_max_dispatch_tokens_per_rank, hidden_of(x), num_experts),
                                "low_latency_dispatch")
        recv, count, handle, event, hook = buf.dispatch(
            x, topk_idx, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
            async_finish=async_finish, return_recv_hook=return_recv_hook,
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats)
        return recv, count, handle, EventOverlap(event), hook

    def low_latency_combine(self, x: "torch.Tensor", topk_idx: "torch.Tensor",
                            topk_weights: "torch.Tensor", handle: Handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional["torch.Tensor"] = None,
                            combine_wait_recv_cost_stats: Optional["torch.Tensor"] = None
                            ) -> Tuple["torch.Tensor", EventOverlap, Optional[Callable[[], None]]]:
        if use_logfmt:
            raise ValueError("use_logfmt=True (LogFMT combine compression) is not supported by pyep; "
                             "combine sends BF16")
        if combine_wait_recv_cost_stats is not None:
            raise ValueError("combine_wait_recv_cost_stats is not supported by pyep; pass None")
        buf = self._buffers.for_handle(handle, "low_latency_combine")
        combined, event, hook = buf.combine(x, topk_idx, topk_weights, handle, zero_copy=zero_copy,
                                            async_finish=async_finish,
                                            return_recv_hook=return_recv_hook, out=out)
        return combined, EventOverlap(event), hook

    def get_next_low_latency_combine_buffer(self, handle: Handle) -> "torch.Tensor":
        buf = self._buffers.for_handle(handle, "get_next_low_latency_combine_buffer")
        return buf.get_next_combine_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Reset the buffer of that shape (creating it if needed); earlier handles go stale."""
        self._buffers.get((num_max_dispatch_tokens_per_rank, hidden, num_experts),
                          "clean_low_latency_buffer").clean()

    def ep_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> Any:
        """The underlying pyep EpBuffer of one shape (transport_table(), describe(), ...)."""
        return self._buffers.get((num_max_dispatch_tokens_per_rank, hidden, num_experts), "ep_buffer")

    def destroy(self) -> None:
        self._buffers.destroy()
