"""`EpBuffer`: low-latency MoE dispatch/combine (DeepEP low-latency / Mooncake EP contract).

The front checks every argument (pyep.ep.validate) before anything is sent, keeps the handle
bookkeeping (owner, dispatch sequence, buffer half, membership epoch) and delegates the work to a
backend (pyep.ep.backend describes the contract): the native CUDA backend where it can run, else the
reference backend over torch.distributed. Re-admitting restarted ranks (store-based buffers) is
buffer_member.py, mixed in.

Expert ids are checked without a host sync (check_values=True): the backend records the first bad
entry of a dispatch (pyep.ep.ll.errors) and the front raises it after the host waits a caller makes anyway
(event.wait(), the receive hook) or when the next combine has done its exchange. check_values="strict"
checks on the host before launch instead; False checks nothing.

Every exchange carries its call number (docs/elastic.md, "Call-tagged exchanges"): a call this front
refuses (its arguments) still takes part in its exchange with an abort marker, so no peer waits for it
or pairs another call with it; the peers get PeerRefusedCall for that call, a peer at another call gets
CallMismatch, and the combine of a dispatch that failed is skipped on every rank.
"""
from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

from ..control import ControlPlane, make_control
from .contract import COMBINE_REFUSED, CombineOptions, DispatchOptions, EpBackend
from ..backend import profiled_range, torch_function_off, CompletedEvent, EventLike, PeerTransport
from ..config import DEFAULT_TIMEOUT_US, MAX_TOPK
from .config import MAX_REJOIN_LEAD_CALLS, EpConfig
from ..elastic.membership import DEFAULT_LEAD_CALLS, Membership, MembershipError, buffer_fingerprint
from .buffer_calls import CheckedEvent, CheckedHook, EpBufferCalls
from .buffer_member import EpBufferMembership
from .layout import size_hint as _size_hint
from .handle import Handle
from .validate import validate_combine, validate_dispatch, validate_handle

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("pyep.ep")

