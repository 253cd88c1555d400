"""The normal mode's C++ fast path, its Python side on the CPU (pyep/ep/normal/native_fast.py): the switch,
what NormalFast is told of the backend's state, and how plans are kept on a handle. The fast path itself
(engine/bindings/normal_fast_bind.cpp) runs in tests/test_normal_gpu.py (normal_gpu_fast.fast_path)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, List

import pytest
import torch

from pyep.ep.normal.handle import NormalHandle
from pyep.ep.normal.native_fast import FAST_ENV, MAX_FAST_PLANS, NativeFastPath, fast_enabled, remember_plan
from pyep.ep.normal.tags import KIND_CACHED, KIND_COMBINE


def test_switch(monkeypatch: Any) -> None:
    monkeypatch.delenv(FAST_ENV, raising=False)
    assert fast_enabled()
    monkeypatch.setenv(FAST_ENV, "0")
    assert not fast_enabled()
    monkeypatch.setenv(FAST_ENV, "yes")
    with pytest.raises(ValueError, match=FAST_ENV):
        fast_enabled()


class Backend(NativeFastPath):
    """The state NativeFastPath reads, with a stand-in for NormalFast."""

    def __init__(self) -> None:
        self._fast = SimpleNamespace(ready=None, voids_seen=None, geo_ring=-1, geo_slot=-1, pool=object())
        self._broken = self._destroyed = False
        self._mask = None
        self._grace_left = 0
        self._geometry = None
        self.records = SimpleNamespace(voids_seen=0)


@pytest.mark.parametrize("change", ["none", "broken", "destroyed", "mask", "grace"])
def test_ready_only_in_the_plain_state(change: str) -> None:
    b = Backend()
    if change == "broken":
        b._broken = True
    elif change == "destroyed":
        b._destroyed = True
    elif change == "mask":
        b._mask = torch.ones(2, dtype=torch.int32)
    elif change == "grace":
        b._grace_left = 3
    b._sync_fast()
    assert b._fast.ready is (change == "none")


def test_voids_and_geometry_follow_the_python_path() -> None:
    b = Backend()
    b.records.voids_seen, b._geometry = 4, (256, 14592)
    b._sync_fast()
    assert (b._fast.voids_seen, b._fast.geo_ring, b._fast.geo_slot) == (4, 256, 14592)
    b._close_fast()
    assert b._fast.ready is False and b._fast.pool is None


def _handle() -> NormalHandle:
    i32 = torch.int32
    return NormalHandle(torch.zeros(2, 2, dtype=i32), torch.zeros(2, 4, dtype=i32), torch.zeros(2, 4, dtype=i32),
                        torch.zeros(8, dtype=i32), torch.zeros(8, 2, dtype=torch.bool), torch.zeros(8, 2, dtype=i32),
                        owner="o", epoch=0, num_channels=4, num_tokens=8, num_recv_tokens=8, num_worst_tokens=0,
                        hidden=128, num_topk=2)


class PlanMaker:
    fast = "the NormalFast"

    def __init__(self) -> None:
        self.made: List[Any] = []

    def fast_plan(self, handle: Any, config: Any, hidden: int, epoch: int) -> Any:
        self.made.append((config, hidden, epoch))
        return f"plan {len(self.made)}"


def test_plans_kept_per_kind_and_config_argument() -> None:
    b, h = PlanMaker(), _handle()
    cfg = object()
    assert remember_plan(b, KIND_CACHED, h, None, "default", 128, 0) == "the NormalFast"
    assert remember_plan(b, KIND_CACHED, h, None, "default", 128, 0) == "the NormalFast"   # kept: not made again
    remember_plan(b, KIND_COMBINE, h, None, "default", 128, 0)
    remember_plan(b, KIND_CACHED, h, cfg, cfg, 128, 0)
    assert len(b.made) == 3
    assert h.fast_plans[(KIND_CACHED, id(None))] == (None, "plan 1")
    assert h.fast_plans[(KIND_CACHED, id(cfg))] == (cfg, "plan 3")   # the config is kept with its plan
    assert repr(h).count("plan") == 0 and h == h                       # not part of the handle's repr


def test_plans_bounded_and_absent_without_a_fast_path() -> None:
    b, h = PlanMaker(), _handle()
    configs = [object() for _ in range(MAX_FAST_PLANS + 5)]
    for c in configs:
        remember_plan(b, KIND_CACHED, h, c, c, 128, 0)
    assert len(h.fast_plans) == MAX_FAST_PLANS
    h2 = _handle()
    assert remember_plan(SimpleNamespace(), KIND_CACHED, h2, None, "default", 128, 0) is None   # reference backend
    assert h2.fast_plans == {}
