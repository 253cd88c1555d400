"""The native normal mode across nodes: the staged route of docs/normal_internode.md on the kernels.

Dispatch: inter_route (send_head, channel prefix, node streams, this rank's count record) -> relay
counts (RDMA: rows per column peer) -> relay of the count records (RDMA, one row per column peer) ->
inter_pack (a token's row once per node that needs it; the own node's run straight into F) -> relay
of the rows (RDMA) -> the node's intranode notify (its slots also carry the M records this rank holds,
so every rank ends up with every source's record) -> the intranode dispatch of the forwarded rows F,
each row written at its place in the contract's order (row_map) with its source token index.
Combine: the intranode combine of the node (its output is the per-node BF16 partial of
contract.combine_order), relay of the partials back to the source (RDMA), inter_reduce there.

Host waits: two per non-cached dispatch without num_worst_tokens (the relay's counts, to size F; the
notify's, to size the outputs); none with num_worst_tokens (F and the outputs are sized by bounds,
rows beyond them are dropped and WorstTokensExceeded is recorded) and none for cached dispatch and
combine. Every device wait is bounded (the relay's and the intranode kernels'); errors are recorded
and raised at the next call or event wait.

CUDA graphs: the calls without a host wait are capturable -- every call number and ring counter lives
on the device and is advanced by the kernels, so each replay is a new call. `capture_refusal` says
which calls a capture refuses (NotCapturable, before anything is launched).
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from .._dist import group_device
from .._dist import barrier_bounded as barrier
from ..backend import BackendUnavailable
from ..streams import raw_current_stream
from . import internode_order as order
from . import tags
from .config import Config
from .contract import CombineCall, CombineResult, DispatchCall, DispatchResult, LayoutResult
from .capture import capture_refusal
from .errors import BufferBroken, NormalCallMismatch, NotCapturable, PeerTimeout
from .events import wait_bound_s
from .internode_member import InternodeMembership
from .internode_relay import Relay, RelayError, next_ticket, stream_capturing
from .native import NormalNativeBackend
from .topology import NodeLayout

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("pyep.ep.normal.internode")
PHASE_COUNTS, PHASE_DISPATCH, PHASE_COMBINE = 3, 4, 5
NODE_SIZES = (1, 2, 4, 8)
MAX_NODES = 32


def relay_transport(transport: str) -> str:
    """The column's transport: the softnic for emulated ones and under virtual nodes, else the NIC."""
    from ...transport.base import VIRTUAL_NODE_ENV
    if transport in ("emulated", "emulated-internode"):
        return "emulated"
    if transport == "auto" and os.environ.get(VIRTUAL_NODE_ENV):
        return "emulated"
    return "ibgda"


def _align16(v: int) -> int:
    return (v + 15) // 16 * 16


