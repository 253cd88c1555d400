"""CUDA stream and event helpers of the native backend: the hot-path stream query and the bounded
event that async_finish returns."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    import torch


def _raw_stream_getter() -> Optional[Callable[[int], int]]:
    try:
        import torch
        return getattr(torch._C, "_cuda_getCurrentRawStream", None)
    except ImportError:
        return None


_RAW_STREAM = _raw_stream_getter()


def raw_current_stream(device: "torch.device") -> int:
    """cudaStream_t of the current stream on `device`. torch.cuda.current_stream() builds a Stream
    object through several Python layers (about 25 us per call measured on the GPU hosts, more than
    a kernel launch); the launch only needs the handle."""
    if _RAW_STREAM is not None:
        return int(_RAW_STREAM(device.index))
    import torch
    return int(torch.cuda.current_stream(device).cuda_stream)


def wait_event_bounded(event: "torch.cuda.Event", bound_s: float, what: str) -> None:
    """Block the host until `event` completed, polling with a growing pause; TimeoutError naming `what`
    after bound_s (a kernel waits at most timeout_us per peer, so longer means the GPU is blocked)."""
    deadline = time.monotonic() + bound_s
    pause = 20e-6
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish within {bound_s:.1f} s on the device (its kernels wait "
                               f"at most timeout_us per peer; a longer stall means the GPU is blocked by other work)")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


class NativeEvent:
    """EventLike over a CUDA event; wait() is bounded and names the operation."""

    def __init__(self, event: "torch.cuda.Event", device: "torch.device", what: str, bound_s: float) -> None:
        self._event = event
        self._device = device
        self.what = what
        self.bound_s = bound_s

    def wait(self) -> None:
        wait_event_bounded(self._event, self.bound_s, self.what)

    def current_stream_wait(self) -> None:
        import torch
        torch.cuda.current_stream(self._device).wait_event(self._event)

    def __repr__(self) -> str:
        return f"NativeEvent({self.what!r})"
