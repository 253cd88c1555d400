"""The job's TCPStore, listening on one address only. c10d's TCPStore server binds every interface;
given a socket that is already listening (master_listen_fd) it serves that one instead, so the
launcher and the drill bind it to the address their ranks use (127.0.0.1 for single-machine jobs) and
nothing on other interfaces can reach it (docs/elastic.md, "Threat model")."""
from __future__ import annotations

import datetime
import socket
from typing import Any


class JobStore:
    """A master TCPStore on (host, port) only; port 0 picks a free one."""

    def __init__(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        import torch.distributed as dist
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=1024)
        self.host = host
        self.port = int(sock.getsockname()[1])
        try:
            self.store: Any = dist.TCPStore(host, self.port, world_size, is_master=True, wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=timeout_s),
                                            master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()
            raise
        sock.detach()       # the store's server serves on this descriptor and closes it when destroyed

    def close(self) -> None:
        self.store = None
