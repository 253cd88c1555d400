"""The event types the DeepEP and Mooncake shims hand out (deep_ep.utils.EventOverlap / EventHandle).

`EventHandle` is DeepEP's C++ event object (deep_ep_cpp / deep_ep._C): `EventHandle()` records an event
on the current CUDA stream; `current_stream_wait()` makes the current stream wait for it. Megatron-LM
builds `EventOverlap(EventHandle())` itself and passes it as previous_event; DeepEP V2's
`ElasticBuffer.capture()` returns one. `.event` is the torch.cuda.Event behind it (None on CPU, where
every call is synchronous), so pyep's normal mode takes it as previous_event like its own events.

`EventOverlap` is the wrapper both DeepEP versions return: V1's interface (`event`, `extra_tensors`,
`current_stream_wait()`, `with event:`) plus V2's additions (`current_stream_wait(release_handle)`,
`register_hook_after_wait`, `with event(release_handle=True):`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

if TYPE_CHECKING:
    import torch

__all__ = ["EventHandle", "EventOverlap"]


class EventHandle:
    """DeepEP's EventHandle: constructed without arguments it records an event on the current stream.
    The shims also make one around an event they recorded (`EventHandle.of`), with the wait of the call
    that made it, so `wait()` still raises what the device recorded for that call."""

    __slots__ = ("_event", "_device", "_wait")

    def __init__(self) -> None:
        import torch
        self._wait: Optional[Callable[[], None]] = None
        self._event: Optional["torch.cuda.Event"] = None
        self._device: Optional["torch.device"] = None
        if torch.cuda.is_available():
            self._device = torch.device("cuda", torch.cuda.current_device())
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self._device))

    @classmethod
    def of(cls, event: Optional["torch.cuda.Event"], device: Optional["torch.device"],
           wait: Optional[Callable[[], None]] = None) -> "EventHandle":
        """A handle of an event already recorded (None: the work is complete). `wait` is the bounded
        host wait of the call behind it (pyep's NormalEvent.wait), used by `wait()`."""
        h = cls.__new__(cls)
        h._event, h._device, h._wait = event, device, wait
        return h

    @property
    def event(self) -> Optional["torch.cuda.Event"]:
        return self._event

    def current_stream_wait(self) -> None:
        """The current stream waits for the event (no host blocking)."""
        if self._event is not None:
            import torch
            torch.cuda.current_stream(self._device).wait_event(self._event)

    def wait(self) -> None:
        """pyep extension: block the host until the work finished (bounded), then raise errors the
        device recorded for it."""
        if self._wait is not None:
            self._wait()
        elif self._event is not None:
            # A captured stream point has no call of its own: bound the wait like a call with the
            # default peer timeout (the work ahead of it is pyep calls at most that slow).
            from ..ep.config import DEFAULT_TIMEOUT_US
            from ..ep.normal.events import wait_bound_s
            from ..ep.streams import wait_event_bounded
            wait_event_bounded(self._event, wait_bound_s(DEFAULT_TIMEOUT_US), "EventHandle")

    def __repr__(self) -> str:
        return f"EventHandle({'cuda' if self._event is not None else 'complete'})"


class EventOverlap:
    """DeepEP/Mooncake's event wrapper: `event`, `extra_tensors` (kept alive until the wrapper goes, as
    DeepEP does for async calls), current_stream_wait() and `with event:` overlap blocks (V2: also
    `with event(release_handle=True):`, and a hook run after the wait)."""

    def __init__(self, event: Any = None, extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Optional[Callable[[], None]] = None
        self._release_on_exit = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        if self.event is None:
            raise RuntimeError("EventOverlap.current_stream_wait(): this wrapper holds no event")
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], None]) -> None:
        """V2: run `hook_after_wait()` once, right after the next current_stream_wait()."""
        if self.hook_after_wait is not None:
            raise RuntimeError("EventOverlap: a hook is already registered")
        self.hook_after_wait = hook_after_wait

    def wait(self) -> None:
        """pyep extension: block the host until the work finished (bounded), then raise errors the
        device recorded for it."""
        if self.event is not None:
            self.event.wait()

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        self._release_on_exit = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_on_exit)
        self._release_on_exit = False
