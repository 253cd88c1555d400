"""Ranks on one machine for the store-based tests: c10d TCPStores (a master on a free port of 127.0.0.1,
and clients of it) and one thread per rank."""
from __future__ import annotations

import datetime
import threading
from typing import Any, Callable, List, Sequence


def master_store(timeout_s: float = 30.0) -> Any:
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def client_store(port: int, timeout_s: float = 30.0) -> Any:
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", port, 1, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def run_threads(fns: Sequence[Callable[[], Any]], timeout_s: float = 60.0) -> List[Any]:
    """fns[i]() in thread i, all at once; their results in order. A thread still running after timeout_s
    fails the test ("a rank thread hung"); the first exception of a thread is raised here."""
    out: List[Any] = [None] * len(fns)
    errs: List[BaseException] = []

    def body(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errs.append(exc)
    ts = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in ts), "a rank thread hung"
    if errs:
        raise errs[0]
    return out