RecvX = Union["torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]]
Hook = Optional[Callable[[], None]]


def _native_unavailable_reason(config: EpConfig) -> Optional[str]:
    """Local check: can this process run the native backend? None if yes, else why not."""
    import torch
    try:
        from .native import NativeBackend
    except Exception as exc:  # any import failure means "not here"; the reason is logged
        return f"pyep.ep.ll.native is not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    check = getattr(NativeBackend, "unavailable_reason", None)
    return check(config) if check is not None else None


def _make_backend(control: ControlPlane, config: EpConfig, joining: bool) -> EpBackend:
    from .reference import ReferenceBackend
    if config.backend == "reference":
        return ReferenceBackend(control, config)
    reason = _native_unavailable_reason(config)
    if config.backend == "native":
        if reason is not None:
            from ..backend import BackendUnavailable
            raise BackendUnavailable(f"backend='native' cannot run here: {reason}")
        from .native import NativeBackend
        return NativeBackend(control, config)
    # "auto": every rank must pick the same backend, so agree on the local answers first. A restarted
    # rank (store-based buffers) takes what the survivors agreed on.
    if joining:
        use_native = control.shared_value("backend", lambda: b"", 10.0) == b"native"
    else:
        use_native = control.all_min(0 if reason else 1, config.timeout_us / 1e6 + 10.0,
                                     "EpBuffer backend selection") == 1
        if control.kind == "store":
            control.shared_value("backend", lambda: b"native" if use_native else b"reference", 10.0)
    if use_native:
        if reason is not None:
            from ..backend import BackendUnavailable
            raise BackendUnavailable(f"the other ranks run the native backend, this process cannot: {reason}")
        from .native import NativeBackend
        return NativeBackend(control, config)
    log.info("EpBuffer: using the reference backend (%s)",
             reason or "another rank cannot run the native backend")
    return ReferenceBackend(control, config)


class EpBuffer(EpBufferMembership, EpBufferCalls):
    """Low-latency expert-parallel dispatch/combine over a process group.

    dispatch -> (recv_x or (recv_x, scales), recv_count, handle, event, hook)
    combine  -> (out, event, hook)
    At most two dispatch results may be in flight: the handle of dispatch #n is refused once
    dispatch #n+2 was issued. All ranks of the group must make the same calls in the same order.
    A bad expert id (pyep.ep.ll.errors) is raised at event.wait(), the hook or the end of the next
    combine by default, before launch with check_values="strict", never with check_values=False. A peer
    that refused a call, or met this rank at another call, is raised the same way (PeerRefusedCall,
    CallMismatch), or before the combine of that dispatch, which every rank then skips.
    """

    def __init__(self, group: Optional["dist.ProcessGroup"] = None, device_name: str = "mlx5_0", *,
                 num_max_dispatch_tokens_per_rank: int = 128, hidden: int = 7168, num_experts: int = 256,
                 transport: str = "auto", timeout_us: int = DEFAULT_TIMEOUT_US, backend: str = "auto",
                 num_qps_per_peer: Optional[int] = None, allow_nvlink: bool = True,
                 num_buffer_bytes: Optional[int] = None, max_topk: int = MAX_TOPK,
                 ranks_per_node: Optional[int] = None, check_values: Union[bool, str] = True,
                 store: Any = None, rank: Optional[int] = None, world_size: Optional[int] = None,
                 store_prefix: str = "pyep/ep", rejoin_lead_calls: int = DEFAULT_LEAD_CALLS,
                 job_secret: Optional[bytes] = None) -> None:
        config = EpConfig(num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, hidden=hidden,
                          num_experts=num_experts, max_topk=max_topk, transport=transport,
                          allow_nvlink=allow_nvlink, device_name=device_name, timeout_us=timeout_us,
                          num_qps_per_peer=num_qps_per_peer, num_buffer_bytes=num_buffer_bytes,
                          ranks_per_node=ranks_per_node, backend=backend, check_values=check_values)
        self._init(make_control(group, store, rank, world_size, store_prefix, job_secret), config, rejoin_lead_calls)

    @classmethod
    def from_config(cls, config: EpConfig, group: Optional["dist.ProcessGroup"] = None, *, store: Any = None,
                    rank: Optional[int] = None, world_size: Optional[int] = None, store_prefix: str = "pyep/ep",
                    rejoin_lead_calls: int = DEFAULT_LEAD_CALLS, job_secret: Optional[bytes] = None) -> "EpBuffer":
        if not isinstance(config, EpConfig):
            raise TypeError(f"config must be an EpConfig, got {type(config).__name__}")
        self = cls.__new__(cls)
        self._init(make_control(group, store, rank, world_size, store_prefix, job_secret), config, rejoin_lead_calls)
        return self

    def _init(self, control: ControlPlane, config: EpConfig, lead_calls: int) -> None:
        self._destroyed = True   # until the backend exists, nothing may be called
        self._control = control
        self._group = control.group
        self._num_ranks = control.world_size
        self._rank = control.rank
        config.check_group_size(self._num_ranks)
        self._config = config
        self._owner = uuid.uuid4().hex
        self._epoch = 0
        self._seq = 0
        self._combines_refused_by_peers: Dict[int, str] = {}   # dispatch seq -> who refused its combine (buffer_calls)
        self._grace_seq = 0      # call #A of the latest rejoin: it and the grace window after it wait longer
        # Store-based buffers have a membership (pyep.ep.elastic.membership, docs/elastic.md): a process whose
        # rank already had one is a restarted rank and joins the running job instead of setting up.
        self._member: Optional[Membership] = None
        if control.kind == "store":
            if isinstance(lead_calls, bool) or not isinstance(lead_calls, int):
                raise TypeError(f"rejoin_lead_calls must be an int, got {type(lead_calls).__name__}")
            if not 0 <= lead_calls <= MAX_REJOIN_LEAD_CALLS:
                raise ValueError(f"rejoin_lead_calls must be in [0, {MAX_REJOIN_LEAD_CALLS}], got {lead_calls}")
            self._member = Membership(control, buffer_fingerprint(config, self._num_ranks),
                                      max(60.0, 3 * config.timeout_us / 1e6), lead_calls)
            control.joining = self._member.joining
        self._backend = _make_backend(control, config, self._member is not None and self._member.joining)
        if self._member is not None:
            self._member.attach(self._backend)
        # Backends report what their calls recorded -- bad expert ids (unless check_values is False), failed
        # exchanges (always) -- through take_error(), without a device sync.
        self._take_error: Optional[Callable[..., Optional[Exception]]] = getattr(self._backend, "take_error", None)
        self._device = self._backend.device
        self._init_fast(config)
        self._destroyed = False
        if self._member is not None and self._member.joining:
            self._fast_dispatch = self._fast_combine = None   # until join(): see _check_alive
            self._member.announce()
        elif self._member is not None:
            # A store-based job starts like a rejoin (docs/elastic.md, "The first calls"): the set-up
            # barrier releases the ranks a store poll apart and their first launches are cold, so
            # calls 1 .. REJOIN_GRACE_CALLS get the grace window's longer wait too. Without it a rank
            # whose first call started more than a short timeout after the others' was marked in call 1.
            self._grace_seq = 1
        # `pyep qp dump` on a running job: PYEP_QP_DUMP_SIGNAL / PYEP_QP_DUMP_TRIGGER (none by default).
        from ...transport.qp_dump import install_dump_triggers
        self._qp_dump = install_dump_triggers(self, self._rank) if hasattr(self._backend, "qp_contexts") else None
        log.debug("EpBuffer rank %d/%d: %s, backend %s", self._rank, self._num_ranks,
                  config.describe_shape(self._num_ranks), self._backend.name)

    def _init_fast(self, config: EpConfig) -> None:
        """The backend's C++ fast path (native: one binding call per plain dispatch/combine), if any.
        Strict value checks, async_finish, the recv hook and a running profiler always take the Python
        path; the fast path itself declines anything else it does not take (argument errors included,
        which the Python path then raises from validate.py)."""
        import torch.autograd.profiler as prof
        fast = getattr(self._backend, "fast_path", None)
        if config.check_values == "strict" or not hasattr(prof, "_is_profiler_enabled"):
            fast = None
        self._prof = prof   # profiled_range's test: ranges exist only while a profiler runs
        self._fast_dispatch: Optional[Callable[..., Any]] = fast.dispatch if fast is not None else None
        self._fast_combine: Optional[Callable[..., Any]] = (
            getattr(self._backend, "fast_combine", None) if fast is not None else None)

    # ------------------------------------------------------------------ properties
    @property
    def config(self) -> EpConfig:
        return self._config

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def num_ranks(self) -> int:
        return self._num_ranks

    @property
    def num_local_experts(self) -> int:
        return self._config.num_experts // self._num_ranks

    @property
    def device(self) -> "torch.device":
        return self._device

    @property
    def backend_name(self) -> str:
        return self._backend.name

    @property
    def backend(self) -> EpBackend:
        """The backend object, for diagnostics (`pyep qp dump`, tools/ll_trace.py): dispatch and
        combine go through EpBuffer, which checks their arguments."""
        return self._backend

    @property
    def group(self) -> "dist.ProcessGroup":
        return self._group

    @staticmethod
    def size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int, num_ranks: int,
                  max_topk: int = MAX_TOPK) -> int:
        """Bytes of the native low-latency buffer for a shape (both halves)."""
        return _size_hint(num_max_dispatch_tokens_per_rank, hidden, num_experts, num_ranks, max_topk)

    @property
    def num_buffer_bytes(self) -> int:
        given = self._config.num_buffer_bytes
        return given if given is not None else self._config.size_hint(self._num_ranks)

    def _check_alive(self, what: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"EpBuffer.{what}() called after destroy()")
        if self._member is not None and self._member.joining and what not in ("join", "update_ep_member"):
            raise MembershipError(f"EpBuffer.{what}(): rank {self._rank} restarted (generation "
                                  f"{self._member.generation}) and is not admitted yet: call join() or "
                                  f"update_ep_member() first")

    def _raise_pending(self) -> None:
        """Raise (and clear) the error an earlier call recorded (a bad expert id, a failed exchange), if
        it is visible yet. Reads pinned host words: no device synchronisation."""
        take = self._take_error
        if take is not None:
            err = take(latest_call=self._seq)
            if err is not None:
                self._note_refused_combine(err)
                raise err

    def _checked(self, event: EventLike, hook: Hook) -> Tuple[EventLike, Hook]:
        if self._take_error is None:
            return event, hook
        return CheckedEvent(event, self._raise_pending), (CheckedHook(hook, self._raise_pending)
                                                         if hook is not None else None)

    # ------------------------------------------------------------------ dispatch / combine
    @torch_function_off
    def dispatch(self, x: "torch.Tensor", topk_idx: "torch.Tensor", *, use_fp8: bool = True,
                 round_scale: bool = False, use_ue8m0: bool = False,
                 active_ranks: Optional["torch.Tensor"] = None, timeout_us: Optional[int] = None,
                 async_finish: bool = False, return_recv_hook: bool = False,
                 cumulative_local_expert_recv_stats: Optional["torch.Tensor"] = None,
                 dispatch_wait_recv_cost_stats: Optional["torch.Tensor"] = None
                 ) -> Tuple[RecvX, "torch.Tensor", Handle, EventLike, Hook]:
        if self._in_grace(self._seq + 1):
            timeout_us = self._rejoin_timeout(timeout_us)
        fast = self._fast_dispatch
        if (fast is not None and async_finish is False and return_recv_hook is False and not self._destroyed
                and not self._prof._is_profiler_enabled):
            try:
                res = fast(x, topk_idx, use_fp8, round_scale, use_ue8m0, active_ranks, timeout_us,
                           cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                           (self._seq + 1) & 0xFFFFFFFF)
            except BaseException:
                self._seq += 1   # the launch failed after the half was consumed, as in the path below
                raise
            if res is not None:
                recv_x, scales, recv_count, src_info, layout_range, extras, n, k = res
                self._seq = seq = self._seq + 1
                cfg = self._config
                handle = Handle.fast(src_info, layout_range, cfg.num_max_dispatch_tokens_per_rank, cfg.hidden,
                                     cfg.num_experts, n, k, self._owner, self._epoch, seq, use_fp8, extras)
                event: EventLike = CompletedEvent(f"dispatch #{seq}")
                if self._take_error is not None:
                    event = CheckedEvent(event, self._raise_pending)
                return ((recv_x, scales) if use_fp8 else recv_x), recv_count, handle, event, None
            # Declined: the path below raises the argument error, or runs the call.
        self._check_alive("dispatch")
        # A recorded error is not raised here: a dispatch that raised would leave this rank without the
        # handle whose combine its peers make (they would wait for it). The next combine raises it.
        try:
            timeout = validate_dispatch(
                self._config, self._num_ranks, self._device, x, topk_idx, use_fp8=use_fp8,
                round_scale=round_scale, use_ue8m0=use_ue8m0, active_ranks=active_ranks,
                timeout_us=timeout_us, async_finish=async_finish, return_recv_hook=return_recv_hook,
                cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats)
        except Exception as exc:
            self._refuse_dispatch(exc, active_ranks, timeout_us)
            raise
        # The half is consumed even if the backend fails half-way: its state is unknown after that.
        self._seq += 1
        seq = self._seq
        opts = DispatchOptions(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                               active_ranks=active_ranks, timeout_us=timeout, async_finish=async_finish,
                               return_recv_hook=return_recv_hook,
                               cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                               buffer_idx=seq & 1, seq=seq,
                               dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats)
        with profiled_range("pyep::dispatch"):
            res = self._backend.dispatch(x, topk_idx, opts)   # a backend refusal sends its own abort marker
        if return_recv_hook and res.hook is None:
            raise RuntimeError(f"backend {self._backend.name} returned no hook for return_recv_hook=True")
        cfg = self._config
        handle = Handle(src_info=res.src_info, layout_range=res.layout_range,
                        num_max_dispatch_tokens_per_rank=cfg.num_max_dispatch_tokens_per_rank,
                        hidden=cfg.hidden, num_experts=cfg.num_experts, num_tokens=int(x.shape[0]),
                        num_topk=int(topk_idx.shape[1]), owner=self._owner, epoch=self._epoch, seq=seq,
                        buffer_idx=seq & 1, use_fp8=use_fp8, extras=res.extras)
        recv: RecvX = (res.recv_x, res.recv_scales) if use_fp8 else res.recv_x
        event, hook = self._checked(res.event if res.event is not None else CompletedEvent(f"dispatch #{seq}"),
                                    res.hook if return_recv_hook else None)
        return recv, res.recv_count, handle, event, hook

    @torch_function_off
    def combine(self, x: "torch.Tensor", topk_idx: "torch.Tensor", topk_weights: "torch.Tensor",
                handle: Handle, *, active_ranks: Optional["torch.Tensor"] = None,
                timeout_us: Optional[int] = None, zero_copy: bool = False, async_finish: bool = False,
                return_recv_hook: bool = False, out: Optional["torch.Tensor"] = None, use_logfmt: bool = False,
                combine_wait_recv_cost_stats: Optional["torch.Tensor"] = None
                ) -> Tuple["torch.Tensor", EventLike, Hook]:
        if self._in_grace(getattr(handle, "seq", None)):
            timeout_us = self._rejoin_timeout(timeout_us)
        fast = self._fast_combine
        # use_logfmt takes the Python path (the fast path launches BF16 combines only).
        if (fast is not None and use_logfmt is False and async_finish is False and return_recv_hook is False
                and (zero_copy is False or zero_copy is True) and not self._destroyed
                and not self._prof._is_profiler_enabled and self._handle_ok(handle)
                and COMBINE_REFUSED not in handle.extras and handle.seq not in self._combines_refused_by_peers):
            res = fast(x, topk_idx, topk_weights, handle, active_ranks, timeout_us, out, zero_copy,
                       combine_wait_recv_cost_stats)
            if res is not None:
                self._raise_pending()    # after the exchange: this combine's peers are served
                done = CompletedEvent(f"combine of dispatch #{handle.seq}")
                return res, CheckedEvent(done, self._raise_pending), None
        self._check_alive("combine")
        known = self._handle_ok(handle)
        if known:
            self._raise_failed_dispatch(handle)
        try:
            handle, timeout = validate_combine(
                self._config, self._num_ranks, self._device, x, topk_idx, topk_weights, handle,
                owner=self._owner, epoch=self._epoch, last_seq=self._seq, active_ranks=active_ranks,
                timeout_us=timeout_us, zero_copy=zero_copy, async_finish=async_finish,
                return_recv_hook=return_recv_hook, out=out, use_logfmt=use_logfmt,
                combine_wait_recv_cost_stats=combine_wait_recv_cost_stats)
        except Exception as exc:
            if known:    # without a handle of this buffer there is no call to abort
                self._refuse_combine(exc, handle, active_ranks, timeout_us)
            raise
        opts = CombineOptions(active_ranks=active_ranks, timeout_us=timeout, zero_copy=zero_copy,
                              async_finish=async_finish, return_recv_hook=return_recv_hook, out=out,
                              use_logfmt=bool(use_logfmt), combine_wait_recv_cost_stats=combine_wait_recv_cost_stats)
        with profiled_range("pyep::combine"):
            res = self._backend.combine(x, topk_idx, topk_weights, handle, opts)
        if return_recv_hook and res.hook is None:
            raise RuntimeError(f"backend {self._backend.name} returned no hook for return_recv_hook=True")
        event, hook = self._checked(res.event if res.event is not None
                                    else CompletedEvent(f"combine of dispatch #{handle.seq}"),
                                    res.hook if return_recv_hook else None)
        if hook is None:
            # After the exchange (its peers are served): an error an earlier call recorded. With a hook
            # the hook raises it, after the receive half it must not lose.
            self._raise_pending()
        return res.out, event, hook

    def _handle_ok(self, handle: Any) -> bool:
        """validate_handle's verdict without raising: a bad handle takes the Python path, which raises
        its error in validate_combine's order (a recorded value error first)."""
        try:
            validate_handle(handle, self._config, self._num_ranks, owner=self._owner, epoch=self._epoch,
                            last_seq=self._seq)
        except (TypeError, ValueError):
            return False
        return True

    def get_next_combine_buffer(self, handle: Handle) -> "torch.Tensor":
        """bf16 [E_l, R*T, H] to write expert outputs into for combine(..., zero_copy=True)."""
        self._check_alive("get_next_combine_buffer")
        validate_handle(handle, self._config, self._num_ranks, owner=self._owner, epoch=self._epoch,
                        last_seq=self._seq)
        return self._backend.next_combine_buffer(handle)

    # ------------------------------------------------------------------ lifetime
    def clean(self) -> None:
        """Reset the communication buffers (collective where the backend needs it). Older handles go
        stale."""
        self._check_alive("clean")
        clean = getattr(self._backend, "clean", None)
        if clean is not None:
            clean()
        self._realign_calls("EpBuffer.clean")
        self._epoch += 1

    def transport_table(self) -> List[PeerTransport]:
        self._check_alive("transport_table")
        return list(self._backend.transport_table())

    def describe(self) -> str:
        self._check_alive("describe")
        lines = [f"EpBuffer rank {self._rank}/{self._num_ranks}: backend {self._backend.name}, "
                 f"{self._config.describe_shape(self._num_ranks)}, device {self._device}"]
        lines += ["  " + p.describe() for p in self.transport_table()]
        return "\n".join(lines)

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        self._fast_dispatch = self._fast_combine = None
        if self._qp_dump is not None:
            self._qp_dump.close()
        self._backend.destroy()

    def __enter__(self) -> "EpBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "destroyed" if self._destroyed else self._backend.name
        return f"EpBuffer(rank={self._rank}, num_ranks={self._num_ranks}, {state})"