class NormalInternodeBackend(InternodeMembership):
    name = "native"

    @staticmethod
    def unavailable_reason(group: "dist.ProcessGroup", *, transport: str = "auto", nodes: Optional[NodeLayout] = None,
                           **_: Any) -> Optional[str]:
        """Local check (no communication, no allocation): None if this process can run the backend."""
        import torch
        if nodes is None or not nodes.internode:
            return "the group is one node (the intranode backend runs it)"
        if nodes.ranks_per_node not in NODE_SIZES or nodes.num_nodes > MAX_NODES:
            return (f"the native internode mode runs {NODE_SIZES} ranks per node on up to {MAX_NODES} nodes, not "
                    f"{nodes.num_nodes} x {nodes.ranks_per_node}")
        if transport not in ("auto", "emulated", "emulated-internode", "ibgda"):
            return f"the native internode mode runs over a NIC or the softnic, not transport {transport!r}"
        if not torch.cuda.is_available():
            return "no CUDA device is available"
        from ..._native import load
        mod = load()
        if mod is None or not getattr(mod, "has_cuda", False) or not hasattr(getattr(mod, "relay", None), "route"):
            return "pyep._engine has no internode kernels (a host-only build)"
        return None

    def __init__(self, group: Optional["dist.ProcessGroup"], *, num_nvl_bytes: Optional[int], hidden: int,
                 transport: str, timeout_us: int, num_sms: int, nodes: Optional[NodeLayout] = None,
                 num_rdma_bytes: Optional[int] = None, control: Any = None, joining: bool = False,
                 elastic: bool = False) -> None:
        """group: a process group; or control: a store-based buffer's control plane, joining for a
        restarted rank (its QPs are made when the survivors admit it: internode_member.py). elastic (a
        store-based buffer always is): on nodes of several ranks the data path runs rank to rank -- every
        rank its own node of the relay, no NVLink forwarding -- while the contract keeps `nodes`
        (internode_member.py says why)."""
        import torch
        import torch.distributed as dist
        reason = NormalInternodeBackend.unavailable_reason(group, transport=transport, nodes=nodes)
        if reason is not None:
            raise BackendUnavailable(reason)
        assert nodes is not None
        self.contract_nodes = nodes
        self.flat = (elastic or control is not None) and nodes.ranks_per_node > 1
        if self.flat:
            log.info("elastic internode buffer on %d nodes of %d ranks: its data path runs rank to rank (no NVLink "
                     "forwarding), so that a dead rank leaves out its own tokens only (docs/elastic.md)",
                     nodes.num_nodes, nodes.ranks_per_node)
            nodes = NodeLayout(nodes.num_ranks, 1)
        from ..._native import load
        self._r = load().relay
        self.group, self.nodes, self._control = group, nodes, control
        if control is not None:
            self.rank, self.num_ranks = control.rank, control.world_size
        else:
            self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.hidden, self.timeout_us = hidden, timeout_us
        p, m_n, r_n = nodes.ranks_per_node, nodes.num_nodes, self.num_ranks
        self.node_index = nodes.node(self.rank)
        self.max_experts = max(1024, 32 * r_n)
        self.meta_ints = order.meta_ints(r_n, self.max_experts)
        self._setup_s = max(120.0, 3 * timeout_us / 1e6)
        # Every rank creates every node group in the same order (new_group is collective); a store-based
        # buffer's node is this rank alone.
        node_groups = [dist.new_group(list(nodes.ranks(n))) for n in range(m_n)] if control is None else []
        self.node: Optional[NormalNativeBackend] = None
        self.relay: Optional[Relay] = None
        self._broken = False
        self._ticket = 0                 # the host's label of its waited-for count exchanges
        self._warmed: Set[Tuple[Any, ...]] = set()   # call kinds run eagerly (capture_refusal)
        try:
            node_control = control.subgroup(f"node{self.node_index}", 0, 1) if control is not None else None
            self.node = NormalNativeBackend(node_groups[self.node_index] if control is None else None,
                                            num_nvl_bytes=num_nvl_bytes, hidden=hidden, transport="auto",
                                            timeout_us=timeout_us, num_sms=num_sms, notify_extra=m_n * self.meta_ints,
                                            control=node_control, output_pool=False)
            self.node.join_group(list(nodes.ranks(self.node_index)), r_n)
            self.device = self.node.device
            row = self._r.relay_row(hidden, False, 16, p, True)["bytes"]
            ring = int(num_rdma_bytes) // (2 * m_n) if num_rdma_bytes else Config().num_max_rdma_chunked_recv_tokens * row
            # The ring also holds the count records of two calls in flight.
            self.relay = Relay(group, nodes, ring_bytes=max(ring, 8 * self.meta_ints),
                               transport=relay_transport(transport), timeout_us=timeout_us,
                               setup_timeout_s=self._setup_s, tag_record=self.node.tag_record_address,
                               control=control, joining=joining)
            s = self._r.InterStatic()
            s.rank, s.num_ranks, s.node, s.num_nodes, s.ranks_per_node = self.rank, r_n, self.node_index, m_n, p
            s.err, s.workspace = self.node.static_error_words()
            s.contract_ranks_per_node = self.contract_nodes.ranks_per_node if self.flat else 0
            self._static = s
            self._steps = torch.arange(m_n + 1, dtype=torch.int32, device=self.device)   # one row per column peer
            self._zeros: Dict[int, "torch.Tensor"] = {}
            # inter_order's answer to the host: [ticket, aligned per-expert counts of this rank's experts].
            # Labelled with the call's count-exchange ticket (self._ticket): one label per waited-for call.
            self._order_host = torch.zeros(1 + self.max_experts // r_n, dtype=torch.int32, device="cpu",
                                           pin_memory=True)
            if control is None:
                barrier(group, group_device(group), int(self._setup_s * 1e6), "normal internode buffer setup")
            else:
                self.open_grace()     # a store-based buffer's first calls (a restarted rank's too)
        except BaseException:
            self._release()
            raise
        log.debug("rank %d: internode normal buffer, %d nodes x %d ranks", self.rank, m_n, p)

    # ------------------------------------------------------------------ errors
    def pending_error(self) -> Optional[Exception]:
        """The node's records (which the relay's gate shares) and the relay's error record: a void call
        or a value error is returned, a timeout, a failed queue or ranks at different calls break the
        buffer and raise."""
        if self._broken:
            raise BufferBroken("a peer timed out, an RDMA queue failed or the ranks were at different calls in an "
                               "earlier call of this buffer: call clean() on every live rank before using it again")
        assert self.node is not None and self.relay is not None
        try:
            exc = self.node.pending_error()   # names the group's ranks (join_group)
            self.relay.check_errors()
        except (PeerTimeout, RelayError, BufferBroken, NormalCallMismatch):
            self._broken = True
            raise
        return exc

    def check_errors(self) -> None:
        exc = self.pending_error()
        if exc is not None:
            raise exc

    def fit_config(self, config: Any) -> Any:
        return self.node.fit_config(config)

    def check_call(self, call: Any) -> None:
        """The node's limits, and the relay's: refused before anything is launched (contract.py)."""
        self.node.check_call(call)
        hd = call.handle
        if hd is not None and hd.internode is None:
            raise ValueError("this handle was not made by the native internode path of this buffer")
        if isinstance(call, DispatchCall) and hd is None and call.num_experts > self.max_experts:
            raise ValueError(f"the internode buffer counts up to {self.max_experts} experts, got {call.num_experts}")
        h = int(call.x.shape[1])
        if isinstance(call, DispatchCall):
            k = int(call.topk_idx.shape[1]) if call.topk_idx is not None else 0
            row = self._r.relay_row(h, call.x_scales is not None, k, self.nodes.ranks_per_node, hd is None)["bytes"]
        else:
            row = _align16(2 * h + 4 * (int(call.topk_weights.shape[1]) if call.topk_weights is not None else 0))
        if row > self.relay.layout.ring_bytes:
            raise ValueError(f"a relay row of {row} bytes does not fit the relay ring of {self.relay.layout.ring_bytes} "
                             f"bytes: construct the buffer with a larger num_rdma_bytes")

    def refuse(self, kind: int, reason: str) -> Optional[Exception]:
        """This call's gates with REFUSED tags, in the order the call's own gates run (the column's count
        exchange first, but for a combine, which starts in the node): every rank of the group then finds
        the call void -- directly, or passed on by a rank of its node or column. get_dispatch_layout
        exchanges nothing; nothing is launched inside a capture (native.py refuse says why)."""
        if kind == tags.KIND_LAYOUT or self._broken or stream_capturing():
            return None
        assert self.node is not None and self.relay is not None
        node = lambda: self.node.gate(kind, [], status=tags.STATUS_REFUSED, reason=reason)  # noqa: E731
        column = lambda: self.relay.gate(kind, status=tags.STATUS_REFUSED)                  # noqa: E731
        for step in ((node, column) if kind == tags.KIND_COMBINE else (column, node)):
            step()
        return None

    # ------------------------------------------------------------------ helpers
    def _zero(self, n: int) -> "torch.Tensor":
        import torch
        if n not in self._zeros:
            z = torch.zeros(max(n, 1), dtype=torch.int32, device=self.device)
            if stream_capturing():
                return z    # in the graph's pool, zeroed by each replay: not for eager calls
            self._zeros[n] = z
        return self._zeros[n]

    def _capture_gate(self, kind: Tuple[Any, ...], what: str, host_wait: bool) -> bool:
        """Refuses a call a capture cannot hold (NotCapturable); returns whether this call is eager."""
        if not stream_capturing():
            return True
        why = capture_refusal(what, host_wait=host_wait, drains=self.relay.drains, warmed=kind in self._warmed)
        if why is not None:
            raise NotCapturable(why)
        return False

    def _wait_expert_counts(self, num_local_experts: int) -> List[int]:
        """inter_order's per-expert counts: a bounded host wait for its ticket (the kernel runs right after
        the node's notify, which the host already waited for)."""
        host = self._order_host.numpy()
        limit = wait_bound_s(self.timeout_us, 10.0)
        deadline = time.monotonic() + limit
        while int(host[0]) != self._ticket:
            if time.monotonic() > deadline:
                raise TimeoutError(f"normal internode dispatch: the per-expert counts (inter_order #{self._ticket}) "
                                   f"did not arrive within {limit:.1f} s (the GPU is blocked by other work)")
            time.sleep(5e-6)
        return [int(v) for v in host[1:1 + num_local_experts]]

    def _rdma(self, cfg: Config) -> Tuple[int, int]:
        return cfg.num_max_rdma_chunked_recv_tokens, cfg.num_max_rdma_chunked_send_tokens

    # ------------------------------------------------------------------ calls
    def get_dispatch_layout(self, topk_idx: "torch.Tensor", num_experts: int) -> LayoutResult:
        import torch
        eager = self._capture_gate(("layout",), "an internode get_dispatch_layout", host_wait=False)
        n, k = topk_idx.shape
        dev, r_n = self.device, self.num_ranks
        per_rank = torch.empty(r_n, dtype=torch.int32, device=dev)
        per_expert = torch.empty(num_experts, dtype=torch.int32, device=dev)
        per_node = torch.empty(self.contract_nodes.num_nodes, dtype=torch.int32, device=dev)
        in_rank = torch.empty((n, r_n), dtype=torch.bool, device=dev)
        self.node.records.num_experts = num_experts
        dropped = self._dropped()
        self._r.layout(self._static, topk_idx.data_ptr(), n, k, num_experts, per_rank.data_ptr(), per_expert.data_ptr(),
                       per_node.data_ptr(), in_rank.data_ptr(), raw_current_stream(dev),
                       dropped.data_ptr() if dropped is not None else 0)
        if eager:
            self._warmed.add(("layout",))
        return LayoutResult(per_rank, per_expert, in_rank, per_node, num_dropped_tokens=dropped)

    def dispatch(self, call: DispatchCall) -> DispatchResult:
        cached = call.handle is not None
        kind = (("cached dispatch", call.x_scales is not None) if cached else
                ("dispatch", call.x_scales is not None, call.topk_idx is not None, call.topk_weights is not None,
                 call.num_worst_tokens > 0))
        eager = self._capture_gate(kind, "a cached internode dispatch" if cached else "an internode dispatch",
                                   host_wait=not cached and call.num_worst_tokens == 0)
        self.node.settle_ring_geometry(call.config.num_max_nvl_chunked_recv_tokens, int(call.x.shape[1]),
                                       "normal internode dispatch")
        self._call_timeout()
        try:
            res = self._cached_dispatch(call) if cached else self._dispatch(call)
        except (PeerTimeout, RelayError, NormalCallMismatch):   # raised by a host wait of this call
            self._broken = True
            raise
        if eager:
            self._warmed.add(kind)
        return res

    def _dispatch(self, call: DispatchCall) -> DispatchResult:
        import torch
        dev, r_n = self.device, self.num_ranks
        p, m_n, node = self.nodes.ranks_per_node, self.nodes.num_nodes, self.node_index
        i32, u8 = torch.int32, torch.uint8
        cfg, c_n = call.config, call.config.num_channels()
        n, h = call.x.shape
        fp8 = call.x_scales is not None
        k = int(call.topk_idx.shape[1]) if call.topk_idx is not None else 0
        e_n, nwt = call.num_experts, call.num_worst_tokens
        e_l = e_n // r_n
        self.node.records.num_experts = e_n
        stream = raw_current_stream(dev)
        mi = self.meta_ints
        ptr = (lambda t: t.data_ptr() if t is not None else 0)
        in_rank = call.is_token_in_rank
        send_head = torch.empty((n, r_n), dtype=i32, device=dev)
        cpm = torch.empty((r_n, c_n), dtype=i32, device=dev)
        node_head = torch.empty((n, m_n), dtype=i32, device=dev)
        node_counts = torch.empty(m_n, dtype=i32, device=dev)
        meta = torch.empty((m_n, mi), dtype=i32, device=dev)
        meta_col = torch.empty((m_n, mi), dtype=i32, device=dev)
        # The caller's layout tensors are checked against is_token_in_rank and topk_idx on the way.
        checked = call.topk_idx is not None and n > 0
        dropped = self._dropped()
        self._r.route(self._static, ptr(call.topk_idx) if n else 0, k, e_n, in_rank.data_ptr(), n, c_n,
                      send_head.data_ptr(), cpm.data_ptr(), node_head.data_ptr(), node_counts.data_ptr(),
                      meta.data_ptr(), meta_col[node].data_ptr(), mi, stream, call.num_tokens_per_rank.data_ptr(),
                      call.num_tokens_per_rdma_rank.data_ptr(), call.num_tokens_per_expert.data_ptr(),
                      self.node.layout_scratch_address if checked else 0, int(checked),
                      dropped.data_ptr() if dropped is not None and checked else 0)
        per_expert = call.num_tokens_per_expert.to(i32)
        meta[:, 1 + r_n:1 + r_n + e_n] = per_expert            # the record's tokens per expert
        meta_col[node, 1 + r_n:1 + r_n + e_n] = per_expert
        # Counts to the column peers (RDMA), then every source's record one hop (RDMA) ...
        recv = torch.empty(m_n + 1, dtype=i32, device=dev)
        host = nwt == 0
        if host:
            self._ticket = next_ticket(self._ticket)
        self.relay.counts_async(self._ticket, node_counts, recv, host, kind=tags.KIND_DISPATCH)
        q_r, chunk_r = self._rdma(cfg)
        self.relay.relay_into(PHASE_COUNTS, meta.view(u8), self._steps, meta_col.view(u8), self._steps, q_r, 1)
        f_off = torch.empty(m_n + 1, dtype=i32, device=dev)
        s_off = torch.empty(m_n + 1, dtype=i32, device=dev)
        self._r.offsets(self._static, node_counts.data_ptr(), recv.data_ptr(), f_off.data_ptr(), s_off.data_ptr(), stream)
        if host:
            from_nodes, to_nodes = self.relay.wait_counts(self._ticket)
            f_rows = sum(from_nodes) + to_nodes[node]
            s_rows = sum(to_nodes) - to_nodes[node]
        else:
            f_rows, s_rows = p * nwt, n * (m_n - 1)
        # ... the rows (RDMA) into F, the forwarded rows of this node by source node.
        rr = self._r.relay_row(h, fp8, k, p, True)
        fwd = torch.empty((f_rows, rr["bytes"]), dtype=u8, device=dev)
        send = torch.empty((s_rows, rr["bytes"]), dtype=u8, device=dev)
        scales = call.x_scales.contiguous() if fp8 else None   # the relay's pack reads dense scales
        self._r.pack(self._static, call.x.data_ptr(), ptr(scales), ptr(call.topk_idx), ptr(call.topk_weights),
                     in_rank.data_ptr(), node_head.data_ptr(), n, h, k, fp8, True, f_off.data_ptr(), s_off.data_ptr(),
                     fwd.data_ptr(), f_rows, send.data_ptr(), stream)
        self.relay.relay_into(PHASE_DISPATCH, send, s_off, fwd, f_off, q_r, chunk_r, capacity=f_rows)
        if self._mask is not None:
            # A node that left the call in its relays: nothing more to it, its tokens dropped (once).
            self._r.settle(self._static, self._column_mask(), node_head.data_ptr(), send_head.data_ptr(), cpm.data_ptr(),
                           n, c_n, dropped.data_ptr() if dropped is not None else 0, stream)
        # The intranode dispatch reads F's payloads in place (x_row_bytes); its small fields in one pass,
        # the ids made node-local (internode_order.node_local_ids), rows past the real count not in any rank.
        scales_f = torch.empty((f_rows, h // 128), dtype=torch.float32, device=dev) if fp8 else None
        ids_node = torch.empty((f_rows, k), dtype=torch.int64, device=dev) if k else None
        w_f = torch.empty((f_rows, k), dtype=torch.float32, device=dev) if k and call.topk_weights is not None else None
        src_f = torch.empty(f_rows, dtype=i32, device=dev)
        in_f = torch.empty((f_rows, p), dtype=torch.bool, device=dev)
        # With a mask, a source node that left the call (before it or during its relays) sends nothing: its
        # run of F is in no rank and its record reads as empty.
        self._r.unpack(self._static, fwd.data_ptr(), f_rows, h, k, fp8, e_l, f_off.data_ptr(), ptr(scales_f),
                       ptr(ids_node), ptr(w_f), src_f.data_ptr(), in_f.data_ptr(), stream, self._column_mask(),
                       meta_col.data_ptr() if self._mask is not None else 0, mi)
        # The node's notify: node-level prefix matrices and counts, and every rank's records.
        nd = self.node
        rpm_f = torch.empty((p, p), dtype=i32, device=dev)
        cpm_f = torch.empty((p, c_n), dtype=i32, device=dev)
        rcp_f = torch.empty((p, c_n), dtype=i32, device=dev)
        sh_f = torch.empty((f_rows, p), dtype=i32, device=dev)
        gathered = torch.empty((p, m_n * mi), dtype=i32, device=dev)
        tag = torch.zeros(2, dtype=i32, device=dev)     # the handle's mark: the node call of this dispatch
        a = nd.count_args(f_rows, self._zero(p * e_l).data_ptr(), in_f.data_ptr(), p * e_l, c_n, call.expert_alignment,
                          nwt, rpm_f, cpm_f, rcp_f, sh_f, tags.KIND_DISPATCH,
                          [h, c_n, cfg.num_max_nvl_chunked_recv_tokens, e_n, k, int(call.topk_weights is not None) | int(fp8) << 1])
        a.extra, a.extra_out, a.extra_ints = meta_col.data_ptr(), gathered.data_ptr(), m_n * mi
        a.upstream, a.tag_out = self.relay.workspace_address, tag.data_ptr()
        # The node's gate: a void of the column's count exchange (a refusal in this column) is passed on,
        # so every rank of the node -- and through the other columns, every rank -- voids the call.
        rows = nd.notify(a, f"normal internode dispatch #{call.seq}")
        # Row map, rank_prefix_matrix and (for the host) the per-expert counts from the records: one
        # kernel, answered before the dispatch runs (internode_order.py states what it computes).
        rmap = torch.empty(max(rows, 1), dtype=i32, device=dev)
        rpm = torch.empty((r_n, r_n), dtype=i32, device=dev)
        if host:
            self._order_host[0] = 0
        self._r.order(self._static, gathered.data_ptr(), mi, rows, rmap.data_ptr(), rpm.data_ptr(),
                      self._order_host.data_ptr() if host else 0, self._ticket if host else 0, e_n,
                      call.expert_alignment, stream)
        counts: List[int] = self._wait_expert_counts(e_l) if host else []
        rmap = rmap[:rows]
        recv_x = torch.empty((rows, h), dtype=call.x.dtype, device=dev)
        recv_scales = torch.empty((rows, h // 128), dtype=torch.float32, device=dev) if fp8 else None
        recv_idx = torch.empty((rows, k), dtype=torch.int64, device=dev) if k else None
        recv_w = torch.empty((rows, k), dtype=torch.float32, device=dev) if k and call.topk_weights is not None else None
        recv_src = torch.empty(rows, dtype=i32, device=dev)
        nd.launch_dispatch(fwd, scales_f, ids_node, w_f, in_f, rpm_f, cpm_f, rcp_f, f_rows, h, k, e_l, fp8, cfg, rows,
                           nwt, recv_x, recv_scales, recv_idx, recv_w, recv_src, src_f, rmap, x_row_bytes=rr["bytes"])
        rcp = torch.empty((r_n, c_n), dtype=i32, device=dev)
        self._r.recv_prefix(self._static, gathered.data_ptr(), mi, rpm.data_ptr(), recv_src.data_ptr(), rows, c_n,
                            rcp.data_ptr(), stream)
        state = order.StagedState(node_head=node_head, f_offsets=f_off, s_offsets=s_off, forward_rows=f_rows,
                                  send_rows=s_rows, node_rank_prefix=rpm_f, node_channel_prefix=cpm_f,
                                  node_recv_channel_prefix=rcp_f, node_send_head=sh_f, node_in_rank=in_f, row_map=rmap)
        # The routing the call kept: less the ranks out of the mask after it (a rank marked in it included;
        # its tokens count as dropped in the combine, whose rows from it do not come back).
        kept = in_rank & (self._mask != 0).view(1, -1) if self._mask is not None else None
        return DispatchResult(recv_x=recv_x, recv_x_scales=recv_scales, recv_topk_idx=recv_idx, recv_topk_weights=recv_w,
                              num_recv_tokens_per_expert_list=counts, rank_prefix_matrix=rpm, channel_prefix_matrix=cpm,
                              recv_channel_prefix_matrix=rcp, recv_src_idx=recv_src, send_head=send_head,
                              num_recv_tokens=rows if host else -1, internode=state, tag=tag,
                              is_token_in_rank=kept, num_dropped_tokens=dropped)

    def _cached_dispatch(self, call: DispatchCall) -> DispatchResult:
        import torch
        hd = call.handle
        st: order.StagedState = hd.internode
        dev, p = self.device, self.nodes.ranks_per_node
        n, h = call.x.shape
        fp8 = call.x_scales is not None
        cfg = call.config
        self.relay.gate(tags.KIND_CACHED, handle_tag=hd.tag)
        rr = self._r.relay_row(h, fp8, 0, p, False)
        fwd = torch.empty((st.forward_rows, rr["bytes"]), dtype=torch.uint8, device=dev)
        send = torch.empty((st.send_rows, rr["bytes"]), dtype=torch.uint8, device=dev)
        scales = call.x_scales.contiguous() if fp8 else None   # the relay's pack reads dense scales
        self._r.pack(self._static, call.x.data_ptr(), scales.data_ptr() if scales is not None else 0, 0, 0, 0,
                     st.node_head.data_ptr(), n, h, 0, fp8, False, st.f_offsets.data_ptr(), st.s_offsets.data_ptr(),
                     fwd.data_ptr(), st.forward_rows, send.data_ptr(), raw_current_stream(dev))
        q_r, chunk_r = self._rdma(cfg)
        self.relay.relay_into(PHASE_DISPATCH, send, st.s_offsets, fwd, st.f_offsets, q_r, chunk_r,
                              capacity=st.forward_rows)
        dropped = None
        if self._mask is not None:
            # The handle places every source's rows: those of a source node out of the call arrive emptied
            # (zero payload and scales), and this rank's tokens for a node out of it count as dropped.
            self._r.empty(self._static, fwd.data_ptr(), st.forward_rows, rr["bytes"], st.f_offsets.data_ptr(),
                          self._column_mask(), raw_current_stream(dev))
            dropped = self._dropped_by_column(st)
        scales_f = order.unpack(fwd, rr["scales"], 4 * (h // 128), torch.float32) if fp8 else None
        rows = hd.num_recv_rows
        recv_x = torch.empty((rows, h), dtype=call.x.dtype, device=dev)
        recv_scales = torch.empty((rows, h // 128), dtype=torch.float32, device=dev) if fp8 else None
        self.node.gate(tags.KIND_CACHED, [h, hd.num_channels, cfg.num_max_nvl_chunked_recv_tokens, int(fp8)],
                       handle_tag=hd.tag, upstream=self.relay.workspace_address)
        self.node.launch_dispatch(fwd, scales_f, None, None, st.node_in_rank, st.node_rank_prefix,
                                  st.node_channel_prefix, st.node_recv_channel_prefix, st.forward_rows, h, 0, 0, fp8,
                                  cfg, rows, hd.num_worst_tokens, recv_x, recv_scales, None, None, None, None, st.row_map,
                                  x_row_bytes=rr["bytes"])
        return DispatchResult(recv_x=recv_x, recv_x_scales=recv_scales, recv_topk_idx=None, recv_topk_weights=None,
                              num_recv_tokens_per_expert_list=None, rank_prefix_matrix=hd.rank_prefix_matrix,
                              channel_prefix_matrix=hd.channel_prefix_matrix,
                              recv_channel_prefix_matrix=hd.recv_channel_prefix_matrix, recv_src_idx=hd.recv_src_idx,
                              send_head=hd.send_head, num_recv_tokens=hd.num_recv_tokens, internode=st,
                              num_dropped_tokens=dropped)

    def _dropped_by_column(self, st: order.StagedState) -> "torch.Tensor":
        """int32 [R]: this rank's tokens with a row for a node out of the relay's call mask (one rank per
        node: node m is rank m), read on the device after the relay."""
        import torch
        m_n = self.nodes.num_nodes
        word = self.relay.mask_word
        bits = torch.arange(m_n, dtype=torch.int32, device=self.device)
        out_nodes = ((word >> bits) & 1) == 0
        out_nodes[self.node_index] = False
        return ((st.node_head >= 0) & out_nodes.view(1, -1)).sum(0, dtype=torch.int32)

    def combine(self, call: CombineCall) -> CombineResult:
        hd, cfg = call.handle, call.config
        st: order.StagedState = hd.internode
        kind = ("combine", call.topk_weights is not None, call.bias[0] is not None, call.bias[1] is not None)
        eager = self._capture_gate(kind, "an internode combine", host_wait=False)
        self.node.settle_ring_geometry(cfg.num_max_nvl_chunked_recv_tokens, int(call.x.shape[1]), "normal internode combine")
        self._call_timeout()
        res = self._combine(call, st)
        if eager:
            self._warmed.add(kind)
        return res

    def _combine(self, call: CombineCall, st: order.StagedState) -> CombineResult:
        import torch
        hd, cfg = call.handle, call.config
        dev = self.device
        n, h = hd.num_tokens, int(call.x.shape[1])
        k = int(call.topk_weights.shape[1]) if call.topk_weights is not None else 0
        f_rows = st.forward_rows
        # The node's partials (contract.combine_order's part_n) for every forwarded row ...
        part = torch.empty((f_rows, h), dtype=torch.bfloat16, device=dev)
        part_w = torch.empty((f_rows, k), dtype=torch.float32, device=dev) if k else None
        self.node.gate(tags.KIND_COMBINE, [h, hd.num_channels, cfg.num_max_nvl_chunked_recv_tokens, k], handle_tag=hd.tag)
        self.node.launch_combine(call.x, call.topk_weights, st.node_send_head, st.node_rank_prefix,
                                 st.node_channel_prefix, st.node_recv_channel_prefix, f_rows, h, k, hd.num_channels,
                                 cfg, part, part_w, st.row_map)
        # ... back to their sources (RDMA) as [bf16 H][fp32 K] rows ...
        width = _align16(2 * h + 4 * k)
        rows = torch.zeros((f_rows, width), dtype=torch.uint8, device=dev)
        rows[:, :2 * h] = part.view(torch.uint8)
        if k:
            rows[:, 2 * h:2 * h + 4 * k] = part_w.view(torch.uint8)
        back = torch.empty((st.send_rows, width), dtype=torch.uint8, device=dev)
        q_r, chunk_r = self._rdma(cfg)
        self.relay.gate(tags.KIND_COMBINE, upstream=self.node.static_error_words()[1])   # passes a node void on
        self.relay.relay_into(PHASE_COMBINE, rows, st.f_offsets, back, st.s_offsets, q_r, chunk_r,
                              capacity=st.send_rows)
        # ... and the sum in node order at the source.
        out = torch.empty((n, h), dtype=torch.bfloat16, device=dev)
        out_w = torch.empty((n, k), dtype=torch.float32, device=dev) if k else None
        b0, b1 = call.bias
        ptr = (lambda t: t.data_ptr() if t is not None else 0)
        dropped = self._dropped()
        # With a mask, a node out of the relay's call mask adds no partial: each token that had a row there
        # counts as dropped for it.
        self._r.reduce(self._static, st.node_head.data_ptr(), st.f_offsets.data_ptr(), st.s_offsets.data_ptr(),
                       part.data_ptr(), ptr(part_w), back.data_ptr(), width, ptr(b0), ptr(b1), n, h, k, out.data_ptr(),
                       ptr(out_w), raw_current_stream(dev), self._column_mask(), ptr(dropped))
        return CombineResult(out, out_w, num_dropped_tokens=dropped)

    # ------------------------------------------------------------------ the rest
    def clean(self) -> None:
        """Collective: the node's channels and the column's relay counters start over."""
        assert self.node is not None and self.relay is not None
        self.node.clean()
        bound = int(self._setup_s * 1e6)
        if self._control is not None:
            self.relay.clean(lambda: self._control.barrier(self._setup_s, "normal internode clean"))
        else:
            self.relay.clean(lambda: barrier(self.group, group_device(self.group), bound, "normal internode clean"))
        self._broken = False

    def buffer_bytes(self) -> int:
        return (self.node.buffer_bytes() if self.node else 0) + (self.relay._bytes if self.relay else 0)

    def raw_buffer(self) -> "tuple[int, int]":
        return self.node.raw_buffer()

    def transport_table(self) -> List[Any]:
        return self.node.transport_table()

    def _release(self) -> None:
        if self.relay is not None:
            self.relay.destroy()
            self.relay = None
        if self.node is not None:
            self.node.destroy()
            self.node = None

    def destroy(self) -> None:
        self._release()
