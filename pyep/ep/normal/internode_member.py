"""The native internode backend's mask and its side of elastic membership (docs/elastic.md, "Normal mode";
pyep.ep.elastic.membership drives it). Mixed into NormalInternodeBackend.

The mask runs on a data path of one rank per node: a rank is then its column's only member on its node,
so leaving it out leaves out its own tokens only. With more ranks per node, rank (n, l) is the one RDMA
relay between column l of the other nodes and node n, and leaving it out would cut the rows of its
column's live ranks into node n and their partials back. So an elastic buffer (a store-based one, or one
given active_ranks=) on nodes of several ranks runs its data path rank to rank -- every rank a node of
the relay of its own, each token once per destination rank, no NVLink forwarding -- while its contract
keeps the caller's nodes (num_tokens_per_rdma_rank; combine sums one BF16 partial per node of them:
inter_reduce groups the ranks' rows by node). Keeping the forwarding needs the dead rank's column
adopted by a live rank of its node (docs/elastic.md, "Across nodes").

A store-based buffer (elastic: one rank per node on the data path, the relay is the whole job) takes a
restarted rank back by rebuilding only the QPs to it, restarting this rank's counters of the streams
shared with it and setting the count slots it holds for it as a peer in step shows them
(internode_relay.py); the newcomer takes the survivors' call number and generation. Its node stage has
no peer (one rank), so nothing else changes.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from .errors import ElasticUnsupported

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pyep.ep.normal.internode")


class InternodeMembership:
    """Needs: nodes, rank, num_ranks, device, name, timeout_us, relay, node, _static."""

    _mask: Optional["torch.Tensor"] = None   # set_mask: the buffer's active_ranks (None: no mask)
    _grace_left: int = 0
    _graced: bool = False

    # ------------------------------------------------------------------ the mask
    @property
    def takes_mask(self) -> bool:
        """One rank per node on the data path (module doc)."""
        return self.nodes.ranks_per_node == 1

    def set_mask(self, mask: "torch.Tensor") -> None:
        """The buffer's active_ranks (int32 [R] on this device), read on the device by every call: the
        kernels before the column's count exchange take it as the call's snapshot (a rank out of it gets
        nothing, its tokens count as dropped), the relay leaves out the column peers out of it and marks
        one that stays silent past the timeout or whose QP fails (normal_internode_relay.cu); the call
        goes on among the others."""
        from .native_state import check_device_mask
        if not self.takes_mask:
            raise ElasticUnsupported(f"an active_ranks mask on a buffer forwarding over {self.nodes.num_nodes} nodes of "
                                     f"{self.nodes.ranks_per_node} ranks (a dead rank would cut its column's relay "
                                     f"into its node): pass active_ranks= at construction, the buffer then runs "
                                     f"rank to rank", self.name)
        check_device_mask(mask, self.num_ranks, self.device)
        self._mask = mask
        self._static.active = mask.data_ptr()
        self.relay.static.active = mask.data_ptr()

    def take_back(self, ranks: List[int]) -> None:
        """Between calls, on every rank alike: these entries of the mask went back to 1 (the DeepEP shim's
        unmask; the ranks stayed alive). Every call ran the column's count exchange on every rank, masked
        or not, so the call numbers agree; what a masked stretch left behind is this rank's counters of
        the streams shared with them (a rank marked in the middle of a relay) and the count slots they
        last wrote here, several calls old. Both are set as for a restarted rank, on both sides: a rank
        that takes itself back (its own entry was 0) does it with every column peer."""
        if not self.takes_mask:
            raise ElasticUnsupported(f"taking ranks {ranks} back into an internode buffer on nodes of "
                                     f"{self.nodes.ranks_per_node} ranks", self.name)
        me = self.nodes.node(self.rank)
        peers = range(self.nodes.num_nodes) if self.rank in ranks else sorted({self.nodes.node(r) for r in ranks})
        for m in peers:
            if m != me:
                self.relay.restart_peer(m)
                self.relay.counts_in_step(m)

    def _dropped(self) -> Optional["torch.Tensor"]:
        import torch
        return torch.zeros(self.num_ranks, dtype=torch.int32, device=self.device) if self._mask is not None else None

    def _column_mask(self) -> int:
        """The relay's call-mask word (bit m: node m's column peer in the call), 0 without a mask."""
        return self.relay.mask_word_address if self._mask is not None else 0

    def inactive_ranks(self) -> List[int]:
        return [] if self._mask is None else [r for r, on in enumerate(self._mask.tolist()) if not on]

    # ------------------------------------------------------------------ newcomer
    def member_payload(self) -> bytes:
        return self.relay.member_payload()

    def join(self, blobs: Dict[int, bytes], half: int) -> None:
        """Admitted: QPs to every survivor with what it published for us."""
        self.relay.finish_join(blobs)

    def next_half(self, next_call: int, at: int) -> int:
        return 0                      # the count slots are by call parity, on the device: no halves

    def step_state(self) -> "tuple[int, int]":
        """(generation, the device's call number of the column's count exchange)."""
        return self.relay.step_state()

    def take_step_state(self, epoch: int, calls: int) -> None:
        self.relay.take_step_state(epoch, calls)
        self.open_grace()

    # ------------------------------------------------------------------ survivor
    def prepare_peer(self, rank: int, payload: bytes) -> bytes:
        """Rebuild the QPs to restarted `rank` (still out of the calls) and restart the counters of the
        streams shared with it. Returns our connect data for it."""
        return self.relay.rebuild_peer(self.nodes.node(rank), payload)

    def prepare_done(self, rank: int) -> bool:
        return True

    def activate_peer(self, rank: int, active: Optional["torch.Tensor"]) -> None:
        """At the agreed step, between calls: its count slots in step, then its mask entry."""
        import torch
        self.relay.counts_in_step(self.nodes.node(rank))
        if self._mask is not None:
            self._mask[rank] = 1
        if active is not None and active is not self._mask:
            active[rank] = 1
        torch.cuda.synchronize(self.device)
        log.debug("rank %d: rank %d's QPs rebuilt and its relay streams restarted", self.rank, rank)

    def peer_words(self, peer: int) -> Dict[str, Any]:
        return self.relay.peer_words(self.nodes.node(peer))

    # ------------------------------------------------------------------ the grace window
    def open_grace(self) -> None:
        from ..elastic.membership import REJOIN_GRACE_CALLS
        self._grace_left = 2 * REJOIN_GRACE_CALLS        # calls: a dispatch and a combine per step

    def _call_timeout(self) -> None:
        """Before a call's launches: the relay's timeout of this call (native_member.py says why the
        first calls after a set-up or an admission wait longer)."""
        from ..elastic.membership import REJOIN_CALL_TIMEOUT_US
        if self._grace_left > 0:
            self._grace_left -= 1
            self._graced = True
            self.relay.static.timeout_ns = max(int(self.timeout_us), REJOIN_CALL_TIMEOUT_US) * 1000
        elif self._graced:        # the window closed: the buffer's own timeout again
            self._graced = False
            self.relay.static.timeout_ns = int(self.timeout_us) * 1000
