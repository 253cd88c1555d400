"""Shared by the drop-in shims: DeepEP and Mooncake pass the shape (T, E; H from x) on every call
instead of at construction, so a shim keeps one EpBuffer per shape, created on first use (a
collective, like the call that triggers it) -- at most `max_shapes` of them: past that the least
recently used one is destroyed (docs/compat.md, "Low-latency buffers per shape"). Also the shared
active-rank mask of DeepEP's shrink mode, and raw views of a native buffer."""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional, Set, Tuple, Union

from ..ep.ll.buffer import EpBuffer
from ..ep.config import MAX_TOPK
from ..ep.ll.config import EpConfig
from ..ep.ll.handle import Handle

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("pyep.compat")
ShapeKey = Tuple[int, int, int]   # (num_max_dispatch_tokens_per_rank, hidden, num_experts)
# pyep's kernels pick a peer's QP as `local expert % QPs per peer`, so QPs beyond one per local expert
# carry nothing; 64 is EpConfig's upper bound.
MAX_QPS_PER_PEER = 64
# Low-latency buffers one shim instance keeps (each holds num_rdma_bytes / its size hint). DeepEP
# and Mooncake size one buffer for every shape; a shape that varies per call (vLLM's padded batch
# sizes, say) would otherwise pin one buffer per value for the life of the process.
DEFAULT_MAX_SHAPES = 4


def hidden_of(x: Any) -> int:
    import torch
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must have shape [N, hidden], got {list(x.shape)}")
    return int(x.shape[1])


def handle_key(handle: Any) -> ShapeKey:
    if not isinstance(handle, Handle):
        raise TypeError(f"handle must be the handle returned by dispatch, got {type(handle).__name__}")
    return (handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)


def qps_per_peer(requested: Optional[int], num_local_experts: int) -> Optional[int]:
    """DeepEP's num_qps_per_rank (NVSHMEM RC QPs per peer; its tests pass E // R, up to hundreds) as
    pyep's QPs per peer: at most one per local expert and at most MAX_QPS_PER_PEER. None: pyep picks."""
    if requested is None or requested < 1:
        return None
    nqp = max(1, min(requested, num_local_experts, MAX_QPS_PER_PEER))
    if nqp != requested:
        log.debug("num_qps_per_rank=%d -> %d QPs per peer (pyep uses one QP per local expert at most, "
                  "%d local experts, cap %d)", requested, nqp, num_local_experts, MAX_QPS_PER_PEER)
    return nqp


def check_max_shapes(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"max_ll_shapes must be an int >= 1 (low-latency buffers kept per Buffer), got {v!r}")
    return v


