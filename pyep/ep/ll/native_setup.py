"""How the native low-latency backend (pyep.ep.ll.native) sets itself up and lets go: the engine module,
the kernels' static table (LLStatic: peer addresses, rkeys, QP contexts, layout offsets), the C++ fast
path bound to it, the grid size, the shared-memory check, the pinned error record, the kernel trace, and
the release of all of it. None of it runs per dispatch/combine call.
"""
from __future__ import annotations

import logging
from typing import Any, List

from ..backend import BackendUnavailable
from .errors import CALL_RECORD_WORDS, RECORD_WORDS
from .trace import ENV_VAR as TRACE_ENV

log = logging.getLogger("pyep.ep.ll.native")   # the backend's logger: its set-up lines keep their name

SOFTNIC_RESERVED_SMS = 4
FAST_ENV = "PYEP_LL_FAST"


def engine_ep() -> Any:
    from ..._native import load
    mod = load()
    if mod is None:
        raise BackendUnavailable("pyep._engine is not built (pip install -e .)")
    if not getattr(mod, "has_cuda", False) or not hasattr(mod, "ep"):
        raise BackendUnavailable("pyep._engine is a host-only build without the CUDA EP kernels")
    return mod.ep


def map_error_record(ep: Any) -> "tuple[int, Any]":
    """The kernels' records: pinned host memory the device writes at the same address (UVA), and a numpy
    view of it for the host (reading it is a plain memory load, never a device sync). Words
    [0, ERR_WORDS): the value record (bad expert ids); then CALL_ERR_WORDS: the call record (an exchange
    that failed with a peer), which every buffer has, whatever check_values says."""
    import ctypes

    import numpy as np
    words = int(getattr(ep, "ERR_WORDS", RECORD_WORDS))
    call_words = int(getattr(ep, "CALL_ERR_WORDS", CALL_RECORD_WORDS))
    if (words, call_words) != (RECORD_WORDS, CALL_RECORD_WORDS):
        raise BackendUnavailable(f"pyep._engine's error records ({words} + {call_words} words) do not match "
                                 f"pyep.ep.ll.errors ({RECORD_WORDS} + {CALL_RECORD_WORDS}): rebuild the extension")
    ptr = int(ep.host_alloc_mapped(4 * (words + call_words)))
    view = np.ctypeslib.as_array((ctypes.c_int32 * (words + call_words)).from_address(ptr))
    return ptr, view


