"""A handle combined again, host side (pyep.ep.ll.native): the backend counts combines per handle in its
extras and flags the second and later ones `repeat`, so the kernel waits for every destination's
acknowledgement (engine/kernels/ll_ack.cuh; the device side is tested in tests/test_ll_sim_repeat.py, the GPU
case is repeated_combine in tests/ep_native_cases.py). Checked on the CPU with the backend's own
methods and a recording engine."""
from __future__ import annotations

from typing import Any, List

import pytest

torch = pytest.importorskip("torch")

from pyep.ep.ll.contract import CombineOptions
from pyep.ep.backend import OnceHook
from pyep.ep.ll.handle import Handle
from pyep.ep.ll.layout import ll_buffer_layout
from pyep.ep.ll.native import COMBINED, RECV_PENDING, NativeBackend

N, K, H = 4, 2, 256


class _Engine:
    def __init__(self) -> None:
        self.launches: List[tuple] = []

    def combine(self, static: Any, *args: Any, repeat: bool = False, **kw: Any) -> None:
        self.launches.append((args[12], repeat))      # (phases, repeat)


class _Fast:
    def __init__(self, take: bool = True) -> None:
        self.calls: List[bool] = []
        self.take = take

    def combine(self, *args: Any) -> Any:
        self.calls.append(args[-2])                    # repeat (then the call number)
        return torch.zeros(N, H, dtype=torch.bfloat16) if self.take else None


def _backend(monkeypatch: Any, capturing: bool = False) -> Any:
    b = NativeBackend.__new__(NativeBackend)
    b._destroyed = False
    b.rank = 0
    b._buf = 1234
    b._static = None
    b._ep = _Engine()
    b._fast = None
    b.device = torch.device("cpu")
    b.layout = ll_buffer_layout(8, H, 4, 2, K)
    b._active = torch.ones(2, dtype=torch.int32)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)

    def run_phases(launch, async_finish, recv_hook, keep, hook_name, what, timeout_us):
        if recv_hook:
            launch(1, 0)
            return None, OnceHook(lambda: launch(2, 0))
        launch(3, 0)
        return None, None
    b._run_phases = run_phases
    return b


def _handle() -> Any:
    h = Handle.__new__(Handle)
    for name, v in (("src_info", torch.zeros(2, 16, dtype=torch.int32)),
                    ("layout_range", torch.zeros(2, 2, dtype=torch.int64)), ("seq", 7), ("num_tokens", N),
                    ("num_topk", K),
                    ("extras", {"backend": "native", "half": 1, "topk_slot": torch.zeros(2, 16, dtype=torch.int32),
                                "buffer": 1234})):
        object.__setattr__(h, name, v)
    return h


def _combine(b: Any, h: Any, hook: bool = False) -> Any:
    opts = CombineOptions(active_ranks=None, timeout_us=1000, zero_copy=False, async_finish=False,
                          return_recv_hook=hook, out=None)
    x = torch.zeros(2, 16, H, dtype=torch.bfloat16)
    return b.combine(x, torch.zeros(N, K, dtype=torch.int64), torch.zeros(N, K), h, opts)


def test_second_and_later_combines_are_flagged_repeat(monkeypatch: Any) -> None:
    b = _backend(monkeypatch)
    h = _handle()
    for _ in range(3):
        _combine(b, h)
    assert b._ep.launches == [(3, False), (3, True), (3, True)]
    assert h.extras[COMBINED] == 3
    other = _handle()                      # another handle starts again at its first combine
    _combine(b, other)
    assert b._ep.launches[-1] == (3, False)


def test_a_captured_combine_is_flagged_repeat(monkeypatch: Any) -> None:
    """A graph may replay a captured combine on the same handle: it waits like a repeated one."""
    b = _backend(monkeypatch, capturing=True)
    _combine(b, _handle())
    assert b._ep.launches == [(3, True)]


def test_uncalled_receive_hook_refuses_the_next_combine(monkeypatch: Any) -> None:
    b = _backend(monkeypatch)
    h = _handle()
    res = _combine(b, h, hook=True)
    assert h.extras[RECV_PENDING] is True
    with pytest.raises(ValueError, match="receive hook was not called"):
        _combine(b, h)
    assert b._ep.launches == [(1, False)]  # the refused combine launched nothing
    res.hook()
    assert h.extras[RECV_PENDING] is False
    _combine(b, h)
    assert b._ep.launches == [(1, False), (2, False), (3, True)]


def test_fast_path_counts_and_passes_repeat(monkeypatch: Any) -> None:
    b = _backend(monkeypatch)
    b._fast = _Fast()
    h = _handle()
    for _ in range(3):
        assert b.fast_combine(None, None, None, h, None, None, None, False) is not None
    assert b._fast.calls == [False, True, True] and h.extras[COMBINED] == 3
    _combine(b, h)                         # the Python path continues the same count
    assert b._ep.launches == [(3, True)] and h.extras[COMBINED] == 4


def test_fast_path_declines_while_a_hook_is_pending_and_counts_only_what_it_ran(monkeypatch: Any) -> None:
    b = _backend(monkeypatch)
    b._fast = _Fast()
    h = _handle()
    _combine(b, h, hook=True)
    assert b.fast_combine(None, None, None, h, None, None, None, False) is None
    assert b._fast.calls == []             # left to the Python path, which raises
    b._fast = _Fast(take=False)
    h2 = _handle()
    assert b.fast_combine(None, None, None, h2, None, None, None, False) is None
    assert h2.extras.get(COMBINED, 0) == 0  # a declined call is not a combine
