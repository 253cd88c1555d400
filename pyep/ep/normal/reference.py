"""Reference backend of the normal mode: contract.py in plain torch over torch.distributed collectives
(gloo on CPU, NCCL on GPU). It is the oracle the native kernels are compared with bit for bit, so it
is written to be obviously right rather than fast.

Every call starts with the call-tag exchange (tags.py): every rank's generation, call number, kind,
shape signature and status, so that a rank refused on its host (it exchanges only its REFUSED tag)
or at another call never pairs its collectives with this call's (PeerRefusedCall / NormalCallMismatch
on every rank). A non-cached dispatch then is two all-to-alls: a header (per source: its expert-id
and layout error records, the rows it sends each rank, the num_tokens_per_rank it claims, and per
destination its per-channel rows and per-expert entries) and the rows themselves as bytes (gloo has
no bf16/fp8). Every rank receives every source's error records and row counts, so all ranks take the
same decision about an error at the same call and nobody is left waiting in a collective. A cached
dispatch and a combine move rows only: the handle already says how many rows go where.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from .._dist import group_device
from ..config import DEFAULT_TIMEOUT_US
from . import tags
from .contract import (CombineCall, CombineResult, DispatchCall, DispatchResult, LayoutResult,
                       combine_order)
from .errors import BufferBroken, NormalCallMismatch, WorstTokensExceeded, node_count_mismatch, rank_count_mismatch
from .reference_exchange import CALLS_PER_STEP, NormalExchange
from .reference_values import ERR_WORDS, first_bad_entry, layout_contradiction, raise_first
from .topology import NodeLayout

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("pyep.ep.normal.reference")


def row_bytes(t: "torch.Tensor") -> "torch.Tensor":
    """[M, ...] tensor -> [M, nbytes] uint8 (dtype-agnostic transport)."""
    import torch
    width = t.element_size()
    for d in t.shape[1:]:
        width *= d
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], width)


def columns(rows: "torch.Tensor", begin: int, nbytes: int, dtype: "torch.dtype") -> "torch.Tensor":
    """Bytes [begin, begin + nbytes) of every uint8 row, reinterpreted as `dtype`: [M, nbytes/size].
    Through a flat copy: a column slice of a single row counts as contiguous with the parent's stride,
    which view(dtype) refuses."""
    m = rows.shape[0]
    flat = rows[:, begin:begin + nbytes].reshape(-1).clone()
    return flat.view(dtype).reshape(m, nbytes // flat.new_empty(0).view(dtype).element_size())


def token_channels(n: int, num_channels: int, device: "torch.device") -> "torch.Tensor":
    """int64 [N]: the channel of each token. Channel c covers [min(c*P, N), min((c+1)*P, N)) with
    P = ceil(N / C), so token t is in channel t // P."""
    import torch
    per = max(1, -(-n // num_channels))
    return torch.div(torch.arange(n, device=device, dtype=torch.int64), per, rounding_mode="floor")


class NormalReferenceBackend(NormalExchange):
    name = "reference"

    def __init__(self, group: Optional["dist.ProcessGroup"], *, timeout_us: int = DEFAULT_TIMEOUT_US,
                 nodes: Optional[NodeLayout] = None, control: Any = None,
                 mask: Optional["torch.Tensor"] = None) -> None:
        """On a process group (`group`), or -- `control` a StoreControl, group None -- on a store: every
        exchange is then store mailbox keys (pyep.ep.elastic.mailbox) and a dead rank is marked, not
        waited for. `mask`: the buffer's active_ranks tensor (int32 [R], 1 = active), updated in place."""
        import torch
        import torch.distributed as dist
        self.group = group
        self._mail: Any = None
        if group is None:
            from ..elastic.mailbox import StoreMailbox
            self.rank, self.num_ranks = control.rank, control.world_size
            self.device = torch.device("cpu")
            self._mail = StoreMailbox(control)
        else:
            self.rank = dist.get_rank(group)
            self.num_ranks = dist.get_world_size(group)
            self.device = group_device(group)
        self.nodes = nodes if nodes is not None else NodeLayout(self.num_ranks, self.num_ranks)
        self.mask = mask if mask is not None else torch.ones(self.num_ranks, dtype=torch.int32, device=self.device)
        self.timeout_us = timeout_us
        self.epoch = 0                         # generation: clean() calls so far
        self.calls = 0                         # exchanging calls of this generation
        self._broken: Optional[str] = None     # why, after a NormalCallMismatch (until clean())
        # A store-based job starts like a rejoin: its first steps wait longer (docs/elastic.md).
        self.grace_until = CALLS_PER_STEP * 16 if self._mail is not None else 0

    @staticmethod
    def unavailable_reason(*args: object, **kwargs: object) -> Optional[str]:
        return None

    # ------------------------------------------------------------------ helpers
    def _rows_per_source(self, rank_prefix_matrix: "torch.Tensor") -> List[int]:
        col = [int(v) for v in rank_prefix_matrix[:, self.rank]]
        return [col[0]] + [col[s] - col[s - 1] for s in range(1, self.num_ranks)]

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: "torch.Tensor", num_experts: int) -> LayoutResult:
        import torch
        r_n, dev = self.num_ranks, self.device
        e_l = num_experts // r_n
        # The tag exchange carries every rank's bad-id record: every rank raises at this call or none does.
        _, bad, active = self._exchange_tags(tags.KIND_LAYOUT, tags.signature(num_experts),
                                             extra=first_bad_entry(topk_idx, num_experts))
        raise_first(bad, self.rank, num_experts, bad_ids=True)
        on = active.to(dev)
        n = topk_idx.shape[0]
        valid = topk_idx >= 0
        owner = torch.div(topk_idx, e_l, rounding_mode="floor")
        in_all = torch.zeros((n, r_n), dtype=torch.bool, device=dev)
        for r in range(r_n):
            in_all[:, r] = (valid & (owner == r)).any(dim=1)
        # Inactive ranks are left out: their tokens are dropped (counted), their experts count nothing.
        in_rank = in_all & on.view(1, -1)
        live = valid & on[owner.clamp_min(0)]
        per_expert = torch.bincount(topk_idx[live], minlength=num_experts).to(torch.int32)
        return LayoutResult(num_tokens_per_rank=in_rank.sum(dim=0).to(torch.int32),
                            num_tokens_per_expert=per_expert, is_token_in_rank=in_rank,
                            num_tokens_per_rdma_rank=self._per_node(in_rank),
                            num_dropped_tokens=(in_all & ~on.view(1, -1)).sum(dim=0).to(torch.int32))

    def _per_node(self, in_rank: "torch.Tensor") -> Optional["torch.Tensor"]:
        """int32 [M]: tokens with a rank on node n (None on one node)."""
        import torch
        if not self.nodes.internode:
            return None
        m, p = self.nodes.num_nodes, self.nodes.ranks_per_node
        return in_rank.reshape(-1, m, p).any(dim=2).sum(dim=0).to(torch.int32)

    # ------------------------------------------------------------------ dispatch
    def _payload(self, call: DispatchCall, tokens: "torch.Tensor", with_topk: bool) -> "torch.Tensor":
        """uint8 [M, width] rows of the given tokens: source index (int64), x, scales, top-k ids and
        weights."""
        import torch
        parts = [row_bytes(tokens.reshape(-1, 1)), row_bytes(call.x[tokens])]
        if call.x_scales is not None:
            parts.append(row_bytes(call.x_scales[tokens]))
        if with_topk and call.topk_idx is not None:
            parts.append(row_bytes(call.topk_idx[tokens]))
            if call.topk_weights is not None:
                parts.append(row_bytes(call.topk_weights[tokens]))
        return torch.cat(parts, dim=1)

    def _unpack(self, call: DispatchCall, recv: "torch.Tensor", rows: int, with_topk: bool
                ) -> Tuple["torch.Tensor", Optional["torch.Tensor"], "torch.Tensor",
                           Optional["torch.Tensor"], Optional["torch.Tensor"]]:
        """Received rows -> (recv_x, recv_x_scales, recv_src_idx, recv_topk_idx, recv_topk_weights),
        each with `rows` rows; rows past the received ones are padding (x 0, ids -1, weights 0, src -1)."""
        import torch
        m, h, dev = recv.shape[0], call.x.shape[1], self.device
        off = 0

        def take(nbytes: int, dtype: "torch.dtype") -> "torch.Tensor":
            nonlocal off
            part = columns(recv, off, nbytes, dtype)
            off += nbytes
            return part

        src = torch.full((rows,), -1, dtype=torch.int32, device=dev)
        src[:m] = take(8, torch.int64).reshape(m).to(torch.int32)
        xb = take(h * call.x.element_size(), torch.uint8)
        recv_x = torch.zeros((rows, xb.shape[1]), dtype=torch.uint8, device=dev)
        recv_x[:m] = xb
        recv_x = recv_x.view(call.x.dtype).reshape(rows, h)
        scales = None
        if call.x_scales is not None:
            g = call.x_scales.shape[1]
            scales = torch.zeros((rows, g), dtype=torch.float32, device=dev)
            scales[:m] = take(4 * g, torch.float32)
        idx_out = w_out = None
        if with_topk and call.topk_idx is not None:
            k = call.topk_idx.shape[1]
            e_l = call.num_experts // self.num_ranks
            ids = take(8 * k, torch.int64)
            local = (ids >= self.rank * e_l) & (ids < (self.rank + 1) * e_l)
            idx_out = torch.full((rows, k), -1, dtype=torch.int64, device=dev)
            idx_out[:m] = torch.where(local, ids - self.rank * e_l, torch.full_like(ids, -1))
            if call.topk_weights is not None:
                w = take(4 * k, torch.float32)
                w_out = torch.zeros((rows, k), dtype=torch.float32, device=dev)
                w_out[:m] = torch.where(local, w, torch.zeros_like(w))
        return recv_x, scales, src, idx_out, w_out

    def dispatch(self, call: DispatchCall) -> DispatchResult:
        if call.handle is not None:
            return self._cached_dispatch(call)
        import torch
        r_n, me, dev = self.num_ranks, self.rank, self.device
        n, c_n = call.x.shape[0], call.config.num_channels()
        e_l = call.num_experts // r_n
        assert call.num_tokens_per_rank is not None and call.num_tokens_per_expert is not None
        k = int(call.topk_idx.shape[1]) if call.topk_idx is not None else 0
        what, _, active = self._exchange_tags(tags.KIND_DISPATCH, tags.signature(
            call.x.shape[1], c_n, call.num_experts, k, call.topk_weights is not None, call.x_scales is not None))
        in_all = call.is_token_in_rank
        routed = self._routed(call, in_all)          # [N, R]: tokens routed to each rank, mask or not
        on = active.to(dev)
        in_rank = in_all & on.view(1, -1)            # rows to inactive ranks are dropped
        chan = token_channels(n, c_n, dev)
        err = first_bad_entry(call.topk_idx, call.num_experts) if call.topk_idx is not None else [0] * ERR_WORDS
        err += layout_contradiction(call.topk_idx, call.num_experts, r_n, in_all, call.num_tokens_per_expert,
                                    active=on)
        # Header to d: [bad-id record | layout record | rows I send every rank | my num_tokens_per_rank |
        # my rows for d per channel | my top-k entries per expert of d]; inactive ranks' entries are 0.
        per_chan = self._per_channel(in_rank, chan, c_n)
        claimed_mine = call.num_tokens_per_rank.to(torch.int64) * on.to(torch.int64)
        common = torch.cat([torch.tensor(err, dtype=torch.int64, device=dev), per_chan.sum(dim=1), claimed_mine])
        experts = call.num_tokens_per_expert.to(torch.int64).reshape(r_n, e_l) * on.to(torch.int64).view(-1, 1)
        parts = [common.reshape(1, -1).expand(r_n, -1), per_chan, experts]
        if self.nodes.internode:
            # [my num_tokens_per_rdma_rank | what is_token_in_rank gives for it], for every destination; the
            # caller's is_token_in_rank, not the masked one: a layout made with an older mask is accepted.
            assert call.num_tokens_per_rdma_rank is not None
            rdma = torch.cat([call.num_tokens_per_rdma_rank.to(torch.int64), self._per_node(in_all).to(torch.int64)])
            parts.append(rdma.reshape(1, -1).expand(r_n, -1))
        header = torch.cat(parts, dim=1).contiguous()
        hdr = self._fixed(header, active, call.timeout_us, f"{what} (header all-to-all)", "hdr")
        o_rows = 2 * ERR_WORDS
        o_claim, o_chan = o_rows + r_n, o_rows + 2 * r_n
        raise_first(hdr[:, :ERR_WORDS], me, call.num_experts, bad_ids=True)
        raise_first(hdr[:, ERR_WORDS:o_rows], me, call.num_experts, bad_ids=False)
        sent = hdr[:, o_rows:o_claim]          # [s][d]: rows source s sends d
        claimed = hdr[:, o_claim:o_chan]       # [s][d]: num_tokens_per_rank of source s (its active ranks)
        if not torch.equal(sent, claimed):
            s, d = (int(v) for v in (sent != claimed).nonzero()[0])
            err_c = rank_count_mismatch(d, int(claimed[s, d]), int(sent[s, d]))
            err_c.add_note(f"in the tensors of rank {s} ({what}); every rank raises at this call")
            raise err_c
        if self.nodes.internode:
            self._check_rdma_claims(hdr[:, o_chan + c_n + e_l:], what)
        live = active.to(dev).to(torch.int64)
        sent = sent * live.view(-1, 1) * live.view(1, -1)    # a rank marked in the header exchange is out
        arrive = sent.sum(dim=0)               # [d]: rows rank d receives
        nwt = call.num_worst_tokens
        if nwt > 0 and bool((arrive > nwt).any()):
            d = me if int(arrive[me]) > nwt else int((arrive > nwt).nonzero()[0])
            err_w = WorstTokensExceeded(int(arrive[d]), nwt)
            err_w.add_note(f"on rank {d}; every rank raises at this call")
            raise err_w

        in_rank = in_all & active.to(dev).view(1, -1)
        send_counts = [int(v) for v in in_rank.sum(dim=0)]
        tokens = torch.cat([in_rank[:, d].nonzero().reshape(-1) for d in range(r_n)])
        send = self._payload(call, tokens, with_topk=True)
        recv, got = self._rows(send, send_counts, [int(v) for v in sent[:, me]], active, call.timeout_us,
                               f"{what} (data all-to-all)", "data")
        # Sources (and destinations) marked in the data exchange are out of this call too.
        live = active.to(dev).to(torch.int64)
        sent = sent * live.view(-1, 1) * live.view(1, -1)
        in_rank = in_all & active.to(dev).view(1, -1)
        per_chan = self._per_channel(in_rank, chan, c_n)
        m = recv.shape[0]
        rows = nwt if nwt > 0 else m
        recv_x, scales, src, idx_out, w_out = self._unpack(call, recv, rows, with_topk=True)

        rank_prefix = torch.cumsum(sent, dim=0).to(torch.int32)
        channel_prefix = torch.cumsum(per_chan, dim=1).to(torch.int32)
        recv_chan = hdr[:, o_chan:o_chan + c_n] * live.view(-1, 1)   # [s][c] rows s sends me on c
        recv_channel_prefix = (torch.cumsum(recv_chan, dim=1) - recv_chan).to(torch.int32)
        send_head = self._send_head(in_rank, chan, per_chan)
        counts_list: List[int] = []
        if nwt == 0:
            align = call.expert_alignment
            per_local = (hdr[:, o_chan + c_n:o_chan + c_n + e_l] * live.view(-1, 1)).sum(dim=0)
            counts_list = [(int(v) + align - 1) // align * align for v in per_local]
        dropped = (routed & ~active.to(dev).view(1, -1)).sum(dim=0).to(torch.int32)
        return DispatchResult(recv_x=recv_x, recv_x_scales=scales, recv_topk_idx=idx_out,
                              recv_topk_weights=w_out, num_recv_tokens_per_expert_list=counts_list,
                              rank_prefix_matrix=rank_prefix, channel_prefix_matrix=channel_prefix,
                              recv_channel_prefix_matrix=recv_channel_prefix, recv_src_idx=src,
                              send_head=send_head, num_recv_tokens=m, tag=self._mark(),
                              is_token_in_rank=in_rank, num_dropped_tokens=dropped)

    def _routed(self, call: DispatchCall, in_rank: "torch.Tensor") -> "torch.Tensor":
        """bool [N, R]: the ranks each token is routed to -- by topk_idx where the call has it (a layout
        made with an older mask left a rank out already), else by is_token_in_rank."""
        import torch
        if call.topk_idx is None:
            return in_rank
        e_l = call.num_experts // self.num_ranks
        valid = (call.topk_idx >= 0) & (call.topk_idx < call.num_experts)
        owner = torch.div(torch.where(valid, call.topk_idx, torch.zeros_like(call.topk_idx)), e_l,
                          rounding_mode="floor")
        return torch.stack([(valid & (owner == r)).any(dim=1) for r in range(self.num_ranks)], dim=1) \
            if call.topk_idx.shape[0] else torch.zeros_like(in_rank)

    def _per_channel(self, in_rank: "torch.Tensor", chan: "torch.Tensor", c_n: int) -> "torch.Tensor":
        """int64 [R, C]: my rows for each destination per channel."""
        import torch
        per_chan = torch.zeros((self.num_ranks, c_n), dtype=torch.int64, device=self.device)
        for d in range(self.num_ranks):
            per_chan[d] = torch.bincount(chan[in_rank[:, d]], minlength=c_n)
        return per_chan

    def _mark(self) -> int:
        """A handle's tag: the generation and number of the dispatch that made it."""
        return (self.epoch << 32) | self.calls

    def _check_rdma_claims(self, rdma: "torch.Tensor", what: str) -> None:
        """rdma [R, 2M]: every source's num_tokens_per_rdma_rank and the count its is_token_in_rank
        gives; every rank sees every source's pair, so all raise together."""
        import torch
        m = self.nodes.num_nodes
        claimed, derived = rdma[:, :m], rdma[:, m:]
        if not torch.equal(claimed, derived):
            s, n = (int(v) for v in (claimed != derived).nonzero()[0])
            err = node_count_mismatch(n, int(claimed[s, n]), int(derived[s, n]))
            err.add_note(f"in the tensors of rank {s} ({what}); every rank raises at this call")
            raise err

    def _send_head(self, in_rank: "torch.Tensor", chan: "torch.Tensor", per_chan: "torch.Tensor"
                   ) -> "torch.Tensor":
        """send_head[t, d]: position of t in the (channel(t), -> d) stream from 0, -1 if not sent:
        its index among all tokens sent to d, minus the tokens sent to d in earlier channels."""
        import torch
        n, r_n = in_rank.shape
        head = torch.full((n, r_n), -1, dtype=torch.int32, device=self.device)
        before = torch.cumsum(per_chan, dim=1) - per_chan                   # [d][c] exclusive
        for d in range(r_n):
            sel = in_rank[:, d]
            pos = torch.cumsum(sel.to(torch.int64), dim=0) - 1 - before[d][chan]
            head[:, d] = torch.where(sel, pos, torch.full_like(pos, -1)).to(torch.int32)
        return head

    def _cached_dispatch(self, call: DispatchCall) -> DispatchResult:
        import torch
        handle = call.handle
        assert handle is not None
        r_n, dev = self.num_ranks, self.device
        what, _, active = self._exchange_tags(tags.KIND_CACHED, tags.signature(
            call.x.shape[1], handle.num_channels, call.x_scales is not None, handle.tag & 0xFFFFFFFF, handle.tag >> 32))
        in_rank = handle.is_token_in_rank & active.to(dev).view(1, -1)
        send_counts = [int(v) for v in in_rank.sum(dim=0)]
        per_source = self._rows_per_source(handle.rank_prefix_matrix)
        tokens = torch.cat([in_rank[:, d].nonzero().reshape(-1) for d in range(r_n)])
        send = self._payload(call, tokens, with_topk=False)
        recv, got = self._rows(send, send_counts, [n if active[s] else 0 for s, n in enumerate(per_source)], active,
                               call.timeout_us, f"{what} (data all-to-all)", "data")
        # Every source's rows at the handle's places; a source left out leaves zero rows (and src -1).
        full = torch.zeros((sum(per_source), send.shape[1]), dtype=torch.uint8, device=dev)
        full[:, :8] = row_bytes(torch.full((full.shape[0], 1), -1, dtype=torch.int64, device=dev))
        at = 0
        for s_, (n, g) in enumerate(zip(per_source, got)):
            begin = sum(per_source[:s_])
            if g:
                full[begin:begin + n] = recv[at:at + g]
            at += g
        recv_x, scales, src, _, _ = self._unpack(call, full, handle.num_recv_rows, with_topk=False)
        dropped = (handle.is_token_in_rank & ~active.to(dev).view(1, -1)).sum(dim=0).to(torch.int32)
        return DispatchResult(recv_x=recv_x, recv_x_scales=scales, recv_topk_idx=None, recv_topk_weights=None,
                              num_recv_tokens_per_expert_list=None, rank_prefix_matrix=handle.rank_prefix_matrix,
                              channel_prefix_matrix=handle.channel_prefix_matrix,
                              recv_channel_prefix_matrix=handle.recv_channel_prefix_matrix, recv_src_idx=src,
                              send_head=handle.send_head, num_recv_tokens=sum(got), num_dropped_tokens=dropped)

    # ------------------------------------------------------------------ combine
    def combine(self, call: CombineCall) -> CombineResult:
        import torch
        handle, dev, r_n = call.handle, self.device, self.num_ranks
        n, h = handle.num_tokens, call.x.shape[1]
        k = call.topk_weights.shape[1] if call.topk_weights is not None else 0
        what, _, active = self._exchange_tags(tags.KIND_COMBINE, tags.signature(
            h, handle.num_channels, k, handle.tag & 0xFFFFFFFF, handle.tag >> 32))
        # Received row j of source s goes back to s with its source index; rows past the real count
        # (num_worst_tokens padding) are not sent, nor the rows of a source that is inactive now.
        per_source = self._rows_per_source(handle.rank_prefix_matrix)
        keep = torch.cat([torch.full((c,), bool(active[s_]), dtype=torch.bool, device=dev)
                          for s_, c in enumerate(per_source)])
        real = sum(per_source)
        parts = [row_bytes(handle.recv_src_idx[:real].to(torch.int64).reshape(-1, 1)), row_bytes(call.x[:real])]
        if call.topk_weights is not None:
            parts.append(row_bytes(call.topk_weights[:real]))
        send = torch.cat(parts, dim=1)[keep]
        send_counts = [c if active[s_] else 0 for s_, c in enumerate(per_source)]
        expected = [int(v) for v in handle.is_token_in_rank.sum(dim=0)]
        recv, recv_counts = self._rows(send, send_counts, [c if active[d] else 0 for d, c in enumerate(expected)],
                                       active, call.timeout_us, f"{what} (data all-to-all)", "data")
        src = columns(recv, 0, 8, torch.int64).reshape(-1)
        if src.numel() and (int(src.min()) < 0 or int(src.max()) >= n):
            raise NormalCallMismatch(what, self.rank, -1, self.calls, None,
                                     f"a returned row names token {int(src.min())}..{int(src.max())} of {n}")
        xs = columns(recv, 8, 2 * h, torch.bfloat16).float()
        ws = columns(recv, 8 + 2 * h, 4 * k, torch.float32) if k else None
        # fp32, in the contract's order: 0, + bias_0, + bias_1, then the ranks ascending (a token
        # comes back at most once from each rank, so each step is one rounding per element). A rank
        # that is inactive contributes nothing: combine sums what remains.
        acc = torch.zeros((n, h), dtype=torch.float32, device=dev)
        for b in call.bias:
            if b is not None:
                acc = acc + b.float()
        acc_w = torch.zeros((n, k), dtype=torch.float32, device=dev) if k else None
        starts = [sum(recv_counts[:d]) for d in range(r_n)]
        groups = combine_order(r_n, self.nodes.ranks_per_node)
        for ranks in groups:
            # One partial per group (contract.combine_order): on one node the group is every rank and
            # the rows go straight into acc; per node they go into a partial that is rounded to BF16
            # (the forwarder's RDMA row) before it is added.
            alone = len(groups) == 1
            part = acc if alone else torch.zeros((n, h), dtype=torch.float32, device=dev)
            part_w = acc_w if alone or acc_w is None else torch.zeros((n, k), dtype=torch.float32, device=dev)
            touched = torch.zeros(n, dtype=torch.bool, device=dev)
            for d in ranks:
                sl = slice(starts[d], starts[d] + recv_counts[d])
                part[src[sl]] = part[src[sl]] + xs[sl]
                if part_w is not None and ws is not None:
                    part_w[src[sl]] = part_w[src[sl]] + ws[sl]
                touched[src[sl]] = True
            if not alone:
                acc[touched] = acc[touched] + part[touched].to(torch.bfloat16).float()
                if acc_w is not None and part_w is not None:
                    acc_w[touched] = acc_w[touched] + part_w[touched]
        dropped = torch.tensor([c if not active[d] else 0 for d, c in enumerate(expected)], dtype=torch.int32,
                               device=dev)
        return CombineResult(combined_x=acc.to(torch.bfloat16), combined_topk_weights=acc_w,
                             num_dropped_tokens=dropped)

    # ------------------------------------------------------------------ the rest
    def check_errors(self) -> None:
        """The reference raises at the call that sees a bad value; only a broken buffer is left over."""
        if self._broken is not None:
            raise BufferBroken(self._broken)

    def pending_error(self) -> Optional[Exception]:
        self.check_errors()
        return None

    def check_call(self, call: object) -> None:
        """The reference runs any shape the front accepts."""

    def fit_config(self, config: Any) -> Any:
        """No rings: every config fits."""
        return config

    def buffer_bytes(self) -> int:
        return 0

    # ------------------------------------------------------------------ membership (store-based buffers)
    # The reference backend has no links: a rejoin rebuilds nothing; the mailbox keys carry each
    # source's generation, so a dead process's mail is never read as its successor's.
    def member_payload(self) -> bytes:
        return b""

    def prepare_peer(self, rank: int, payload: bytes) -> bytes:
        if self._mail is not None:
            self._mail.forget(rank)
        return b""

    def prepare_done(self, rank: int) -> bool:
        return True

    def next_half(self, next_call: int, at: int) -> int:
        return 0                          # no buffer halves

    def set_generations(self, generations: List[int]) -> None:
        if self._mail is not None:
            self._mail.generations = generations   # the membership's list, shared (admissions update it)

    def activate_peer(self, rank: int, active: Optional["torch.Tensor"]) -> None:
        self.mask[rank] = 1
        if active is not None and active is not self.mask:
            active[rank] = 1

    def join(self, blobs: Dict[int, bytes], half: int) -> None:
        return None

    def inactive_ranks(self) -> List[int]:
        return [r for r, on in enumerate(self.mask.tolist()) if not on]

    def step_state(self) -> Tuple[int, int]:
        """(generation, calls): what a restarted rank takes from the survivors at its first step."""
        return self.epoch, self.calls

    def take_step_state(self, epoch: int, calls: int) -> None:
        self.epoch, self.calls = epoch, calls
        self.open_grace()

    def destroy(self) -> None:
        pass
