"""The one-copy dispatch output pool's bookkeeping on the CPU (pyep/ep/normal/direct_pool.py): first-fit
placement, a region taken for as long as torch keeps its array-interface object (here: a list standing in
for the caller's tensors), no region when nothing fits, and the stream order of reuse: a region freed on
another stream makes the new launch stream wait for an event recorded there; on the same stream nothing
is recorded. The GPU side (torch's views of pool memory, peers writing into them, outputs kept past later
calls) is tests/test_normal_gpu.py's one-copy case."""
from __future__ import annotations

from typing import Any, List, Tuple

import pytest
import torch

from pyep.ep.normal.direct_pool import OutputLayout, OutputPool, output_pool_hint, pool_bounds


class FakeEp:
    def __init__(self) -> None:
        self.calls: List[Tuple[str, int, int]] = []

    def event_create(self) -> int:
        return 77

    def event_destroy(self, ev: int) -> None:
        self.calls.append(("destroy", ev, 0))

    def event_record(self, ev: int, stream: int) -> None:
        self.calls.append(("record", ev, stream))

    def stream_wait_event(self, stream: int, ev: int) -> None:
        self.calls.append(("wait", stream, ev))


class FakeMemory:
    ptr = 1 << 20


@pytest.fixture
def pool(monkeypatch: Any) -> Tuple[OutputPool, List[Any], FakeEp]:
    held: List[Any] = []   # the caller's tensors: their regions live while listed

    def as_tensor(region: Any, dtype: Any, device: Any) -> torch.Tensor:
        held.append(region)
        return torch.zeros(region.__cuda_array_interface__["shape"][0], dtype=dtype)
    monkeypatch.setattr(torch, "as_tensor", as_tensor)
    ep = FakeEp()
    lay = OutputLayout.of(64, 256, 2, False, 4)
    return OutputPool(FakeMemory(), 1024, 1024 + 2 * lay.total + 128, torch.device("cpu"), ep), held, ep


def test_first_fit_hold_and_release(pool: Tuple[OutputPool, List[Any], FakeEp]) -> None:
    p, held, ep = pool
    a = p.outputs(64, 256, torch.bfloat16, False, 4, 5, 5)
    b = p.outputs(64, 256, torch.bfloat16, False, 4, 5, 5)
    assert a is not None and b is not None
    assert tuple(a.recv_x.shape) == (64, 256) and a.recv_x.dtype == torch.bfloat16
    assert p.outputs(64, 256, torch.bfloat16, False, 4, 5, 5) is None, "a third output cannot fit"
    first = held.pop(0)              # the caller frees the first outputs
    del first
    c = p.outputs(64, 256, torch.bfloat16, False, 4, 5, 5)
    assert c is not None and c.stage == a.stage, "the freed region is reused first"
    assert ep.calls == [], "reuse on the stream the outputs were made for needs no event"
    assert p.held_bytes() == 2 * OutputLayout.of(64, 256, 2, False, 4).total


def test_spare_outputs_leave_as_much_free(pool: Tuple[OutputPool, List[Any], FakeEp]) -> None:
    """spare=True (a ring-path dispatch's recv_x, for a pull combine): placed only where as much again stays
    free behind it, so that a one-copy dispatch of the same size still finds room."""
    p, held, ep = pool
    a = p.outputs(64, 256, torch.bfloat16, False, 4, 5, 5, spare=True)
    assert a is not None, "an empty pool of room for two takes a spare output"
    assert p.outputs(64, 256, torch.bfloat16, False, 4, 5, 5, spare=True) is None, "no room for two behind it"
    b = p.outputs(64, 256, torch.bfloat16, False, 4, 5, 5)
    assert b is not None and b.stage != a.stage, "the room a spare output left is a one-copy output's"
    held.clear()
    assert p.outputs(32, 256, torch.bfloat16, False, None, 5, 5, spare=True) is not None


def test_pull_switch(monkeypatch: Any) -> None:
    from pyep.ep.normal.direct_pool import pull_combine_enabled
    monkeypatch.delenv("PYEP_NORMAL_PULL", raising=False)
    assert pull_combine_enabled()
    monkeypatch.setenv("PYEP_NORMAL_PULL", "0")
    assert not pull_combine_enabled()
    for bad in ("", "on", "2"):
        monkeypatch.setenv("PYEP_NORMAL_PULL", bad)
        with pytest.raises(ValueError, match="PYEP_NORMAL_PULL must be 0"):
            pull_combine_enabled()


