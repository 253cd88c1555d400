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
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from .._dist import group_device
from .._dist import all_to_all_bounded as all_to_all
from ..config import DEFAULT_TIMEOUT_US
from . import tags
from .contract import (CombineCall, CombineResult, DispatchCall, DispatchResult, LayoutResult,
                       combine_order)
from .errors import (BufferBroken, NormalCallMismatch, WorstTokensExceeded, node_count_mismatch,
                     rank_count_mismatch)
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


class NormalReferenceBackend:
    name = "reference"

    def __init__(self, group: "dist.ProcessGroup", *, timeout_us: int = DEFAULT_TIMEOUT_US,
                 nodes: Optional[NodeLayout] = None) -> None:
        import torch.distributed as dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.nodes = nodes if nodes is not None else NodeLayout(self.num_ranks, self.num_ranks)
        self.device = group_device(group)
        self.timeout_us = timeout_us
        self.epoch = 0                         # generation: clean() calls so far
        self.calls = 0                         # exchanging calls of this generation
        self._broken: Optional[str] = None     # why, after a NormalCallMismatch (until clean())

    @staticmethod
    def unavailable_reason(*args: object, **kwargs: object) -> Optional[str]:
        return None

    # ------------------------------------------------------------------ helpers
    def _all_to_all_rows(self, send: "torch.Tensor", send_counts: List[int], recv_counts: List[int],
                         timeout_us: int, what: str) -> "torch.Tensor":
        """uint8 rows of `send` grouped by destination go to their ranks; returns the received rows
        grouped by source rank ascending."""
        import torch
        recv = torch.empty((sum(recv_counts), send.shape[1]), dtype=torch.uint8, device=self.device)
        all_to_all(recv, send, recv_counts, send_counts, self.group, timeout_us, what)
        return recv

    def _exchange_records(self, mine: "torch.Tensor", timeout_us: int, what: str) -> "torch.Tensor":
        """Every rank sends the same int64 [W] record to every rank; returns [R, W] (row s: source s)."""
        import torch
        send = mine.reshape(1, -1).expand(self.num_ranks, -1).contiguous()
        recv = torch.empty_like(send)
        all_to_all(recv, send, None, None, self.group, timeout_us, what)
        return recv

    def _exchange_tags(self, kind: int, sig: Tuple[int, ...], *, status: int = tags.STATUS_OK, reason: str = "",
                       extra: Optional[List[int]] = None) -> Tuple[str, "torch.Tensor"]:
        """The call's tag exchange (the first collective of every call): returns the call's name and every
        rank's `extra` words [R, len(extra)]. Raises NormalCallMismatch (and breaks the buffer) when some
        rank is at another call, PeerRefusedCall when a peer refused this call (unless this rank refuses
        it too: its own error is raised by the front)."""
        if self._broken is not None:
            raise BufferBroken(self._broken)
        self.calls += 1
        what = f"normal {tags.KIND_NAMES[kind]} #{self.calls}"
        mine = tags.CallTag(self.epoch, self.calls, kind, status, sig, self.rank, reason)
        table = self._tag_table(mine, extra or [], f"{what} (call tags)")
        try:
            peers = [tags.decode(table[r].tolist(), what, self.rank, r, self.calls, self.num_ranks)
                     for r in range(self.num_ranks)]
            err = tags.verdict(what, self.rank, mine, peers)
            if isinstance(err, NormalCallMismatch):
                raise err
        except NormalCallMismatch as exc:
            self._broken = f"{exc}; call clean() on every rank"
            raise
        if err is not None and status == tags.STATUS_OK:
            raise err
        return what, table[:, tags.TAG_INTS:]

    def _tag_table(self, mine: tags.CallTag, extra: List[int], what: str) -> "torch.Tensor":
        """Every rank's [tag | extra] as int64 [R, TAG_INTS + ERR_WORDS]: one width for every call, so
        that ranks at different calls still exchange whole tags (and find out) instead of mismatching
        the collective's sizes."""
        import torch
        words = tags.encode(mine) + extra + [0] * (ERR_WORDS - len(extra))
        return self._exchange_records(torch.tensor(words, dtype=torch.int64, device=self.device), self.timeout_us,
                                      what)

    def refuse(self, kind: int, reason: str) -> Optional[Exception]:
        try:
            self._exchange_tags(kind, (), status=tags.STATUS_REFUSED, reason=reason)
        except (NormalCallMismatch, BufferBroken) as exc:
            return exc
        except TimeoutError as exc:
            # The peers did not make this call at all: gloo's pending exchange pairs with nothing now.
            self._broken = f"a refused call's tag exchange found no peers ({exc}); call clean() on every rank"
            return exc
        return None

    def _rows_per_source(self, rank_prefix_matrix: "torch.Tensor") -> List[int]:
        col = [int(v) for v in rank_prefix_matrix[:, self.rank]]
        return [col[0]] + [col[s] - col[s - 1] for s in range(1, self.num_ranks)]

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: "torch.Tensor", num_experts: int) -> LayoutResult:
        import torch
        r_n, dev = self.num_ranks, self.device
        e_l = num_experts // r_n
        # The tag exchange carries every rank's bad-id record: every rank raises at this call or none does.
        _, bad = self._exchange_tags(tags.KIND_LAYOUT, tags.signature(num_experts),
                                     extra=first_bad_entry(topk_idx, num_experts))
        raise_first(bad, self.rank, num_experts, bad_ids=True)
        n = topk_idx.shape[0]
        valid = topk_idx >= 0
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        owner = torch.div(topk_idx, e_l, rounding_mode="floor")
        in_rank = torch.zeros((n, r_n), dtype=torch.bool, device=dev)
        for r in range(r_n):
            in_rank[:, r] = (valid & (owner == r)).any(dim=1)
        return LayoutResult(num_tokens_per_rank=in_rank.sum(dim=0).to(torch.int32),
                            num_tokens_per_expert=per_expert, is_token_in_rank=in_rank,
                            num_tokens_per_rdma_rank=self._per_node(in_rank))

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
        what, _ = self._exchange_tags(tags.KIND_DISPATCH, tags.signature(
            call.x.shape[1], c_n, call.num_experts, k, call.topk_weights is not None, call.x_scales is not None))
        in_rank = call.is_token_in_rank
        chan = token_channels(n, c_n, dev)
        per_chan = torch.zeros((r_n, c_n), dtype=torch.int64, device=dev)   # [d][c] my rows for d
        for d in range(r_n):
            per_chan[d] = torch.bincount(chan[in_rank[:, d]], minlength=c_n)
        err = first_bad_entry(call.topk_idx, call.num_experts) if call.topk_idx is not None else [0] * ERR_WORDS
        err += layout_contradiction(call.topk_idx, call.num_experts, r_n, in_rank, call.num_tokens_per_expert)
        # Header to d: [bad-id record | layout record | rows I send every rank | my num_tokens_per_rank |
        # my rows for d per channel | my top-k entries per expert of d]
        common = torch.cat([torch.tensor(err, dtype=torch.int64, device=dev), per_chan.sum(dim=1),
                            call.num_tokens_per_rank.to(torch.int64)])
        experts = call.num_tokens_per_expert.to(torch.int64).reshape(r_n, e_l)
        parts = [common.reshape(1, -1).expand(r_n, -1), per_chan, experts]
        if self.nodes.internode:
            # [my num_tokens_per_rdma_rank | what is_token_in_rank gives for it], for every destination
            assert call.num_tokens_per_rdma_rank is not None
            rdma = torch.cat([call.num_tokens_per_rdma_rank.to(torch.int64), self._per_node(in_rank).to(torch.int64)])
            parts.append(rdma.reshape(1, -1).expand(r_n, -1))
        header = torch.cat(parts, dim=1).contiguous()
        hdr = torch.empty_like(header)
        all_to_all(hdr, header, None, None, self.group, call.timeout_us, f"{what} (header all-to-all)")
        o_rows = 2 * ERR_WORDS
        o_claim, o_chan = o_rows + r_n, o_rows + 2 * r_n
        raise_first(hdr[:, :ERR_WORDS], me, call.num_experts, bad_ids=True)
        raise_first(hdr[:, ERR_WORDS:o_rows], me, call.num_experts, bad_ids=False)
        sent = hdr[:, o_rows:o_claim]          # [s][d]: rows source s sends d
        claimed = hdr[:, o_claim:o_chan]       # [s][d]: num_tokens_per_rank of source s
        if not torch.equal(sent, claimed):
            s, d = (int(v) for v in (sent != claimed).nonzero()[0])
            err = rank_count_mismatch(d, int(claimed[s, d]), int(sent[s, d]))
            err.add_note(f"in the tensors of rank {s} ({what}); every rank raises at this call")
            raise err
        if self.nodes.internode:
            self._check_rdma_claims(hdr[:, o_chan + c_n + e_l:], what)
        arrive = sent.sum(dim=0)               # [d]: rows rank d receives
        nwt = call.num_worst_tokens
        if nwt > 0 and bool((arrive > nwt).any()):
            d = me if int(arrive[me]) > nwt else int((arrive > nwt).nonzero()[0])
            err_w = WorstTokensExceeded(int(arrive[d]), nwt)
            err_w.add_note(f"on rank {d}; every rank raises at this call")
            raise err_w

        send_counts = [int(v) for v in sent[me]]
        recv_counts = [int(v) for v in sent[:, me]]
        tokens = torch.cat([in_rank[:, d].nonzero().reshape(-1) for d in range(r_n)])
        send = self._payload(call, tokens, with_topk=True)
        recv = self._all_to_all_rows(send, send_counts, recv_counts, call.timeout_us, f"{what} (data all-to-all)")
        m = recv.shape[0]
        rows = nwt if nwt > 0 else m
        recv_x, scales, src, idx_out, w_out = self._unpack(call, recv, rows, with_topk=True)

        rank_prefix = torch.cumsum(claimed, dim=0).to(torch.int32)
        channel_prefix = torch.cumsum(per_chan, dim=1).to(torch.int32)
        recv_chan = hdr[:, o_chan:o_chan + c_n]                       # [s][c] rows s sends me on c
        recv_channel_prefix = (torch.cumsum(recv_chan, dim=1) - recv_chan).to(torch.int32)
        send_head = self._send_head(in_rank, chan, per_chan)
        counts_list: List[int] = []
        if nwt == 0:
            align = call.expert_alignment
            per_local = hdr[:, o_chan + c_n:o_chan + c_n + e_l].sum(dim=0)
            counts_list = [(int(v) + align - 1) // align * align for v in per_local]
        return DispatchResult(recv_x=recv_x, recv_x_scales=scales, recv_topk_idx=idx_out,
                              recv_topk_weights=w_out, num_recv_tokens_per_expert_list=counts_list,
                              rank_prefix_matrix=rank_prefix, channel_prefix_matrix=channel_prefix,
                              recv_channel_prefix_matrix=recv_channel_prefix, recv_src_idx=src,
                              send_head=send_head, num_recv_tokens=m, tag=self._mark())

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
        r_n = self.num_ranks
        what, _ = self._exchange_tags(tags.KIND_CACHED, tags.signature(
            call.x.shape[1], handle.num_channels, call.x_scales is not None, handle.tag & 0xFFFFFFFF, handle.tag >> 32))
        in_rank = handle.is_token_in_rank
        send_counts = [int(v) for v in in_rank.sum(dim=0)]
        recv_counts = self._rows_per_source(handle.rank_prefix_matrix)
        tokens = torch.cat([in_rank[:, d].nonzero().reshape(-1) for d in range(r_n)])
        send = self._payload(call, tokens, with_topk=False)
        recv = self._all_to_all_rows(send, send_counts, recv_counts, call.timeout_us, f"{what} (data all-to-all)")
        m = recv.shape[0]
        recv_x, scales, src, _, _ = self._unpack(call, recv, handle.num_recv_rows, with_topk=False)
        return DispatchResult(recv_x=recv_x, recv_x_scales=scales, recv_topk_idx=None, recv_topk_weights=None,
                              num_recv_tokens_per_expert_list=None, rank_prefix_matrix=handle.rank_prefix_matrix,
                              channel_prefix_matrix=handle.channel_prefix_matrix,
                              recv_channel_prefix_matrix=handle.recv_channel_prefix_matrix, recv_src_idx=src,
                              send_head=handle.send_head, num_recv_tokens=m)

    # ------------------------------------------------------------------ combine
    def combine(self, call: CombineCall) -> CombineResult:
        import torch
        handle, dev, r_n = call.handle, self.device, self.num_ranks
        n, h = handle.num_tokens, call.x.shape[1]
        k = call.topk_weights.shape[1] if call.topk_weights is not None else 0
        what, _ = self._exchange_tags(tags.KIND_COMBINE, tags.signature(
            h, handle.num_channels, k, handle.tag & 0xFFFFFFFF, handle.tag >> 32))
        # Received row j of source s goes back to s with its source index; rows past the real count
        # (num_worst_tokens padding) are not sent.
        send_counts = self._rows_per_source(handle.rank_prefix_matrix)
        real = sum(send_counts)
        parts = [row_bytes(handle.recv_src_idx[:real].to(torch.int64).reshape(-1, 1)),
                 row_bytes(call.x[:real])]
        if call.topk_weights is not None:
            parts.append(row_bytes(call.topk_weights[:real]))
        send = torch.cat(parts, dim=1)
        recv_counts = [int(v) for v in handle.is_token_in_rank.sum(dim=0)]
        recv = self._all_to_all_rows(send, send_counts, recv_counts, call.timeout_us, f"{what} (data all-to-all)")
        src = columns(recv, 0, 8, torch.int64).reshape(-1)
        xs = columns(recv, 8, 2 * h, torch.bfloat16).float()
        ws = columns(recv, 8 + 2 * h, 4 * k, torch.float32) if k else None
        # fp32, in the contract's order: 0, + bias_0, + bias_1, then the ranks ascending (a token
        # comes back at most once from each rank, so each step is one rounding per element).
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
        return CombineResult(combined_x=acc.to(torch.bfloat16), combined_topk_weights=acc_w)

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

    def clean(self) -> None:
        """Collective: every rank must be cleaning (the tags of this exchange compare kinds only: the
        ranks may have been at different calls, which is what clean() repairs), then every rank starts
        a new generation at call 1."""
        mine = tags.CallTag(self.epoch, 0, tags.KIND_CLEAN, origin=self.rank)
        table = self._tag_table(mine, [], "normal reference clean (call tags)")
        what = "normal clean"
        for r in range(self.num_ranks):
            peer = tags.decode(table[r].tolist(), what, self.rank, r, 0, self.num_ranks)
            if peer.kind != tags.KIND_CLEAN:
                raise NormalCallMismatch(what, self.rank, r, "clean", peer.describe(),
                                         "clean() is collective: every rank must call it")
        self.epoch += 1
        self.calls = 0
        self._broken = None

    def buffer_bytes(self) -> int:
        return 0

    def destroy(self) -> None:
        pass