@dataclass
class ShapeBuffers:
    """EpBuffers of one shim instance, keyed by shape, least recently used first. Every rank makes the
    same calls with the same shapes (they are collectives), so every rank evicts the same buffer at
    the same call and the eviction's destroy() pairs up across ranks."""

    group: Optional["dist.ProcessGroup"]
    template: EpConfig                      # transport/backend settings; shape fields replaced
    qps_per_rank: Optional[int] = None      # the caller's QP count, mapped per shape (qps_per_peer)
    max_shapes: int = DEFAULT_MAX_SHAPES
    buffers: "OrderedDict[ShapeKey, EpBuffer]" = field(default_factory=OrderedDict)
    evicted: Set[ShapeKey] = field(default_factory=set)
    destroyed: bool = False

    def __post_init__(self) -> None:
        check_max_shapes(self.max_shapes)

    def get(self, key: ShapeKey, what: str) -> EpBuffer:
        if self.destroyed:
            raise RuntimeError(f"{what}() called after destroy()")
        buf = self.buffers.get(key)
        if buf is not None:
            self.buffers.move_to_end(key)
            return buf
        while len(self.buffers) >= self.max_shapes:
            old_key, old = self.buffers.popitem(last=False)
            log.info("low-latency buffer of shape T=%d H=%d E=%d evicted (max_ll_shapes=%d reached by "
                     "T=%d H=%d E=%d); its handles are no longer valid", *old_key, self.max_shapes, *key)
            self.evicted.add(old_key)
            old.destroy()
        import torch.distributed as dist
        from ..ep._dist import resolve_group
        t, h, e = key
        r_n = dist.get_world_size(resolve_group(self.group))
        tpl = self.template
        cfg = EpConfig(num_max_dispatch_tokens_per_rank=t, hidden=h, num_experts=e,
                       max_topk=tpl.max_topk, transport=tpl.transport, allow_nvlink=tpl.allow_nvlink,
                       device_name=tpl.device_name, timeout_us=tpl.timeout_us,
                       num_qps_per_peer=qps_per_peer(self.qps_per_rank, max(1, e // r_n)),
                       num_buffer_bytes=tpl.num_buffer_bytes, ranks_per_node=tpl.ranks_per_node,
                       backend=tpl.backend, check_values=tpl.check_values)
        buf = EpBuffer.from_config(cfg, self.group)
        log.debug("created EpBuffer for T=%d H=%d E=%d", t, h, e)
        self.buffers[key] = buf
        self.evicted.discard(key)
        return buf

    def for_handle(self, handle: Any, what: str) -> EpBuffer:
        key = handle_key(handle)
        if self.destroyed:
            raise RuntimeError(f"{what}() called after destroy()")
        buf = self.buffers.get(key)
        if buf is None:
            if key in self.evicted:
                raise ValueError(f"{what}: the buffer of shape T={key[0]}, H={key[1]}, E={key[2]} that issued this "
                                 f"handle was evicted (more than max_ll_shapes={self.max_shapes} shapes in use); "
                                 f"dispatch again, or raise max_ll_shapes")
            raise ValueError(f"{what}: handle was issued by another Buffer (no buffer of shape "
                             f"T={key[0]}, H={key[1]}, E={key[2]} here)")
        # A handle of an evicted buffer whose shape was made again is refused by the new buffer (its
        # owner token differs).
        self.buffers.move_to_end(key)
        return buf

    def destroy(self) -> None:
        for buf in self.buffers.values():
            buf.destroy()
        self.buffers.clear()
        self.destroyed = True


def template_config(*, backend: str, transport: str, device_name: str, timeout_us: int,
                    allow_nvlink: bool, num_buffer_bytes: Optional[int],
                    check_values: Union[bool, str] = True) -> EpConfig:
    # A template: the shape only has to pass validation; ShapeBuffers builds a config per call shape.
    return EpConfig(num_max_dispatch_tokens_per_rank=1, hidden=128, num_experts=1, max_topk=MAX_TOPK,
                    transport=transport, allow_nvlink=allow_nvlink, device_name=device_name,
                    timeout_us=timeout_us, num_buffer_bytes=num_buffer_bytes, backend=backend,
                    check_values=check_values)


class ActiveMask:
    """DeepEP's shrink-mode mask buffer (1 = masked) held as pyep's active_ranks (1 = active, int32
    [R]): one tensor shared by every low-latency buffer of a shim, passed to each call, so a rank the
    kernels time out on is masked for every later call, and the caller's updates reach every call."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._pending: List[int] = [1] * num_ranks    # until a buffer says which device it lives on
        self.tensor: Optional["torch.Tensor"] = None

    def bind(self, device: "torch.device") -> "torch.Tensor":
        import torch
        if self.tensor is None:
            self.tensor = torch.tensor(self._pending, dtype=torch.int32, device=device)
        elif self.tensor.device != device:
            raise RuntimeError(f"low-latency buffers of one Buffer live on {self.tensor.device} and "
                               f"{device}; shrink mode needs one device")
        return self.tensor

    def _check_rank(self, rank: Any) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank_to_mask must be an int in [0, {self.num_ranks}), got {rank!r}")
        return rank

    def update(self, rank: int, mask: bool) -> List[int]:
        """Returns the ranks this takes back (masked before, not now)."""
        r = self._check_rank(rank)
        if self.tensor is None:
            back = [r] if not mask and not self._pending[r] else []
            self._pending[r] = 0 if mask else 1
            return back
        back = [r] if not mask and not int(self.tensor[r]) else []
        self.tensor[r] = 0 if mask else 1       # stream-ordered, like DeepEP's one-thread kernel
        return back

    def query(self, mask_status: Any) -> None:
        import torch
        if not isinstance(mask_status, torch.Tensor):
            raise TypeError(f"mask_status must be a torch.Tensor, got {type(mask_status).__name__}")
        if mask_status.dtype != torch.int32 or tuple(mask_status.shape) != (self.num_ranks,):
            raise ValueError(f"mask_status must be int32 [{self.num_ranks}], got {mask_status.dtype} "
                             f"{list(mask_status.shape)}")
        if self.tensor is None:
            src = torch.tensor([1 - a for a in self._pending], dtype=torch.int32, device=mask_status.device)
        else:
            src = (self.tensor == 0).to(torch.int32)
        mask_status.copy_(src)

    def clean(self) -> List[int]:
        """Unmasks every rank; returns the ranks this takes back."""
        if self.tensor is None:
            back = [r for r, a in enumerate(self._pending) if not a]
            self._pending = [1] * self.num_ranks
            return back
        back = [r for r, a in enumerate(self.tensor.tolist()) if not a]
        self.tensor.fill_(1)
        return back


def raw_buffer_tensor(backend: Any, what: str) -> "torch.Tensor":
    """uint8 view of a native backend's registered buffer (the memory DeepEP's get_local_buffer_tensor
    exposes), from the backend's raw_buffer() -> (address, bytes). The reference backend has no such
    memory: its transfers are torch.distributed collectives, so there is nothing to view and this raises."""
    import torch
    raw = getattr(backend, "raw_buffer", None)
    device = getattr(backend, "device", None)
    if raw is None or device is None or getattr(device, "type", "") != "cuda":
        raise NotImplementedError(
            f"{what}: the {getattr(backend, 'name', type(backend).__name__)} backend has no registered "
            f"device buffer to view (the reference backend moves data with torch.distributed "
            f"collectives); reset state with clean_low_latency_buffer() instead")
    ptr, nbytes = raw()

    from ..ep.devmem import DeviceArray
    return torch.as_tensor(DeviceArray(ptr, nbytes), dtype=torch.uint8, device=device)
