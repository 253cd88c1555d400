"""Drop-in for DeepEP's `deep_ep.Buffer` API on top of pyep: the low-latency mode and the normal
(high-throughput) mode within one node.

    from pyep.compat.deep_ep import Buffer, Config
    # normal mode (intranode)
    buf = Buffer(group, num_nvl_bytes=int(1e9))
    ntpr, _, ntpe, is_token_in_rank, event = buf.get_dispatch_layout(topk_idx, E)
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=ntpr, is_token_in_rank=is_token_in_rank, num_tokens_per_expert=ntpe,
        topk_idx=topk_idx, topk_weights=topk_weights)
    combined_x, combined_w, event = buf.combine(y, handle, topk_weights=recv_w)
    # low-latency mode
    buf = Buffer(group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                 low_latency_mode=True)
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(x, topk_idx, T, E)
    out, event, hook = buf.low_latency_combine(y, topk_idx, topk_weights, handle)

Like DeepEP's, one Buffer serves both modes. The normal mode is pyep.ep.normal.NormalBuffer (its
handle unpacks like DeepEP's 6-tuple); the internode normal mode is not available. The low-latency
handle unpacks like DeepEP's 5-tuple (src_info, layout_range, T, H, E).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple, Union

from ..ep.config import DEFAULT_TIMEOUT_US, MAX_HIDDEN
from ..ep.config import size_hint as _size_hint
from ..ep.handle import Handle
from ..ep.normal.buffer import NormalBuffer
from ..ep.normal.config import Config
from ..ep.normal.handle import NormalHandle
from ._shapes import EventOverlap, ShapeBuffers, hidden_of, template_config

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("pyep.compat.deep_ep")
RecvX = Union["torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]]
Bias = Union[None, "torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]]
__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]


def __getattr__(name: str) -> Any:
    # DeepEP's deep_ep.topk_idx_t, resolved lazily: importing the shim must not import torch.
    if name == "topk_idx_t":
        import torch
        return torch.int64
    raise AttributeError(f"module 'pyep.compat.deep_ep' has no attribute {name!r}")


def normal_hidden(num_nvl_bytes: int, num_ranks: int) -> int:
    """The largest hidden (a multiple of 128, <= MAX_HIDDEN) whose default-config native buffer fits in
    num_nvl_bytes. DeepEP sizes its normal mode by bytes alone and takes any hidden that fits; pyep's
    NormalBuffer wants an upper bound on hidden, and this is the one those bytes give. 0 if none fits."""
    for hidden in range(MAX_HIDDEN, 0, -128):
        if NormalBuffer.size_hint(hidden, num_ranks) <= num_nvl_bytes:
            return hidden
    return 0


class Buffer:
    """DeepEP's Buffer. `low_latency_mode` is accepted for DeepEP's signature but gates nothing: pyep
    keeps separate buffers per mode, so both modes' methods work on any Buffer.

    When the normal mode's NormalBuffer is created: at construction when num_nvl_bytes > 0 (DeepEP
    allocates its NVLink buffer there too, and construction is collective in both), else on the first
    normal-mode call (also collective: every rank makes it). A low-latency-only user (num_nvl_bytes=0)
    thus never pays for an NVLink buffer it does not use."""

    num_sms: int = NormalBuffer.num_sms

    def __init__(self, group: Optional["dist.ProcessGroup"] = None, num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: Optional[int] = None, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, *, backend: str = "auto",
                 transport: str = "auto", device_name: str = "mlx5_0",
                 timeout_us: int = DEFAULT_TIMEOUT_US) -> None:
        for name, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if allow_mnnvl:
            raise ValueError("allow_mnnvl=True (multi-node NVLink) is not supported by pyep")
        self.low_latency_mode = low_latency_mode
        self._explicitly_destroy = explicitly_destroy
        self._buffers = ShapeBuffers(group, template_config(
            backend=backend, transport=transport, device_name=device_name, timeout_us=timeout_us,
            num_qps_per_peer=num_qps_per_rank, allow_nvlink=allow_nvlink_for_low_latency_mode,
            num_buffer_bytes=num_rdma_bytes or None))
        self._group = group
        self._num_nvl_bytes = num_nvl_bytes
        self._normal_kwargs = dict(backend=backend, transport=transport, timeout_us=timeout_us)
        self._normal: Optional[NormalBuffer] = None
        if num_nvl_bytes > 0:
            self._normal_buffer("Buffer")

    # ------------------------------------------------------------------ normal mode
    def _normal_buffer(self, what: str) -> NormalBuffer:
        if self._buffers.destroyed:
            raise RuntimeError(f"{what}() called after destroy()")
        if self._normal is None:
            import torch.distributed as dist
            from ..ep._dist import resolve_group
            group = resolve_group(self._group)
            if self._num_nvl_bytes:
                hidden = normal_hidden(self._num_nvl_bytes, dist.get_world_size(group))
                if hidden == 0:
                    raise ValueError(f"num_nvl_bytes={self._num_nvl_bytes} is too small for the normal mode "
                                     f"(hidden=128 needs {NormalBuffer.size_hint(128, dist.get_world_size(group))} "
                                     f"bytes); see NormalBuffer.size_hint")
                nvl: Optional[int] = self._num_nvl_bytes
            else:
                hidden, nvl = 7168, None   # sized by pyep for DeepSeek's hidden
            self._normal = NormalBuffer(group, nvl, hidden=hidden, **self._normal_kwargs)
            log.debug("normal-mode buffer: %s", self._normal.describe())
        return self._normal

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs of the normal-mode kernels in the default configs (even: a sender and a receiver per
        channel)."""
        NormalBuffer.set_num_sms(new_num_sms)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return NormalBuffer.get_dispatch_config(num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return NormalBuffer.get_combine_config(num_ranks)

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(NormalBuffer.capture())

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The normal mode's communication stream; None on CPU devices or before the normal-mode buffer
        exists (num_nvl_bytes=0 and no normal-mode call yet)."""
        return self._normal.get_comm_stream() if self._normal is not None else None

    def get_dispatch_layout(self, topk_idx: "torch.Tensor", num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> Tuple["torch.Tensor", None, "torch.Tensor", "torch.Tensor", EventOverlap]:
        ntpr, rdma, ntpe, in_rank, event = self._normal_buffer("get_dispatch_layout").get_dispatch_layout(
            topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream)
        return ntpr, rdma, ntpe, in_rank, EventOverlap(event)

    def dispatch(self, x: RecvX, handle: Optional[NormalHandle] = None,
                 num_tokens_per_rank: Optional["torch.Tensor"] = None,
                 num_tokens_per_rdma_rank: Optional["torch.Tensor"] = None,
                 is_token_in_rank: Optional["torch.Tensor"] = None,
                 num_tokens_per_expert: Optional["torch.Tensor"] = None,
                 topk_idx: Optional["torch.Tensor"] = None, topk_weights: Optional["torch.Tensor"] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False
                 ) -> Tuple[RecvX, Optional["torch.Tensor"], Optional["torch.Tensor"], Optional[List[int]],
                            Optional[NormalHandle], EventOverlap]:
        *rest, event = self._normal_buffer("dispatch").dispatch(
            x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
            topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
            allocate_on_comm_stream)
        recv_x, recv_idx, recv_w, counts, new_handle = rest
        return recv_x, recv_idx, recv_w, counts, new_handle, EventOverlap(event)

    def combine(self, x: "torch.Tensor", handle: NormalHandle, topk_weights: Optional["torch.Tensor"] = None,
                bias: Bias = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False
                ) -> Tuple["torch.Tensor", Optional["torch.Tensor"], EventOverlap]:
        combined_x, combined_w, event = self._normal_buffer("combine").combine(
            x, handle, topk_weights, bias, config, previous_event, async_finish, allocate_on_comm_stream)
        return combined_x, combined_w, EventOverlap(event)

    def internode_dispatch(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("pyep's normal mode is intranode only: internode_dispatch (RDMA between "
                                  "nodes) is not available yet; use one node's ranks, or the low-latency mode")

    def internode_combine(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("pyep's normal mode is intranode only: internode_combine (RDMA between "
                                  "nodes) is not available yet; use one node's ranks, or the low-latency mode")

    def normal_buffer(self) -> NormalBuffer:
        """The underlying pyep NormalBuffer (describe(), backend_name, ...); creates it if needed
        (collective)."""
        return self._normal_buffer("normal_buffer")

    # ------------------------------------------------------------------ low-latency mode
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
        if self._normal is not None:
            self._normal.destroy()
            self._normal = None
        self._buffers.destroy()
