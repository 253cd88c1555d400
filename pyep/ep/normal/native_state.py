"""What a call of the native normal backend settles on the host before it launches (native.py mixes it
in): the ring geometry of its rings, and the active_ranks mask its kernels read, with the per-call
dropped-token counts a mask gives."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Tuple

from . import layout

if TYPE_CHECKING:
    import torch


def check_device_mask(mask: "torch.Tensor", num_ranks: int, device: "torch.device") -> None:
    """The native kernels read active_ranks on their GPU: int32 [R], contiguous, on `device`."""
    import torch
    if mask.device != device or mask.dtype != torch.int32 or tuple(mask.shape) != (num_ranks,):
        raise ValueError(f"the native normal mode reads active_ranks on the GPU: it must be int32 "
                         f"[{num_ranks}] on {device}, got {mask.dtype} {list(mask.shape)} on {mask.device}")
    if not mask.is_contiguous():
        raise ValueError("active_ranks must be contiguous")


# normal_tma.cuh: which row copies go by the SM's bulk copy engine.
TMA_LOCAL = 1   # the dispatch receiver's copies into its own outputs, the combine's reduce loads
TMA_PEER = 2    # stores into a peer's buffer: one-copy dispatch rows, ring rows of dispatch and combine
_TMA_SIDES = {"all": TMA_LOCAL | TMA_PEER, "0": 0, "local": TMA_LOCAL, "peer": TMA_PEER}


def bulk_copy_setting() -> str:
    """PYEP_NORMAL_TMA, checked when the buffer is built: `1` (the default), one of `all`, `0`, `local`,
    `peer` for both kernels, or `D/C` with one of those for the dispatch (D) and the combine (C)
    (bulk_copy_flags says what each does). ValueError for anything else."""
    import os
    value = os.environ.get("PYEP_NORMAL_TMA", "1")
    parts = value.split("/")
    if value != "1" and not (len(parts) in (1, 2) and all(p in _TMA_SIDES for p in parts)):
        raise ValueError(f"PYEP_NORMAL_TMA must be 1 (the default: bulk copies only where every peer shares "
                         f"this GPU), one of {sorted(_TMA_SIDES)}, or DISPATCH/COMBINE with one of those each "
                         f"(e.g. 0/peer), got {value!r}")
    return value


def bulk_copy_flags(setting: str, peers_share_gpu: bool) -> Tuple[int, int]:
    """The kernels' use_tma bits (dispatch, combine) for a PYEP_NORMAL_TMA setting. `1` (the default):
    every row copy by bulk copy where every peer shares this rank's GPU (ranks sharing one GPU, HBM to
    HBM: BF16 dispatch +18 % at 2 ranks, combine +3 % at 4), and none where a peer is on another GPU:
    over NVLink the warps' own loads and stores were faster (4 ranks on 4 H200s, DeepEP's test, GB/s per
    rank: BF16 dispatch 385 against 380, combine 343 against 334, and 317 with the local copies alone;
    docs/results/2026-11-27b-x4). For measurements: `all` both sides whatever the topology, `0` none,
    `local` or `peer` one side only, for both kernels, or `D/C` per kernel. Every setting moves the same
    bytes; ranks may differ."""
    if setting == "1":
        both = TMA_LOCAL | TMA_PEER if peers_share_gpu else 0
        return both, both
    parts = setting.split("/")
    return _TMA_SIDES[parts[0]], _TMA_SIDES[parts[-1]]


class NativeCallState:
    """Mixed into NormalNativeBackend (which provides _static, _geometry, _mask, device, num_ranks)."""

    _geometry: Optional[Tuple[int, int]]
    _mask: Optional["torch.Tensor"]
    _static: Any
    device: "torch.device"
    num_ranks: int
    _sync_fast: Any   # native_fast.NativeFastPath

    def set_mask(self, mask: "torch.Tensor") -> None:
        """The buffer's active_ranks (int32 [R] on this device, 1 = active), read by every call's kernels
        on the device -- no host read, so the caller may change it in place between calls -- and cleared
        by them for a peer that stays silent past the timeout (docs/elastic.md, "Normal mode")."""
        check_device_mask(mask, self.num_ranks, self.device)
        self._mask = mask
        self._static.active = mask.data_ptr()
        self._sync_fast()

    def _dropped(self) -> Optional["torch.Tensor"]:
        """A call's per-rank count of tokens it did not deliver (with a mask), or None."""
        import torch
        return torch.zeros(self.num_ranks, dtype=torch.int32, device=self.device) if self._mask is not None else None

    def _settle_ring_geometry(self, ring_tokens: int, hidden: int, what: str) -> None:
        """A ring's place in the buffer depends on its depth and on the slot stride (layout.py). The
        stride is that of the call's hidden size (slot_bytes(hidden): the largest row of any call of that
        hidden, so FP8 dispatch, BF16 dispatch and combine rows of one model share one layout), not of the
        largest hidden the buffer could hold: a buffer sized by bytes (the DeepEP shim's num_nvl_bytes)
        would otherwise spread every row over slots two or more times its size, and the rings of all
        ranks over that much more memory. A call with another geometry than the last one lays its rings
        over streams that a slower peer may still be reading from the earlier call: it first lets every
        rank finish its earlier calls (device synchronise, then the call's gate); calls of one geometry
        never wait here."""
        import torch
        slot = layout.slot_bytes(hidden)
        geometry = (ring_tokens, slot)
        if self._geometry is None or self._geometry == geometry:
            self._geometry = geometry
            self._static.slot_bytes = slot
            self._sync_fast()
            return
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(f"{what}: the ring geometry changes from {self._geometry[0]} rows of {self._geometry[1]} "
                             f"bytes to {ring_tokens} rows of {slot} bytes (num_max_nvl_chunked_recv_tokens or the "
                             f"hidden size changed) inside a CUDA graph capture; a new geometry needs every rank "
                             f"idle first: make one eager call with the new config and shape before capturing")
        # The call's gate is the barrier: no rank passes it before every rank posted its flag, which a
        # rank does after this synchronisation (ring depth and hidden are in the tag: the ranks change alike).
        torch.cuda.synchronize(self.device)
        self._geometry = geometry
        self._static.slot_bytes = slot
        self._sync_fast()

