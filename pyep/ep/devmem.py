"""Device memory that pyep allocates itself (the engine's device_alloc), seen by torch without a copy.

DeviceArray describes `count` elements at a device address through the CUDA array interface, for
torch.as_tensor: torch keeps the object for as long as a tensor views the memory, and with it `owner`.
DeviceMemory frees its allocation when the last owner lets go, so a tensor that views it keeps it alive.
"""
from __future__ import annotations

from typing import Any


class DeviceArray:
    """`count` elements of `typestr` (the array interface's: "|u1" bytes, "<i4" int32) at `addr`."""

    def __init__(self, addr: int, count: int, typestr: str = "|u1", owner: Any = None) -> None:
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": typestr, "data": (addr, False), "version": 2}
        self.owner = owner


class DeviceMemory:
    """`nbytes` of device memory from `ep.device_alloc`, freed when this object is collected."""

    def __init__(self, ep: Any, nbytes: int) -> None:
        self.ep, self.ptr = ep, int(ep.device_alloc(nbytes))

    def __del__(self) -> None:
        if self.ptr:
            try:
                self.ep.device_free(self.ptr)
            except Exception:   # noqa: BLE001 - interpreter shutdown: the driver may be gone
                pass
            self.ptr = 0