def test_reuse_on_another_stream_waits(pool: Tuple[OutputPool, List[Any], FakeEp]) -> None:
    p, held, ep = pool
    p.outputs(32, 256, torch.float8_e4m3fn, True, None, 5, 9)    # async: launch 5, caller 9
    held.clear()
    out = p.outputs(32, 256, torch.float8_e4m3fn, True, None, 6, 6)
    assert out is not None and out.stage == 0 and out.recv_x_scales is not None
    assert tuple(out.recv_x_scales.shape) == (32, 2)
    assert ep.calls == [("record", 77, 5), ("wait", 6, 77), ("record", 77, 9), ("wait", 6, 77)]
    p.close()
    assert ep.calls[-1] == ("destroy", 77, 0)


def test_sizes() -> None:
    lay = OutputLayout.of(10, 256, 1, True, 8)
    assert lay.scales == 2560 and lay.stage == lay.user_bytes == 2560 + 128
    assert lay.total == lay.user_bytes + (10 * (8 * 8 + 4) + 127) // 128 * 128
    assert pool_bounds(100 << 20, 50 << 20) == (50 << 20, 100 << 20)
    assert pool_bounds(60 << 20, 50 << 20) == (0, 0), "less than POOL_MIN_BYTES: no pool"
    assert output_pool_hint(2, 100, 256) >= 3 * 200 * 512


def test_constants_match_the_kernels() -> None:
    """layout.py's descriptor words and the staging row size are the kernels' (normal_launch.h)."""
    import os
    import re

    from pyep.ep.normal.direct_pool import stage_row_bytes
    from pyep.ep.normal.limits import DESC_INTS
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = open(os.path.join(root, "engine", "kernels", "normal_launch.h")).read()
    assert int(re.search(r"constexpr int kDescInts = (\d+);", src).group(1)) == DESC_INTS
    m = re.search(r"stage_row_bytes\(int num_topk\) \{ return (\d+)u \* \(uint32_t\)num_topk \+ (\d+)u; \}", src)
    assert m is not None and all(int(m.group(1)) * k + int(m.group(2)) == stage_row_bytes(k) for k in range(17))


def test_one_copy_switch(monkeypatch: Any) -> None:
    from pyep.ep.normal.direct_pool import one_copy_enabled
    monkeypatch.delenv("PYEP_NORMAL_DIRECT", raising=False)
    assert one_copy_enabled()
    monkeypatch.setenv("PYEP_NORMAL_DIRECT", "0")
    assert not one_copy_enabled()
    monkeypatch.setenv("PYEP_NORMAL_DIRECT", "1")
    assert one_copy_enabled()
    for bad in ("", "yes", "2", " 1"):
        monkeypatch.setenv("PYEP_NORMAL_DIRECT", bad)
        with pytest.raises(ValueError, match="PYEP_NORMAL_DIRECT must be 0"):
            one_copy_enabled()


def test_pool_only_where_every_buffer_has_the_same_size() -> None:
    """native.py _settle_pool: a sender checks a peer's descriptor against its own pool, so ranks whose
    buffers differ in size keep no pool (every cached dispatch takes the ring path) instead of refusing
    each other's descriptors."""
    from types import SimpleNamespace

    from pyep.ep.normal.native import NormalNativeBackend
    closed: List[int] = []
    for sizes, kept in (([1 << 30] * 4, True), ([1 << 30, 1 << 30, (1 << 30) + 128, 1 << 30], False)):
        me = SimpleNamespace(rank=0, _bytes=1 << 30, _pool_lo=4096, _pool_hi=1 << 30,
                             _pool=SimpleNamespace(close=lambda: closed.append(1)))
        NormalNativeBackend._settle_pool(me, sizes)   # type: ignore[arg-type]
        assert (me._pool is not None) == kept
        assert (me._pool_lo, me._pool_hi) == ((4096, 1 << 30) if kept else (0, 0))
    assert closed == [1]