class NativeSetup:
    """Mixed into NativeBackend (which provides _ep, _peers, layout, config, device, _buf, ...)."""

    # ------------------------------------------------------------------ tables
    def _build_static(self) -> Any:
        import numpy as np
        import torch
        lay, links, dev = self.layout, self._peers.links, self.device
        nqp = self._peers.qps_per_peer()
        ctx_sizes = {len(c) for link in links for c in link.qp_contexts}
        if len(ctx_sizes) > 1:
            raise RuntimeError(f"QP device contexts of different sizes {sorted(ctx_sizes)}")
        ctx_size = ctx_sizes.pop() if ctx_sizes else 0
        qps = bytearray(len(links) * nqp * ctx_size)
        for link in links:
            for j, ctx in enumerate(link.qp_contexts):
                at = (link.rank * nqp + j) * ctx_size
                qps[at:at + ctx_size] = ctx
        t = {
            "peer_base": torch.tensor([link.store_base for link in links], dtype=torch.int64),
            "remote_addr": torch.tensor([link.remote_addr for link in links], dtype=torch.int64),
            "rkeys": torch.from_numpy(np.array([link.rkey for link in links], dtype=np.uint32).view(np.int32)),
            "flag_expect": torch.tensor([link.flag_expect for link in links], dtype=torch.int32),
            "qps": torch.frombuffer(qps, dtype=torch.uint8) if qps else torch.zeros(16, dtype=torch.uint8),
            # Each rank's membership generation (its low bits travel in every signal word): all 0 on a
            # process group, the store's generations on a store-based buffer (set_generations).
            "gens": torch.tensor(self._generations or [0] * self.num_ranks, dtype=torch.int32),
        }
        self._tables = {k: v.to(dev) for k, v in t.items()}
        s = self._ep.LLStatic()
        s.rank, s.num_ranks = self.rank, self.num_ranks
        s.num_local_experts, s.num_max_tokens = lay.num_local_experts, lay.num_max_tokens
        s.hidden, s.max_topk = lay.hidden, lay.max_topk
        s.buf = self._buf
        s.peer_base = self._tables["peer_base"].data_ptr()
        s.remote_addr = self._tables["remote_addr"].data_ptr()
        s.rkeys = self._tables["rkeys"].data_ptr()
        s.lkey = self._peers.lkey()
        s.qps = self._tables["qps"].data_ptr() if ctx_size else 0
        s.num_qps_per_peer = nqp
        s.flag_expect = self._tables["flag_expect"].data_ptr()
        s.fetch_addr = self._buf + lay.off_fetch
        s.workspace = self._ws.data_ptr()
        s.half_bytes, s.off_dsig, s.off_csig = lay.half_bytes, lay.off_dsig, lay.off_csig
        s.off_cack = lay.off_cack
        s.off_drecv, s.off_crecv = lay.off_drecv, lay.off_crecv
        s.msg_bytes, s.slots_per_src = lay.msg_bytes, lay.slots_per_src
        s.num_blocks = self._grid_size()
        s.err = self._err_ptr if self.config.check_values is not False else 0
        s.call_err = self._err_ptr + 4 * RECORD_WORDS
        s.peer_gen = self._tables["gens"].data_ptr()
        import os
        if os.environ.get(TRACE_ENV, "") not in ("", "0"):
            # Diagnostics (pyep.ep.ll.trace): every block stamps its progress; read with read_trace().
            self._trace = torch.zeros((2, s.num_blocks, int(self._ep.TRACE_SLOTS)), dtype=torch.int64, device=dev)
            s.trace = self._trace.data_ptr()
        return s

    def _make_fast(self) -> Any:
        """The C++ fast path of dispatch/combine (one binding call: checks, ATen outputs, launch), or None
        where the build has none or PYEP_LL_FAST=0 (diagnostics: the Python path for every call)."""
        import os
        cls = getattr(self._ep, "FastLL", None)
        if cls is None or os.environ.get(FAST_ENV, "1") == "0":
            return None
        cfg, lay = self.config, self.layout
        fast = cls(self._static, self.device.index, lay.num_max_tokens, lay.hidden, cfg.num_experts, self.num_ranks,
                   cfg.max_topk, cfg.timeout_us, self._active)
        fast.half = self._half_py
        fast.blocked = self._pending_ev is not None
        return fast


    def read_trace(self) -> List[List[List[int]]]:
        """The latest dispatch's and combine's per-block stamps [kernel][block][slot] in ns (0 = not
        reached); waits for the device. Needs PYEP_LL_TRACE=1 when the buffer was created."""
        import torch
        if self._trace is None:
            raise RuntimeError(f"no kernel trace: create the buffer with {TRACE_ENV}=1 in the environment")
        torch.cuda.synchronize(self.device)
        return self._trace.tolist()

    def clear_trace(self) -> None:
        if self._trace is not None:
            self._trace.zero_()

    def _grid_size(self) -> int:
        """Blocks per LL kernel. Every block must be resident at once (blocks wait on each other's
        signals), so ranks that share one GPU split its SMs; PYEP_LL_NUM_BLOCKS overrides."""
        import os
        import socket

        import torch
        sms = int(self._ep.num_sms(self.device.index))
        env = os.environ.get("PYEP_LL_NUM_BLOCKS")
        if env:
            n = int(env)
            if not 1 <= n <= sms:
                raise ValueError(f"PYEP_LL_NUM_BLOCKS={env} must be in 1..{sms} (SMs of {self.device})")
            return n
        me = (socket.gethostname(), str(torch.cuda.get_device_properties(self.device).uuid))
        everyone = self._peers.gpu_identities(me)
        sharing = sum(1 for x in everyone if tuple(x) == me)
        if sharing > 1:
            log.info("rank %d: %d ranks share %s: %d of %d SMs each", self.rank, sharing, self.device,
                     max(1, sms // sharing), sms)
        blocks = max(1, sms // sharing)
        if any(link.kind == "emulated" for link in self._peers.links):
            # The softnic executes WQEs as copies and one-thread atomic kernels on this GPU while our
            # kernels spin on signals. With a block on every SM those did not get to run (seen on
            # H200: every emulated peer timed out; with 4 SMs left free the tests pass), though
            # registers and shared memory would allow co-residency; why is not established.
            blocks = max(1, blocks - SOFTNIC_RESERVED_SMS)
        return blocks

    def _shape_static(self) -> Any:
        """An LLStatic with only the shape the kernels' shared memory depends on."""
        s = self._ep.LLStatic()
        s.num_ranks, s.num_local_experts = self.num_ranks, self.layout.num_local_experts
        return s

    def _check_shared_memory(self) -> None:
        """The kernels keep per-expert tables in shared memory; refuse shapes that do not fit (every
        rank has the same shape, so every rank refuses before any collective)."""
        s = self._shape_static()
        need = max(int(self._ep.dispatch_smem_bytes(s)), int(self._ep.combine_smem_bytes(s)))
        have = int(self._ep.max_smem_optin(self.device.index))
        if need > have:
            raise ValueError(f"{self.config.describe_shape(self.num_ranks)} needs {need} bytes of shared memory "
                             f"per block, the GPU allows {have}: use fewer experts")

    def _release(self) -> None:
        # The fast path holds the error record's address: drop it before the record is freed.
        self._fast = None
        if self._peers is not None:
            try:
                self._peers.close()
            except Exception as exc:  # noqa: BLE001 - keep releasing the rest
                log.warning("closing transports failed: %s", exc)
            self._peers = None
        if self._buf:
            self._ep.device_free(self._buf)
            self._buf = 0
        if self._err_ptr:
            # The record is pinned host memory the kernels write: free it only when none can run
            # (destroy synchronises first; a failed __init__ never launched one).
            self._err = None
            self._ep.host_free(self._err_ptr)
            self._err_ptr = 0
