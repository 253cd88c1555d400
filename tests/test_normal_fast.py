"""The normal mode's C++ fast path, its Python side on the CPU (pyep/ep/normal/native_fast.py): the switch,
what NormalFast is told of the backend's state, how plans are kept on a handle, and which calls
NormalBuffer hands to it (a reference buffer on 2 gloo ranks with a stand-in fast path). The fast path
itself (engine/bindings/normal_fast_bind.cpp) runs in tests/test_normal_gpu.py (normal_gpu_fast.fast_path)."""
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
        self._fast = SimpleNamespace(ready=None, voids_seen=None, geo_ring=-1, geo_slot=-1, pool=object(), pull=None)
        self._pool, self._pull = object(), True
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
    assert b._fast.pull is True, "pull offers follow the pool and PYEP_NORMAL_PULL, not the state"
    b._pull = False
    b._sync_fast()
    assert b._fast.pull is False


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


# ------------------------------------------------------------------ NormalBuffer's routing to the fast path
class FakeFast:
    """Stands in for NormalFast on a reference buffer: records what reaches it; `take` says whether it
    takes a call (returns a marker) or declines it (None)."""

    def __init__(self) -> None:
        self.seen: List[Any] = []
        self.take = True
        self.epoch = 0

    def dispatch(self, plan: Any, x: Any) -> Any:
        self.seen.append(("dispatch", plan))
        return torch.full((1, 1), 7.0) if self.take else None

    def combine(self, plan: Any, x: Any, weights: Any) -> Any:
        self.seen.append(("combine", plan))
        return (torch.full((1, 1), 8.0), None) if self.take else None


def _routing_case() -> str:
    import torch.autograd.profiler as prof
    import torch.distributed as dist

    from pyep.ep.normal import Config, NormalBuffer
    me = dist.get_rank()
    buf = NormalBuffer(hidden=256, backend="reference")
    fake = FakeFast()
    made: List[Any] = []

    def fast_plan(handle: Any, config: Any, hidden: int, epoch: int) -> Any:
        made.append((config, hidden, epoch))
        return f"plan {len(made)}"

    buf.backend.fast_plan, buf.backend.fast = fast_plan, fake
    cfg = Config(6, 4, 32)
    g = torch.Generator().manual_seed(me)
    x = torch.randn((40, 256), generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 8, (40, 2), generator=g)
    w = torch.rand((40, 2), generator=g)
    lay = buf.get_dispatch_layout(idx, 8)
    recv, _, rw, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                                             num_tokens_per_expert=lay[2], topk_idx=idx, topk_weights=w, config=cfg)
    assert not handle.fast_plans and not fake.seen, "a dispatch without a handle made a plan"
    first = buf.dispatch(x, handle=handle, config=cfg)               # Python path: the plan is made
    assert fake.seen == [] and made == [(cfg, 256, 0)], (fake.seen, made)
    taken = buf.dispatch(x, handle=handle, config=cfg)               # taken by the fast path
    assert fake.seen == [("dispatch", "plan 1")] and float(taken[0][0, 0]) == 7.0
    assert taken[1:5] == (None, None, None, None) and "dispatch" in taken[5].what
    fake.take = False                                                # declined: the Python path's result
    again = buf.dispatch(x, handle=handle, config=cfg)
    assert len(fake.seen) == 2 and torch.equal(again[0], first[0])
    fake.take = True
    for kw in (dict(async_finish=True, previous_event=buf.capture()), dict(expert_alignment=2)):
        buf.dispatch(x, handle=handle, config=cfg, **kw)[5].wait()   # never the fast path
    assert len(fake.seen) == 2, fake.seen
    other = Config(6, 4, 32)                                         # equal, but another object: a new plan
    buf.dispatch(x, handle=handle, config=other)
    assert len(fake.seen) == 2 and len(made) == 2
    prof._is_profiler_enabled = True                                 # a running profiler: the Python path
    try:
        buf.dispatch(x, handle=handle, config=cfg)
    finally:
        prof._is_profiler_enabled = False
    assert len(fake.seen) == 2
    y = recv.clone()
    buf.combine(y, handle, topk_weights=rw, config=cfg)              # Python path, plan made
    out = buf.combine(y, handle, topk_weights=rw, config=cfg)
    assert fake.seen[-1] == ("combine", "plan 3") and float(out[0][0, 0]) == 8.0
    buf.combine(y, handle, topk_weights=rw, config=cfg, bias=torch.zeros((40, 256), dtype=torch.bfloat16))
    assert len(fake.seen) == 3, "a combine with a bias reached the fast path"
    buf.clean()
    assert fake.epoch == 1, "clean() did not tell the fast path the new generation"
    buf.destroy()
    assert buf._fast is None
    return "ok"


def test_buffer_routes_plain_calls_with_a_plan_to_the_fast_path(pool2: Any) -> None:
    """NormalBuffer on the reference backend with a stand-in fast path: the first plain cached dispatch
    or combine of a handle and config argument makes the plan, the next ones reach the fast path (its
    result returned, its decline leaving the call to the Python path); events, expert_alignment, a bias,
    another config object and a running profiler keep calls on the Python path; clean() and destroy()
    reach it."""
    assert pool2.run(_routing_case) == ["ok", "ok"]
