"""c10d TCPStores for the tests on one machine: a master on a free port of 127.0.0.1, and clients of it."""
from __future__ import annotations

import datetime
from typing import Any


def master_store(timeout_s: float = 30.0) -> Any:
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def client_store(port: int, timeout_s: float = 30.0) -> Any:
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", port, 1, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
