"""The native normal backend's links and its side of elastic membership (pyep.ep.elastic.membership drives
it; docs/elastic.md, "Normal mode"). A store-based native NormalBuffer takes a restarted rank back by
rebuilding only the link to it -- a new IPC mapping of its new buffer, written into its entry of the
kernels' peer table -- and restarting the counters of the streams this rank shares with it, at the call
the survivors agreed on; every other link, counter and ring is untouched.

Why the counters restart: every stream (channel c, source -> receiver) keeps absolute row counts on both
sides (layout.py: tail and rx_pos at the receiver, head and tx_pos at the sender). The restarted process
starts with a zeroed buffer, so for the streams to and from it this rank's words go back to 0 as well.
The gate flags this rank holds for it are set to what a peer in step shows before the next call
(normal_tags.h gate_classify: the two calls before it), and the newcomer takes the survivors' call
number and generation (step_state / take_step_state), so the first call they make together pairs.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ..devmem import DeviceArray
from . import layout
from .limits import MAX_CHANNELS

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pyep.ep.normal.native")

_WS_SEQ, _WS_EPOCH = 1, 2   # normal_tags.h kWsSeq, kWsEpoch


def _s32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v & 0x80000000 else v


def next_call(prev: int) -> int:
    """normal_tags.h next_call: +1, skipping 0 at the 2^32 wrap (0xffffffff -> 2)."""
    s = (prev + 1) & 0xFFFFFFFF
    return 2 if s == 0 else s


def flags_in_step(seq: int) -> Dict[int, int]:
    """{parity: value} of a peer's two gate flags, as a peer in step shows them to a rank whose last call
    was `seq` (0: none yet): the peer's two calls before the next one (normal_tags.h call_is_back)."""
    if seq == 0:
        return {0: 0, 1: 0}
    nxt = next_call(seq)
    return {nxt & 1: (seq - 1) & 0xFFFFFFFF, (nxt & 1) ^ 1: seq}


