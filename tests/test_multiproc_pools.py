"""tests/multiproc.py LazyPools: the workers of a module's pools share a GPU's work queues."""
from __future__ import annotations

import os

from multiproc import LazyPools


def _connections() -> str:
    return os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset")


def test_pools_share_one_budget_and_close_the_others_past_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from pyep.softnic.cuda_env import connections_for
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    pools = LazyPools(planned=4, start_timeout_s=120.0)
    try:
        one = pools[1]
        # Alone, one worker would take 32 queues; it takes a share of the 4 planned processes.
        assert one.run(_connections, timeout_s=60) == [str(connections_for(4))] == ["24"]
        two = pools[2]
        assert two.run(_connections, timeout_s=60) == ["24", "24"]
        assert sorted(pools) == [1, 2] and one.running() and two.running()
        # 1 + 2 + 4 workers exceed the plan: the 1- and 2-rank pools are closed before the 4-rank one starts.
        assert pools[4].run(_connections, timeout_s=60) == ["24"] * 4
        assert sorted(pools) == [4] and not one.running() and not two.running()
    finally:
        pools.close()
