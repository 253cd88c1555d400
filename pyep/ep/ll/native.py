"""The native low-latency EP backend: the CUDA kernels of engine/kernels/ll_*.cu over per-peer
transports (local stores, NVLink IPC stores, or RDMA writes posted by the GPU on a real NIC or the
softnic). Implements pyep.ep.backend.EpBackend; the buffer layout is pyep.ep.ll.layout.

Streams: a call launches on the current stream, or with async_finish on this backend's communication
stream (which first waits for the current stream) and returns an event; the next non-async call on
the current stream waits for that event, so calls never overlap on the device. Nothing in dispatch or
combine blocks the host, so both are CUDA-graph capturable.

Expert ids are checked by the dispatch kernel into a pinned, host-mapped error record (unless
check_values=False), and an exchange that failed with a peer (an abort marker, another call's tag) into
the call record beside it; take_error() reads them with a plain host load (docs/ll_kernels.md;
native_tags.py).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from ..control import as_control
from .native_member import NativeMembership
from .native_setup import FAST_ENV, NativeSetup, engine_ep, map_error_record
from .native_tags import COMBINED, RECV_PENDING, NativeCallTags
from ..backend import OnceHook, profiled_range, BackendUnavailable, PeerTransport
from .contract import CombineOptions, CombineResult, DispatchOptions, DispatchResult
from .config import EpConfig
from .errors import refusal_reason
from .layout import LLLayout, ll_buffer_layout
from ..streams import NativeEvent, raw_current_stream
from ..validate import check_aligned

if TYPE_CHECKING:
    import torch

    from .handle import Handle

log = logging.getLogger("pyep.ep.ll.native")
PHASE_SEND, PHASE_RECV = 1, 2
SETUP_TIMEOUT_FLOOR_S = 120.0   # first IPC mappings / QP setup on a loaded node
# COMBINED / RECV_PENDING (handle extras) live with the abort launches that read them (native_tags.py),
# FAST_ENV lives with the fast path it switches off (native_setup.py); tools import it from here.
__all__ = ["NativeBackend", "COMBINED", "RECV_PENDING", "FAST_ENV", "PHASE_SEND", "PHASE_RECV"]


class NativeBackend(NativeSetup, NativeMembership, NativeCallTags):
    name = "native"

    @staticmethod
    def unavailable_reason(config: EpConfig) -> Optional[str]:
        try:
            import torch
        except ImportError:
            return "torch is not installed"
        if not torch.cuda.is_available():
            return "no CUDA device is available"
        try:
            engine_ep()
        except BackendUnavailable as exc:
            return str(exc)
        return None

    def __init__(self, comm: Any, config: EpConfig) -> None:
        import torch
        self._ep = engine_ep()                       # BackendUnavailable before any collective
        if not torch.cuda.is_available():
            raise BackendUnavailable("no CUDA device is available")
        self.control = as_control(comm)              # a ProcessGroup or a store (pyep.ep.control)
        self.group = self.control.group
        self.config = config
        self.rank = self.control.rank
        self.num_ranks = self.control.world_size
        config.check_group_size(self.num_ranks)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._destroyed = False
        self._buf = 0
        self._peers: Any = None
        cfg, r_n = config, self.num_ranks
        self.layout: LLLayout = ll_buffer_layout(cfg.num_max_dispatch_tokens_per_rank, cfg.hidden,
                                                 cfg.num_experts, r_n, cfg.max_topk)
        self.num_local_experts = self.layout.num_local_experts
        self.buffer_bytes = max(self.layout.total_bytes, cfg.num_buffer_bytes or 0)
        self._setup_timeout_s = max(SETUP_TIMEOUT_FLOOR_S, 3 * cfg.timeout_us / 1e6)
        self._ws = torch.zeros(self.layout.workspace_words(), dtype=torch.int32, device=self.device)
        self._active = torch.ones(r_n, dtype=torch.int32, device=self.device)
        self._comm = torch.cuda.Stream(device=self.device)
        # The C++ fast path (ep_fast_bind.cpp), made once the static table exists; until then and in
        # builds without it, _half and _pending live here.
        self._fast: Any = None
        self._half_py = 0
        self._pending_ev: Optional["torch.cuda.Event"] = None
        self._combine_bufs: List[Optional["torch.Tensor"]] = [None, None]
        self._tables: Dict[str, "torch.Tensor"] = {}
        self._trace: Optional["torch.Tensor"] = None
        self._err_ptr = 0
        self._err: Any = None
        self._check_shared_memory()
        try:
            self._ep.load_kernels(self._shape_static())
            self._err_ptr, self._err = map_error_record(self._ep)
            self._buf = int(self._ep.device_alloc(self.buffer_bytes))
            self._ep.memset_async(self._buf, 0, self.buffer_bytes, torch.cuda.current_stream().cuda_stream)
            torch.cuda.current_stream().synchronize()
            from ..peers import PeerSet
            self._peers = PeerSet(self.control, config.links, self._ep, self.rank, r_n, self.device.index, self._buf,
                                  self.buffer_bytes, self._setup_timeout_s)
            if getattr(self.control, "joining", False):
                self._prepare_join()                 # a restarted rank: pyep.ep.ll.native_member
            else:
                self._peers.connect()
                self._static = self._build_static()
                self._fast = self._make_fast()
                self.control.barrier(self._setup_timeout_s, "native EP buffer setup (every rank mapped its peers)")
        except BaseException:
            self._release()
            raise
        log.debug("rank %d: %s", self.rank, self.layout.describe())

    @property
    def fast_path(self) -> Any:
        """The C++ fast path EpBuffer calls for a plain dispatch (None: every call takes the Python path).
        Its dispatch returns (recv_x, scales, recv_count, src_info, layout_range, handle extras, N, K), or
        None for a call it leaves to the Python path (which then raises validate.py's error or runs it)."""
        return self._fast

    def fast_combine(self, x: "torch.Tensor", topk_idx: "torch.Tensor", topk_weights: "torch.Tensor",
                     handle: "Handle", active_ranks: Optional["torch.Tensor"], timeout_us: Any,
                     out: Optional["torch.Tensor"], zero_copy: bool,
                     wait_stats: Optional["torch.Tensor"] = None) -> Optional["torch.Tensor"]:
        """combine through the fast path for a handle EpBuffer validated; None: take the Python path."""
        fast = self._fast
        ex = handle.extras
        if (fast is None or ex.get("buffer") != self._buf or ex.get("backend") != "native"
                or ex.get(RECV_PENDING)):
            return None                  # a pending receive hook: the Python path raises
        src = self.next_combine_buffer(handle) if zero_copy else None
        combined = ex.get(COMBINED, 0)
        res = fast.combine(x, topk_idx, topk_weights, handle.src_info, handle.layout_range, ex["topk_slot"],
                           ex["half"], handle.num_tokens, handle.num_topk, active_ranks, timeout_us, out, src,
                           wait_stats, combined > 0, handle.seq & 0xFFFFFFFF)
        if res is not None:
            ex[COMBINED] = combined + 1
        return res

    # The buffer half of the next dispatch and the outstanding async_finish event are shared with the
    # fast path: it must leave a call to the Python path while an event is outstanding (stream order).
    @property
    def _half(self) -> int:
        return int(self._fast.half) if self._fast is not None else self._half_py

    @_half.setter
    def _half(self, value: int) -> None:
        self._half_py = value
        if self._fast is not None:
            self._fast.half = value

    @property
    def _pending(self) -> Optional["torch.cuda.Event"]:
        return self._pending_ev

    @_pending.setter
    def _pending(self, ev: Optional["torch.cuda.Event"]) -> None:
        self._pending_ev = ev
        if self._fast is not None:
            self._fast.blocked = ev is not None

    # ------------------------------------------------------------------ streams
    def _raw_current_stream(self) -> int:
        return raw_current_stream(self.device)

    def _launch_stream(self, async_finish: bool) -> "tuple[Optional[torch.cuda.Stream], int]":
        """(Stream object or None for "the current stream", its cudaStream_t) for this call's launch."""
        if not async_finish and self._pending is None:
            return None, self._raw_current_stream()
        st = self._stream(async_finish)
        return st, int(st.cuda_stream)

    def _stream(self, async_finish: bool) -> "torch.cuda.Stream":
        import torch
        cur = torch.cuda.current_stream(self.device)
        if async_finish:
            self._comm.wait_stream(cur)
            return self._comm
        if self._pending is not None:
            # An event recorded outside a graph capture cannot be waited on inside it; a capture
            # starts from a synchronised stream anyway.
            if not torch.cuda.is_current_stream_capturing():
                cur.wait_event(self._pending)
            self._pending = None
        return cur

    def _finish(self, stream: Optional["torch.cuda.Stream"], async_finish: bool, keep: List[Any], what: str,
                timeout_us: int) -> Optional[NativeEvent]:
        import torch
        if not async_finish or stream is None:
            return None
        for t in keep:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(stream)
        ev = torch.cuda.Event()
        ev.record(stream)
        self._pending = ev
        return NativeEvent(ev, self.device, what, 2 * timeout_us / 1e6 + 10.0)

    def _hook(self, launch: Callable[[int], None], sent_on: Optional["torch.cuda.Stream"], sent_ptr: int,
              what: str) -> OnceHook:
        import torch
        sent = torch.cuda.Event()
        if sent_on is not None:
            sent.record(sent_on)
        else:
            sent.record()

        def run() -> None:
            with profiled_range(what):
                cur = self._raw_current_stream()
                if cur != sent_ptr:
                    torch.cuda.current_stream(self.device).wait_event(sent)
                launch(cur)
        return OnceHook(run)

    def _run_phases(self, launch: Callable[[int, int], None], async_finish: bool, recv_hook: bool,
                    keep: List[Any], hook_name: str, what: str,
                    timeout_us: int) -> "tuple[Optional[NativeEvent], Optional[OnceHook]]":
        """Launch one call: both phases at once, or the send phase now and the receive phase in the
        returned hook. launch(phases, cudaStream_t)."""
        stream, ptr = self._launch_stream(async_finish)
        hook = None
        if recv_hook:
            launch(PHASE_SEND, ptr)
            hook = self._hook(lambda s: launch(PHASE_RECV, s), stream, ptr, hook_name)
        else:
            launch(PHASE_SEND | PHASE_RECV, ptr)
        return self._finish(stream, async_finish, keep, what, timeout_us), hook

    # ------------------------------------------------------------------ dispatch / combine
    def _active_ptr(self, active: Optional["torch.Tensor"]) -> int:
        return (active if active is not None else self._active).data_ptr()

    def _refused(self, exc: BaseException, sent: bool, abort: Callable[[int], None], what: str) -> None:
        """A call that failed on the host before its first launch took part in nothing: send the abort
        marker for it, so the peers neither wait for it nor pair another call with it (the caller
        re-raises `exc`). After the first launch the call is under way and its peers are served."""
        if sent:
            return
        try:
            abort(refusal_reason(exc))
        except Exception as abort_exc:  # noqa: BLE001 - the refusal is what the caller reports
            log.error("rank %d: %s was refused (%s) and its abort marker could not be sent: %s", self.rank, what,
                      exc, abort_exc)

    def dispatch(self, x: "torch.Tensor", topk_idx: "torch.Tensor", opts: DispatchOptions) -> DispatchResult:
        self._check_alive("dispatch")
        half = self._half
        self._half ^= 1
        self._last_seq = max(self._last_seq, opts.seq)
        sent = [False]
        try:
            return self._dispatch(half, x, topk_idx, opts, sent)
        except Exception as exc:
            self._refused(exc, sent[0], lambda why: self._launch_abort_dispatch(half, opts, why),
                          f"dispatch #{opts.seq}")
            raise

    def _dispatch(self, half: int, x: "torch.Tensor", topk_idx: "torch.Tensor", opts: DispatchOptions,
                  sent: List[bool]) -> DispatchResult:
        import torch
        check_aligned("x", x)
        lay, dev = self.layout, self.device
        e_l, rows, h = lay.num_local_experts, self.num_ranks * lay.num_max_tokens, lay.hidden
        n, k = int(topk_idx.shape[0]), int(topk_idx.shape[1])
        recv_x = torch.empty((e_l, rows, h), dtype=torch.float8_e4m3fn if opts.use_fp8 else torch.bfloat16,
                             device=dev)
        scales: Optional[torch.Tensor] = None
        if opts.use_fp8:
            groups = h // 128
            if opts.use_ue8m0:
                packed = (groups + 3) // 4
                scales = torch.empty_strided((e_l, rows, packed), (packed * rows, 1, rows), dtype=torch.int32,
                                             device=dev)
            else:
                # Column-major per expert ([E_l, G, rows] transposed), in one call.
                scales = torch.empty_strided((e_l, rows, groups), (groups * rows, 1, rows), dtype=torch.float32,
                                             device=dev)
        # One allocation for the three int32 outputs (each allocation costs several microseconds of
        # host time); they are disjoint, contiguous views.
        meta = torch.empty(e_l * (1 + 2 * rows), dtype=torch.int32, device=dev)
        recv_count = meta[:e_l]
        src_info = meta[e_l:e_l * (1 + rows)].view(e_l, rows)
        recv_slot = meta[e_l * (1 + rows):].view(e_l, rows)
        layout_range = torch.empty((e_l, self.num_ranks), dtype=torch.int64, device=dev)
        active = self._active_ptr(opts.active_ranks)
        cum = opts.cumulative_local_expert_recv_stats
        waits = opts.dispatch_wait_recv_cost_stats
        timeout_ns = int(opts.timeout_us) * 1000

        def launch(phases: int, stream: int) -> None:
            self._ep.dispatch(self._static, x.data_ptr(), topk_idx.data_ptr(), n, k, half, opts.use_fp8,
                              opts.round_scale, opts.use_ue8m0, active, recv_x.data_ptr(),
                              scales.data_ptr() if scales is not None else 0, src_info.data_ptr(),
                              recv_slot.data_ptr(), layout_range.data_ptr(), recv_count.data_ptr(),
                              cum.data_ptr() if cum is not None else 0, timeout_ns, phases, stream,
                              wait_stats=waits.data_ptr() if waits is not None else 0, seq=opts.seq & 0xFFFFFFFF)
            sent[0] = True

        keep = [x, topk_idx, recv_x, scales, recv_count, src_info, recv_slot, layout_range, cum,
                opts.active_ranks, waits]
        event, hook = self._run_phases(launch, opts.async_finish, opts.return_recv_hook, keep,
                                       "pyep::native::dispatch_recv", f"native dispatch #{opts.seq}",
                                       opts.timeout_us)
        return DispatchResult(recv_x=recv_x, recv_scales=scales, recv_count=recv_count, src_info=src_info,
                              layout_range=layout_range, event=event, hook=hook,
                              extras={"backend": "native", "half": half, "topk_slot": recv_slot,
                                      "buffer": self._buf})

    def combine(self, x: "torch.Tensor", topk_idx: "torch.Tensor", topk_weights: "torch.Tensor",
                handle: "Handle", opts: CombineOptions) -> CombineResult:
        self._check_alive("combine")
        sent = [False]
        try:
            return self._combine(x, topk_idx, topk_weights, handle, opts, sent)
        except Exception as exc:
            self._refused(exc, sent[0], lambda why: self.abort_combine(handle, opts, why),
                          f"combine of dispatch #{handle.seq}")
            raise

    def _combine(self, x: "torch.Tensor", topk_idx: "torch.Tensor", topk_weights: "torch.Tensor",
                 handle: "Handle", opts: CombineOptions, sent: List[bool]) -> CombineResult:
        import torch
        half, recv_slot = self._handle_parts(handle)
        ex = handle.extras
        if ex.get(RECV_PENDING):
            # Its peers' acknowledgements of that combine come from their receive halves, which they
            # run when they call their hooks: this combine would wait for them and time out.
            raise ValueError(f"dispatch #{handle.seq}'s handle is combined again, but its previous combine's "
                             f"receive hook was not called: call that hook first")
        combined = int(ex.get(COMBINED, 0))
        # A handle combined before, or a combine a CUDA graph may replay: wait on the device for every
        # destination's acknowledgement of our earlier combines on this half (docs/ll_kernels.md).
        repeat = combined > 0 or torch.cuda.is_current_stream_capturing()
        n, k = int(topk_idx.shape[0]), int(topk_idx.shape[1])
        src = self.next_combine_buffer(handle) if opts.zero_copy else x
        out = opts.out if opts.out is not None else torch.empty((n, self.layout.hidden), dtype=torch.bfloat16,
                                                                 device=self.device)
        check_aligned("x", src)
        check_aligned("out", out)
        active = self._active_ptr(opts.active_ranks)
        waits = opts.combine_wait_recv_cost_stats
        timeout_ns = int(opts.timeout_us) * 1000

        def launch(phases: int, stream: int) -> None:
            self._ep.combine(self._static, src.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(), n, k,
                             half, handle.src_info.data_ptr(), recv_slot.data_ptr(),
                             handle.layout_range.data_ptr(), active, out.data_ptr(), timeout_ns, phases, stream,
                             opts.use_logfmt, wait_stats=waits.data_ptr() if waits is not None else 0,
                             repeat=repeat, seq=handle.seq & 0xFFFFFFFF)
            sent[0] = True
            if phases == PHASE_RECV:
                ex[RECV_PENDING] = False

        keep = [src, topk_idx, topk_weights, out, handle.src_info, recv_slot, handle.layout_range,
                opts.active_ranks, waits]
        event, hook = self._run_phases(launch, opts.async_finish, opts.return_recv_hook, keep,
                                       "pyep::native::combine_recv", f"native combine of dispatch #{handle.seq}",
                                       opts.timeout_us)
        ex[COMBINED] = combined + 1
        ex[RECV_PENDING] = hook is not None
        return CombineResult(out=out, event=event, hook=hook)

    def _handle_parts(self, handle: "Handle") -> "tuple[int, torch.Tensor]":
        ex = handle.extras
        if ex.get("backend") != "native" or "half" not in ex or "topk_slot" not in ex:
            raise ValueError("handle was not produced by the native backend (no buffer half / top-k slots)")
        if ex.get("buffer") != self._buf:
            raise ValueError("handle was produced by another native EP buffer")
        return int(ex["half"]), ex["topk_slot"]

    def next_combine_buffer(self, handle: "Handle") -> "torch.Tensor":
        import torch
        self._check_alive("next_combine_buffer")
        half, _ = self._handle_parts(handle)
        buf = self._combine_bufs[half]
        if buf is None:
            lay = self.layout
            buf = torch.zeros((lay.num_local_experts, self.num_ranks * lay.num_max_tokens, lay.hidden),
                              dtype=torch.bfloat16, device=self.device)
            self._combine_bufs[half] = buf
        return buf

    # ------------------------------------------------------------------ membership / lifetime
    def _zero_state(self) -> None:
        import torch
        stream = torch.cuda.current_stream(self.device)
        for off, size in self.layout.signal_ranges:
            self._ep.memset_async(self._buf + off, 0, size, stream.cuda_stream)
        self._ws.zero_()
        stream.synchronize()
        self._half = 0
        self._pending = None

    def update_ep_member(self, active_ranks: Optional["torch.Tensor"]) -> None:
        import torch
        self._check_alive("update_ep_member")
        torch.cuda.synchronize(self.device)   # our kernels are bounded by timeout_us, so this is too
        self._peers.reconnect()
        self._static = self._build_static()
        if self._fast is not None:
            self._fast.static = self._static
        self._zero_state()
        if active_ranks is not None:
            self._active.copy_(active_ranks)
        else:
            self._active.fill_(1)
        self.control.barrier(self._setup_timeout_s, "native update_ep_member (every rank cleared its buffer)")

    def clean(self) -> None:
        import torch
        self._check_alive("clean")
        torch.cuda.synchronize(self.device)
        self._zero_state()
        self.control.barrier(self._setup_timeout_s, "native clean (every rank cleared its buffer)")

    def qp_contexts(self) -> List[Any]:
        """The live QP device contexts of the NIC links, for pyep.transport.qp_dump (`pyep qp dump`)."""
        from ...transport.qp_dump import refs_from_table
        self._check_alive("qp_contexts")
        if "qps" not in self._tables or not any(link.qp_contexts for link in self._peers.links):
            return []
        return refs_from_table(self._peers.links, self._tables["qps"], self._peers.qps_per_peer(),
                               self._peers.provider())

    def transport_table(self) -> List[PeerTransport]:
        """One entry per rank; a rank this backend's own mask marked after a timeout shows as
        "inactive" (reading the mask waits for the device: a diagnostic, not a hot-path call)."""
        self._check_alive("transport_table")
        marks = self.active_marks()
        return [PeerTransport(link.rank, link.kind if marks[link.rank] else "inactive",
                              link.detail if marks[link.rank] else f"timed out; was {link.kind} ({link.detail})")
                for link in self._peers.links]

    def raw_buffer(self) -> "tuple[int, int]":
        """(device address, bytes) of the registered buffer that the kernels and the peers write: the
        memory DeepEP's get_local_buffer_tensor exposes (pyep.compat views it). Valid until destroy();
        writing it while a call is in flight corrupts that call."""
        self._check_alive("raw_buffer")
        return self._buf, self.buffer_bytes

    @property
    def active_mask(self) -> "torch.Tensor":
        """The backend's own active_ranks (used when a call passes none)."""
        return self._active

    def _check_alive(self, what: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"native EP backend: {what}() after destroy()")

    def destroy(self) -> None:
        import torch
        if self._destroyed:
            return
        self._destroyed = True
        try:
            torch.cuda.synchronize(self.device)
        finally:
            self._release()
            self._combine_bufs = [None, None]
            self._tables = {}
