"""The output pool of one-copy dispatch (engine/kernels/normal_direct.cuh; docs/normal_mode.md,
"One-copy dispatch").

A native buffer with room past its rings keeps that room as an output pool. A dispatch offers one-copy
outputs when its recv_x and recv_x_scales fit a free region of the pool: they are returned as views of
that region, and the peers store rows straight into them. The region stays taken for as long as any
tensor viewing it lives: its memory reaches torch through a CUDA array interface object, which torch
keeps until the last view is gone; the pool holds only a weak reference to it.

Reuse follows the caching allocator's stream semantics. The outputs belong to the streams the call was
made for (the launch stream, and the caller's where they differ: async_finish, which record_streams its
outputs there). A later call that reuses the memory on another launch stream first makes that stream
wait for everything queued so far on those streams, which includes every use queued before the tensors
were freed; on the same stream, stream order does it. Its kernel tells the peers where to write only
after that. When no free region fits (the caller still holds earlier outputs, or the call is too large),
the call offers nothing and every rank takes the ring path: one-copy never changes results. Per call the
host builds no finalizer, event object or torch Stream: each of those cost tens of microseconds a call
(tools/dev/pool_host_time.py, tools/dev/normal_host_time.py).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from ..devmem import DeviceArray, DeviceMemory

POOL_ALIGN = 128
POOL_MIN_BYTES = 16 << 20      # less than this past the rings: no pool (a buffer sized by size_hint)
RING_RESERVE_SMS = 32          # the rings below the pool hold configs of up to this many SMs (or the buffer's)


def one_copy_enabled() -> bool:
    """Whether native buffers keep an output pool for one-copy dispatch: on unless PYEP_NORMAL_DIRECT=0.
    It was opt-in while DeepEP's test harness showed it at two speeds; the slow one was host time, every
    tensor method of the call going through the __torch_function__ mode a default device puts on
    (backend.torch_function_off; docs/results/2026-11-26i-h200x1)."""
    import os
    value = os.environ.get("PYEP_NORMAL_DIRECT", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PYEP_NORMAL_DIRECT must be 0 (ring path only) or 1 (one-copy dispatch where the "
                         f"buffer has room past its rings, the default), got {value!r}")
    return value == "1"


def pull_combine_enabled() -> bool:
    """Whether a combine whose input lies in the output pool on every rank reads the peers' rows where they
    lie (engine/kernels/normal_pull.cuh): on unless PYEP_NORMAL_PULL=0 (every combine then pushes its rows
    through the rings)."""
    import os
    value = os.environ.get("PYEP_NORMAL_PULL", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PYEP_NORMAL_PULL must be 0 (combines push through the rings) or 1 (a combine whose "
                         f"inputs lie in the output pool pulls them, the default), got {value!r}")
    return value == "1"


def _align(v: int, a: int = POOL_ALIGN) -> int:
    return (v + a - 1) // a * a


def stage_row_bytes(num_topk: int) -> int:
    """normal_launch.h stage_row_bytes: a staging row holds K int32 local ids, K fp32 weights, the source index."""
    return 8 * num_topk + 4


def ring_reserve(num_ranks: int, num_sms: int, hidden: int) -> int:
    """Bytes kept for rings below an output pool: the largest rings of the default configs (dispatch and
    combine, at the table's ring depth too) of max(num_sms, RING_RESERVE_SMS) SMs and this hidden."""
    from . import layout
    from .config import sizing_configs
    slot = layout.slot_bytes(hidden)
    return max(layout.ring_bytes(num_ranks, c.num_channels(), c.num_max_nvl_chunked_recv_tokens, slot)
               for c in sizing_configs(num_ranks, max(num_sms, RING_RESERVE_SMS)))


def output_pool_hint(num_ranks: int, num_tokens: int, hidden: int, num_topk: int = 16) -> int:
    """Pool bytes for three dispatches' outputs of num_tokens tokens a rank, each received from every
    rank (R x num_tokens rows), BF16 (FP8 rows and scales are smaller): a loop's previous output is
    still held while its next call runs, and often the output of the dispatch whose handle it reuses."""
    return 3 * OutputLayout.of(num_ranks * num_tokens, hidden, 2, False, num_topk).total + POOL_ALIGN


def pooled_buffer_bytes(num_ranks: int, num_sms: int, hidden: int, num_tokens: int) -> int:
    """num_nvl_bytes of a native buffer whose rings hold the default configs of num_sms SMs and whose
    output pool holds output_pool_hint(): one-copy dispatch for calls of up to num_tokens tokens a rank."""
    from . import layout
    return (layout.ring_offset(num_ranks) + ring_reserve(num_ranks, num_sms, hidden) +
            output_pool_hint(num_ranks, num_tokens, hidden) + POOL_ALIGN)


def pool_bounds(total_bytes: int, ring_end: int) -> Tuple[int, int]:
    """(lo, hi) byte offsets of the pool in a buffer of total_bytes whose rings end at ring_end, or (0, 0)
    when less than POOL_MIN_BYTES is left."""
    lo, hi = _align(ring_end), total_bytes // POOL_ALIGN * POOL_ALIGN
    return (lo, hi) if hi - lo >= POOL_MIN_BYTES else (0, 0)


@dataclass
class OutputLayout:
    """Offsets (from the region's start) of one call's outputs: recv_x, recv_x_scales (FP8), staging rows."""
    x: int
    scales: int
    stage: int
    user_bytes: int    # recv_x and its scales: what the returned tensors view
    total: int

    @staticmethod
    def of(rows: int, hidden: int, elem: int, fp8: bool, stage_k: Optional[int]) -> "OutputLayout":
        x_bytes = _align(rows * hidden * elem)
        s_bytes = _align(rows * (hidden // 128) * 4) if fp8 else 0
        user = max(POOL_ALIGN, x_bytes + s_bytes)
        stage = _align(rows * stage_row_bytes(stage_k)) if stage_k is not None else 0
        return OutputLayout(0, x_bytes, user if stage_k is not None else 0, user, user + stage)


@dataclass
class _Taken:
    off: int
    nbytes: int
    alive: Any                 # weakref to the region's DeviceArray: None once it is gone
    streams: Tuple[int, ...]   # raw streams the outputs were made for


@dataclass
class DirectOutputs:
    recv_x: Any
    recv_x_scales: Any
    stage: int         # device address of the staging rows, or 0


@dataclass
class OutputPool:
    """Regions of [lo, hi) of the buffer `memory` (DeviceMemory) on `device`, handed out first-fit. `ep`:
    the engine's ep module (raw CUDA events); close() releases the pool's event."""
    memory: DeviceMemory
    lo: int
    hi: int
    device: Any
    ep: Any
    _taken: List[_Taken] = field(default_factory=list)
    _event: int = 0

    def _place(self, need: int) -> Optional[int]:
        busy = sorted((t.off, t.off + t.nbytes) for t in self._taken if t.alive() is not None)
        start = self.lo
        for b0, b1 in busy:
            if start + need <= b0:
                break
            start = max(start, _align(b1))
        return start if start + need <= self.hi else None

    def outputs(self, rows: int, hidden: int, dtype: Any, fp8: bool, stage_k: Optional[int],
                launch_stream: int, caller_stream: int, spare: bool = False) -> Optional[DirectOutputs]:
        """recv_x [rows, hidden] of dtype, recv_x_scales [rows, hidden / 128] (FP8) and staging rows (stage_k:
        the call's top-k, None for a dispatch with a handle) in a free region, or None. launch_stream (a
        raw handle) first waits for the uses, on other streams, of earlier outputs that lived there.
        spare: only where as much again stays free right behind the region (outputs that only a pull
        combine gains from leave room for one-copy dispatches)."""
        import torch
        elem = dtype.itemsize
        lay = OutputLayout.of(rows, hidden, elem, fp8, stage_k)
        off = self._place(2 * lay.total if spare else lay.total)
        if off is None:
            return None
        end = off + lay.total
        keep: List[_Taken] = []
        for t in self._taken:
            if t.alive() is None and t.off < end and off < t.off + t.nbytes:
                for st in t.streams:
                    if st != launch_stream:
                        if not self._event:
                            self._event = int(self.ep.event_create())
                        # Recorded now, it covers every use queued on `st` before the tensors died.
                        self.ep.event_record(self._event, st)
                        self.ep.stream_wait_event(launch_stream, self._event)
                continue
            keep.append(t)
        base = self.memory.ptr
        # The region's object: torch keeps it (and the buffer's memory) while a view lives.
        region = DeviceArray(base + off, lay.user_bytes, owner=self.memory)
        streams = (launch_stream,) if caller_stream in (0, launch_stream) else (launch_stream, caller_stream)
        keep.append(_Taken(off, lay.total, weakref.ref(region), streams))
        self._taken = keep
        raw = torch.as_tensor(region, dtype=torch.uint8, device=self.device)
        del region
        recv_x = raw[lay.x:lay.x + rows * hidden * elem].view(dtype).view(rows, hidden)
        scales = (raw[lay.scales:lay.scales + rows * (hidden // 128) * 4].view(torch.float32).view(rows, hidden // 128)
                  if fp8 else None)
        return DirectOutputs(recv_x, scales, base + off + lay.stage if stage_k is not None else 0)

    def fast_outputs(self, rows: int, hidden: int, fp8: bool, stream: int) -> Optional[Tuple[Any, Any, int]]:
        """outputs() of a cached dispatch made on `stream` through the C++ fast path (normal_fast_bind.cpp):
        (recv_x, recv_x_scales or None, staging address 0), or None."""
        import torch
        o = self.outputs(rows, hidden, torch.float8_e4m3fn if fp8 else torch.bfloat16, fp8, None, stream, stream)
        return None if o is None else (o.recv_x, o.recv_x_scales, o.stage)

    def held_bytes(self) -> int:
        return sum(t.nbytes for t in self._taken if t.alive() is not None)

    def close(self) -> None:
        if self._event:
            self.ep.event_destroy(self._event)
            self._event = 0
