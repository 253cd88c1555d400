"""The RDMA stage of the normal mode across nodes: `Relay` drives engine/kernels/normal_internode_relay.cu
between the ranks of one column (the ranks with this rank's local index on every node) over our mlx5
QPs -- the softnic (transport "emulated" / "emulated-internode") or a real NIC ("ibgda" / "auto") --
set up by pyep.transport's PeerSet exactly as the LL mode's NIC peers. docs/normal_internode.md
explains the protocol; this module owns the relay buffer's layout:

    u32 tail[M] | u32 head[M] | u32 tx[M] | u32 rx[M] | u64 count[2][M] | u64 outbox[2][M] | u64 fetch
    (128-byte aligned) send rings [M] of ring_bytes | receive rings [M] of ring_bytes

One call moves, for every other node m, a dense run of rows to node m's column peer and receives the
run that peer sends here; counts() first tells each peer how many rows to expect (and the host, for
sizing). Counters are absolute and never reset except by clean(). Every counter and the count
exchange's call number live on the device and only kernels advance them (the call number is word
RELAY_SEQ_WORD of the workspace), so the launches are capturable in a CUDA graph and every replay is
a new call; the host only labels the calls it waits for (the ticket of the pinned count words).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ..config import LinkConfig
from ..streams import raw_current_stream
from . import tags
from .device_records import TAG_RECORD_INTS
from .errors import ERR_NONE, NormalModeError, PeerTimeout
from .events import wait_bound_s
from .topology import NodeLayout

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("pyep.ep.normal.relay")
RING_ALIGN = 128
PHASES = {3: "rdma counts", 4: "rdma dispatch", 5: "rdma combine"}
ERR_QP = 5
CLAIM_WORD = 4       # workspace word of the first-error-wins claim (normal_common.cuh record_error_words)


def _align(v: int, a: int) -> int:
    return (v + a - 1) // a * a


@dataclass(frozen=True)
class RelayLayout:
    num_nodes: int
    ring_bytes: int

    @property
    def words(self) -> dict:
        m = self.num_nodes
        off = {"tail": 0, "head": m, "tx": 2 * m, "rx": 3 * m, "count": 4 * m}
        off["outbox"] = off["count"] + 4 * m
        off["fetch"] = off["outbox"] + 4 * m
        off["end"] = off["fetch"] + 2
        return off

    @property
    def off_send(self) -> int:
        return _align(4 * self.words["end"], RING_ALIGN)

    @property
    def off_recv(self) -> int:
        return self.off_send + self.num_nodes * self.ring_bytes

    @property
    def total_bytes(self) -> int:
        return self.off_recv + self.num_nodes * self.ring_bytes


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (then no host synchronisation is allowed)."""
    import torch
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def next_ticket(prev: int) -> int:
    """The host's label of its next waited-for count exchange: 1, 2, ... 2^31 - 1, then 1 again (the
    kernel writes +-ticket into a pinned int32; 0 means not yet)."""
    return prev % 0x7FFFFFFF + 1


def nic_transport(transport: str) -> str:
    """The PeerSet transport of the column: every column peer is on another node."""
    return "emulated" if transport in ("emulated", "emulated-internode") else "ibgda"


def drain_after_launch(transport: str, module_loading: Optional[str]) -> bool:
    """Whether the host must wait for each relay kernel before it issues more CUDA work.

    On the softnic a relay kernel spins until the softnic's progress thread -- a host thread of this
    process -- has queued its cudaMemcpyAsync / atomic kernel. With CUDA's lazy module loading (the
    default; torch sets CUDA_MODULE_LOADING=LAZY when it is unset) the first launch of any kernel not
    yet loaded (ours, torch's, the caller's) loads it under the primary context's lock and waits there
    for the device to drain: the progress thread's next CUDA call blocks on that lock, the spinning
    relay kernel never sees its completion, and both wait until the relay's timeout ("quiet timeout",
    PeerTimeout). A real NIC needs no host thread, and with CUDA_MODULE_LOADING=EAGER nothing is
    loaded at launch time: then no wait is needed."""
    if nic_transport(transport) != "emulated":
        return False
    return (module_loading or "LAZY").strip().upper() != "EAGER"