class NativeNormalMembership:
    """Mixed into NormalNativeBackend (which provides _ep, _buf, _bytes, _ws, _mask, _epoch, _extra, rank,
    num_ranks, device, _setup_timeout_s, _tma_setting, _make_static; sets _tma_dispatch, _tma_combine)."""

    _join_payload: bytes = b""
    _control: Any = None
    _sync_fast: Any   # native_fast.NativeFastPath

    # ------------------------------------------------------------------ links
    def _setup_links(self, group: Any, control: Any, joining: bool) -> None:
        """Map every peer's buffer (a group's or a store's set-up exchange); a restarted rank only
        announces itself here and maps its peers in join()."""
        import torch

        from ..config import LinkConfig
        from ..peers import PeerSet
        self._control = control
        # Every rank of this buffer is on one node (an internode buffer's node stage too, whatever
        # $PYEP_VIRTUAL_NODE_SIZE says about the job's nodes).
        cfg = LinkConfig(transport="nvlink" if self.num_ranks > 1 else "auto", ranks_per_node=self.num_ranks)
        self._peers = PeerSet(control if control is not None else group, cfg, self._ep, self.rank, self.num_ranks,
                              self.device.index, self._buf, self._bytes, self._setup_timeout_s)
        if control is not None:
            self.open_grace()         # a store-based buffer's first calls (a restarted rank's too)
        if joining:
            self._join_payload = self._peers.prepare_join()
            self._settle_pool([i.buffer_bytes for i in self._peers.infos])
            self._settle_bulk_copies()
            self._peer_base = torch.zeros(self.num_ranks, dtype=torch.int64, device=self.device)
            self._static = self._make_static()
            return
        self._peers.connect()
        self._check_links()
        self._settle_pool([i.buffer_bytes for i in self._peers.infos])
        self._settle_bulk_copies()
        self._peer_base = torch.tensor([link.store_base for link in self._peers.links], dtype=torch.int64,
                                       device=self.device)
        self._static = self._make_static()
        self._barrier("normal-mode buffer setup (every rank mapped its peers)")

    def _settle_bulk_copies(self) -> None:
        """The kernels' bulk-copy flags (native_state.bulk_copy_flags): whether every peer's buffer is on
        this rank's GPU (same host and PCI bus id in the peers' descriptions)."""
        from .native_state import bulk_copy_flags
        me = self._peers.infos[self.rank]
        share = all((i.host, i.pci_bus_id.lower()) == (me.host, me.pci_bus_id.lower()) for i in self._peers.infos)
        self._tma_dispatch, self._tma_combine = bulk_copy_flags(self._tma_setting, share)

    def _check_links(self) -> None:
        kinds = {link.kind for link in self._peers.links}
        if not kinds <= {"local", "nvlink"}:
            raise ValueError(f"the normal mode needs every rank on NVLink; the plan uses {sorted(kinds)}")

    def _barrier(self, what: str) -> None:
        if self._control is not None:
            self._control.barrier(self._setup_timeout_s, what)
            return
        from .._dist import barrier_bounded, group_device
        barrier_bounded(self.group, group_device(self.group), int(self._setup_timeout_s * 1e6), what)

    def _words(self) -> "torch.Tensor":
        import torch
        n = layout.control_words(self.num_ranks, self._extra)["end"]
        return torch.as_tensor(DeviceArray(self._buf, n, "<i4"), dtype=torch.int32, device=self.device)

    def _restart_streams(self, rank: int) -> None:
        """This rank's words of the streams it shares with `rank` (both directions, every channel) back
        to 0: the restarted process counts from 0."""
        w, off, r_n = self._words(), layout.control_words(self.num_ranks, self._extra), self.num_ranks
        for name in ("tail", "head", "tx_pos", "rx_pos"):
            w[off[name] + rank:off[name] + MAX_CHANNELS * r_n:r_n] = 0
        # Its pull combine words too (normal_pull.cuh): call numbers of the old process.
        w[off["pulled"] + rank:off["pulled"] + 2 * MAX_CHANNELS * r_n:r_n] = 0

    def _flags_in_step(self, src: int, seq: int) -> None:
        """The gate flags this rank holds for source `src`, as a peer in step at call `seq` shows them."""
        w, off = self._words(), layout.control_words(self.num_ranks, self._extra)["notify_flag"]
        for parity, value in flags_in_step(seq).items():
            w[off + parity * self.num_ranks + src] = _s32(value)

    def peer_words(self, peer: int, channels: int = 4) -> Dict[str, List[int]]:
        """This rank's control words of the streams shared with `peer` (the first `channels` channels)
        and the two gate flags it holds for it, plus the workspace: what a failure report shows."""
        import torch
        torch.cuda.synchronize(self.device)
        w, off, r_n = self._words().cpu().tolist(), layout.control_words(self.num_ranks, self._extra), self.num_ranks
        out = {k: [w[off[k] + c * r_n + peer] for c in range(channels)] for k in ("tail", "head", "tx_pos", "rx_pos")}
        out["flags"] = [w[off["notify_flag"] + par * r_n + peer] for par in (0, 1)]
        out["workspace"] = self._ws.cpu().tolist()
        return out

    def _device_seq(self) -> int:
        return int(self._ws[_WS_SEQ].item()) & 0xFFFFFFFF

    # ------------------------------------------------------------------ newcomer
    def member_payload(self) -> bytes:
        return self._join_payload

    def join(self, blobs: Dict[int, bytes], half: int) -> None:
        """Admitted: map every survivor's buffer with what it published for us."""
        import torch
        self._peers.finish_join(blobs)
        self._check_links()
        self._peer_base.copy_(torch.tensor([link.store_base for link in self._peers.links], dtype=torch.int64,
                                             device="cpu"))
        torch.cuda.synchronize(self.device)

    def next_half(self, next_call: int, at: int) -> int:
        return 0                      # one notify slot pair per call parity, on the device: no halves

    def step_state(self) -> "tuple[int, int]":
        """(generation, the device's call number): what a restarted rank takes at its first step."""
        import torch
        torch.cuda.synchronize(self.device)
        return int(self._epoch), self._device_seq()

    def take_step_state(self, epoch: int, calls: int) -> None:
        import torch
        self._epoch = int(epoch)
        self._ws[_WS_EPOCH] = _s32(epoch)
        self._ws[_WS_SEQ] = _s32(calls)
        for src in range(self.num_ranks):
            if src != self.rank:
                self._flags_in_step(src, calls)
        torch.cuda.synchronize(self.device)
        self.open_grace()

    # ------------------------------------------------------------------ the grace window
    # A store-based buffer's first calls and those after an admission wait at least
    # REJOIN_CALL_TIMEOUT_US (docs/elastic.md, "The grace window"): a restarted process's first calls run
    # cold code (module loading, first allocations), and a survivor that marked it would be marked back.
    _grace_left: int = 0

    def open_grace(self) -> None:
        from ..elastic.membership import REJOIN_GRACE_CALLS
        self._grace_left = 2 * REJOIN_GRACE_CALLS        # calls: a dispatch and a combine per step
        self._sync_fast()

    def _call_timeout(self) -> None:
        """Before a call's launches: the kernels' timeout of this call (a field of the static they take)."""
        from ..elastic.membership import REJOIN_CALL_TIMEOUT_US
        us = int(self.timeout_us)
        if self._grace_left > 0:
            self._grace_left -= 1
            us = max(us, REJOIN_CALL_TIMEOUT_US)
        self._static.timeout_ns = us * 1000
        self._sync_fast()

    # ------------------------------------------------------------------ survivor
    def prepare_peer(self, rank: int, payload: bytes) -> bytes:
        """Rebuild the link to restarted `rank` (still out of the calls here) and restart the counters of
        the streams shared with it. Returns our connect data for it."""
        import torch
        # A kernel launched before the rank was marked may still use the old mapping: wait for it first
        # (bounded by the kernels' timeouts).
        torch.cuda.synchronize(self.device)
        blob = self._peers.rebuild_peer(rank, payload)
        self._peer_base[rank] = int(self._peers.links[rank].store_base)
        self._restart_streams(rank)
        torch.cuda.synchronize(self.device)
        return blob

    def prepare_done(self, rank: int) -> bool:
        return True                   # prepare_peer completes on the device before it returns

    def activate_peer(self, rank: int, active: Optional["torch.Tensor"]) -> None:
        """At the agreed step, between calls: the rank's gate flags as a peer in step shows them, then
        its mask entry. The survivors' previous calls are complete (a synchronisation), so nothing of
        the dead process's streams is in flight."""
        import torch
        torch.cuda.synchronize(self.device)
        self._flags_in_step(rank, self._device_seq())
        if self._mask is not None:
            self._mask[rank] = 1
        if active is not None and active is not self._mask:
            active[rank] = 1
        torch.cuda.synchronize(self.device)
        log.debug("rank %d: rank %d's link rebuilt and its streams restarted", self.rank, rank)

    # ------------------------------------------------------------------ a live rank taken back (group)
    def take_back(self, ranks: List[int]) -> None:
        """Between calls, on every rank alike: these entries of the mask went back to 1 (the DeepEP
        shim's unmask; the ranks stayed alive, no process restarted). Every call advanced every rank's
        call number, masked or not, so the numbers agree; what a masked stretch left behind is this
        rank's words of the streams shared with them (a rank marked in the middle of a stream) and the
        gate flags they last wrote here, several calls old, which the gate would read as another call.
        Both are set as for a restarted rank, on both sides: a rank that takes itself back (its own
        entry was 0) does it with every peer."""
        import torch
        torch.cuda.synchronize(self.device)
        peers = range(self.num_ranks) if self.rank in ranks else ranks
        seq = self._device_seq()
        for p in peers:
            if p != self.rank:
                self._restart_streams(p)
                self._flags_in_step(p, seq)
        torch.cuda.synchronize(self.device)

    def inactive_ranks(self) -> List[int]:
        if self._mask is None:
            return []
        return [r for r, on in enumerate(self._mask.tolist()) if not on]
