"""Events and streams of the normal mode's front.

`NormalEvent` is what every NormalBuffer call returns: with async_finish a CUDA event recorded on the
launch stream, otherwise an event that is already complete (CPU devices, or the caller's stream
already waits for the work). `wait()` is bounded and then raises the error the device recorded for
the call (backend.check_errors), so a caller that only waits on events still sees InvalidExpertIndex,
WorstTokensExceeded or PeerTimeout. It also behaves like DeepEP's EventOverlap: `with event:` runs the
block and then makes the current stream wait.

`launch` does the stream bookkeeping DeepEP's C++ runtime does around each kernel: pick the launch
stream, make it wait for previous_event (or for the caller's stream), run the backend there, then
either record an event (async_finish) or make the caller's stream wait for it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Tuple, TypeVar

from ..streams import wait_event_bounded

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
Check = Optional[Callable[[], None]]


# The host's waits for the kernels of a call, in kernel timeouts: a kernel gives up on a silent peer
# after one, on a peer that keeps beating (it waits on a third rank: normal_common.cuh PeerClock) or a
# column peer across nodes (normal_internode_relay.cu column_timeout_ns) after two; one more covers
# queued work ahead of them (previous_event, other streams) on a busy GPU.
HOST_BOUND_TIMEOUTS = 3


def wait_bound_s(timeout_us: int, slack_s: float = 1.0) -> float:
    """Host bound of a wait for a call's kernels (an event, or a pinned word they set)."""
    return HOST_BOUND_TIMEOUTS * timeout_us / 1e6 + slack_s


class NormalEvent:
    """The event of one NormalBuffer call (DeepEP EventOverlap's interface, bounded wait)."""

    __slots__ = ("_event", "_device", "what", "bound_s", "_check", "num_dropped_tokens")

    def __init__(self, event: Optional["torch.cuda.Event"], device: Optional["torch.device"], what: str,
                 bound_s: float, check: Check = None) -> None:
        self._event = event          # None: the work was complete when the call returned
        self._device = device
        self.what = what
        self.bound_s = bound_s
        self._check = check
        # int32 [R]: tokens of this call routed to rank r that it did not deliver (r inactive: the
        # active_ranks mask, docs/elastic.md "Normal mode"); None where the backend drops nothing.
        self.num_dropped_tokens: Optional["torch.Tensor"] = None

    @property
    def cuda_event(self) -> Optional["torch.cuda.Event"]:
        return self._event

    @property
    def event(self) -> "NormalEvent":
        # DeepEP code passes `getattr(previous_event, "event", None)` around; resolving to the event
        # itself keeps such code working when it holds a NormalEvent instead of an EventOverlap.
        return self

    def query(self) -> bool:
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        """Block until the call's work finished (bounded), then raise what the device recorded."""
        if self._event is not None:
            wait_event_bounded(self._event, self.bound_s, self.what)
        if self._check is not None:
            self._check()

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the call (no host blocking)."""
        if self._event is not None:
            import torch
            torch.cuda.current_stream(self._device).wait_event(self._event)

    def __enter__(self) -> "NormalEvent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.current_stream_wait()

    def __repr__(self) -> str:
        state = "complete" if self._event is None else "cuda"
        return f"NormalEvent({self.what!r}, {state})"


def cuda_event_of(previous_event: Any) -> Optional["torch.cuda.Event"]:
    """The CUDA event behind what a caller passes as previous_event: a NormalEvent, an EventOverlap
    (pyep.compat or DeepEP style, `.event`), a pyep CompletedEvent or a torch.cuda.Event. None when
    there is nothing to wait for. validate.check_previous_event has accepted the type already."""
    if previous_event is None:
        return None
    if isinstance(previous_event, NormalEvent):
        return previous_event.cuda_event
    inner = getattr(previous_event, "event", None)
    if inner is not None and inner is not previous_event:
        return cuda_event_of(inner)
    import torch
    if torch.cuda.is_available() and isinstance(previous_event, torch.cuda.Event):
        return previous_event
    return None


def capture_current(what: str = "capture") -> NormalEvent:
    """An event recorded on the current CUDA stream (a complete one where there is no CUDA)."""
    import torch
    if not torch.cuda.is_available():
        return NormalEvent(None, None, what, 0.0)
    dev = torch.device("cuda", torch.cuda.current_device())
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(dev))
    return NormalEvent(ev, dev, what, wait_bound_s(10_000_000))


def launch(device: "torch.device", comm_stream: Callable[[], Any], fn: Callable[[], T], *, what: str,
           previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool, bound_s: float,
           check: Check, tensors: Callable[[T], Iterable[Optional["torch.Tensor"]]]) -> Tuple[T, NormalEvent]:
    """Run fn() (the backend call) on the right stream and return (its result, the call's event).

    CPU devices: everything is synchronous, fn() runs inline and the event is complete.
    CUDA: the launch stream is the buffer's comm stream with async_finish or allocate_on_comm_stream,
    else the current stream; it first waits for previous_event, or (comm stream) for the current
    stream, so fn's kernels see the caller's earlier work. `tensors(result)` lists every input and
    output tensor: with async_finish each is record_stream'ed on both streams, because inputs made on
    the caller's stream are read on the comm stream and outputs made on the comm stream are used on
    the caller's -- without it the caching allocator could hand their memory out too early.
    """
    if device.type != "cuda" or not (async_finish or allocate_on_comm_stream or previous_event is not None):
        # CPU, or the plain synchronous call: fn's kernels go on the current stream, which needs no
        # Stream object (building one costs more host time than a kernel launch).
        return fn(), NormalEvent(None, device, what, bound_s, check)
    import torch
    current = torch.cuda.current_stream(device)
    launch_stream = comm_stream() if (async_finish or allocate_on_comm_stream) else current
    prev = cuda_event_of(previous_event)
    if prev is not None:
        launch_stream.wait_event(prev)
    elif launch_stream != current:
        launch_stream.wait_stream(current)
    if launch_stream == current:
        result = fn()
    else:
        with torch.cuda.stream(launch_stream):
            result = fn()
    if async_finish:
        ev = torch.cuda.Event()
        ev.record(launch_stream)
        for t in tensors(result):
            if t is not None:
                t.record_stream(launch_stream)
                if launch_stream != current:
                    t.record_stream(current)
        return result, NormalEvent(ev, device, what, bound_s, check)
    if launch_stream != current:
        current.wait_stream(launch_stream)
    return result, NormalEvent(None, device, what, bound_s, check)
