"""`NormalBuffer`: DeepEP's normal (high-throughput) mode, intranode: get_dispatch_layout, dispatch
(also cached, with a handle), combine -- DeepEP's argument order, defaults and return shapes.

The front checks every argument on the host (pyep.ep.normal.validate; never tensor values), keeps the
handle bookkeeping (owner token, epoch), raises errors the device recorded for earlier calls, does the
stream/event bookkeeping (pyep.ep.normal.events) and hands the work to a backend (contract.py): the
native NVLink kernels where they can run, else the reference over torch.distributed (the choice:
backend_select.py). All ranks of the
group make the same calls in the same order. The active_ranks mask, store-based buffers (reference
backend over store mailbox keys) and rejoin: buffer_member.py (docs/elastic.md, "Normal mode").
"""
from __future__ import annotations

import functools
import logging
import uuid
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

from .._dist import group_device
from ..control import make_control
from ..elastic.membership import Membership, MembershipError
from ..backend import profiled_range, torch_function_off
from ..streams import raw_current_stream
from ..config import DEFAULT_TIMEOUT_US, TRANSPORTS
from . import validate as v
from .config import DEFAULT_NUM_SMS, MAX_CHANNELS, Config, default_config, sizing_configs
from .backend_select import make_backend
from .buffer_member import NormalBufferMembership, check_active_ranks
from .contract import CombineCall, DispatchCall, NormalBackend
from .errors import ElasticUnsupported, RefusingArgs
from .events import NormalEvent, capture_current, launch, wait_bound_s
from .handle import NormalHandle
from .native_fast import remember_plan
from .limits import MAX_BUFFER_BYTES, MAX_GROUP_RANKS, MAX_TIMEOUT_US
from .tags import KIND_CACHED, KIND_COMBINE, KIND_DISPATCH, KIND_LAYOUT
from .topology import NodeLayout, detect_node_layout

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("pyep.ep.normal")
RecvX = Union["torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]]
BACKENDS = ("auto", "native", "reference")


@functools.lru_cache(maxsize=64)   # a pure function of its arguments, asked on every call; Config is frozen
def _default(num_ranks: int, num_sms: int, combine: bool, one_node: bool) -> Config:
    # The tuned table covers the rank counts the native kernels run on; other counts (the reference on
    # 3 ranks, say) get the Config defaults with the shared SM count.
    try:
        return default_config(num_ranks, num_sms, combine, one_node)
    except ValueError:
        return Config(num_sms)


class NormalBuffer(NormalBufferMembership):
    """DeepEP normal-mode dispatch/combine: within one node, or across nodes (chosen when the group
    spans nodes or virtual nodes: ranks_per_node, $PYEP_VIRTUAL_NODE_SIZE, host names; see topology.py).

    get_dispatch_layout -> (num_tokens_per_rank, num_tokens_per_rdma_rank (None on one node),
                            num_tokens_per_expert, is_token_in_rank, event)
    dispatch -> (recv_x or (recv_x, recv_x_scales), recv_topk_idx, recv_topk_weights,
                 num_recv_tokens_per_expert_list, handle, event); cached: (recv_x, None, None, None, None, event)
    combine  -> (combined_x, combined_topk_weights, event)

    active_ranks (int32 [R], 1 = active; the buffer keeps the tensor and clears an entry when it marks
    that rank) leaves ranks out of every call: their tokens are dropped and counted in
    `event.num_dropped_tokens` (and `handle.num_dropped_tokens`). store=/rank=/world_size= build it on a
    c10d Store instead of a group (reference backend): a dead rank is marked, the others go on, and its
    restarted process rejoins (docs/elastic.md, "Normal mode"). elastic=True (implied by active_ranks= and
    by store=): the buffer will take a mask (use_active_ranks later); across nodes of several ranks its
    data path then runs rank to rank, which a mask needs (docs/elastic.md, "Across nodes").
    """

    num_sms: int = DEFAULT_NUM_SMS

    def __init__(self, group: Optional["dist.ProcessGroup"] = None, num_nvl_bytes: Optional[int] = None, *,
                 hidden: int = 7168, backend: str = "auto", transport: str = "auto",
                 timeout_us: int = DEFAULT_TIMEOUT_US, num_sms: Optional[int] = None,
                 ranks_per_node: Optional[int] = None, num_rdma_bytes: Optional[int] = None,
                 active_ranks: Optional["torch.Tensor"] = None, store: Any = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None, store_prefix: str = "pyep/normal",
                 job_secret: Optional[bytes] = None, rejoin_lead_calls: int = 2, elastic: bool = False) -> None:
        import torch
        self._destroyed = True   # until the backend exists nothing may be called
        if num_nvl_bytes is not None:
            v.check_int("num_nvl_bytes", num_nvl_bytes, 0, MAX_BUFFER_BYTES)
        if num_rdma_bytes is not None:
            v.check_int("num_rdma_bytes", num_rdma_bytes, 0, MAX_BUFFER_BYTES)
        v.check_int("hidden", hidden, 1)
        v.check_hidden("hidden", hidden, None)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        v.check_int("timeout_us", timeout_us, 1, MAX_TIMEOUT_US)
        sms = NormalBuffer.num_sms if num_sms is None else num_sms
        _check_num_sms(sms)
        self._control = make_control(group, store, rank, world_size, store_prefix, job_secret)
        self._group = self._control.group
        self._rank = self._control.rank
        self._num_ranks = self._control.world_size
        check_active_ranks(active_ranks, self._num_ranks)
        # The mask lives on the group's device for the reference backend (a store-based buffer's: the
        # CPU), on the GPU for the native kernels, which read it there (checked once the backend exists).
        mask_device = group_device(self._group) if self._group is not None else torch.device("cpu")
        if active_ranks is not None and active_ranks.device != mask_device and active_ranks.device.type != "cuda":
            raise ValueError(f"active_ranks is on {active_ranks.device}, the buffer on {mask_device}")
        self._mask: "torch.Tensor" = (active_ranks if active_ranks is not None
                                      else torch.ones(self._num_ranks, dtype=torch.int32, device=mask_device))
        self._step = 0
        self._member: Optional[Membership] = None
        self._hidden = hidden
        self._timeout_us = timeout_us
        self._bound_s = wait_bound_s(timeout_us)
        self._owner = uuid.uuid4().hex   # once per buffer: handles carry it, calls only compare it
        self._epoch = 0
        self._seq = 0
        self._comm: Any = None
        self._fast: Any = None   # the backend's C++ fast path, once a plan was made (native_fast.py)
        self._prof: Any = None   # torch.autograd.profiler: a running profiler keeps calls on the Python path
        if self._group is None:
            self._nodes = (NodeLayout(self._num_ranks, ranks_per_node) if ranks_per_node is not None
                           else NodeLayout(self._num_ranks, self._num_ranks))
            self._backend = self._store_backend(backend, hidden, timeout_us, rejoin_lead_calls,
                                                dict(num_nvl_bytes=num_nvl_bytes, transport=transport, num_sms=sms,
                                                     num_rdma_bytes=num_rdma_bytes))
        else:
            self._nodes = detect_node_layout(self._group, ranks_per_node, timeout_us)
            self._backend = make_backend(self._group, backend, dict(
                num_nvl_bytes=num_nvl_bytes, hidden=hidden, transport=transport, timeout_us=timeout_us,
                num_sms=sms, nodes=self._nodes, num_rdma_bytes=num_rdma_bytes, mask=self._mask,
                elastic=elastic or active_ranks is not None))
        self._device: "torch.device" = self._backend.device
        if self._backend.name != "reference":
            try:
                self._attach_native_mask(active_ranks)
            except BaseException:
                self._backend.destroy()
                raise
        self._destroyed = False
        log.debug("NormalBuffer rank %d/%d: backend %s, hidden %d, device %s", self._rank, self._num_ranks,
                  self._backend.name, hidden, self._device)

    def _attach_native_mask(self, active_ranks: Optional["torch.Tensor"]) -> None:
        """The native intranode kernels read the mask on the GPU at every call (no host read, so the
        caller may change it in place) and clear a silent peer's entry; the internode kernels with one rank
        per node too (native_internode.py takes_mask); on nodes of several ranks they take none
        yet: a mask given to them is refused, never ignored. Without a mask (neither active_ranks= nor
        update_ep_member) a native buffer keeps the non-elastic rule: a silent peer voids the call with
        PeerTimeout."""
        if active_ranks is None:
            return
        if not getattr(self._backend, "takes_mask", False):
            raise ElasticUnsupported("active_ranks= (a mask the caller holds)", self._backend.name)
        self._backend.set_mask(active_ranks)
        self._mask = active_ranks

    def _store_backend(self, backend: str, hidden: int, timeout_us: int, lead_calls: int,
                       native_kw: Dict[str, Any]) -> NormalBackend:
        """A store-based buffer (one node, or one rank per node): the membership, then -- for a first
        process -- a set-up barrier, so that no rank's first call waits for a peer still starting.
        backend="native": the native kernels with the mask on the GPU -- over CUDA IPC inside a node (a
        restarted rank maps its peers when admitted: native_member.py), over the column relay's QPs with
        one rank per node (its QPs are made when admitted: internode_member.py); else the reference
        backend over store mailboxes."""
        v.check_int("rejoin_lead_calls", lead_calls, 0, 1 << 20)
        rdma_bytes = native_kw.pop("num_rdma_bytes")
        internode = self._nodes.internode
        if backend == "native":   # before the membership writes anything
            from ..backend import BackendUnavailable
            from .native import NormalNativeBackend
            from .native_internode import NormalInternodeBackend
            reason = (NormalInternodeBackend.unavailable_reason(None, transport=native_kw["transport"], nodes=self._nodes)
                      if internode else
                      NormalNativeBackend.unavailable_reason(None, transport=native_kw["transport"], nodes=self._nodes,
                                                             num_ranks=self._num_ranks))
            if reason is not None:
                raise BackendUnavailable(f"NormalBuffer(store=..., backend='native') cannot run here: {reason}")
        timeout_s = max(60.0, 3 * timeout_us / 1e6)
        self._member = Membership(self._control, f"normal {backend} hidden={hidden} ranks={self._num_ranks} "
                                  f"per_node={self._nodes.ranks_per_node}",
                                  timeout_s, lead_calls)
        ref: NormalBackend
        if backend == "native":
            import torch
            if internode:
                from .native_internode import NormalInternodeBackend
                ref = NormalInternodeBackend(None, hidden=hidden, timeout_us=timeout_us, nodes=self._nodes,
                                             control=self._control, joining=self._member.joining,
                                             num_rdma_bytes=rdma_bytes, elastic=True, **native_kw)
            else:
                from .native import NormalNativeBackend
                ref = NormalNativeBackend(None, hidden=hidden, timeout_us=timeout_us, nodes=self._nodes,
                                          control=self._control, joining=self._member.joining, **native_kw)
            mask = self._mask.to(device=ref.device, dtype=torch.int32).contiguous().clone()
            ref.set_mask(mask)
            self._mask = mask
        else:
            from .reference import NormalReferenceBackend
            ref = NormalReferenceBackend(None, timeout_us=timeout_us, nodes=self._nodes, control=self._control,
                                         mask=self._mask)
        self._member.attach(ref)
        if self._member.joining:
            self._member.announce()
        else:
            self._control.barrier(timeout_s, "NormalBuffer set-up")
        return ref

    # ------------------------------------------------------------------ DeepEP's static API
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs of the dispatch/combine kernels of the default configs (two per channel: even)."""
        _check_num_sms(new_num_sms)
        NormalBuffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return default_config(num_ranks, NormalBuffer.num_sms, combine=False)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return default_config(num_ranks, NormalBuffer.num_sms, combine=True)

    def fit_config(self, config: Config) -> Config:
        """`config` changed only as far as this buffer needs to run it: fewer ring rows, then fewer SMs
        (native rings live in the buffer; the reference has none). For callers that choose their SM count
        per call, after the buffer was sized (DeepEP V2's ElasticBuffer)."""
        v.check_config(config)
        return self._backend.fit_config(config)

    @staticmethod
    def size_hint(hidden: int, num_ranks: int, config: Optional[Config] = None) -> int:
        """Bytes of native NVLink buffer per rank for rows of `hidden` BF16 values (with the default
        dispatch and combine configs, and their rings at the table's depth, unless `config` is given)."""
        v.check_int("hidden", hidden, 1)
        v.check_hidden("hidden", hidden, None)
        v.check_int("num_ranks", num_ranks, 1, MAX_GROUP_RANKS)
        v.check_config(config)
        configs = [config] if config is not None else sizing_configs(num_ranks, NormalBuffer.num_sms)
        return max(c.get_nvl_buffer_size_hint(2 * hidden, num_ranks) for c in configs)

    @staticmethod
    def capture() -> NormalEvent:
        """An event of the current stream, to pass as previous_event."""
        return capture_current()

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def num_ranks(self) -> int:
        return self._num_ranks

    @property
    def group(self) -> "dist.ProcessGroup":
        return self._group

    @property
    def device(self) -> "torch.device":
        return self._device

    @property
    def num_nodes(self) -> int:
        return self._nodes.num_nodes

    @property
    def ranks_per_node(self) -> int:
        return self._nodes.ranks_per_node

    @property
    def hidden(self) -> int:
        return self._hidden

    @property
    def backend_name(self) -> str:
        return self._backend.name

    @property
    def backend(self) -> NormalBackend:
        """The backend object, for diagnostics; calls go through the buffer, which checks them."""
        return self._backend

    @property
    def buffer_bytes(self) -> int:
        return self._backend.buffer_bytes()

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The stream async_finish / allocate_on_comm_stream calls run on (None on CPU devices)."""
        self._check_alive("get_comm_stream")
        return self._comm_stream() if self._device.type == "cuda" else None

    def _comm_stream(self) -> "torch.cuda.Stream":
        if self._comm is None:
            import torch
            self._comm = torch.cuda.Stream(device=self._device)
        return self._comm

    def _check_alive(self, what: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"NormalBuffer.{what}() called after destroy()")
        if self._member is not None and self._member.joining and what not in ("join", "update_ep_member"):
            raise MembershipError(f"NormalBuffer.{what}(): rank {self._rank} restarted (generation "
                                  f"{self._member.generation}) and is not admitted yet: call join() first")

    def _begin(self, what: str) -> Optional[Exception]:
        """The error the device recorded for an earlier call (taken; raised by this call once it has
        been made, see _launch), or a raise: destroyed, or broken (a broken buffer exchanges nothing)."""
        self._check_alive(what)
        return self._backend.pending_error()

    def _refusing(self, kind: int, pending: Optional[Exception]) -> RefusingArgs:
        """Host checks of a call. A refused call still takes part in the call's exchange with a REFUSED
        tag (tags.py), so that its peers -- which made the call -- raise PeerRefusedCall for it instead
        of waiting for this rank or pairing its next call with this one."""
        return RefusingArgs(self._backend, kind, pending)

    def _launch(self, what: str, fn: Any, tensors: Any, previous_event: Any, async_finish: bool,
                allocate_on_comm_stream: bool, pending: Optional[Exception]) -> Tuple[Any, NormalEvent]:
        """Run the backend call (events.launch). An earlier call's error (`pending`) is raised once this
        call has been made on every rank: refusing this call instead would void it on the peers too,
        and their error would void the next one."""
        try:
            res = launch(self._device, self._comm_stream, fn, what=what, previous_event=previous_event,
                         async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream,
                         bound_s=self._bound_s, check=self._backend.check_errors, tensors=tensors)
        except Exception as exc:
            if pending is not None:
                exc.add_note(f"an earlier call's error was pending too: {type(pending).__name__}: {pending}")
            raise
        if pending is not None:
            pending.add_note(f"raised by {what}, which was made (its peers have their results); this rank's "
                             f"results of it are dropped")
            raise pending
        return res

    # ------------------------------------------------------------------ layout
    @torch_function_off
    def get_dispatch_layout(self, topk_idx: "torch.Tensor", num_experts: int,
                            previous_event: Optional[Any] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> Tuple["torch.Tensor", None, "torch.Tensor", "torch.Tensor", NormalEvent]:
        pending = self._begin("get_dispatch_layout")
        if self._member is not None:      # a step begins: admit the ranks whose rejoin step this is
            self._step += 1
            self._admit_step(self._step)
        with self._refusing(KIND_LAYOUT, pending):
            v.validate_layout(topk_idx, num_experts, self._num_ranks, self._device)
            v.check_stream_flags(previous_event, async_finish, allocate_on_comm_stream)
        with profiled_range("pyep::normal::layout"):
            res, event = self._launch(
                "get_dispatch_layout", lambda: self._backend.get_dispatch_layout(topk_idx, num_experts),
                lambda r: (topk_idx, r.num_tokens_per_rank, r.num_tokens_per_expert, r.is_token_in_rank,
                           r.num_tokens_per_rdma_rank),
                previous_event, async_finish, allocate_on_comm_stream, pending)
        event.num_dropped_tokens = res.num_dropped_tokens
        return (res.num_tokens_per_rank, res.num_tokens_per_rdma_rank, res.num_tokens_per_expert,
                res.is_token_in_rank, event)

    # ------------------------------------------------------------------ dispatch
    @torch_function_off
    def dispatch(self, x: RecvX, handle: Optional[NormalHandle] = None,
                 num_tokens_per_rank: Optional["torch.Tensor"] = None,
                 num_tokens_per_rdma_rank: Optional["torch.Tensor"] = None,
                 is_token_in_rank: Optional["torch.Tensor"] = None,
                 num_tokens_per_expert: Optional["torch.Tensor"] = None,
                 topk_idx: Optional["torch.Tensor"] = None, topk_weights: Optional["torch.Tensor"] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[Any] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False
                 ) -> Tuple[RecvX, Optional["torch.Tensor"], Optional["torch.Tensor"], Optional[List[int]],
                            Optional[NormalHandle], NormalEvent]:
        if (handle is not None and self._fast is not None and not self._prof._is_profiler_enabled
                and previous_event is None and async_finish is False
                and allocate_on_comm_stream is False and num_tokens_per_rank is None and is_token_in_rank is None
                and num_tokens_per_rdma_rank is None and num_tokens_per_expert is None and topk_idx is None
                and topk_weights is None and type(expert_alignment) is int and expert_alignment == 1
                and type(num_worst_tokens) is int and num_worst_tokens == 0 and type(handle) is NormalHandle):
            entry = handle.fast_plans.get((KIND_CACHED, id(config)))
            if entry is not None and entry[0] is config:
                recv_fast = self._fast.dispatch(entry[1], x)
                if recv_fast is not None:
                    self._seq += 1
                    return recv_fast, None, None, None, None, NormalEvent(
                        None, self._device, f"normal dispatch #{self._seq}", self._bound_s, self._backend.check_errors)
        pending = self._begin("dispatch")
        config_arg = config
        cached = handle is not None
        with self._refusing(KIND_CACHED if cached else KIND_DISPATCH, pending):
            v.check_config(config)
            v.check_stream_flags(previous_event, async_finish, allocate_on_comm_stream)
            args = v.validate_dispatch(
                x=x, handle=handle, num_tokens_per_rank=num_tokens_per_rank,
                num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                num_ranks=self._num_ranks, device=self._device, buffer_hidden=self._hidden, owner=self._owner,
                epoch=self._epoch, num_nodes=self._nodes.num_nodes)
            if config is None:      # the default, as far as this buffer's rings hold it (fit_config)
                sms = 2 * handle.num_channels if cached else NormalBuffer.num_sms
                config = self._backend.fit_config(_default(self._num_ranks, sms, False, not self._nodes.internode))
            if cached:
                v.check_channels("cached dispatch", config, handle)
                in_rank = handle.is_token_in_rank
                num_worst_tokens = handle.num_worst_tokens
            else:
                in_rank = is_token_in_rank
            scales = args.x_scales   # any strides: each backend reads them in place or makes them dense
            call = DispatchCall(x=args.x, x_scales=scales, topk_idx=topk_idx, topk_weights=topk_weights,
                                num_tokens_per_rank=num_tokens_per_rank,
                                num_tokens_per_rdma_rank=None if cached else num_tokens_per_rdma_rank,
                                is_token_in_rank=in_rank,
                                num_tokens_per_expert=num_tokens_per_expert, num_experts=args.num_experts,
                                expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                                config=config, handle=handle, timeout_us=self._timeout_us, seq=self._seq + 1,
                                caller_stream=raw_current_stream(self._device) if self._device.type == "cuda" else 0)
            self._backend.check_call(call)
        self._seq += 1
        with profiled_range("pyep::normal::dispatch"):
            res, event = self._launch(
                f"normal dispatch #{self._seq}", lambda: self._backend.dispatch(call),
                lambda r: (call.x, call.x_scales, topk_idx, topk_weights, num_tokens_per_rank,
                           num_tokens_per_rdma_rank, in_rank,
                           num_tokens_per_expert, r.recv_x, r.recv_x_scales, r.recv_topk_idx,
                           r.recv_topk_weights, r.rank_prefix_matrix, r.channel_prefix_matrix,
                           r.recv_channel_prefix_matrix, r.recv_src_idx, r.send_head),
                previous_event, async_finish, allocate_on_comm_stream, pending)
        recv: RecvX = (res.recv_x, res.recv_x_scales) if scales is not None else res.recv_x
        event.num_dropped_tokens = res.num_dropped_tokens
        if cached:
            if previous_event is None and not async_finish:
                self._remember_fast(KIND_CACHED, handle, config_arg, config, args.hidden)
            return recv, None, None, None, None, event
        new_handle = NormalHandle(
            rank_prefix_matrix=res.rank_prefix_matrix, channel_prefix_matrix=res.channel_prefix_matrix,
            recv_channel_prefix_matrix=res.recv_channel_prefix_matrix, recv_src_idx=res.recv_src_idx,
            is_token_in_rank=in_rank if res.is_token_in_rank is None else res.is_token_in_rank,
            send_head=res.send_head, owner=self._owner, epoch=self._epoch,
            num_channels=config.num_channels(), num_tokens=int(args.x.shape[0]),
            num_recv_tokens=res.num_recv_tokens, num_worst_tokens=num_worst_tokens, hidden=args.hidden,
            num_topk=args.num_topk, ranks_per_node=self._nodes.ranks_per_node if self._nodes.internode else 0,
            internode=res.internode, tag=res.tag, num_dropped_tokens=res.num_dropped_tokens)
        return (recv, res.recv_topk_idx, res.recv_topk_weights, res.num_recv_tokens_per_expert_list,
                new_handle, event)

    # ------------------------------------------------------------------ combine
    @torch_function_off
    def combine(self, x: "torch.Tensor", handle: NormalHandle, topk_weights: Optional["torch.Tensor"] = None,
                bias: Union[None, "torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]] = None,
                config: Optional[Config] = None, previous_event: Optional[Any] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> Tuple["torch.Tensor", Optional["torch.Tensor"], NormalEvent]:
        if (self._fast is not None and not self._prof._is_profiler_enabled and bias is None
                and previous_event is None and async_finish is False and allocate_on_comm_stream is False
                and type(handle) is NormalHandle):
            entry = handle.fast_plans.get((KIND_COMBINE, id(config)))
            if entry is not None and entry[0] is config:
                res_fast = self._fast.combine(entry[1], x, topk_weights)
                if res_fast is not None:
                    self._seq += 1
                    return res_fast[0], res_fast[1], NormalEvent(
                        None, self._device, f"normal combine #{self._seq}", self._bound_s, self._backend.check_errors)
        pending = self._begin("combine")
        config_arg = config
        with self._refusing(KIND_COMBINE, pending):
            v.check_config(config)
            v.check_stream_flags(previous_event, async_finish, allocate_on_comm_stream)
            hd = v.check_handle(handle, owner=self._owner, epoch=self._epoch, num_ranks=self._num_ranks)
            bias_0, bias_1 = v.validate_combine(x=x, handle=hd, topk_weights=topk_weights, bias=bias,
                                                device=self._device, buffer_hidden=self._hidden)
            if config is None:      # the default, as far as this buffer's rings hold it (fit_config)
                config = self._backend.fit_config(_default(self._num_ranks, 2 * hd.num_channels, True,
                                                            not self._nodes.internode))
            v.check_channels("combine", config, hd)
            call = CombineCall(x=x, topk_weights=topk_weights, bias=(bias_0, bias_1), handle=hd, config=config,
                               timeout_us=self._timeout_us, seq=self._seq + 1)
            self._backend.check_call(call)
        self._seq += 1
        with profiled_range("pyep::normal::combine"):
            res, event = self._launch(
                f"normal combine #{self._seq}", lambda: self._backend.combine(call),
                lambda r: (x, topk_weights, bias_0, bias_1, hd.recv_src_idx, hd.send_head, hd.rank_prefix_matrix,
                           hd.recv_channel_prefix_matrix, r.combined_x, r.combined_topk_weights),
                previous_event, async_finish, allocate_on_comm_stream, pending)
        event.num_dropped_tokens = res.num_dropped_tokens
        if bias is None and previous_event is None and not async_finish:
            self._remember_fast(KIND_COMBINE, hd, config_arg, config, int(x.shape[1]))
        return res.combined_x, res.combined_topk_weights, event

    def get_combine_input(self, handle: NormalHandle) -> "torch.Tensor":
        """An uninitialised bf16 [rows received, hidden] tensor for the experts' output of `handle`'s dispatch,
        in this buffer's output pool where it has room (a plain allocation otherwise, or on a backend
        without a pool). Write the experts' output into it (matmul(..., out=), copy_) and pass it to
        combine: a combine whose input lies in the pool on every rank reads each rank's rows where they
        lie, instead of pushing them through the rings (docs/normal_mode.md, "Pull combine"). The
        dispatch's own recv_x, when it came from the pool, pulls too. Made on the current stream; the
        memory returns to the pool when the tensor is gone."""
        import torch
        hd = v.check_handle(handle, owner=self._owner, epoch=self._epoch, num_ranks=self._num_ranks)
        rows = hd.num_recv_rows
        made = getattr(self._backend, "combine_input", None)
        t = made(rows, self._hidden) if made is not None else None
        return t if t is not None else torch.empty((rows, self._hidden), dtype=torch.bfloat16, device=self._device)

    def _remember_fast(self, kind: int, handle: NormalHandle, config_arg: Optional[Config], config: Config,
                       hidden: int) -> None:
        """After the Python path made a plain cached dispatch or combine (no events, no bias): the handle's
        plan for the next such calls (native_fast.remember_plan). A store-based (elastic) buffer keeps
        every call on the Python path, and so does every call while a torch profiler runs (the calls'
        ranges, profiled_range, are the Python path's; a torch without the profiler flag: always)."""
        import torch.autograd.profiler as prof
        if self._member is None and hasattr(prof, "_is_profiler_enabled"):
            fast = remember_plan(self._backend, kind, handle, config_arg, config, hidden, self._epoch)
            if fast is not None:
                self._prof, self._fast = prof, fast

    # ------------------------------------------------------------------ lifetime
    def clean(self) -> None:
        """Collective: reset the channels (and leave a broken state after a peer timeout); handles
        made before it are refused afterwards."""
        self._check_alive("clean")
        self._backend.clean()
        self._epoch += 1
        if self._fast is not None:   # the handles of earlier generations are the Python path's to refuse
            self._fast.epoch = self._epoch

    def describe(self) -> str:
        self._check_alive("describe")
        return (f"NormalBuffer rank {self._rank}/{self._num_ranks}: backend {self._backend.name}, "
                f"{self._nodes.num_nodes} node(s) of {self._nodes.ranks_per_node} ranks, "
                f"hidden <= {self._hidden}, device {self._device}, {self.buffer_bytes} buffer bytes, "
                f"default num_sms {NormalBuffer.num_sms}")

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        self._fast = None
        self._backend.destroy()

    def __enter__(self) -> "NormalBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "destroyed" if self._destroyed else self._backend.name
        return f"NormalBuffer(rank={self._rank}, num_ranks={self._num_ranks}, {state})"


def _check_num_sms(n: Any) -> int:
    v.check_int("num_sms", n, 2)
    if n % 2 or n > 2 * MAX_CHANNELS:
        raise ValueError(f"num_sms must be even (a sender and a receiver SM per channel) and <= "
                         f"{2 * MAX_CHANNELS}, got {n}")
    return n
