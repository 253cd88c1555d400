"""The native backend's side of elastic membership (pyep.ep.elastic.membership drives it; docs/elastic.md is
the protocol). Only the links to the restarted rank change: its row of the kernels' peer tables
(NVLink address, NIC address, rkey, QP contexts, flag count) is rewritten in place, so the tables'
addresses -- which LLStatic, the C++ fast path and captured CUDA graphs hold -- stay valid, and every
other row, QP and counter is untouched.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

from .layout import ws_csent_index

if TYPE_CHECKING:
    import torch


class NativeMembership:
    """Mixed into NativeBackend (which provides _peers, _tables, _active, _half, layout, ...)."""

    _join_payload: bytes = b""

    # ------------------------------------------------------------------ newcomer
    def _prepare_join(self) -> None:
        """Constructor of a restarted rank: local resources and the announcement; no collective."""
        self._join_payload = self._peers.prepare_join()
        self._static = None
        self._fast = None

    def member_payload(self) -> bytes:
        return self._join_payload

    def join(self, blobs: Dict[int, bytes], half: int) -> None:
        import torch
        self._peers.finish_join(blobs)
        self._static = self._build_static()
        self._fast = self._make_fast()
        self._half = half            # the survivors' half at call #A (their parity, not ours)
        self._active.fill_(1)
        torch.cuda.synchronize(self.device)

    def next_half(self, next_call: int, at: int) -> int:
        return int(self._half) ^ ((at - next_call) & 1)

    # ------------------------------------------------------------------ survivor
    def prepare_peer(self, rank: int, payload: bytes) -> bytes:
        """Rebuild the link to a restarted rank (still inactive here) and clear what its dead process
        may have left in our signal words. Returns our connect data for it."""
        import torch
        # A kernel launched before the rank was marked may still use the old link (its QPs, its IPC
        # mapping): wait for them before anything of the old link goes. Bounded by the kernels' timeouts.
        torch.cuda.synchronize(self.device)
        blob = self._peers.rebuild_peer(rank, payload)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        lay = self.layout
        for h in (0, 1):
            # Only the dead process wrote these words (dispatch counts from it, its combine flag).
            for le in range(lay.num_local_experts):
                self._ep.memset_async(self._buf + lay.dsig_offset(h, le, rank), 0, 4, stream)
            self._ep.memset_async(self._buf + lay.csig_offset(h, rank), 0, 4, stream)
            # Combine acknowledgements: its count of our combines it reduced, and ours of those we sent
            # it, restart together (ll_ack.cuh), or our next repeated combine would wait for acks of
            # combines the dead process never reduced.
            self._ep.memset_async(self._buf + lay.cack_offset(h, rank), 0, 4, stream)
            self._ws[ws_csent_index(self.num_ranks, h, rank)] = 0
        torch.cuda.synchronize(self.device)
        return blob

    def prepare_done(self, rank: int) -> bool:
        return True                  # prepare_peer completes on the device before it returns

    def activate_peer(self, rank: int, active: Optional["torch.Tensor"]) -> None:
        import torch
        # Call #A-1 must be complete here: the newcomer writes call #A into our buffer half as soon as
        # it starts, and #A-2 (same half) clears that half's signals when it ends.
        torch.cuda.synchronize(self.device)
        self._write_link_row(rank)
        self._active[rank] = 1
        if active is not None:
            active[rank] = 1
        torch.cuda.synchronize(self.device)

    def _write_link_row(self, rank: int) -> None:
        import numpy as np
        import torch
        link, t = self._peers.links[rank], self._tables
        t["peer_base"][rank] = int(link.store_base)
        t["remote_addr"][rank] = int(link.remote_addr)
        t["rkeys"][rank] = int(np.array([link.rkey], dtype=np.uint32).view(np.int32)[0])
        t["flag_expect"][rank] = int(link.flag_expect)
        if link.qp_contexts:
            nqp = self._peers.qps_per_peer()
            size = len(link.qp_contexts[0])
            for j, ctx in enumerate(link.qp_contexts):
                at = (rank * nqp + j) * size
                t["qps"][at:at + size].copy_(torch.frombuffer(bytearray(ctx), dtype=torch.uint8))

    def inactive_ranks(self) -> List[int]:
        return [r for r, on in enumerate(self.active_marks()) if not on]

    def active_marks(self) -> List[int]:
        """The backend's own active_ranks on the host, once the device has finished every call launched so
        far (a diagnostic, never on the hot path). The wait is a device synchronisation, not the copy's:
        a copy into pageable memory that has to wait for a call still spinning on its peers waits inside
        the CUDA driver, and over the softnic those peers may need this process's softnic thread to issue
        that call's RDMA writes (cudaMemcpyAsync) through the same driver -- the stall lazy module loading
        caused (docs/elastic.md, "Warm up before the first call"). Suspected in a GPU run (emulated, two
        ranks on one GPU): the rank that refused a combine read its marks right after the abort launch,
        its dispatch's writes not yet issued, and both ranks timed out on each other."""
        import torch
        torch.cuda.synchronize(self.device)
        return [int(v) for v in self._active.tolist()]

    def link_state(self) -> Dict[int, Any]:
        """Per peer: the QP numbers and the softnic's per-QP counters (wqes executed), for tests that
        check a rejoin leaves the other peers' links alone."""
        return self._peers.link_state()
