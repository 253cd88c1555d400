"""What every EP backend of either mode (low-latency, normal) shares: the unavailability error, the event
protocol that dispatch/combine return, hooks, the profiler range, and a peer's transport description.
The low-latency contract itself is pyep.ep.ll.contract; the normal mode's is pyep.ep.normal.contract."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:  # torch is imported lazily everywhere in pyep
    import torch  # noqa: F401


class BackendUnavailable(RuntimeError):
    """The backend cannot run in this process (no CUDA, host-only build, no kernels)."""


@runtime_checkable
class EventLike(Protocol):
    """What dispatch/combine return as `event` (async_finish): DeepEP's EventOverlap subset."""

    def wait(self) -> None:
        """Block the host until the operation finished (bounded; raises TimeoutError naming it)."""

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the operation (no host blocking)."""


Hook = Callable[[], None]


F = TypeVar("F", bound=Callable[..., Any])


def torch_function_off(fn: F) -> F:
    """Run a per-call entry point (dispatch, combine, layout) with torch's Python-level dispatch off
    (torch._C.DisableTorchFunction: __torch_function__ modes and subclass handlers). Such a mode is on
    whenever a program sets a default device (torch.set_default_device, `with torch.device(...)`, as
    DeepEP's tests do): every tensor method the call uses (view, data_ptr, stride, ...) then goes through
    Python and costs about 3 us more: under DeepEP's test a cached normal dispatch spent 150-340 us on
    the host, 52-130 with the mode off (docs/results/2026-11-26i-h200x1). The calls are opaque
    communication ops, as DeepEP's C++ ones are to such modes; everything they allocate names its device
    and dtype."""
    off: Any = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal off
        if off is None:
            import torch
            off = torch._C.DisableTorchFunction
        with off():
            return fn(*args, **kwargs)
    return call  # type: ignore[return-value]


def profiled_range(name: str) -> Any:
    """torch.profiler.record_function(name) while a torch profiler runs, else a no-op context:
    entering a record_function costs host time on every call even when nobody profiles, and these
    ranges exist only to be seen in profiles."""
    import torch
    enabled = getattr(torch.autograd.profiler, "_is_profiler_enabled", None)
    if enabled is None or enabled:
        return torch.profiler.record_function(name)
    return _NO_RANGE


_NO_RANGE = contextlib.nullcontext()   # stateless and re-entrant: one serves every call


class OnceHook:
    """The receive hook a backend returns with return_recv_hook: runs the receive half once; calling
    it again is harmless (DeepEP's hooks behave the same)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Optional[Callable[[], None]] = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class CompletedEvent:
    """An event for work that already finished when the call returned (reference backend, or a
    synchronous native call)."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def wait(self) -> None:
        return None

    def current_stream_wait(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"CompletedEvent({self.what!r})"


@dataclass(frozen=True)
class PeerTransport:
    rank: int
    kind: str          # "local", "nvlink", "ibgda", "emulated", "reference", "inactive"
    detail: str = ""   # e.g. "mlx5_0 port 1, 2 QPs", "nccl all_to_all"

    def describe(self) -> str:
        return f"rank {self.rank}: {self.kind}" + (f" ({self.detail})" if self.detail else "")
