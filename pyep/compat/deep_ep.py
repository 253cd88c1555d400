"""Drop-in for DeepEP's `deep_ep` module on top of pyep: V1's `Buffer` (low-latency mode, shrink mode,
and the normal mode inside a node and across nodes), V2's `ElasticBuffer` / `EPHandle`
(pyep.compat.elastic), `Config`, `EventOverlap`, `EventHandle`, `topk_idx_t`.

    from pyep.compat.deep_ep import Buffer, Config          # or: pyep.compat.install_deep_ep_alias()
    buf = Buffer(group, num_nvl_bytes=int(1e9))             # normal mode
    ntpr, ntprr, ntpe, is_token_in_rank, event = buf.get_dispatch_layout(topk_idx, E)
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=ntpe, topk_idx=topk_idx, topk_weights=topk_weights)
    combined_x, combined_w, event = buf.combine(y, handle, topk_weights=recv_w)
    buf = Buffer(group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                 low_latency_mode=True, num_qps_per_rank=E // R)   # low-latency mode
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(x, topk_idx, T, E)
    out, event, hook = buf.low_latency_combine(y, topk_idx, topk_weights, handle)

Like DeepEP's, one Buffer serves both modes. The normal-mode handle unpacks like DeepEP's: the 6-tuple
inside a node, the 10-tuple across nodes (pyep.compat._v1_internode). docs/compat.md lists every name
and what differs.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple, Union

from ..ep.config import DEFAULT_TIMEOUT_US
from ..ep.ll.layout import size_hint as _size_hint
from ..ep.ll.handle import Handle
from ..ep.normal.buffer import NormalBuffer
from ..ep.normal.config import Config
from ..ep.normal.handle import NormalHandle
from . import _events as utils  # noqa: F401 - deep_ep.utils (EventOverlap, EventHandle)
from ._configs import normal_config, normal_hidden
from ._events import EventHandle, EventOverlap
from ._shapes import (DEFAULT_MAX_SHAPES, ActiveMask, ShapeBuffers, check_max_shapes, hidden_of, raw_buffer_tensor,
                      template_config)
from ._v1_internode import InternodeHandle, native_forward_stage, reference_forward_stage, unwrap
from .elastic import ElasticBuffer, EPHandle

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("pyep.compat.deep_ep")
RecvX = Union["torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]]
Bias = Union[None, "torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]]
Hook = Optional[Callable[[], None]]
__all__ = ["Buffer", "Config", "EventOverlap", "EventHandle", "ElasticBuffer", "EPHandle", "topk_idx_t"]
NormalHandles = Union[NormalHandle, InternodeHandle]


def __getattr__(name: str) -> Any:
    # DeepEP's deep_ep.topk_idx_t, resolved lazily: importing the shim must not import torch.
    if name == "topk_idx_t":
        import torch
        return torch.int64
    raise AttributeError(f"module 'pyep.compat.deep_ep' has no attribute {name!r}")


def _check_bytes(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    return v


class Buffer:
    """DeepEP's Buffer. Both modes' methods work on any Buffer (pyep keeps a buffer per mode):
    `low_latency_mode` only decides when the normal-mode buffer is made. With low_latency_mode=False
    and num_nvl_bytes > 0 it is made here (construction is collective, as in DeepEP); otherwise on the
    first normal-mode call (collective too), so a low-latency user never pays for NVLink rings.
    Low-latency buffers are made per (T, H, E) shape on first use."""

    num_sms: int = NormalBuffer.num_sms

    def __init__(self, group: Optional["dist.ProcessGroup"] = None, num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Optional[Any] = None, *, backend: str = "auto", transport: str = "auto",
                 device_name: str = "mlx5_0", timeout_us: int = DEFAULT_TIMEOUT_US,
                 max_ll_shapes: int = DEFAULT_MAX_SHAPES) -> None:
        import torch.distributed as dist
        from ..ep._dist import resolve_group
        _check_bytes("num_nvl_bytes", num_nvl_bytes)
        _check_bytes("num_rdma_bytes", num_rdma_bytes)
        if isinstance(num_qps_per_rank, bool) or not isinstance(num_qps_per_rank, int) or num_qps_per_rank < 0:
            raise ValueError(f"num_qps_per_rank must be an int >= 1, got {num_qps_per_rank!r}")
        if low_latency_mode and num_qps_per_rank < 1:
            raise ValueError("num_qps_per_rank must be >= 1 in low-latency mode (DeepEP asserts the same)")
        check_max_shapes(max_ll_shapes)
        if group is None and comm is not None:
            raise NotImplementedError("comm (an mpi4py communicator) is not supported: pyep sets its buffers "
                                      "up over torch.distributed; call init_process_group() and pass "
                                      "group= (e.g. dist.new_group over the same ranks)")
        if comm is not None:
            log.debug("comm given together with group: the group is used (as DeepEP does)")
        if allow_mnnvl:
            log.info("allow_mnnvl=True: pyep does not use multi-node NVLink; peers on other nodes are "
                     "reached over the NIC (transport='auto'), which gives the same results")
        if use_fabric:
            log.info("use_fabric=True: pyep maps same-node peers with CUDA IPC handles, not the fabric API; "
                     "the buffers behave the same")
        # Every argument is checked (template_config) before the group is touched.
        template = template_config(backend=backend, transport=transport, device_name=device_name,
                                   timeout_us=timeout_us, allow_nvlink=allow_nvlink_for_low_latency_mode,
                                   num_buffer_bytes=num_rdma_bytes or None)
        self.group = resolve_group(group)
        self.rank: int = dist.get_rank(self.group)
        self.group_size: int = dist.get_world_size(self.group)
        self._buffers = ShapeBuffers(self.group, template, qps_per_rank=num_qps_per_rank, max_shapes=max_ll_shapes)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self._mask: Optional[ActiveMask] = ActiveMask(self.group_size) if enable_shrink else None
        self._normal_kwargs = dict(backend=backend, transport=transport, timeout_us=timeout_us)
        self._normal: Optional[NormalBuffer] = None
        if num_nvl_bytes > 0 and not low_latency_mode:
            self._normal_buffer("Buffer")

    def __del__(self) -> None:
        # DeepEP's destructor frees the buffers unless explicitly_destroy (then destroy() must be called).
        try:
            if not getattr(self, "explicitly_destroy", True):
                self._release()
            elif not self._buffers.destroyed and (self._buffers.buffers or self._normal is not None):
                log.warning("destroy() was not called before a Buffer(explicitly_destroy=True) was "
                            "collected; its resources stay until the process exits")
        except Exception:   # noqa: BLE001 - nothing may escape a finaliser (interpreter shutdown)
            pass

    # ------------------------------------------------------------------ static / class API
    @staticmethod
    def is_sm90_compiled() -> bool:
        """DeepEP gates FP8 (and TMA) features with it; every pyep backend has them (the reference
        quantizes bit-for-bit like the kernels), so True."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs of the normal-mode kernels in the default configs (even: a sender and a receiver per
        channel)."""
        NormalBuffer.set_num_sms(new_num_sms)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """pyep's tuned config for one node of 1, 2, 4 or 8 ranks; across nodes (a multiple of 8 ranks)
        the 8-rank node's. Its get_rdma_buffer_size_hint is 0: pyep sizes the relay rings itself."""
        return normal_config(num_ranks, NormalBuffer.num_sms, combine=False)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return normal_config(num_ranks, NormalBuffer.num_sms, combine=True)

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(NormalBuffer.capture())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes pyep's low-latency buffer needs for this shape (DeepEP's argument order)."""
        return _size_hint(num_max_dispatch_tokens_per_rank, hidden, num_experts, num_ranks)

    # ------------------------------------------------------------------ instance API
    def _alive(self, what: str) -> None:
        if self._buffers.destroyed:
            raise RuntimeError(f"{what}() called after destroy()")

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The normal mode's communication stream; None on CPU devices or before the normal-mode buffer
        exists (pyep's low-latency kernels run on the caller's stream and need none)."""
        self._alive("get_comm_stream")
        return self._normal.get_comm_stream() if self._normal is not None else None

    def get_local_buffer_tensor(self, dtype: "torch.dtype", size: Optional["torch.Size"] = None,
                                offset: int = 0, use_rdma_buffer: bool = False) -> "torch.Tensor":
        """The registered buffer as a tensor of `dtype` from byte `offset` (DeepEP's C++ adds offset in
        bytes). use_rdma_buffer=True: the low-latency buffer (there must be exactly one shape in use);
        False: the normal mode's NVLink buffer. Native backends only (see raw_buffer_tensor)."""
        import torch
        self._alive("get_local_buffer_tensor")
        if use_rdma_buffer:
            if len(self._buffers.buffers) != 1:
                raise RuntimeError(f"get_local_buffer_tensor(use_rdma_buffer=True): pyep keeps one low-latency "
                                   f"buffer per (T, H, E) shape and this Buffer has "
                                   f"{len(self._buffers.buffers)}; it needs exactly one")
            backend = next(iter(self._buffers.buffers.values())).backend
        else:
            backend = self._normal_buffer("get_local_buffer_tensor").backend
        raw = raw_buffer_tensor(backend, "get_local_buffer_tensor")
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= raw.numel():
            raise ValueError(f"offset must be a byte offset in [0, {raw.numel()}], got {offset!r}")
        elem = torch.empty(0, dtype=dtype, device="cpu").element_size()
        count = (raw.numel() - offset) // elem
        t = raw[offset:offset + count * elem].view(dtype)
        if size is None:
            return t
        want = torch.Size(size)
        if t.numel() < want.numel():
            raise ValueError(f"size {list(want)} needs {want.numel()} elements, the buffer holds {t.numel()}")
        return t[:want.numel()].view(want)

    def destroy(self) -> None:
        """Release every buffer (collective where the backend needs it). DeepEP asserts
        explicitly_destroy=True here; pyep releases either way, which no DeepEP program can notice."""
        self._release()

    def _release(self) -> None:
        if self._normal is not None:
            self._normal.destroy()
            self._normal = None
        self._buffers.destroy()

    # ------------------------------------------------------------------ normal mode
    def _normal_buffer(self, what: str) -> NormalBuffer:
        self._alive(what)
        if self._normal is None:
            if self.num_nvl_bytes:
                hidden = normal_hidden(self.num_nvl_bytes, self.group_size)
                if hidden == 0:
                    raise ValueError(f"num_nvl_bytes={self.num_nvl_bytes} is too small for the normal mode "
                                     f"(hidden=128 needs {NormalBuffer.size_hint(128, self.group_size)} "
                                     f"bytes); see NormalBuffer.size_hint")
                nvl: Optional[int] = self.num_nvl_bytes
            else:
                hidden, nvl = 7168, None   # sized by pyep for DeepSeek's hidden
            # elastic: the Buffer's mask will reach it (an internode buffer then runs rank to rank).
            normal = NormalBuffer(self.group, nvl, hidden=hidden, elastic=self._mask is not None, **self._normal_kwargs)
            if self._mask is not None and normal.takes_active_ranks:
                # One mask per Buffer: the low-latency kernels' marks and the caller's
                # low_latency_update_mask_buffer reach the normal mode's calls, and the normal kernels'
                # marks the low-latency calls (docs/elastic.md). Before the first normal call, on every rank.
                try:
                    normal.use_active_ranks(self._mask.bind(normal.mask_device))
                except BaseException:
                    normal.destroy()
                    raise
            self._normal = normal
            log.debug("normal-mode buffer: %s", self._normal.describe())
        return self._normal

    def normal_buffer(self) -> NormalBuffer:
        """pyep extension: the underlying NormalBuffer (describe(), backend_name, ...); creates it if
        needed (collective)."""
        return self._normal_buffer("normal_buffer")

    def get_dispatch_layout(self, topk_idx: "torch.Tensor", num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> Tuple["torch.Tensor", None, "torch.Tensor", "torch.Tensor", EventOverlap]:
        ntpr, rdma, ntpe, in_rank, event = self._normal_buffer("get_dispatch_layout").get_dispatch_layout(
            topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream)
        return ntpr, rdma, ntpe, in_rank, EventOverlap(event)

    def dispatch(self, x: RecvX, handle: Optional[NormalHandles] = None,
                 num_tokens_per_rank: Optional["torch.Tensor"] = None,
                 num_tokens_per_rdma_rank: Optional["torch.Tensor"] = None,
                 is_token_in_rank: Optional["torch.Tensor"] = None,
                 num_tokens_per_expert: Optional["torch.Tensor"] = None,
                 topk_idx: Optional["torch.Tensor"] = None, topk_weights: Optional["torch.Tensor"] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False
                 ) -> Tuple[RecvX, Optional["torch.Tensor"], Optional["torch.Tensor"], Optional[List[int]],
                            Optional[NormalHandles], EventOverlap]:
        """DeepEP's dispatch. Across nodes the new handle is DeepEP's internode 10-tuple
        (InternodeHandle); cached dispatch and combine take either kind back."""
        nb = self._normal_buffer("dispatch")
        *rest, event = nb.dispatch(
            x, unwrap(handle), num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
            num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
            previous_event, async_finish, allocate_on_comm_stream)
        recv_x, recv_idx, recv_w, counts, new_handle = rest
        if new_handle is not None and nb.num_nodes > 1:
            new_handle = self._internode_handle(nb, new_handle)
        return recv_x, recv_idx, recv_w, counts, new_handle, EventOverlap(event)

    def _internode_handle(self, nb: NormalBuffer, h: NormalHandle) -> InternodeHandle:
        if h.internode is not None:
            forward = native_forward_stage(h.internode)
        else:
            forward = reference_forward_stage(h.is_token_in_rank, self.rank, nb.num_nodes, nb.ranks_per_node,
                                              h.num_channels, nb.group, self._normal_kwargs["timeout_us"])
        return InternodeHandle(h, self.rank, forward)

    def combine(self, x: "torch.Tensor", handle: NormalHandles, topk_weights: Optional["torch.Tensor"] = None,
                bias: Bias = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False
                ) -> Tuple["torch.Tensor", Optional["torch.Tensor"], EventOverlap]:
        combined_x, combined_w, event = self._normal_buffer("combine").combine(
            x, unwrap(handle), topk_weights, bias, config, previous_event, async_finish, allocate_on_comm_stream)
        return combined_x, combined_w, EventOverlap(event)

    def internode_dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """DeepEP's internode entry point: dispatch() picks the internode protocol itself when the group
        spans nodes (or virtual nodes), so both names run the same call."""
        return self.dispatch(*args, **kwargs)

    def internode_combine(self, *args: Any, **kwargs: Any) -> Any:
        return self.combine(*args, **kwargs)

    # ------------------------------------------------------------------ low-latency mode
    def _active(self, buf: Any) -> Optional["torch.Tensor"]:
        return self._mask.bind(buf.device) if self._mask is not None else None

    def low_latency_dispatch(self, x: "torch.Tensor", topk_idx: "torch.Tensor",
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional["torch.Tensor"] = None,
                             dispatch_wait_recv_cost_stats: Optional["torch.Tensor"] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False
                             ) -> Tuple[RecvX, "torch.Tensor", Handle, EventOverlap, Hook]:
        """DeepEP's low_latency_dispatch. dispatch_wait_recv_cost_stats (int64 [num_ranks], as DeepEP's C++
        checks it): the receive adds how long it waited for each source rank -- in nanoseconds
        (%globaltimer) where DeepEP adds clock64 cycles summed over its per-expert waits; slow ranks stand
        out the same way (docs/compat.md)."""
        buf = self._buffers.get((num_max_dispatch_tokens_per_rank, hidden_of(x), num_experts),
                                "low_latency_dispatch")
        recv, count, handle, event, hook = buf.dispatch(
            x, topk_idx, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
            active_ranks=self._active(buf), async_finish=async_finish, return_recv_hook=return_recv_hook,
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats)
        keep = ((x, topk_idx, recv, count, handle, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats)
                if async_finish else None)
        return recv, count, handle, EventOverlap(event, keep), hook

    def low_latency_combine(self, x: "torch.Tensor", topk_idx: "torch.Tensor",
                            topk_weights: "torch.Tensor", handle: Handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional["torch.Tensor"] = None,
                            combine_wait_recv_cost_stats: Optional["torch.Tensor"] = None
                            ) -> Tuple["torch.Tensor", EventOverlap, Hook]:
        """DeepEP's low_latency_combine; combine_wait_recv_cost_stats as dispatch_wait_recv_cost_stats."""
        buf = self._buffers.for_handle(handle, "low_latency_combine")
        combined, event, hook = buf.combine(x, topk_idx, topk_weights, handle, active_ranks=self._active(buf),
                                            zero_copy=zero_copy, async_finish=async_finish,
                                            return_recv_hook=return_recv_hook, out=out, use_logfmt=use_logfmt,
                                            combine_wait_recv_cost_stats=combine_wait_recv_cost_stats)
        keep = (x, topk_idx, topk_weights, handle, combined, combine_wait_recv_cost_stats) if async_finish else None
        return combined, EventOverlap(event, keep), hook

    def get_next_low_latency_combine_buffer(self, handle: Handle) -> "torch.Tensor":
        buf = self._buffers.for_handle(handle, "get_next_low_latency_combine_buffer")
        return buf.get_next_combine_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Reset the buffer of that shape (creating it if needed); earlier handles go stale."""
        self._buffers.get((num_max_dispatch_tokens_per_rank, hidden, num_experts),
                          "clean_low_latency_buffer").clean()

    def _shrink(self, what: str) -> ActiveMask:
        self._alive(what)
        if self._mask is None:
            raise RuntimeError(f"{what}(): shrink mode must be enabled (Buffer(..., enable_shrink=True))")
        return self._mask

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """mask=True: neither send to nor wait for rank_to_mask from the next call on; False: unmask.
        Local to this rank and stream-ordered, as DeepEP's. A rank that really restarted also needs
        update_ep_member() (collective) to rebuild its connections."""
        back = self._shrink("low_latency_update_mask_buffer").update(rank_to_mask, bool(mask))
        self._normal_takes_back(back)
        if mask and self._normal is not None and not self._normal.takes_active_ranks:
            log.warning("rank %d masked: the low-latency calls leave it out, but this Buffer's normal mode runs "
                        "the internode %s kernels forwarding over NVLink (built without elastic=True), which take "
                        "no mask -- its calls still include rank %d (and raise PeerTimeout if it is dead); the "
                        "reference backend, the intranode kernels and elastic internode buffers take the mask",
                        rank_to_mask, self._normal.backend_name, rank_to_mask)

    def low_latency_query_mask_buffer(self, mask_status: "torch.Tensor") -> None:
        """Writes int32 [num_ranks] into mask_status: 1 = masked (by the caller or by a timeout)."""
        self._shrink("low_latency_query_mask_buffer").query(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        self._normal_takes_back(self._shrink("low_latency_clean_mask_buffer").clean())

    def _normal_takes_back(self, ranks: List[int]) -> None:
        """Ranks the caller unmasked: the normal mode, which shares the mask, restarts its streams with
        them (NormalBuffer.take_back_ranks; DeepEP's callers unmask on every rank alike, between calls)."""
        if ranks and self._normal is not None and self._normal.takes_active_ranks:
            self._normal.take_back_ranks(ranks)

    def update_ep_member(self) -> None:
        """pyep extension (Mooncake's name): collective, rebuilds the connections of ranks that
        restarted, on every low-latency buffer; earlier handles go stale."""
        self._alive("update_ep_member")
        for buf in self._buffers.buffers.values():
            buf.update_ep_member(self._active(buf))

    def ep_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> Any:
        """pyep extension: the EpBuffer of one shape (transport_table(), describe(), ...)."""
        return self._buffers.get((num_max_dispatch_tokens_per_rank, hidden, num_experts), "ep_buffer")
