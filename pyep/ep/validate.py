"""Argument checks every buffer of either mode builds on (a bool, a tensor's dtype/shape/device/layout, a
timeout). Wrong Python/torch types and dtypes raise TypeError; wrong shapes, devices, layouts and values
raise ValueError. Every message names the argument, what was expected and what was given. The modes'
own checks are pyep.ep.ll.validate and pyep.ep.normal.validate."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from .config import DEFAULT_TIMEOUT_US

if TYPE_CHECKING:
    import torch

Shape = Sequence[Optional[int]]   # None: any size in that dimension


def _fmt_shape(shape: Shape) -> str:
    return "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


def check_tensor(name: str, t: Any, *, dtype: "torch.dtype", shape: Shape, device: "torch.device",
                 contiguous: bool = True) -> "torch.Tensor":
    import torch
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    got_shape = t.shape
    if len(got_shape) != len(shape):
        raise ValueError(f"{name} must have shape {_fmt_shape(shape)}, got {list(got_shape)}")
    for got, want in zip(got_shape, shape):   # a plain loop: this runs several times in every call
        if want is not None and got != want:
            raise ValueError(f"{name} must have shape {_fmt_shape(shape)}, got {list(got_shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {list(t.stride())} for shape "
                         f"{list(t.shape)})")
    return t


def check_aligned(name: str, t: "torch.Tensor") -> None:
    """The kernels move rows with 16-byte vector accesses: a contiguous tensor can still start at an odd
    element (a slice of a flat tensor), and such a load faults the whole CUDA context."""
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address (got {t.data_ptr():#x}); "
                         f"pass a freshly allocated or .clone()d tensor")


def check_timeout(name: str, value: Any, default: int = DEFAULT_TIMEOUT_US) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (microseconds) or None, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0 microseconds, got {value}")
    return value
