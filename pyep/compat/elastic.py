"""DeepEP V2's `ElasticBuffer` and `EPHandle` (deep_ep 2.1.0, deep_ep/buffers/elastic.py) on pyep's normal
mode (pyep.NormalBuffer): inside a node and across nodes, without NCCL GIN and without a JIT.

    buf = ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True)
    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buf.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=E)
    y, y_weights, event = buf.combine(expert_out, handle, topk_weights=recv_topk_weights)
    recv_x, *_ = buf.dispatch(x, handle=handle)                       # cached: no count exchange

A dispatch is pyep's get_dispatch_layout + dispatch; V2's outputs (expanded layout, prefix sums,
metadata) are derived on the device (_elastic_layout). do_cpu_sync=False sizes the outputs by the
worst case (num_max_tokens_per_rank * num_ranks rows) through num_worst_tokens: no host wait, so the
call can be captured in a CUDA graph. Engram, PP and AGRS raise NotImplementedError. docs/compat.md
lists every name and what differs.
"""
from __future__ import annotations

import contextlib
import logging
import uuid
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional, Tuple, Union

from ..ep.backend import torch_function_off
from ..ep.normal.buffer import NormalBuffer
from ..ep.normal.config import Config
from ..ep.normal.events import cuda_event_of
from . import _elastic_layout as lay
from ._elastic_dispatch import cached_dispatch, fresh_dispatch
from ._configs import clamp_num_sms, normal_config, normal_hidden, theoretical_num_sms
from ._elastic_handle import EPHandle, check_count, check_flag, check_stats, split_x
from ._events import EventHandle, EventOverlap

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("pyep.compat.elastic")
__all__ = ["ElasticBuffer", "EPHandle"]
RecvX = Union["torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]]
Bias = Union[None, "torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]]
RELAY_QPS_PER_PEER = 2      # the QPs pyep's internode relay opens per column peer


def _not_in_pyep(feature: str, name: str, static: bool = False) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"ElasticBuffer.{name}: {feature} is not implemented by pyep's DeepEP V2 shim, "
                                  f"which provides expert-parallel dispatch/combine only (docs/compat.md)")
    refuse.__name__ = name
    return staticmethod(refuse) if static else refuse


ENGRAM = "Engram (remote KV-cache fetch)"
PP = "PP (pipeline-parallel send/recv)"
AGRS = "AGRS (all-gather reduce-scatter)"


class ElasticBuffer:
    """DeepEP V2's ElasticBuffer (expert-parallel part). V2's arguments at their positions with their
    defaults; pyep's options (backend, transport) keyword-only after them."""

    def __init__(self, group: Optional["dist.ProcessGroup"] = None, num_bytes: Optional[int] = None,
                 num_cpu_bytes: int = 0, num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False, *, backend: str = "auto", transport: str = "auto") -> None:
        import torch.distributed as dist
        from ..ep._dist import resolve_group
        self._nb: Optional[NormalBuffer] = None
        if num_cpu_bytes:
            raise NotImplementedError(f"ElasticBuffer(num_cpu_bytes={num_cpu_bytes!r}): CPU buffers hold {ENGRAM} "
                                      f"storage, which pyep's shim does not implement")
        if num_bytes is not None:
            check_count("num_bytes", num_bytes, 0)
        for name, v in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("hidden", hidden),
                        ("num_topk", num_topk), ("num_allocated_qps", num_allocated_qps), ("sl_idx", sl_idx),
                        ("num_cpu_timeout_secs", num_cpu_timeout_secs)):
            check_count(name, v, 0)
        check_count("num_gpu_timeout_secs", num_gpu_timeout_secs, 1)
        for name, v in (("use_fp8_dispatch", use_fp8_dispatch), ("deterministic", deterministic),
                        ("allow_hybrid_mode", allow_hybrid_mode), ("allow_multiple_reduction", allow_multiple_reduction),
                        ("prefer_overlap_with_compute", prefer_overlap_with_compute),
                        ("explicitly_destroy", explicitly_destroy)):
            check_flag(name, v)
        self.group = resolve_group(group)
        self.rank_idx: int = dist.get_rank(self.group)
        self.num_ranks: int = dist.get_world_size(self.group)
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.deterministic = bool(deterministic)   # pyep's receive order is fixed: always deterministic
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.explicitly_destroy = bool(explicitly_destroy)
        self.num_allocated_qps = num_allocated_qps or RELAY_QPS_PER_PEER
        self._timeout_us = num_gpu_timeout_secs * 1_000_000
        self._owner = uuid.uuid4().hex
        if num_cpu_timeout_secs and num_cpu_timeout_secs < num_gpu_timeout_secs:
            log.debug("num_cpu_timeout_secs=%d < num_gpu_timeout_secs=%d: pyep bounds host waits by the peer "
                      "timeout (2x + 1 s)", num_cpu_timeout_secs, num_gpu_timeout_secs)
        log.debug("ElasticBuffer: sl_idx=%d, num_topk=%d, use_fp8_dispatch=%s accepted (pyep sizes by hidden)",
                  sl_idx, num_topk, use_fp8_dispatch)
        buffer_hidden = (hidden + 127) // 128 * 128 if hidden else 0
        if not buffer_hidden:
            buffer_hidden = normal_hidden(num_bytes, min(self.num_ranks, 8)) if num_bytes else 7168
            if not buffer_hidden:
                raise ValueError(f"num_bytes={num_bytes} is too small for any hidden size; see "
                                 f"ElasticBuffer.get_buffer_size_hint")
        self._nb = NormalBuffer(self.group, num_bytes or None, hidden=buffer_hidden, backend=backend,
                                transport=transport, timeout_us=self._timeout_us)
        self.num_bytes: int = self._nb.buffer_bytes
        self.num_rdma_ranks, self.num_nvlink_ranks = self._nb.num_nodes, self._nb.ranks_per_node
        if self.allow_hybrid_mode:
            self.num_scaleout_ranks, self.num_scaleup_ranks = self.num_rdma_ranks, self.num_nvlink_ranks
        else:
            self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks

    def __del__(self) -> None:
        try:
            if self._nb is not None and not self.explicitly_destroy:
                self.destroy()
            elif self._nb is not None:
                log.warning("destroy() was not called before an ElasticBuffer(explicitly_destroy=True) was "
                            "collected; its resources stay until the process exits")
        except Exception:   # noqa: BLE001 - nothing may escape a finaliser (interpreter shutdown)
            pass

    def destroy(self) -> None:
        """Release the buffer (collective where the backend needs it). V2 asserts explicitly_destroy;
        pyep releases either way."""
        if self._nb is not None:
            self._nb.destroy()
            self._nb = None

    def _buffer(self, what: str) -> NormalBuffer:
        if self._nb is None:
            raise RuntimeError(f"ElasticBuffer.{what}() called after destroy()")
        return self._nb

    # ------------------------------------------------------------------ sizes, domains, SMs
    @staticmethod
    def get_buffer_size_hint(group: Optional["dist.ProcessGroup"], num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes of pyep's node buffer for rows of `hidden` (its rings hold chunks, not whole batches,
        so num_max_tokens_per_rank does not enter), rounded up to 2 MiB as V2's hints are."""
        import torch.distributed as dist
        from ..ep._dist import resolve_group
        r_n = dist.get_world_size(resolve_group(group))
        need = NormalBuffer.size_hint((hidden + 127) // 128 * 128, min(r_n, 8))
        return (need + (1 << 21) - 1) >> 21 << 21

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """(RDMA ranks, NVLink ranks): pyep's nodes and ranks per node."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """(scale-out, scale-up) ranks: the nodes with allow_hybrid_mode, else (1, num_ranks)."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """SMs for pyep's normal kernels (pyep's own model, _configs.theoretical_num_sms)."""
        import torch
        check_count("num_experts", num_experts, 1)
        check_count("num_topk", num_topk, 1)
        if num_scaleout_topk:
            raise ValueError("num_scaleout_topk must be 0 (as DeepEP V2: reserved for a balanced group gate)")
        dev = self._buffer("get_theoretical_num_sms").device
        device_sms = (torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1 << 30)
        return theoretical_num_sms(num_ranks=self.num_ranks, num_nodes=self.num_rdma_ranks, num_experts=num_experts,
                                   num_topk=num_topk, nvlink_gbs=nvlink_gbs, rdma_gbs=rdma_gbs,
                                   sm_read_gbs=sm_read_gbs, sm_write_gbs=sm_write_gbs,
                                   prefer_overlap=self.prefer_overlap_with_compute, device_sms=device_sms)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """QPs pyep uses per peer: its relay's across nodes, none on one node (NVLink only)."""
        check_count("num_sms", num_sms, 0)
        return min(RELAY_QPS_PER_PEER, self.num_allocated_qps) if self.num_rdma_ranks > 1 else 0

    @staticmethod
    def capture() -> EventHandle:
        """An event of the current stream."""
        return EventHandle()

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The stream async calls run on; None on CPU devices."""
        return self._buffer("get_comm_stream").get_comm_stream()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """All ranks meet: the device finishes its queued work, then a bounded all-reduce over the group
        (a host barrier, stronger than V2's stream-ordered one; refused inside a CUDA graph capture)."""
        import torch
        from ..ep._dist import barrier_bounded, group_device
        nb = self._buffer("barrier")
        if nb.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("ElasticBuffer.barrier() is a host barrier and cannot be captured in a CUDA graph")
            torch.cuda.synchronize(nb.device)
        barrier_bounded(self.group, group_device(self.group), self._timeout_us, "ElasticBuffer.barrier")

    # ------------------------------------------------------------------ Engram, PP, AGRS
    get_engram_storage_size_hint = _not_in_pyep(ENGRAM, "get_engram_storage_size_hint", static=True)
    engram_write = _not_in_pyep(ENGRAM, "engram_write")
    engram_fetch = _not_in_pyep(ENGRAM, "engram_fetch")
    get_pp_buffer_size_hint = _not_in_pyep(PP, "get_pp_buffer_size_hint", static=True)
    pp_set_config = _not_in_pyep(PP, "pp_set_config")
    pp_send = _not_in_pyep(PP, "pp_send")
    pp_recv = _not_in_pyep(PP, "pp_recv")
    get_agrs_num_max_session_bytes = _not_in_pyep(AGRS, "get_agrs_num_max_session_bytes", static=True)
    get_agrs_buffer_size_hint = _not_in_pyep(AGRS, "get_agrs_buffer_size_hint", static=True)
    create_agrs_session = _not_in_pyep(AGRS, "create_agrs_session")
    destroy_agrs_session = _not_in_pyep(AGRS, "destroy_agrs_session")
    agrs_new_session = _not_in_pyep(AGRS, "agrs_new_session")
    agrs_set_config = _not_in_pyep(AGRS, "agrs_set_config")
    agrs_get_inplace_tensor = _not_in_pyep(AGRS, "agrs_get_inplace_tensor")
    all_gather = _not_in_pyep(AGRS, "all_gather")

    # ------------------------------------------------------------------ streams
    def _config(self, num_sms: int, num_experts: int, num_topk: int, combine: bool) -> Config:
        check_count("num_sms", num_sms, 0)
        sms = clamp_num_sms(num_sms or self.get_theoretical_num_sms(num_experts, num_topk))
        try:
            config = normal_config(self.num_ranks, sms, combine)
        except ValueError:        # rank counts pyep has no table for (the reference on 3 ranks, say)
            config = Config(sms)
        # V2 sizes its buffer before it knows the SM count of a call: run the largest config that fits.
        return self._buffer("dispatch").fit_config(config)

    def _pre_wait(self, nb: NormalBuffer, events: List[Any]) -> None:
        """The shim reads the caller's tensors on the current stream before pyep's call (scale packs,
        weights, the expanded rows' local reduction): make the current stream wait for the caller's
        events first."""
        if nb.device.type == "cuda":
            import torch
            current = torch.cuda.current_stream(nb.device)
            for ev in events:
                cuda = cuda_event_of(ev)
                if cuda is not None:
                    current.wait_event(cuda)

    @staticmethod
    def _after_pre(events: List[Any], async_: bool) -> Any:
        """The event pyep's call waits for: recorded on the current stream after the shim's own
        pre-processing, so the comm stream never reads a tensor the shim is still writing (an event
        taken before it raced: the combine read a half-reduced x on the GPU)."""
        return EventHandle() if async_ and events else None

    @contextlib.contextmanager
    def _on(self, nb: NormalBuffer, async_: bool) -> Iterator[None]:
        """Run the shim's post-processing on the stream pyep's call ran on (async: the comm stream)."""
        if nb.device.type == "cuda" and async_:
            import torch
            with torch.cuda.stream(nb.get_comm_stream()):
                yield
        else:
            yield

    def _event(self, nb: NormalBuffer, async_: bool, wait: Callable[[], None], outputs: List[Any],
               inputs: List[Any]) -> EventOverlap:
        """The call's event (async) recorded after the post-processing; outputs made on the comm stream
        and inputs read there are recorded on both streams for the caching allocator."""
        if not async_:
            return EventOverlap(None)
        if nb.device.type != "cuda":
            return EventOverlap(EventHandle.of(None, None, wait))
        import torch
        comm, current = nb.get_comm_stream(), torch.cuda.current_stream(nb.device)
        ev = torch.cuda.Event()
        ev.record(comm)
        for t in outputs:
            if isinstance(t, torch.Tensor):
                t.record_stream(current)
        for t in inputs:
            if isinstance(t, torch.Tensor):
                t.record_stream(comm)
        return EventOverlap(EventHandle.of(ev, nb.device, wait))

    # ------------------------------------------------------------------ dispatch / combine
    @torch_function_off
    def dispatch(self, x: RecvX, topk_idx: Optional["torch.Tensor"] = None,
                 topk_weights: Optional["torch.Tensor"] = None,
                 cumulative_local_expert_recv_stats: Optional["torch.Tensor"] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: Optional[Any] = None, previous_event_before_epilogue: Optional[Any] = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False
                 ) -> Tuple[RecvX, Optional["torch.Tensor"], Optional["torch.Tensor"], EPHandle, EventOverlap]:
        nb = self._buffer("dispatch")
        flags = dict(async_=check_flag("async_with_compute_stream", async_with_compute_stream),
                     alloc=check_flag("allocate_on_comm_stream", allocate_on_comm_stream),
                     expand=check_flag("do_expand", do_expand), zero=check_flag("do_zero_padding", do_zero_padding),
                     col_major=check_flag("use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf))
        check_count("num_qps", num_qps, 0)
        if flags["zero"] and not flags["expand"]:
            raise ValueError("do_zero_padding is only valid with do_expand=True (as DeepEP V2)")
        data, sf = split_x(x)
        events = [e for e in (previous_event, previous_event_before_epilogue) if e is not None]
        if handle is not None:
            return cached_dispatch(self, nb, data, sf, topk_idx, topk_weights, cumulative_local_expert_recv_stats,
                                   num_experts, num_max_tokens_per_rank, expert_alignment, events, handle,
                                   do_cpu_sync, flags)
        return fresh_dispatch(self, nb, data, sf, topk_idx, topk_weights, cumulative_local_expert_recv_stats,
                              num_experts, num_max_tokens_per_rank, expert_alignment, num_sms, events,
                              check_flag("do_handle_copy", do_handle_copy),
                              True if do_cpu_sync is None else check_flag("do_cpu_sync", do_cpu_sync), flags)

    @torch_function_off
    def combine(self, x: "torch.Tensor", handle: EPHandle, topk_weights: Optional["torch.Tensor"] = None,
                bias: Bias = None, num_sms: int = 0, num_qps: int = 0, previous_event: Optional[Any] = None,
                previous_event_before_epilogue: Optional[Any] = None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False
                ) -> Tuple["torch.Tensor", Optional["torch.Tensor"], EventOverlap]:
        """Sums each token's rows back at its source: 0, + bias_0, + bias_1, then the ranks' rows in rank
        order (per node first across nodes), in fp32, rounded once (docs/compat.md on V2's order).
        With do_expand each rank first sums a token's expanded rows in top-k order (V2's local
        reduction); topk_weights is then V2's 1-D per-slot tensor."""
        import torch
        nb = self._buffer("combine")
        async_ = check_flag("async_with_compute_stream", async_with_compute_stream)
        alloc = check_flag("allocate_on_comm_stream", allocate_on_comm_stream)
        check_count("num_sms", num_sms, 0)
        check_count("num_qps", num_qps, 0)
        hd = self._own(handle, "combine")
        if num_sms and clamp_num_sms(num_sms) != hd.num_sms:
            log.debug("combine(num_sms=%d): pyep combines on the dispatch's %d SMs (its handle is per channel)",
                      num_sms, hd.num_sms)
        events = [e for e in (previous_event, previous_event_before_epilogue) if e is not None]
        pre = hd.do_expand or previous_event_before_epilogue is not None
        if pre:
            self._pre_wait(nb, events)
        weights = topk_weights
        if hd.do_expand:
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != hd.expand_capacity:
                raise ValueError(f"combine with an expanded handle: x must be [{hd.expand_capacity}, hidden], got "
                                 f"{list(getattr(x, 'shape', [])) or type(x).__name__}")
            x = lay.reduce_expanded(x, hd.slots)
            if weights is not None:
                if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (hd.expand_capacity,):
                    raise ValueError(f"combine with an expanded handle: topk_weights must be 1-D "
                                     f"[{hd.expand_capacity}], got {list(getattr(weights, 'shape', []))}")
                weights = lay.fold_rows(weights, hd.slots)
        prev = self._after_pre(events, async_) if pre else previous_event
        combined, combined_w, nev = nb.combine(x, hd.normal, weights, bias, None, prev, async_,
                                               alloc and async_ and prev is not None)
        return combined, combined_w, self._event(nb, async_, nev.wait, [], [])

    def _own(self, handle: Any, what: str) -> EPHandle:
        if not isinstance(handle, EPHandle):
            raise TypeError(f"{what}: handle must be the EPHandle a dispatch of this buffer returned, got "
                            f"{type(handle).__name__}")
        if handle.owner != self._owner:
            raise ValueError(f"{what}: handle was issued by another ElasticBuffer")
        return handle

    def __repr__(self) -> str:
        state = "destroyed" if self._nb is None else self._nb.backend_name
        return (f"ElasticBuffer(rank={self.rank_idx}, num_ranks={self.num_ranks}, "
                f"{self.num_scaleout_ranks}x{self.num_scaleup_ranks}, {state})")