class RelayError(NormalModeError):
    """A relay QP failed (error CQE or a send queue that stopped completing), naming the peer."""

    def __init__(self, peer: int, qpn: int, syndrome: int, vendor_syndrome: int, kind: int) -> None:
        self.peer, self.qpn, self.syndrome, self.vendor_syndrome, self.kind = peer, qpn, syndrome, vendor_syndrome, kind
        what = {1: "error CQE", 2: "send queue stopped completing", 3: "doorbell ordering timeout",
                4: "quiet timeout"}.get(kind, f"kind {kind}")
        super().__init__(f"RDMA to rank {peer} failed on QP 0x{qpn:x}: {what}, syndrome 0x{syndrome:02x}, "
                         f"vendor syndrome 0x{vendor_syndrome:02x}; call clean() on every live rank")


def relay_error(words: List[int], timeout_us: int) -> Optional[NormalModeError]:
    code, a, b, c = words[:4]
    if code == ERR_NONE:
        return None
    if code == ERR_QP:
        return RelayError(a, c & 0xFFFFFFFF, b & 0xFF, (b >> 8) & 0xFF, (b >> 16) & 0xFFFF)
    if code == 3:
        return PeerTimeout(a, PHASES.get(b, f"phase {b}"), c, timeout_us)
    return NormalModeError(f"relay error record {words[:4]}")


