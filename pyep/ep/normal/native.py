"""The native normal-mode backend: the CUDA kernels of engine/kernels/normal_*.cu over buffers that
every rank of the node maps with CUDA IPC (pyep.transport's PeerSet, NVLink links). Implements
contract.NormalBackend; the buffer layout is pyep.ep.normal.layout, the protocol docs/normal_mode.md.

Host work per call: one launch binding per kernel, output allocation, and -- for a dispatch that is
neither cached nor sized by num_worst_tokens -- one bounded wait on a pinned word for the received-row
count (the only host wait of the mode; DeepEP has the same one). What the kernels record (errors,
void calls) sits in pinned records that device_records.py reads without a device synchronisation.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from ..backend import BackendUnavailable, PeerTransport
from ..streams import raw_current_stream
from . import layout, tags
from .capture import capture_refusal
from .config import MAX_CHANNELS, MAX_LOCAL_EXPERTS, MAX_RANKS, Config
from .contract import CombineCall, CombineResult, DispatchCall, DispatchResult, LayoutResult
from .device_records import TAG_RECORD_INTS, DeviceRecords
from ..devmem import DeviceMemory
from .direct_pool import OutputPool, one_copy_enabled, pool_bounds, pull_combine_enabled, ring_reserve
from .errors import (ERR_PEER_TIMEOUT, BadOutputDescriptor, BufferBroken, LostDispatchPath, NormalCallMismatch,
                     NotCapturable, PeerTimeout)
from .events import wait_bound_s
from .native_fast import NativeFastPath
from .native_member import NativeNormalMembership
from .native_state import NativeCallState, bulk_copy_setting
from .topology import NodeLayout
from .trace import TRACE_WORDS, BlockTrace, decode, trace_enabled

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("pyep.ep.normal.native")
SETUP_TIMEOUT_FLOOR_S = 120.0


def _engine() -> Any:
    from ..._native import load
    mod = load()
    if mod is None:
        raise BackendUnavailable("pyep._engine is not built (pip install -e .)")
    if not getattr(mod, "has_cuda", False) or not hasattr(mod, "normal"):
        raise BackendUnavailable("pyep._engine is a host-only build without the normal-mode kernels")
    return mod


class NormalNativeBackend(NativeCallState, NativeNormalMembership, NativeFastPath):
    name = "native"
    takes_mask = True   # set_mask: the kernels read and clear an active_ranks mask (docs/elastic.md)

    @staticmethod
    def unavailable_reason(group: Optional["dist.ProcessGroup"], *, transport: str = "auto",
                           nodes: Optional[NodeLayout] = None, num_ranks: Optional[int] = None,
                           **_: Any) -> Optional[str]:
        """Local check (no communication, no allocation): None if this process can run the backend."""
        if nodes is not None and nodes.internode:
            return "the group spans nodes (the internode backend runs it)"
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            return "torch is not installed"
        if not torch.cuda.is_available():
            return "no CUDA device is available"
        if transport not in ("auto", "nvlink"):
            return f"the native normal mode runs over NVLink (transport 'auto' or 'nvlink'), not {transport!r}"
        num_ranks = dist.get_world_size(group) if num_ranks is None else num_ranks
        if num_ranks > MAX_RANKS:
            return f"the native normal mode runs on at most {MAX_RANKS} ranks of one node"
        try:
            _engine()
        except BackendUnavailable as exc:
            return str(exc)
        return None

    def __init__(self, group: Optional["dist.ProcessGroup"], *, num_nvl_bytes: Optional[int], hidden: int,
                 transport: str, timeout_us: int, num_sms: int, nodes: Optional[NodeLayout] = None,
                 num_rdma_bytes: Optional[int] = None, notify_extra: int = 0, control: Any = None,
                 joining: bool = False, output_pool: bool = True) -> None:
        """group: a process group; or control: a store-based buffer's control plane (pyep.ep.control),
        joining for a restarted rank (its links are made when the survivors admit it: native_member.py).
        output_pool: keep the room past the rings for one-copy dispatch outputs (direct_pool.py)."""
        import torch
        import torch.distributed as dist
        reason = NormalNativeBackend.unavailable_reason(
            group, transport=transport, nodes=nodes, num_ranks=control.world_size if control is not None else None)
        if reason is not None:
            raise BackendUnavailable(reason)
        mod = _engine()
        self._ep, self._n = mod.ep, mod.normal
        if transport not in ("auto", "nvlink"):
            raise ValueError(f"the normal mode runs over NVLink inside one node (transport 'auto' or 'nvlink'), "
                             f"not {transport!r}; the internode normal mode is not available yet")
        self.group = group
        self.rank = control.rank if control is not None else dist.get_rank(group)
        self.num_ranks = control.world_size if control is not None else dist.get_world_size(group)
        self.nodes = NodeLayout(self.num_ranks, self.num_ranks)
        if self.num_ranks > MAX_RANKS:
            raise ValueError(f"the native normal mode runs on at most {MAX_RANKS} ranks, got {self.num_ranks}")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.hidden = hidden
        self.timeout_us = timeout_us
        r_n = self.num_ranks
        self._extra = notify_extra   # notify words an internode call adds (native_internode.py)
        self.global_ranks: Optional[List[int]] = None   # set by an internode buffer: its ranks of this node
        default_bytes = layout.buffer_bytes(r_n, max(num_sms, 2) // 2, Config().num_max_nvl_chunked_recv_tokens, hidden)
        default_bytes += layout.ring_offset(r_n, notify_extra) - layout.ring_offset(r_n)
        self._bytes = int(num_nvl_bytes) if num_nvl_bytes else default_bytes
        if self._bytes <= layout.ring_offset(r_n, notify_extra):
            raise ValueError(f"num_nvl_bytes={num_nvl_bytes} does not even hold the control area "
                             f"({layout.ring_offset(r_n, notify_extra)} bytes); NormalBuffer.size_hint() says what a shape needs")
        self._setup_timeout_s = max(SETUP_TIMEOUT_FLOOR_S, 3 * timeout_us / 1e6)
        pool_on = output_pool and one_copy_enabled()
        self._pull = pool_on and pull_combine_enabled()
        ring_end = layout.ring_offset(r_n, notify_extra) + ring_reserve(r_n, num_sms, hidden)
        self._pool_lo, self._pool_hi = pool_bounds(self._bytes, ring_end) if pool_on else (0, 0)
        self._pool: Optional[OutputPool] = None
        self._mem: Optional[DeviceMemory] = None
        self._buf = 0
        self._peers: Any = None
        self._broken = False
        self._destroyed = False
        self._geometry: Optional[Tuple[int, int]] = None   # (ring depth, slot stride) of the last launched call
        self._tma_setting = bulk_copy_setting()   # PYEP_NORMAL_TMA (native_state.py), checked here
        self._tma_dispatch = self._tma_combine = 0  # its flags, once the links say where the peers are
        # Pinned host words the kernels write and the host reads without synchronising.
        self._err = torch.zeros(8, dtype=torch.int32, device="cpu", pin_memory=True)
        self._host = torch.zeros(2 + MAX_LOCAL_EXPERTS, dtype=torch.int32, device="cpu",
                                 pin_memory=True)
        self._tag_record = torch.zeros(TAG_RECORD_INTS, dtype=torch.int32, device="cpu", pin_memory=True)
        self._err_np = self._err.numpy()
        self._host_np = self._host.numpy()
        self._ws = torch.zeros(8, dtype=torch.int32, device=self.device)
        self._scratch = torch.zeros(MAX_RANKS * MAX_LOCAL_EXPERTS, dtype=torch.int32, device=self.device)
        # PYEP_NORMAL_TRACE=1: the combines run the traced kernel into these words (trace.py).
        self._trace = (torch.zeros((2 * MAX_CHANNELS, TRACE_WORDS), dtype=torch.int64, device=self.device)
                       if trace_enabled() else None)
        self._epoch = 0
        self._mask: Optional["torch.Tensor"] = None   # set_mask: the buffer's active_ranks
        self.global_base = 0   # an internode buffer's node: the group rank of this node's first rank
        self.records = DeviceRecords(self._err, self._tag_record, self._rearm_claim, self.rank, self.num_ranks,
                                     timeout_us)
        try:
            self._mem = DeviceMemory(self._ep, self._bytes)
            self._buf = self._mem.ptr
            if self._pool_hi:
                self._pool = OutputPool(self._mem, self._pool_lo, self._pool_hi, self.device, self._ep)
            self._ep.memset_async(self._buf, 0, self._bytes, torch.cuda.current_stream().cuda_stream)
            torch.cuda.current_stream().synchronize()
            self._setup_links(group, control, joining)
        except BaseException:
            self._release()
            raise
        log.debug("rank %d: normal-mode buffer of %d bytes", self.rank, self._bytes)

    def _settle_pool(self, buffer_bytes: List[int]) -> None:
        """One-copy dispatch needs the output pool at the same offsets in every rank's buffer (a sender
        checks a peer's descriptor against its own pool, and every rank must take the same path): with
        buffers of different sizes (`buffer_bytes`, every rank's, from the set-up exchange) no rank keeps
        a pool, and cached dispatches take the ring path as they would without one."""
        if self._pool is None or all(int(b) == self._bytes for b in buffer_bytes):
            return
        log.info("rank %d: the ranks' buffers differ in size (%s bytes): no one-copy output pool", self.rank,
                 sorted({int(b) for b in buffer_bytes}))
        self._pool.close()
        self._pool, self._pool_lo, self._pool_hi = None, 0, 0
        self._pull = False

    def _make_static(self) -> Any:
        words = layout.control_words(self.num_ranks, self._extra)
        s = self._n.NormalStatic()
        s.rank, s.num_ranks = self.rank, self.num_ranks
        s.buf = self._buf
        s.peer_base = self._peer_base.data_ptr()
        s.ring_off = layout.ring_offset(self.num_ranks, self._extra)
        s.ring_capacity = self._ring_capacity()
        s.off_direct, s.pool_lo, s.pool_hi = words["direct"], self._pool_lo, self._pool_hi
        s.off_pulled = words["pulled"]
        s.slot_bytes = layout.slot_bytes(self.hidden)
        s.off_tail, s.off_head, s.off_tx, s.off_rx = words["tail"], words["head"], words["tx_pos"], words["rx_pos"]
        s.off_flag, s.off_notify, s.off_alive = words["notify_flag"], words["notify"], words["alive"]
        s.notify_ints = layout.notify_ints(self._extra)
        s.err = self._err.data_ptr()
        s.host_counts = self._host.data_ptr()
        s.workspace = self._ws.data_ptr()
        s.timeout_ns = int(self.timeout_us) * 1000
        s.tag_record = self._tag_record.data_ptr()
        s.global_base = self.global_base
        s.layout_scratch = self._scratch.data_ptr()
        s.trace = self._trace.data_ptr() if self._trace is not None else 0
        return s

    def last_combine_trace(self) -> List[BlockTrace]:
        """The blocks of the last combine queued on the current stream (waits for it), as the traced
        kernel recorded them; ValueError when the buffer was built without PYEP_NORMAL_TRACE=1."""
        import torch
        if self._trace is None:
            raise ValueError("this buffer does not trace its combines: build it with PYEP_NORMAL_TRACE=1")
        torch.cuda.current_stream(self.device).synchronize()
        return decode(self._trace.cpu().tolist(), self._trace.shape[0])

    def join_group(self, global_ranks: List[int], num_ranks: int) -> None:
        """A node of an internode buffer: tags and records name the group's ranks (global_ranks[local])."""
        self.global_ranks = global_ranks
        self.global_base = global_ranks[0]
        self._static.global_base = self.global_base
        self.records = DeviceRecords(self._err, self._tag_record, self._rearm_claim, global_ranks[self.rank], num_ranks,
                                     self.timeout_us, peer_name=lambda r: global_ranks[r])

    # ------------------------------------------------------------------ errors
    def _rearm_claim(self) -> None:
        # In stream order: no synchronisation, and a kernel still running cannot record a second error
        # of the same call over the one just taken.
        self._ep.memset_async(self._ws.data_ptr() + 4 * 4, 0, 4, raw_current_stream(self.device))

    def pending_error(self) -> Optional[Exception]:
        """The errors the device recorded for earlier calls (taken): a void call first (PeerRefusedCall,
        the value error noted on it), else the value error; a timed-out peer or ranks at different calls
        break the buffer and raise here."""
        try:
            return self._pending_error()
        finally:
            self._sync_fast()

    def _pending_error(self) -> Optional[Exception]:
        if self._broken:
            raise BufferBroken("an earlier call of this buffer left the ranks out of step (a peer timed out, the ranks "
                               "were at different calls, or a one-copy descriptor was invalid or lost): call clean() "
                               "on every live rank before using it again")
        void = self.records.take_void()
        value = self.records.take_error()
        for exc in (void, value):
            if isinstance(exc, (PeerTimeout, NormalCallMismatch, BadOutputDescriptor, LostDispatchPath)):
                self._broken = True
                if exc is void and value is not None:
                    exc.add_note(f"also recorded: {type(value).__name__}: {value}")
                raise exc
        if void is not None and value is not None:
            void.add_note(f"also recorded: {type(value).__name__}: {value}")
        return void if void is not None else value

    def check_errors(self) -> None:
        exc = self.pending_error()
        if exc is not None:
            raise exc

    def _ring_capacity(self) -> int:
        """The rings end where the output pool begins (or at the buffer's end without one)."""
        return (self._pool_lo or self._bytes) - layout.ring_offset(self.num_ranks, self._extra)

    def check_call(self, call: Any) -> None:
        """What the launchers would refuse after the call's gate ran (they stay as a safety net): refused
        here, before anything is launched, so that the refusal reaches the peers as a tag."""
        layout.check_rings(call.config, self.num_ranks, self.hidden, self._ring_capacity())

    def fit_config(self, config: Any) -> Any:
        """`config` made to fit this buffer's rings (layout.fit_rings)."""
        return layout.fit_rings(config, self.num_ranks, self.hidden, self._ring_capacity())

    def gate(self, kind: int, sig: List[int], *, status: int = tags.STATUS_OK, reason: str = "",
             handle_tag: Any = None, upstream: int = 0, pull: Tuple[int, int, int] = (0, 0, 0)) -> None:
        """The call gate alone (normal_gate.cuh): every rank's tag for this call, before a cached dispatch
        or a combine moves rows, or in place of a call refused on the host. `pull`: a combine's offer
        (pull_offer)."""
        a = self._n.NotifyArgs()
        a.gate_only = 1
        a.kind, a.status, a.sig = kind, status, sig
        a.pull_offer, a.pull_rows, a.pull_x = pull
        a.reason = reason.encode("utf-8", "replace")[:tags.REASON_BYTES]
        a.handle_tag = handle_tag.data_ptr() if handle_tag is not None else 0
        a.upstream = upstream
        self._n.notify(self._static, a, raw_current_stream(self.device))

    def refuse(self, kind: int, reason: str) -> Optional[Exception]:
        """This call's gate with a REFUSED tag (the peers raise PeerRefusedCall for it). get_dispatch_layout
        exchanges nothing here (no gate to refuse). Not inside a CUDA graph capture: nothing runs there,
        and a gate captured into the graph would replay as a refusal; the capture fails with this rank's
        error anyway."""
        import torch
        if kind == tags.KIND_LAYOUT or self._broken or torch.cuda.is_current_stream_capturing():
            return None
        self.gate(kind, [], status=tags.STATUS_REFUSED, reason=reason)
        return None

    # ------------------------------------------------------------------ calls
    def get_dispatch_layout(self, topk_idx: "torch.Tensor", num_experts: int) -> LayoutResult:
        import torch
        n, k = topk_idx.shape
        dev = self.device
        per_rank = torch.empty(self.num_ranks, dtype=torch.int32, device=dev)
        per_expert = torch.empty(num_experts, dtype=torch.int32, device=dev)
        in_rank = torch.empty((n, self.num_ranks), dtype=torch.bool, device=dev)
        self.records.num_experts = num_experts
        dropped = self._dropped()
        self._n.layout(self._static, topk_idx.data_ptr(), n, k, num_experts, per_rank.data_ptr(),
                       per_expert.data_ptr(), in_rank.data_ptr(), raw_current_stream(dev),
                       dropped.data_ptr() if dropped is not None else 0)
        return LayoutResult(per_rank, per_expert, in_rank, num_dropped_tokens=dropped)

    def _wait_counts(self, what: str) -> int:
        """The pinned word the notify kernel sets once the counts are in: 1, or 2 when the call is void
        (bounded: the kernel itself gives up on a silent peer after the timeout and still sets it)."""
        host = self._host_np
        bound_s = wait_bound_s(self.timeout_us, 10.0)
        deadline = time.monotonic() + bound_s
        spins = 0
        while host[0] == 0:
            spins += 1
            if spins > 2000:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what}: the received-row count did not arrive within "
                                       f"{bound_s:.1f} s (the GPU is blocked by other work)")
                time.sleep(20e-6)
        return int(host[0])

    def count_args(self, n: int, per_expert: int, in_rank: int, num_experts: int, num_channels: int, alignment: int,
                   num_worst_tokens: int, rpm: "torch.Tensor", cpm: "torch.Tensor", rcp: "torch.Tensor",
                   send_head: "torch.Tensor", kind: int, sig: List[int]) -> Any:
        """The notify kernel's arguments for routing and counting n rows, tagged (kind, sig)."""
        a = self._n.NotifyArgs()
        a.num_tokens_per_expert, a.is_token_in_rank, a.num_tokens = per_expert, in_rank, n
        a.num_experts, a.num_channels, a.expert_alignment = num_experts, num_channels, alignment
        a.num_worst_tokens = num_worst_tokens
        a.rank_prefix_matrix, a.channel_prefix_matrix = rpm.data_ptr(), cpm.data_ptr()
        a.recv_channel_prefix_matrix, a.send_head = rcp.data_ptr(), send_head.data_ptr()
        a.kind, a.sig = kind, sig
        return a

    def notify(self, a: Any, what: str) -> int:
        """Launch the notify kernel (routing, counts and the call gate); returns the rows this rank
        receives (a bounded host wait), or num_worst_tokens without waiting. A call the gate voided
        (a peer refused it, ranks at different calls) or a silent peer raises here, with nothing more
        launched: every rank's call is void alike."""
        host = a.num_worst_tokens == 0
        if host:
            self._host_np[0] = 0
        self._n.notify(self._static, a, raw_current_stream(self.device))
        if not host:
            return a.num_worst_tokens
        state = self._wait_counts(what)
        if state == 2 or self._err_np[0] == ERR_PEER_TIMEOUT:
            # Value errors of this call are not taken here: if the call goes on, this rank must still
            # launch the dispatch its peers wait for; they surface at the event wait or the next call.
            exc = self.pending_error()
            if state == 2:
                raise exc if exc is not None else BufferBroken(f"{what}: the call is void and no record says why")
        return int(self._host_np[1])

    def dispatch(self, call: DispatchCall) -> DispatchResult:
        import torch
        if call.handle is None and call.num_worst_tokens == 0 and torch.cuda.is_current_stream_capturing():
            # Refused before the call number moves or a kernel is captured: the buffer and the capture
            # stay usable (the host would wait for counts that no kernel produces during a capture).
            raise NotCapturable(capture_refusal("a normal dispatch", host_wait=True, drains=False, warmed=True))
        dev, r_n = self.device, self.num_ranks
        cfg = call.config
        c_n = cfg.num_channels()
        n, h = call.x.shape
        fp8 = call.x_scales is not None
        self._settle_ring_geometry(cfg.num_max_nvl_chunked_recv_tokens, h, "normal dispatch")
        self._call_timeout()
        stream = raw_current_stream(dev)
        handle = call.handle
        k = int(call.topk_idx.shape[1]) if call.topk_idx is not None else 0
        counts: Optional[List[int]] = None
        q_n = cfg.num_max_nvl_chunked_recv_tokens
        tag = None
        dropped = self._dropped()
        # One-copy dispatch (direct_pool.py) for dispatches with a handle: every rank runs the handshake
        # alike (its bit is in the signature the gate compares). A dispatch without one waits on the
        # host for its counts between its two kernels; there the ring path's senders start before the
        # peers' dispatch kernels are launched, and the one-copy senders could not, which cost more wall
        # time than the single copy saved (docs/normal_mode.md, "One-copy dispatch").
        direct = self._pool is not None and self._mask is None and handle is not None
        if handle is None:
            e_n = call.num_experts
            self.records.num_experts = e_n
            i32 = torch.int32
            rpm = torch.empty((r_n, r_n), dtype=i32, device=dev)
            cpm = torch.empty((r_n, c_n), dtype=i32, device=dev)
            rcp = torch.empty((r_n, c_n), dtype=i32, device=dev)
            send_head = torch.empty((n, r_n), dtype=i32, device=dev)
            tag = torch.zeros(2, dtype=i32, device=dev)     # the handle's mark: (call, generation) of this dispatch
            in_rank = call.is_token_in_rank
            a = self.count_args(n, call.num_tokens_per_expert.data_ptr(), in_rank.data_ptr(), e_n, c_n,
                                call.expert_alignment, call.num_worst_tokens, rpm, cpm, rcp, send_head,
                                tags.KIND_DISPATCH,
                                [h, c_n, q_n, e_n, k, int(call.topk_weights is not None) | int(fp8) << 1])
            a.num_tokens_per_rank, a.tag_out = call.num_tokens_per_rank.data_ptr(), tag.data_ptr()
            a.dropped = dropped.data_ptr() if dropped is not None else 0
            if call.topk_idx is not None and n:
                a.topk, a.num_topk, a.check_layout = call.topk_idx.data_ptr(), k, 1
            rows = self.notify(a, f"normal dispatch #{call.seq}")
            if call.num_worst_tokens > 0:
                real, counts = -1, []
            else:
                real = rows
                counts = self._host_np[2:2 + e_n // r_n].tolist()
        else:
            rpm, cpm, rcp = handle.rank_prefix_matrix, handle.channel_prefix_matrix, handle.recv_channel_prefix_matrix
            send_head, in_rank = handle.send_head, handle.is_token_in_rank
            rows, real = handle.num_recv_rows, handle.num_recv_tokens
            self.gate(tags.KIND_CACHED, [h, c_n, q_n, int(fp8) | int(direct) << 1], handle_tag=handle.tag)
        cached = handle is not None
        outs = None
        if direct and not torch.cuda.is_current_stream_capturing():
            outs = self._pool.outputs(rows, h, call.x.dtype, fp8, None if cached else k, stream, call.caller_stream)
        elif (self._pull and self._pool is not None and self._mask is None and not fp8
              and not torch.cuda.is_current_stream_capturing()):
            # A ring-path BF16 dispatch: its recv_x in the pool where that leaves as much again free, so that
            # a combine of it as it came (an in-place expert, DeepEP's tests) pulls (normal_pull.cuh).
            outs = self._pool.outputs(rows, h, call.x.dtype, False, None, stream, call.caller_stream, spare=True)
        if outs is not None:
            recv_x, recv_scales = outs.recv_x, outs.recv_x_scales
        else:
            recv_x = torch.empty((rows, h), dtype=call.x.dtype, device=dev)
            recv_scales = torch.empty((rows, h // 128), dtype=torch.float32, device=dev) if fp8 else None
        recv_idx = torch.empty((rows, k), dtype=torch.int64, device=dev) if k and not cached else None
        recv_w = (torch.empty((rows, k), dtype=torch.float32, device=dev)
                  if k and call.topk_weights is not None and not cached else None)
        recv_src = torch.empty(rows, dtype=torch.int32, device=dev) if not cached else handle.recv_src_idx
        ptr = (lambda t: t.data_ptr() if t is not None else 0)
        self._n.dispatch(self._static, call.x.data_ptr(), ptr(call.x_scales), ptr(None if cached else call.topk_idx),
                         ptr(None if cached else call.topk_weights), in_rank.data_ptr(), rpm.data_ptr(), cpm.data_ptr(),
                         rcp.data_ptr(), n, h, k, (call.num_experts // r_n) if call.num_experts else 0, fp8, c_n,
                         cfg.num_max_nvl_chunked_recv_tokens, cfg.num_max_nvl_chunked_send_tokens, rows,
                         call.num_worst_tokens, self._tma_dispatch, recv_x.data_ptr(), ptr(recv_scales), ptr(recv_idx), ptr(recv_w),
                         0 if cached else recv_src.data_ptr(), 0, 0, stream, 0, ptr(dropped),
                         send_head.data_ptr() if dropped is not None else 0,
                         *(call.x_scales.stride() if fp8 else (-1, -1)),   # scales read in place, any layout
                         direct, direct and outs is not None, outs.stage if direct and outs is not None else 0)
        # With a mask the handle keeps the call's is_token_in_rank less the ranks out of it (as the
        # reference backend's does); the kernels' own view is send_head, cleared for rows not sent.
        in_rank_kept = (in_rank & (self._mask != 0).view(1, -1)) if dropped is not None and not cached else None
        return DispatchResult(recv_x=recv_x, recv_x_scales=recv_scales, recv_topk_idx=recv_idx,
                              recv_topk_weights=recv_w, num_recv_tokens_per_expert_list=None if cached else counts,
                              rank_prefix_matrix=rpm, channel_prefix_matrix=cpm, recv_channel_prefix_matrix=rcp,
                              recv_src_idx=recv_src, send_head=send_head, num_recv_tokens=real, tag=tag,
                              is_token_in_rank=in_rank_kept, num_dropped_tokens=dropped)

    def pull_offer(self, x: "torch.Tensor", k: int) -> Tuple[int, int, int]:
        """This rank's pull combine offer (engine/kernels/normal_pull.cuh) for input x: (1, rows, byte offset
        of x in the buffer) when x lies in the output pool (an empty x offers the pool's start), else
        (0, 0, 0). Not with weights (the reduce would need the peers' weights where they lie too) or a mask
        (a marked peer's memory must not be read). The combine pulls only when every rank offers."""
        if not self._pull or self._mask is not None or k:
            return (0, 0, 0)
        rows = int(x.shape[0])
        if rows == 0:
            return (1, 0, self._pool_lo)
        lo, size = x.data_ptr() - self._buf, rows * int(x.shape[1]) * x.element_size()
        if not x.is_contiguous() or lo < self._pool_lo or lo + size > self._pool_hi:
            return (0, 0, 0)
        return (1, rows, lo)

    def combine_input(self, rows: int, hidden: int) -> Optional["torch.Tensor"]:
        """A bf16 [rows, hidden] tensor in the output pool on the current stream (NormalBuffer.get_combine_input),
        or None: no pool, pull combine off, a mask, or no free region that fits."""
        import torch
        if not self._pull or self._pool is None or self._mask is not None:
            return None
        stream = raw_current_stream(self.device)
        o = self._pool.outputs(rows, hidden, torch.bfloat16, False, None, stream, stream)
        return None if o is None else o.recv_x

    def combine(self, call: CombineCall) -> CombineResult:
        import torch
        hd = call.handle
        cfg = call.config
        n, h = hd.num_tokens, int(call.x.shape[1])
        k = int(call.topk_weights.shape[1]) if call.topk_weights is not None else 0
        self._settle_ring_geometry(cfg.num_max_nvl_chunked_recv_tokens, h, "normal combine")
        self._call_timeout()
        pull = self.pull_offer(call.x, k)
        self.gate(tags.KIND_COMBINE, [h, hd.num_channels, cfg.num_max_nvl_chunked_recv_tokens, k], handle_tag=hd.tag,
                  pull=pull)
        out = torch.empty((n, h), dtype=torch.bfloat16, device=self.device)
        out_w = torch.empty((n, k), dtype=torch.float32, device=self.device) if k else None
        dropped = self._dropped()
        b0, b1 = call.bias
        ptr = (lambda t: t.data_ptr() if t is not None else 0)
        self._n.combine(self._static, call.x.data_ptr(), ptr(call.topk_weights), ptr(b0), ptr(b1),
                        hd.send_head.data_ptr(), hd.rank_prefix_matrix.data_ptr(), hd.channel_prefix_matrix.data_ptr(),
                        hd.recv_channel_prefix_matrix.data_ptr(), n, h, k, hd.num_channels,
                        cfg.num_max_nvl_chunked_recv_tokens, cfg.num_max_nvl_chunked_send_tokens, out.data_ptr(),
                        ptr(out_w), 0, raw_current_stream(self.device), ptr(dropped), self._tma_combine, pull[0])
        return CombineResult(out, out_w, num_dropped_tokens=dropped)

    # ------------------------------------------------------------------ for native_internode.py
    # The staged internode path runs these kernels on a node's forwarded rows (docs/normal_internode.md).
    def static_error_words(self) -> "tuple[int, int]":
        """(pinned error record, device claim word block): other kernels of the buffer record there."""
        return self._err.data_ptr(), self._ws.data_ptr()

    @property
    def layout_scratch_address(self) -> int:
        """Device int32 [MAX_RANKS * MAX_LOCAL_EXPERTS]: where the route kernels count topk_idx's entries
        per expert (the internode route uses the node's)."""
        return int(self._scratch.data_ptr())

    @property
    def tag_record_address(self) -> int:
        """The pinned tag record (device_records.py): the relay's gate records its voids there too."""
        return int(self._tag_record.data_ptr())

    def settle_ring_geometry(self, ring_tokens: int, hidden: int, what: str) -> None:
        self._settle_ring_geometry(ring_tokens, hidden, what)

    def launch_dispatch(self, x: "torch.Tensor", scales: Any, topk: Any, weights: Any, in_rank: "torch.Tensor",
                        rpm: "torch.Tensor", cpm: "torch.Tensor", rcp: "torch.Tensor", n: int, h: int, k: int,
                        local_experts: int, fp8: bool, cfg: Config, rows: int, num_worst_tokens: int,
                        recv_x: "torch.Tensor", recv_scales: Any, recv_idx: Any, recv_w: Any, recv_src: Any,
                        src_idx: Any, row_map: Any, x_row_bytes: int = 0) -> None:
        """The dispatch kernel on given rows (the staged internode path's forwarded rows: x may be the
        relayed rows themselves, read in place with x_row_bytes between tokens)."""
        ptr = (lambda t: t.data_ptr() if t is not None else 0)
        self._n.dispatch(self._static, x.data_ptr(), ptr(scales), ptr(topk), ptr(weights), in_rank.data_ptr(),
                         rpm.data_ptr(), cpm.data_ptr(), rcp.data_ptr(), n, h, k, local_experts, fp8,
                         cfg.num_channels(), cfg.num_max_nvl_chunked_recv_tokens, cfg.num_max_nvl_chunked_send_tokens,
                         rows, num_worst_tokens, self._tma_dispatch, recv_x.data_ptr(), ptr(recv_scales), ptr(recv_idx),
                         ptr(recv_w), ptr(recv_src), ptr(src_idx), ptr(row_map), raw_current_stream(self.device),
                         x_row_bytes)

    def launch_combine(self, x: "torch.Tensor", weights: Any, send_head: "torch.Tensor", rpm: "torch.Tensor",
                       cpm: "torch.Tensor", rcp: "torch.Tensor", n: int, h: int, k: int, num_channels: int, cfg: Config,
                       out: "torch.Tensor", out_w: Any, row_map: Any) -> None:
        ptr = (lambda t: t.data_ptr() if t is not None else 0)
        self._n.combine(self._static, x.data_ptr(), ptr(weights), 0, 0, send_head.data_ptr(), rpm.data_ptr(),
                        cpm.data_ptr(), rcp.data_ptr(), n, h, k, num_channels, cfg.num_max_nvl_chunked_recv_tokens,
                        cfg.num_max_nvl_chunked_send_tokens, out.data_ptr(), ptr(out_w), ptr(row_map),
                        raw_current_stream(self.device), 0, self._tma_combine)

    # ------------------------------------------------------------------ the rest
    def clean(self) -> None:
        """Collective: every rank quiesces, zeroes its control area and records, starts a new generation
        at call 0, and waits for all others, so that no counter or call number of an interrupted call
        survives."""
        import torch
        torch.cuda.synchronize(self.device)
        what = "normal-mode clean"
        self._barrier(what)
        self._ep.memset_async(self._buf, 0, layout.ring_offset(self.num_ranks, self._extra),
                              torch.cuda.current_stream().cuda_stream)
        torch.cuda.current_stream().synchronize()
        self._err.zero_()
        self._host.zero_()
        self._tag_record.zero_()
        self.records.reset()
        # A new generation, every rank at call 0 (kWsSeq) again: the tags of older calls never match.
        self._epoch += 1
        self._ws.zero_()
        self._ws[2] = self._epoch            # normal_tags.h kWsEpoch
        torch.cuda.current_stream().synchronize()
        self._broken = False
        self._sync_fast()
        self._barrier(what)

    def buffer_bytes(self) -> int:
        return self._bytes

    def raw_buffer(self) -> "tuple[int, int]":
        """(device address, bytes) of the registered NVLink buffer (control area and rings): the memory
        DeepEP's get_local_buffer_tensor(use_rdma_buffer=False) exposes. Valid until destroy()."""
        if self._destroyed:
            raise RuntimeError("native normal-mode backend: raw_buffer() after destroy()")
        return self._buf, self._bytes

    def transport_table(self) -> List[PeerTransport]:
        return [PeerTransport(link.rank, link.kind, link.detail) for link in self._peers.links]

    def _release(self) -> None:
        self._close_fast()
        if self._peers is not None:
            self._peers.close()
            self._peers = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        # The memory goes once no caller's one-copy output views it any more (DeviceMemory).
        self._mem = None
        self._buf = 0

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        import torch
        torch.cuda.synchronize(self.device)
        self._release()
