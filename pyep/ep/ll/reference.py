"""Reference backend: the low-latency EP contract in plain torch over torch.distributed collectives
(gloo on CPU, NCCL on GPU). It is the oracle for the GPU tests, the fallback when no kernels are
built, and the "what you would write without pyep" baseline of the benchmark.

Messages mirror the native wire format: a 16-byte header of four int32 (source token index, top-k
slot, local expert, reserved) followed by the payload, all exchanged as bytes with one counts
all-to-all and one data all-to-all per call. Every collective wait is bounded by the call's timeout.
Each source's part of a call begins with a call header (reference_calls.py: the call number, the
sender's generation, or an abort marker for a call it refused), checked before anything is used.
With return_recv_hook the exchange happens in the call and the hook does the receive-side placement,
so outputs read before the hook runs are zero -- a caller that forgets the hook sees it in tests.

Expert ids the kernels treat as errors (outside [-1, E), or an expert repeated in a row) are routed as
-1 here too. With check_values on, the first one of a dispatch is kept as the pending error that
take_error() hands to EpBuffer, which raises it where it would raise the native kernels' record
(event.wait(), the hook, the end of the next combine): this oracle checks on the host, but reports at
the same points.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from .. import fp8
from . import logfmt
from .._dist import barrier_bounded, group_device
from ..backend import OnceHook, CompletedEvent, PeerTransport
from .contract import CALL_ERROR, CombineOptions, CombineResult, DispatchOptions, DispatchResult
from .config import EpConfig
from ..elastic.mailbox import StoreMailbox
from .errors import (ERR_EXPERT_DUPLICATE, ERR_EXPERT_RANGE, KIND_COMBINE, KIND_DISPATCH, InvalidExpertIndex,
                     LLCallMismatch, make_error)
from .reference_calls import ReferenceExchange
from .validate import find_bad_entry, sanitize_topk

if TYPE_CHECKING:
    import torch

    from .handle import Handle

log = logging.getLogger("pyep.ep.ll.reference")
HEADER_BYTES = 16


def _bytes(t: "torch.Tensor") -> "torch.Tensor":
    """[M, ...] tensor -> [M, nbytes] uint8 view (dtype-agnostic transport: gloo has no bf16/fp8)."""
    import torch
    width = t.element_size()
    for d in t.shape[1:]:
        width *= d
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], width)


class ReferenceBackend(ReferenceExchange):
    name = "reference"

    def __init__(self, comm: Any, config: EpConfig) -> None:
        import torch
        import torch.distributed as dist

        from ..control import as_control
        self.control = as_control(comm)
        self.group = self.control.group
        self.config = config
        self.rank = self.control.rank
        self.num_ranks = self.control.world_size
        self.num_local_experts = config.num_local_experts(self.num_ranks)
        self._combine_bufs: List[Optional["torch.Tensor"]] = [None, None]
        self._error: Optional[InvalidExpertIndex] = None
        self._call_error: Optional[LLCallMismatch] = None   # the first failed exchange not reported yet
        self._generations: Optional[List[int]] = None
        if self.group is not None:
            self.device = group_device(self.group)
            self._backend_name = str(dist.get_backend(self.group))
            self._mail: Optional[StoreMailbox] = None
        else:
            # Store-based buffer: messages are store keys, a source that is late is marked inactive
            # (as the native kernels do), so survivors of a dead rank keep going.
            self.device = torch.device("cpu")
            self._backend_name = "store"
            self._mail = StoreMailbox(self.control)
        self._mask = torch.ones(self.num_ranks, dtype=torch.bool, device=self.device)
        # gloo: counts travel peer to peer, so each source's arrival is seen (and timed) on the host.
        self._p2p_counts = "gloo" in self._backend_name.lower()

    def take_error(self, latest_call: Optional[int] = None) -> Optional[Exception]:
        """The first failed exchange, else the first bad expert id, not reported yet (cleared by reading)."""
        if self._call_error is not None:
            call, self._call_error = self._call_error, None
            return call
        err, self._error = self._error, None
        return err

    def pending_call_error(self, latest_call: Optional[int] = None) -> Optional[LLCallMismatch]:
        return self._call_error

    def _record(self, topk_idx: "torch.Tensor") -> None:
        # Like the device record: the first error stays until it is reported.
        if self._error is not None or self.config.check_values is False or topk_idx.numel() == 0:
            return
        found = find_bad_entry(topk_idx, self.config.num_experts)
        if found is not None:
            row, k, value, first_k = found
            code = ERR_EXPERT_DUPLICATE if first_k >= 0 else ERR_EXPERT_RANGE
            self._error = make_error(code, row, k, value, first_k, self.config.num_experts)

    @staticmethod
    def unavailable_reason(config: EpConfig) -> Optional[str]:
        return None

    def _add_waits(self, stats: Optional["torch.Tensor"], waits: Optional[List[int]],
                   active: "torch.Tensor") -> None:
        """Adds the measured per-source waits of active sources to a caller's *_wait_recv_cost_stats."""
        import torch
        if stats is not None and waits is not None:
            stats.add_(torch.tensor(waits, dtype=torch.int64, device=stats.device) * active.to(stats.device))

    def _check_wait_stats(self, stats: Optional["torch.Tensor"], name: str) -> None:
        if stats is not None and not self._p2p_counts:
            how = ("a store-based buffer polls its mailbox keys, which the host does not time per source"
                   if self._mail is not None else
                   f"over {self._backend_name} its counts travel in one collective, which has no per-source "
                   f"arrival the host can see")
            raise NotImplementedError(f"{name}: the reference backend times per-source waits on gloo groups only "
                                      f"({how}); use the native backend, or a gloo group")

    def _active(self, active_ranks: Optional["torch.Tensor"]) -> "torch.Tensor":
        if active_ranks is None:
            return self._mask.clone()
        return (active_ranks != 0) & self._mask

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, x: "torch.Tensor", topk_idx: "torch.Tensor", opts: DispatchOptions) -> DispatchResult:
        started = [False]
        try:
            return self._dispatch(x, topk_idx, opts, started)
        except Exception as exc:
            self._refusing(exc, started, lambda why: self.abort_dispatch(opts, why))
            raise

    def _dispatch(self, x: "torch.Tensor", topk_idx: "torch.Tensor", opts: DispatchOptions,
                  started: List[bool]) -> DispatchResult:
        import torch
        cfg, dev = self.config, self.device
        r_n, e_l, t_max, h = self.num_ranks, self.num_local_experts, cfg.num_max_dispatch_tokens_per_rank, cfg.hidden
        n, k = topk_idx.shape
        active = self._active(opts.active_ranks)
        self._check_wait_stats(opts.dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats")
        self._record(topk_idx)
        topk_idx = sanitize_topk(topk_idx, cfg.num_experts)
        with torch.profiler.record_function("pyep::reference::dispatch_send"):
            flat = topk_idx.reshape(-1)
            owner = torch.div(flat.clamp_min(0), e_l, rounding_mode="floor")
            valid = (flat >= 0) & active[owner]
            entry = valid.nonzero().reshape(-1)            # ascending (t, k) order
            dest = owner[entry]
            order = torch.sort(dest, stable=True).indices  # group by destination, keep (t, k) order
            entry, dest = entry[order], dest[order]
            tok = torch.div(entry, k, rounding_mode="floor")
            header = torch.stack([tok, entry % k, flat[entry] % e_l, torch.zeros_like(tok)], dim=1)
            parts = [_bytes(header.to(torch.int32))]
            if opts.use_fp8:
                q, scales = fp8.quantize_fp8(x, opts.round_scale)
                parts += [q.view(torch.uint8)[tok], _bytes(scales[tok])]
            else:
                parts.append(_bytes(x[tok]))
            send = torch.cat(parts, dim=1)
            counts = torch.bincount(dest, minlength=r_n).tolist()
            started[0] = True
            recv, recv_counts, waits, failed = self._call_exchange(KIND_DISPATCH, opts.seq, send, counts,
                                                                   opts.timeout_us, f"dispatch #{opts.seq}",
                                                                   f"d{opts.seq}", active, opts.active_ranks)

        rows = r_n * t_max
        groups = h // fp8.GROUP
        # FP8 rows are placed as bytes: index_put is not implemented for float8 on every device.
        recv_x = torch.zeros((e_l, rows, h), dtype=torch.uint8 if opts.use_fp8 else torch.bfloat16,
                             device=dev)
        scales_out: Optional[torch.Tensor] = None
        if opts.use_fp8:
            # Column-major per expert (DeepEP's layout): allocate [E_l, G, rows], hand out the transpose.
            if opts.use_ue8m0:
                scales_out = torch.zeros((e_l, fp8.num_packed_ue8m0(h), rows), dtype=torch.int32,
                                         device=dev).transpose(1, 2)
            else:
                scales_out = torch.zeros((e_l, groups, rows), dtype=torch.float32, device=dev).transpose(1, 2)
        recv_count = torch.zeros(e_l, dtype=torch.int32, device=dev)
        src_info = torch.zeros((e_l, rows), dtype=torch.int32, device=dev)
        layout_range = torch.zeros((e_l, r_n), dtype=torch.int64, device=dev)
        topk_slot = torch.full((e_l, rows), -1, dtype=torch.int32, device=dev)

        def receive() -> None:
            with torch.profiler.record_function("pyep::reference::dispatch_recv"):
                src = torch.repeat_interleave(torch.arange(r_n, device=dev, dtype=torch.int64), recv_counts)
                keep = active[src]
                msgs, src = recv[keep], src[keep]
                hdr = msgs[:, :HEADER_BYTES].contiguous().view(torch.int32).to(torch.int64)
                le = hdr[:, 2]
                key = le * r_n + src
                order = torch.sort(key, stable=True).indices  # by expert, then rank, then (t, k)
                msgs, key, hdr = msgs[order], key[order], hdr[order]
                cnt = torch.bincount(key, minlength=e_l * r_n).to(torch.int64)
                first = torch.cumsum(cnt, 0) - cnt                  # first sorted index of each key
                cnt2 = cnt.view(e_l, r_n)
                begin = torch.cumsum(cnt2, 1) - cnt2
                row = (torch.arange(key.numel(), device=dev, dtype=torch.int64) - first[key]
                       + begin.reshape(-1)[key])
                le = torch.div(key, r_n, rounding_mode="floor")
                layout_range.copy_((begin << 32) | cnt2)
                recv_count.copy_(cnt2.sum(1).to(torch.int32))
                src_info[le, row] = hdr[:, 0].to(torch.int32)
                topk_slot[le, row] = hdr[:, 1].to(torch.int32)
                body = msgs[:, HEADER_BYTES:]
                if opts.use_fp8:
                    recv_x[le, row] = body[:, :h]
                    sc = body[:, h:h + 4 * groups].contiguous().view(torch.float32)
                    if opts.use_ue8m0:
                        scales_out[le, row] = fp8.pack_ue8m0(sc)
                    else:
                        scales_out[le, row] = sc
                else:
                    recv_x[le, row] = body.contiguous().view(torch.bfloat16)
                if opts.cumulative_local_expert_recv_stats is not None:
                    opts.cumulative_local_expert_recv_stats.add_(recv_count)
                self._add_waits(opts.dispatch_wait_recv_cost_stats, waits, active)

        hook: Optional[Callable[[], None]] = None
        if opts.return_recv_hook:
            hook = OnceHook(receive)
        else:
            receive()
        return DispatchResult(recv_x=recv_x.view(torch.float8_e4m3fn) if opts.use_fp8 else recv_x,
                              recv_scales=scales_out, recv_count=recv_count,
                              src_info=src_info, layout_range=layout_range,
                              event=CompletedEvent(f"reference dispatch #{opts.seq}"), hook=hook,
                              extras={"topk_slot": topk_slot, CALL_ERROR: failed})

    # ---------------------------------------------------------------- combine
    def combine(self, x: "torch.Tensor", topk_idx: "torch.Tensor", topk_weights: "torch.Tensor",
                handle: "Handle", opts: CombineOptions) -> CombineResult:
        started = [False]
        try:
            return self._combine(x, topk_idx, topk_weights, handle, opts, started)
        except Exception as exc:
            self._refusing(exc, started, lambda why: self.abort_combine(handle, opts, why))
            raise

    def _combine(self, x: "torch.Tensor", topk_idx: "torch.Tensor", topk_weights: "torch.Tensor",
                 handle: "Handle", opts: CombineOptions, started: List[bool]) -> CombineResult:
        import torch
        cfg, dev = self.config, self.device
        r_n, e_l, h = self.num_ranks, self.num_local_experts, cfg.hidden
        n, k = topk_idx.shape
        active = self._active(opts.active_ranks)
        self._check_wait_stats(opts.combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats")
        topk_idx = sanitize_topk(topk_idx, cfg.num_experts)   # combine does not report, as the kernel
        src_x = self.next_combine_buffer(handle) if opts.zero_copy else x
        with torch.profiler.record_function("pyep::reference::combine_send"):
            cnt = handle.counts()                               # [E_l, R]
            pair = torch.repeat_interleave(torch.arange(e_l * r_n, device=dev, dtype=torch.int64),
                                           cnt.reshape(-1))
            le = torch.div(pair, r_n, rounding_mode="floor")
            src = pair % r_n
            rc = cnt.sum(1)
            row = torch.arange(pair.numel(), device=dev, dtype=torch.int64) - (torch.cumsum(rc, 0) - rc)[le]
            keep = active[src]                                  # never send to a rank marked dead
            le, src, row = le[keep], src[keep], row[keep]
            order = torch.sort(src, stable=True).indices
            le, src, row = le[order], src[order], row[order]
            if "topk_slot" not in handle.extras:
                raise ValueError("handle was not produced by the reference backend (no top-k slots)")
            slot = handle.extras["topk_slot"][le, row]
            if bool((slot < 0).any()):
                raise RuntimeError("reference combine: handle rows without a top-k slot; the handle "
                                   "was not produced by the reference backend")
            header = torch.stack([handle.src_info[le, row].to(torch.int64), slot.to(torch.int64),
                                  le, torch.zeros_like(le)], dim=1).to(torch.int32)
            if opts.use_logfmt:   # the kernels' bits: pyep.ep.ll.logfmt (message padded to its largest size)
                msgs, _ = logfmt.encode(src_x[le, row])
                payload = torch.from_numpy(msgs).to(dev)
            else:
                payload = _bytes(src_x[le, row])
            send = torch.cat([_bytes(header), payload], dim=1)
            counts = torch.bincount(src, minlength=r_n).tolist()
            started[0] = True
            recv, recv_counts, waits, _ = self._call_exchange(KIND_COMBINE, handle.seq, send, counts, opts.timeout_us,
                                                              f"combine of dispatch #{handle.seq}", f"c{handle.seq}",
                                                              active, opts.active_ranks)
        out = opts.out if opts.out is not None else torch.empty((n, h), dtype=torch.bfloat16, device=dev)
        out.zero_()

        def receive() -> None:
            with torch.profiler.record_function("pyep::reference::combine_recv"):
                owner_rank = torch.repeat_interleave(torch.arange(r_n, device=dev, dtype=torch.int64),
                                                     recv_counts)
                keep_msg = active[owner_rank]
                msgs = recv[keep_msg]
                hdr = msgs[:, :HEADER_BYTES].contiguous().view(torch.int32).to(torch.int64)
                got = torch.zeros((n, k), dtype=torch.bool, device=dev)
                if opts.use_logfmt:   # decoded to fp32, reduced like BF16
                    y = torch.zeros((n, k, h), dtype=torch.float32, device=dev)
                    y[hdr[:, 0], hdr[:, 1]] = torch.from_numpy(
                        logfmt.decode(msgs[:, HEADER_BYTES:].cpu().numpy(), h)).to(dev)
                else:
                    y = torch.zeros((n, k, h), dtype=torch.bfloat16, device=dev)
                    y[hdr[:, 0], hdr[:, 1]] = msgs[:, HEADER_BYTES:].contiguous().view(torch.bfloat16)
                got[hdr[:, 0], hdr[:, 1]] = True
                owner = torch.div(topk_idx.clamp_min(0), e_l, rounding_mode="floor")
                use = got & (topk_idx >= 0) & active[owner]
                acc = torch.zeros((n, h), dtype=torch.float32, device=dev)
                for j in range(k):   # k ascending, one fp32 rounding per step, as the kernels do
                    term = topk_weights[:, j:j + 1] * y[:, j].to(torch.float32)
                    acc = torch.where(use[:, j:j + 1], acc + term, acc)
                out.copy_(acc.to(torch.bfloat16))
                self._add_waits(opts.combine_wait_recv_cost_stats, waits, active)

        hook: Optional[Callable[[], None]] = None
        if opts.return_recv_hook:
            hook = OnceHook(receive)
        else:
            receive()
        return CombineResult(out=out, event=CompletedEvent(f"reference combine of dispatch #{handle.seq}"),
                             hook=hook)

    # ---------------------------------------------------------------- the rest
    def next_combine_buffer(self, handle: "Handle") -> "torch.Tensor":
        import torch
        cfg = self.config
        buf = self._combine_bufs[handle.buffer_idx]
        if buf is None:
            buf = torch.zeros((self.num_local_experts, self.num_ranks * cfg.num_max_dispatch_tokens_per_rank,
                               cfg.hidden), dtype=torch.bfloat16, device=self.device)
            self._combine_bufs[handle.buffer_idx] = buf
        return buf

    def update_ep_member(self, active_ranks: Optional["torch.Tensor"]) -> None:
        # Nothing per peer to rebuild; the barrier keeps the call collective like the native one.
        if self.group is not None:
            barrier_bounded(self.group, self.device, self.config.timeout_us, "reference update_ep_member")
        self._mask.fill_(True) if active_ranks is None else self._mask.copy_(active_ranks != 0)

    # ---------------------------------------------------------------- membership (store-based buffers)
    def member_payload(self) -> bytes:
        return b""

    def prepare_peer(self, rank: int, payload: bytes) -> bytes:
        if self._mail is not None:
            self._mail.forget(rank)     # mail of the dead process is never read
        return b""

    def prepare_done(self, rank: int) -> bool:
        return True

    def inactive_ranks(self) -> List[int]:
        return [r for r, on in enumerate(self._mask.tolist()) if not on]

    def next_half(self, next_call: int, at: int) -> int:
        return 0                        # the store mailbox has no buffer halves

    def activate_peer(self, rank: int, active: Optional["torch.Tensor"]) -> None:
        self._mask[rank] = True
        if active is not None:
            active[rank] = 1

    def join(self, blobs: Dict[int, bytes], half: int) -> None:
        return None

    def clean(self) -> None:
        for buf in self._combine_bufs:
            if buf is not None:
                buf.zero_()

    def transport_table(self) -> List[PeerTransport]:
        detail = f"{self._backend_name} all_to_all" if self._mail is None else "store mailbox"
        mask = self._mask.tolist()
        return [PeerTransport(r, "local" if r == self.rank else ("reference" if mask[r] else "inactive"),
                              "torch copy" if r == self.rank else (detail if mask[r] else "timed out"))
                for r in range(self.num_ranks)]

    def destroy(self) -> None:
        self._combine_bufs = [None, None]