class Relay:
    """One rank's end of the column's RDMA rings (collective constructor over the whole group)."""

    _join_payload: bytes = b""   # a restarted rank's announcement (PeerSet.prepare_join); empty otherwise

    def __init__(self, group: Optional["dist.ProcessGroup"], nodes: NodeLayout, *, ring_bytes: int, transport: str,
                 timeout_us: int, setup_timeout_s: float = 120.0, num_qps_per_peer: int = 2,
                 tag_record: int = 0, control: Any = None, joining: bool = False) -> None:
        """group: a process group (collective over it); or control: a store-based buffer's control
        plane, with one rank per node (the column is the whole job), and joining for a restarted rank:
        its QPs are made when the survivors admit it (join)."""
        import torch
        import torch.distributed as dist

        from ..._native import load
        mod = load()
        self._ep, self._r = mod.ep, mod.relay
        if control is not None and nodes.ranks_per_node != 1:
            raise ValueError("a store-based relay runs one rank per node (its column is the whole job)")
        rank = control.rank if control is not None else dist.get_rank(group)
        self.rank = rank
        self.nodes = nodes
        self._epoch = 0
        self.timeout_us = timeout_us
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._drain = drain_after_launch(transport, os.environ.get("CUDA_MODULE_LOADING"))
        if self._drain:
            log.info("relay on the softnic with lazy CUDA module loading: every relay launch is waited for "
                     "on the host (set CUDA_MODULE_LOADING=EAGER to keep the calls asynchronous)")
        if control is None:
            # Every rank creates every column group in the same order (new_group is collective).
            cols = [dist.new_group([m * nodes.ranks_per_node + l for m in range(nodes.num_nodes)])
                    for l in range(nodes.ranks_per_node)]
            self.group = cols[nodes.local(rank)]
        else:
            self.group = None
        m_n = nodes.num_nodes
        self.layout = RelayLayout(m_n, _align(ring_bytes, RING_ALIGN))
        self._bytes = self.layout.total_bytes
        self._buf = 0
        self._peers: Any = None
        self._err = torch.zeros(8, dtype=torch.int32, device="cpu", pin_memory=True)
        self._host = torch.zeros(2 + 2 * m_n, dtype=torch.int32, device="cpu", pin_memory=True)
        self._ws = torch.zeros(8, dtype=torch.int32, device=self.device)
        # Where the column's gate records void calls (device_records.py): the node buffer's, or (a relay
        # on its own, as the relay's tests use it) one of its own.
        self.own_record = None if tag_record else torch.zeros(TAG_RECORD_INTS, dtype=torch.int32, device="cpu",
                                                              pin_memory=True)
        self._tag_record = tag_record or int(self.own_record.data_ptr())
        # A call gate's counts (nothing to send; what arrives is void): made once, outside any capture.
        self._gate_send = torch.zeros(m_n, dtype=torch.int32, device=self.device)
        self._gate_recv = torch.zeros(m_n + 1, dtype=torch.int32, device=self.device)
        try:
            self._buf = int(self._ep.device_alloc(self._bytes))
            self._ep.memset_async(self._buf, 0, self._bytes, torch.cuda.current_stream().cuda_stream)
            torch.cuda.current_stream().synchronize()
            from ..peers import PeerSet
            cfg = LinkConfig(transport=nic_transport(transport), ranks_per_node=1,
                             num_qps_per_peer=num_qps_per_peer)
            self._peers = PeerSet(control if control is not None else self.group, cfg, self._ep, nodes.node(rank),
                                  m_n, self.device.index, self._buf, self._bytes, setup_timeout_s)
            if joining:
                self._join_payload = self._peers.prepare_join()
                nqp = num_qps_per_peer
            else:
                self._peers.connect()
                nqp = self._peers.qps_per_peer()
            # The device tables of the column peers' links (relay_qp, raddr, rkey): rewritten in place for
            # a peer whose link is rebuilt (a rejoin), so the static's pointers stay valid.
            self._nqp = nqp
            self._tables = {
                "remote_addr": torch.zeros(m_n, dtype=torch.int64, device=self.device),
                "rkeys": torch.zeros(m_n, dtype=torch.int32, device=self.device),
                "qps": torch.zeros(m_n * nqp * int(self._r.QP_CONTEXT_SIZE), dtype=torch.uint8, device=self.device),
            }
            if not joining:
                self._load_links(range(m_n))
            self.static = self._make_static(rank, nqp)
        except BaseException:
            self.destroy()
            raise

    def _load_links(self, peers: Any) -> None:
        """Copy the links of `peers` (node indices) into the device tables."""
        import numpy as np
        import torch
        size = int(self._r.QP_CONTEXT_SIZE)
        for m in peers:
            link = self._peers.links[m]
            if m == self.nodes.node(self.rank):
                continue
            if len(link.qp_contexts) != self._nqp:
                raise RuntimeError(f"relay: the link to node {m} has {len(link.qp_contexts)} QPs, the column {self._nqp}")
            ctx = torch.frombuffer(bytearray(b"".join(link.qp_contexts)), dtype=torch.uint8)
            self._tables["qps"][m * self._nqp * size:(m + 1) * self._nqp * size].copy_(ctx)
            self._tables["remote_addr"][m] = int(link.remote_addr)
            self._tables["rkeys"][m] = int(np.array([link.rkey], dtype=np.uint32).view(np.int32)[0])
        torch.cuda.synchronize(self.device)

    def _make_static(self, rank: int, nqp: int) -> Any:
        lay, w = self.layout, self.layout.words
        s = self._r.RelayStatic()
        s.node, s.num_nodes = self.nodes.node(rank), self.nodes.num_nodes
        s.ranks_per_node, s.local = self.nodes.ranks_per_node, self.nodes.local(rank)
        s.buf = self._buf
        s.remote_addr = self._tables["remote_addr"].data_ptr()
        s.rkeys = self._tables["rkeys"].data_ptr()
        s.lkey = self._peers.lkey()
        s.qps = self._tables["qps"].data_ptr()
        s.num_qps_per_peer = nqp
        s.off_tail, s.off_head, s.off_tx, s.off_rx = w["tail"], w["head"], w["tx"], w["rx"]
        s.off_count, s.off_outbox, s.off_fetch = w["count"], w["outbox"], w["fetch"]
        s.off_send, s.off_recv, s.ring_bytes = lay.off_send, lay.off_recv, lay.ring_bytes
        s.err = self._err.data_ptr()
        s.workspace = self._ws.data_ptr()
        s.timeout_ns = self.timeout_us * 1000
        s.tag_record = self._tag_record
        return s

    @property
    def workspace_address(self) -> int:
        """The device words of the column's gate (normal_tags.h kWs*: its void flag and origin)."""
        return int(self._ws.data_ptr())

    MASK_WORD = 6   # normal_tags.h kWsMask: bit m = node m's column peer in the latest call

    @property
    def mask_word_address(self) -> int:
        """The device word of the latest call's column mask (with a mask: static.active)."""
        return int(self._ws.data_ptr()) + 4 * self.MASK_WORD

    @property
    def mask_word(self) -> "torch.Tensor":
        """That word as a 0-d device tensor (read in stream order)."""
        return self._ws[self.MASK_WORD]

    # ------------------------------------------------------------------ calls
    def counts(self, ticket: int, send_counts: "torch.Tensor") -> List[int]:
        """Exchange this call's row counts (int32 [M] on the device, this node's entry ignored); returns
        the rows each node sends here. One bounded host wait; ticket (> 0) labels the call for it."""
        import torch
        self.check_errors()
        recv = torch.zeros(self.nodes.num_nodes + 1, dtype=torch.int32, device=self.device)
        self.counts_async(ticket, send_counts, recv, host=True)
        return self.wait_counts(ticket)[0]

    def counts_async(self, ticket: int, send_counts: "torch.Tensor", recv: "torch.Tensor", host: bool, *,
                     kind: int = tags.KIND_DISPATCH, status: int = tags.STATUS_OK, upstream: int = 0,
                     handle_tag: Any = None) -> None:
        """Launch the count exchange, which is also the column's call gate (normal_internode_relay.cu):
        recv (int32 [M + 1] on the device) gets the rows from every node and their sum (zeros in a void
        call); with host=True the pinned words too, labelled `ticket` (wait_counts reads them). status
        REFUSED: this rank refused the call; upstream: the workspace of an earlier gate of this call
        whose void the records pass on; handle_tag: the handle a cached dispatch uses (one of a void
        dispatch makes this call void). The call number is the device's, so without host this launch is
        graph-capturable."""
        if host:
            if stream_capturing():
                raise ValueError("relay counts for the host cannot be captured in a CUDA graph (the host would "
                                 "wait for a kernel that does not run during the capture)")
            self._host[0] = 0
        self._r.counts(self.static, ticket if host else 0, send_counts.data_ptr(), recv.data_ptr(),
                       self._host.data_ptr() if host else 0, raw_current_stream(self.device), kind, status, self.rank,
                       upstream, handle_tag.data_ptr() if handle_tag is not None else 0)
        self._settle()

    def gate(self, kind: int, *, status: int = tags.STATUS_OK, upstream: int = 0, handle_tag: Any = None) -> None:
        """The column's call gate alone: a count exchange of nothing (a cached dispatch, a combine, or a
        call refused on the host)."""
        self.counts_async(0, self._gate_send, self._gate_recv, False, kind=kind, status=status, upstream=upstream,
                          handle_tag=handle_tag)

    def wait_counts(self, ticket: int) -> "tuple[List[int], List[int]]":
        """(rows from every node, this rank's send_counts) of counts_async(ticket, host=True): a bounded
        host wait (the kernel gives up on a silent peer by itself and still answers)."""
        host = self._host.numpy()
        bound_s = wait_bound_s(self.timeout_us, 10.0)
        deadline = time.monotonic() + bound_s
        while abs(int(host[0])) != ticket:
            if time.monotonic() > deadline:
                raise TimeoutError(f"relay counts #{ticket}: no answer within {bound_s:.1f} s "
                                   f"(the GPU is blocked by other work)")
            time.sleep(20e-6)
        if int(host[0]) < 0:
            self.check_errors()
        m = self.nodes.num_nodes
        return [int(v) for v in host[2:2 + m]], [int(v) for v in host[2 + m:2 + 2 * m]]

    def relay(self, phase: int, src: "torch.Tensor", send_counts: List[int], recv_counts: List[int],
              ring_tokens: int, chunk_tokens: int) -> "torch.Tensor":
        """Rows of `src` (uint8 [sum(send_counts), row_bytes], node by node) go to the column peers;
        returns the rows received (uint8 [sum(recv_counts), row_bytes], node by node)."""
        import torch
        if stream_capturing():
            raise ValueError("relay() copies host lists to the device and keeps its tensors until the next call: "
                             "inside a CUDA graph capture use relay_into() with device offsets")
        row_bytes = int(src.shape[1])
        if row_bytes % 16:
            raise ValueError(f"relay rows must be a multiple of 16 bytes, got {row_bytes}")
        q = min(ring_tokens, self.layout.ring_bytes // row_bytes)
        if q < 1:
            raise ValueError(f"a relay row of {row_bytes} bytes does not fit the ring of {self.layout.ring_bytes}")
        offs = torch.tensor([0] + _cumsum(send_counts), dtype=torch.int32, device="cpu")
        roffs = torch.tensor([0] + _cumsum(recv_counts), dtype=torch.int32, device="cpu")
        dst = torch.empty((sum(recv_counts), row_bytes), dtype=torch.uint8, device=self.device)
        offs_d, roffs_d = offs.to(self.device), roffs.to(self.device)
        self.relay_into(phase, src, offs_d, dst, roffs_d, ring_tokens, chunk_tokens)
        self._keep = (src, offs_d, roffs_d)   # alive until the next call (stream order)
        return dst

    def relay_into(self, phase: int, src: "torch.Tensor", send_offsets: "torch.Tensor", dst: "torch.Tensor",
                   recv_offsets: "torch.Tensor", ring_tokens: int, chunk_tokens: int, capacity: int = 0) -> None:
        """relay() with the runs given by device offsets (int32 [M + 1]; this node's runs are skipped,
        whatever their size) into a caller's dst; capacity > 0: rows of dst, rows beyond it are
        received and dropped. No host work besides the launch."""
        row_bytes = int(src.shape[1])
        if row_bytes % 16 or int(dst.shape[1]) != row_bytes:
            raise ValueError(f"relay rows must be a multiple of 16 bytes and alike on both ends, got {row_bytes} "
                             f"and {int(dst.shape[1])}")
        q = min(ring_tokens, self.layout.ring_bytes // row_bytes)
        if q < 1:
            raise ValueError(f"a relay row of {row_bytes} bytes does not fit the ring of {self.layout.ring_bytes}")
        chunk = max(1, min(chunk_tokens, q))
        self._r.relay(self.static, phase, src.data_ptr(), send_offsets.data_ptr(), dst.data_ptr(),
                      recv_offsets.data_ptr(), row_bytes, q, chunk, capacity, raw_current_stream(self.device))
        self._settle()

    @property
    def drains(self) -> bool:
        """Whether eager launches are waited for (drain_after_launch)."""
        return self._drain

    def _settle(self) -> None:
        """drain_after_launch: no CUDA call of this thread may load a module while a relay kernel
        spins on the softnic. A stream synchronize takes no lock the progress thread needs, and it is
        bounded: every wait inside the relay kernels (and the kernels before them) has its timeout.
        Inside a graph capture nothing runs (and a synchronize would end the capture): the caller made
        sure that no kernel is loaded then (native_internode.py: a warm-up call of the same kind)."""
        if self._drain and not stream_capturing():
            import torch
            torch.cuda.current_stream(self.device).synchronize()

    def clean(self, group_barrier: Any) -> None:
        """Collective over the column (group_barrier waits for every rank): zero the counters, count
        records and the error record, so no counter of an interrupted call survives."""
        import torch
        torch.cuda.synchronize(self.device)
        group_barrier()
        self._ep.memset_async(self._buf, 0, self.layout.off_send, torch.cuda.current_stream().cuda_stream)
        torch.cuda.current_stream().synchronize()
        self._err.zero_()
        # The error claim and the call number: every column peer starts at call 1 of a new generation.
        self._epoch += 1
        self._ws.zero_()
        self._ws[2] = self._epoch            # normal_tags.h kWsEpoch
        torch.cuda.current_stream().synchronize()
        self._host.zero_()
        group_barrier()

    def check_errors(self) -> None:
        words = [int(v) for v in self._err.numpy()[:4]]
        err = relay_error(words, self.timeout_us)
        if err is not None:
            self._err.zero_()
            # Re-arm the claim word only, in stream order: the call number (RELAY_SEQ_WORD) must stay
            # equal to the column peers' until clean() resets all of them.
            self._ep.memset_async(self._ws.data_ptr() + 4 * CLAIM_WORD, 0, 4, raw_current_stream(self.device))
            raise err

    # ------------------------------------------------------------------ elastic membership (a store)
    # docs/elastic.md "Normal mode": a restarted rank's QPs are rebuilt, only those; this rank's counters
    # of the streams shared with it restart at 0 (the newcomer counts from 0), and the count slots it
    # holds for it are set as a peer in step shows them (normal_tags.h gate_classify), as the intranode
    # gate flags are (native_member.py).
    def member_payload(self) -> bytes:
        return self._join_payload

    def finish_join(self, blobs: Dict[int, bytes]) -> None:
        """A restarted rank, admitted: QPs to every survivor with what each published for it."""
        self._peers.finish_join(blobs)
        self._load_links(range(self.nodes.num_nodes))

    def rebuild_peer(self, m: int, payload: bytes) -> bytes:
        """A survivor: new QPs to node m's restarted rank (still out of the calls), and this rank's
        counters of the streams shared with it back to 0. Returns what we publish for it."""
        import torch
        torch.cuda.synchronize(self.device)   # a kernel launched before the mark may still use the old QPs
        blob = self._peers.rebuild_peer(m, payload)
        self._load_links([m])
        self.restart_peer(m)
        return blob

    def restart_peer(self, m: int) -> None:
        """This rank's counters of the streams shared with node m (both directions) back to 0."""
        import torch
        torch.cuda.synchronize(self.device)
        w, words = self._words(), self.layout.words
        for name in ("tail", "head", "tx", "rx"):
            w[words[name] + m] = 0
        torch.cuda.synchronize(self.device)

    def counts_in_step(self, m: int) -> None:
        """The count slots this rank holds for node m, as a peer in step at our call number shows them."""
        import torch
        from .native_member import flags_in_step
        torch.cuda.synchronize(self.device)
        epoch, seq = self.step_state()
        slots = self._words()[self.layout.words["count"]:self.layout.words["count"] + 4 * self.nodes.num_nodes]
        slots = slots.view(torch.int64)
        for par, call in flags_in_step(seq).items():
            rec = 0 if call == 0 else (call << 32) | ((epoch & 7) << 29)   # normal_tags.h: status OK, 0 rows
            slots[par * self.nodes.num_nodes + m] = rec - (1 << 64) if rec >= 1 << 63 else rec
        torch.cuda.synchronize(self.device)

    def step_state(self) -> "tuple[int, int]":
        """(generation, the device's call number) of the count exchange."""
        import torch
        torch.cuda.synchronize(self.device)
        return int(self._epoch), int(self._ws[1].item()) & 0xFFFFFFFF     # normal_tags.h kWsSeq

    def take_step_state(self, epoch: int, seq: int) -> None:
        """A restarted rank: the survivors' generation and call number, and its count slots for every
        survivor in step, before it tells them it is ready (native_member.py says why the order)."""
        from .native_member import _s32
        self._epoch = int(epoch)
        self._ws[2] = _s32(epoch)
        self._ws[1] = _s32(seq)
        for m in range(self.nodes.num_nodes):
            if m != self.nodes.node(self.rank):
                self.counts_in_step(m)

    def peer_words(self, m: int) -> Dict[str, Any]:
        """This rank's words of the streams shared with node m, its two count slots, and the workspace."""
        import torch
        torch.cuda.synchronize(self.device)
        w, words, n = self._words().cpu(), self.layout.words, self.nodes.num_nodes
        out: Dict[str, Any] = {k: int(w[words[k] + m]) & 0xFFFFFFFF for k in ("tail", "head", "tx", "rx")}
        slots = w[words["count"]:words["count"] + 4 * n].view(torch.int64)
        out["count_calls"] = [(int(slots[par * n + m]) >> 32) & 0xFFFFFFFF for par in (0, 1)]
        out["workspace"] = self._ws.cpu().tolist()
        return out

    def _words(self) -> "torch.Tensor":
        import torch
        from ..devmem import DeviceArray
        return torch.as_tensor(DeviceArray(self._buf, self.layout.words["end"], "<i4"), dtype=torch.int32,
                               device=self.device)

    def destroy(self) -> None:
        if self._peers is not None:
            self._peers.close()
            self._peers = None
        if self._buf:
            import torch
            torch.cuda.synchronize(self.device)
            self._ep.device_free(self._buf)
            self._buf = 0


def _cumsum(v: List[int]) -> List[int]:
    out, acc = [], 0
    for x in v:
        acc += x
        out.append(acc)
    return out
