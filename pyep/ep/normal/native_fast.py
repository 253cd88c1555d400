"""The C++ fast path of the native intranode backend (engine/bindings/normal_fast_bind.cpp;
docs/normal_mode.md, "Host path"): a cached dispatch or a combine in one binding call, as DeepEP's C++
runtime makes it, instead of the Python path's argument checks, call records, gate and launch bindings.

The Python path makes every first call of a handle and config and every call that is not plain
(NormalBuffer says which); once it has made one, NormalBuffer keeps the handle's NormalPlan (its
tensors' addresses, channels, ring, hidden) on the handle and passes later calls to NormalFast, which
checks x against the plan and declines (returns None) whatever it does not take. This mixin keeps
NormalFast's view of the backend's state: `ready` (not broken, no mask, no grace window, not
destroyed), the void calls the host has reported (a new one is the Python path's to raise) and the
ring geometry of the last call. PYEP_NORMAL_FAST=0 turns the fast path off.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional, Tuple

from . import layout

if TYPE_CHECKING:
    import torch

FAST_ENV = "PYEP_NORMAL_FAST"
MAX_FAST_PLANS = 64   # per handle: DeepEP's tuning loops try a few dozen configs on one handle


def fast_enabled() -> bool:
    value = os.environ.get(FAST_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{FAST_ENV} must be 0 (every call through the Python path) or 1 (cached dispatch and "
                         f"combine through the C++ fast path, the default), got {value!r}")
    return value == "1"


class NativeFastPath:
    """Mixed into NormalNativeBackend (which provides the attributes below)."""

    _n: Any
    _static: Any
    _pool: Any
    _pull: bool
    _mask: Optional["torch.Tensor"]
    _geometry: Optional[Tuple[int, int]]
    _broken: bool
    _destroyed: bool
    _grace_left: int
    _tma_dispatch: int
    _tma_combine: int
    records: Any
    device: "torch.device"
    timeout_us: int
    _fast: Any = None

    @property
    def fast(self) -> Any:
        """The NormalFast object, once a plan was made (None before, or without a fast path)."""
        return self._fast

    def _sync_fast(self) -> None:
        """Tell the fast path what changed on the Python path (called wherever one of these changes)."""
        f = self._fast
        if f is None:
            return
        f.ready = not (self._broken or self._destroyed or self._mask is not None or self._grace_left > 0)
        f.pull = bool(self._pull and self._pool is not None)
        f.voids_seen = self.records.voids_seen
        if self._geometry is not None:
            f.geo_ring, f.geo_slot = self._geometry

    def _close_fast(self) -> None:
        if self._fast is not None:
            self._fast.ready = False
            self._fast.pool = None

    def fast_plan(self, handle: Any, config: Any, hidden: int, epoch: int) -> Any:
        """A NormalPlan of cached dispatches or combines with `handle` at `config` (the config the Python
        path ran, default and ring fit applied) and `hidden`, or None without a fast path. `epoch`: the
        buffer's generation, which the handle was checked against."""
        if self._fast is None:
            if self._destroyed or not fast_enabled() or not hasattr(self._n, "NormalFast"):
                return None
            self._fast = self._n.NormalFast(self._static, self.device.index, int(self.timeout_us), self._tma_dispatch,
                                            self._tma_combine, self._pool.fast_outputs if self._pool is not None else None)
            self._sync_fast()
        self._fast.epoch = epoch
        p = self._n.NormalPlan()
        p.owner, p.epoch = self._fast.id, handle.epoch
        p.num_tokens, p.hidden, p.rows = handle.num_tokens, hidden, handle.num_recv_rows
        p.num_worst_tokens = handle.num_worst_tokens
        p.channels = config.num_channels()
        p.ring, p.chunk = config.num_max_nvl_chunked_recv_tokens, config.num_max_nvl_chunked_send_tokens
        p.slot = layout.slot_bytes(hidden)
        p.in_rank, p.send_head = handle.is_token_in_rank.data_ptr(), handle.send_head.data_ptr()
        p.rpm, p.cpm = handle.rank_prefix_matrix.data_ptr(), handle.channel_prefix_matrix.data_ptr()
        p.rcp = handle.recv_channel_prefix_matrix.data_ptr()
        p.tag = handle.tag.data_ptr() if handle.tag is not None else 0
        return p


def remember_plan(backend: Any, kind: int, handle: Any, config_arg: Any, config: Any, hidden: int,
                  epoch: int) -> Any:
    """Keep on `handle` the plan of calls of `kind` (tags.KIND_CACHED / KIND_COMBINE) made with the config
    argument `config_arg` (None or a Config; `config` is what the Python path ran), once the Python path
    made one. Returns the backend's NormalFast, or None where the backend has no fast path. The plans
    are keyed by id(config_arg) and keep the config, so its id is not reused while the plan lives."""
    key = (kind, id(config_arg))
    make = getattr(backend, "fast_plan", None)
    if make is None or key in handle.fast_plans or len(handle.fast_plans) >= MAX_FAST_PLANS:
        return getattr(backend, "fast", None)
    plan = make(handle, config, hidden, epoch)
    if plan is None:
        return None
    handle.fast_plans[key] = (config_arg, plan)
    return backend.fast
