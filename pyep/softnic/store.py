"""Agreeing on a fabric id and exchanging connect blobs through a store (torch.distributed Store or any
object with set/get and optionally wait)."""
from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any, List

from .types import check_int


def new_fabric_id() -> int:
    return secrets.randbits(63) + 1


def agree_fabric_id(store: Any, rank: int, prefix: str = "pyep/softnic", timeout_s: float = 60.0) -> int:
    """Rank 0 picks a fabric id and publishes it in `store` (set/get, e.g. a torch.distributed Store)."""
    key = f"{prefix}/fabric_id"
    if rank == 0:
        store.set(key, str(new_fabric_id()).encode())
    _wait(store, [key], timeout_s)
    raw = store.get(key)
    try:
        return check_int("fabric_id", int(bytes(raw).decode()), 1, 2**64 - 1)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"store key {key} does not hold a softnic fabric id: {raw!r}") from exc


def exchange_blobs(store: Any, rank: int, world_size: int, blob: bytes, prefix: str = "pyep/softnic",
                   timeout_s: float = 60.0) -> List[bytes]:
    """Publishes this rank's connect blob and returns every rank's (index = rank)."""
    check_int("world_size", world_size, 1, 1 << 20)
    check_int("rank", rank, 0, world_size - 1)
    store.set(f"{prefix}/blob/{rank}", bytes(blob))
    keys = [f"{prefix}/blob/{r}" for r in range(world_size)]
    _wait(store, keys, timeout_s)
    return [bytes(store.get(k)) for k in keys]


def _wait(store: Any, keys: List[str], timeout_s: float) -> None:
    if hasattr(store, "wait"):
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
        except Exception as exc:  # torch raises DistStoreError / RuntimeError subclasses
            raise TimeoutError(f"softnic: waited {timeout_s} s for store keys {keys}: {exc}") from exc
