"""The contract between `EpBuffer` (the front) and a low-latency EP backend (reference or native).

Who does what
-------------
`EpBuffer` owns argument checking (pyep.ep.ll.validate), handle bookkeeping (owner token, dispatch
sequence number, buffer half, staleness) and the public return tuples. A backend receives arguments
that are already validated -- right dtypes, shapes, devices, contiguity, index ranges -- and does the
communication and the arithmetic. A backend never needs to re-check them and must not keep references
to caller tensors beyond the call (except `opts.active_ranks`, see below).

Construction (collective over the group, every rank calls it with equal arguments)::

    backend = SomeBackend(group, config)          # group: torch.distributed ProcessGroup
                                                  # config: pyep.ep.config.EpConfig (validated,
                                                  # config.num_experts % group size == 0)

A backend class may also provide ``unavailable_reason(config) -> Optional[str]`` as a staticmethod:
a purely local check (no communication, no GPU allocation) that returns None when this process can
run the backend and otherwise a sentence saying why not. `EpBuffer(backend="auto")` calls it on
every rank and agrees on the answer with one all-reduce before any backend constructor runs, so the
ranks never split between backends. Once a constructor runs, nothing falls back: an exception from
it propagates (`EpBuffer(backend="native")` raises `BackendUnavailable` itself when
``unavailable_reason`` says no).

Calls (all ranks of the group call dispatch/combine in the same order, like collectives)
---------------------------------------------------------------------------------------
``dispatch(x, topk_idx, opts) -> DispatchResult``
    x: bf16 [N, H] contiguous, topk_idx: int64 [N, K] contiguous, 0 <= N <= T, 1 <= K <= max_topk,
    both on ``backend.device``. topk_idx VALUES are not checked by the front (that would be a device
    sync; only check_values="strict" does it): an entry outside [-1, E), or an expert an earlier slot
    of the same row names, is routed as -1 (so an expert gets at most T rows per source rank and
    nothing is written out of bounds). Unless EpConfig.check_values is False, the backend records the
    first such entry of a dispatch (row-major order) and returns it, as a pyep.ep.ll.errors exception,
    from the optional ``take_error()`` (which clears it and must not synchronise the device; a
    recorded error stays until taken, later ones are dropped). Received-token layout (the same on every
    backend, bit-for-bit for BF16): for local expert e, rows are grouped by source rank ascending,
    and inside a source rank by (source token index, k) ascending. layout_range[e][r] =
    (begin << 32) | count with begin = sum of counts of ranks < r; recv_count[e] = total count;
    src_info[e][row] = the token's index on its source rank; rows >= recv_count[e] are unspecified
    (the reference zeroes them). An (t, k) entry is sent only when topk_idx[t, k] != -1 and the owner
    rank is active in ``opts.active_ranks`` (when given); a receiver treats a source rank marked 0 as
    having sent nothing. FP8 quantization is pyep.ep.fp8.quantize_fp8, bit-for-bit.
    ``opts.buffer_idx`` (0/1) is the buffer half this call may use; the half of the previous
    dispatch is still in use by its handle (two results may be in flight, three may not).
    The backend adds recv_count into ``opts.cumulative_local_expert_recv_stats`` (int32 [E_l]) when
    the receive completes (in the hook when ``return_recv_hook``), and into
    ``opts.dispatch_wait_recv_cost_stats`` (int64 [R]) the nanoseconds its receive waited for each
    source rank (0 for a source that was there at once, nothing for an inactive one; DeepEP's
    statistic, docs/ll_kernels.md). ``CombineOptions.combine_wait_recv_cost_stats``: the same for
    combine.

``combine(x, topk_idx, topk_weights, handle, opts) -> CombineResult``
    x: bf16 [E_l, R*T, H] contiguous (ignored when ``opts.zero_copy``: the caller already wrote the
    expert outputs into ``next_combine_buffer(handle)``), topk_idx int64 [N, K] and topk_weights fp32
    [N, K] with the N, K of ``handle``. out[t] = sum over k ascending of w[t, k] * y(t, k) with fp32
    accumulation and one final bf16 rounding, skipping k where topk_idx[t, k] == -1 (or is an entry
    dispatch routes as -1, see above; combine does not record it) or the owner rank is marked 0 in
    ``opts.active_ranks``. ``opts.out`` (bf16 [N, H]) when given must be the
    returned tensor.

``next_combine_buffer(handle) -> Tensor``: bf16 [E_l, R*T, H] the caller may write expert outputs into
    for a following ``combine(..., zero_copy=True)`` with the same handle.

``update_ep_member(active_ranks)``: collective over the surviving + rejoining ranks; rebuilds what a
    rank that restarted needs (queue pairs, IPC mappings) and clears signal state. After it returns,
    handles issued before it are stale (EpBuffer enforces that).

``transport_table() -> list[PeerTransport]``: one entry per rank of the group, self included.

``destroy()``: releases everything; idempotent. EpBuffer never calls a destroyed backend.

Optional ``clean()``: zero the signal areas of both halves (collective if the backend needs it);
`EpBuffer.clean()` calls it when present and then treats every earlier handle as stale.

Call tags (docs/elastic.md, "Call-tagged exchanges")
---------------------------------------------------
Every message between ranks carries the call number (``opts.seq``; a combine carries its handle's
``seq``) and the sender's membership generation, and a receiver checks them. ``abort_dispatch(opts,
reason)`` / ``abort_combine(handle, opts, reason)``: the front refused the call on the host; take part in
its exchange anyway with an abort marker (no payload, no output), receiving and discarding the peers'
messages of that call. A backend that refuses a call itself (an exception before it sent anything)
sends the marker itself. A receiver that meets an abort marker or another call's tag uses nothing of
that peer and reports PeerRefusedCall / CallMismatch (pyep.ep.ll.errors) through ``take_error()``
(call errors first; ``pending_call_error()`` peeks without clearing; both take ``latest_call``, the
front's latest dispatch number, where a record holds only low bits of it). Every rank of a dispatch that
failed skips its combine: a backend that knows it on the host puts the error in the handle's extras
under CALL_ERROR (the front then refuses that combine before anything is sent), the native kernels skip
it on the device. ``set_generations(list)``: the membership's shared list of each rank's generation.

active_ranks
------------
``opts.active_ranks`` is an int32 [R] tensor on ``backend.device`` owned by the caller (or None: all
ranks active). A backend that detects a timeout sets the peer's entry to 0 in place (device side)
and treats it as inactive from then on; it never sets an entry back to 1 (only the caller or
``update_ep_member`` does). The reference backend never marks ranks (collectives cannot time out
per peer), it only honours the marks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, runtime_checkable

from ..backend import EventLike, Hook, PeerTransport

if TYPE_CHECKING:  # torch is imported lazily everywhere in pyep
    import torch

    from .handle import Handle

# Handle extras: the error of a dispatch whose exchange failed, when the backend knows it on the host.
CALL_ERROR = "call_error"
COMBINE_REFUSED = "combine_refused"   # Handle.extras: why an earlier combine of the handle was refused


@dataclass(frozen=True)
class DispatchOptions:
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool                    # implies round_scale (validated)
    active_ranks: Optional["torch.Tensor"]   # int32 [R] on backend.device, or None = all active
    timeout_us: int                    # > 0; per-peer wait bound for this call
    async_finish: bool                 # return an event; do not block the current stream's host
    return_recv_hook: bool             # launch only the send half; the hook runs the receive half
    cumulative_local_expert_recv_stats: Optional["torch.Tensor"]  # int32 [E_l] or None
    buffer_idx: int                    # 0 or 1: buffer half of this call (seq & 1)
    seq: int                           # dispatch sequence number of this buffer, starting at 1
    dispatch_wait_recv_cost_stats: Optional["torch.Tensor"] = None  # int64 [R] or None: ns added per source


@dataclass(frozen=True)
class CombineOptions:
    active_ranks: Optional["torch.Tensor"]
    timeout_us: int
    zero_copy: bool
    async_finish: bool
    return_recv_hook: bool
    out: Optional["torch.Tensor"]      # bf16 [N, H] contiguous on backend.device, or None
    use_logfmt: bool = False           # LogFMT-10 payload (pyep.ep.ll.logfmt; H % 512 == 0, checked by
                                       # validate_combine): rows are decoded to fp32 before the reduce
    combine_wait_recv_cost_stats: Optional["torch.Tensor"] = None   # int64 [R] or None: ns added per source


@dataclass
class DispatchResult:
    recv_x: "torch.Tensor"             # bf16 or float8_e4m3fn [E_l, R*T, H]
    recv_scales: Optional["torch.Tensor"]  # fp32 [E_l, R*T, H/128] or int32 [E_l, R*T, ceil(H/512)]
    recv_count: "torch.Tensor"         # int32 [E_l]
    src_info: "torch.Tensor"           # int32 [E_l, R*T]
    layout_range: "torch.Tensor"       # int64 [E_l, R]
    event: Optional[EventLike] = None  # None: EpBuffer returns a CompletedEvent
    hook: Optional[Hook] = None        # required when opts.return_recv_hook, else None
    extras: Dict[str, Any] = field(default_factory=dict)  # backend-private, lands in Handle.extras


@dataclass
class CombineResult:
    out: "torch.Tensor"                # bf16 [N, H]
    event: Optional[EventLike] = None
    hook: Optional[Hook] = None


@runtime_checkable
class EpBackend(Protocol):
    name: str                          # "reference" or "native"
    device: "torch.device"             # where inputs/outputs live
    rank: int
    num_ranks: int

    def dispatch(self, x: "torch.Tensor", topk_idx: "torch.Tensor",
                 opts: DispatchOptions) -> DispatchResult: ...

    def combine(self, x: "torch.Tensor", topk_idx: "torch.Tensor", topk_weights: "torch.Tensor",
                handle: "Handle", opts: CombineOptions) -> CombineResult: ...

    def next_combine_buffer(self, handle: "Handle") -> "torch.Tensor": ...

    def update_ep_member(self, active_ranks: Optional["torch.Tensor"]) -> None: ...

    def transport_table(self) -> List[PeerTransport]: ...

    def destroy(self) -> None: ...
