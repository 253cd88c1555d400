"""A handle combined again (NativeBackend._settle_repeated_combine): the first combine of a handle never
waits; a later one refuses an uncalled receive hook and graph capture, and otherwise synchronises the
device and passes a bounded barrier before it launches. Checked on the CPU with the backend's own
method and recorded device / control calls (the GPU test is repeated_combine in ep_native_cases.py)."""
from __future__ import annotations

from typing import Any, List

import pytest

torch = pytest.importorskip("torch")

from pyep.ep.backend import OnceHook  # noqa: E402
from pyep.ep.handle import Handle  # noqa: E402
from pyep.ep.native import NativeBackend  # noqa: E402


class _Control:
    def __init__(self) -> None:
        self.barriers: List[str] = []

    def barrier(self, timeout_s: float, what: str) -> None:
        assert timeout_s > 0
        self.barriers.append(what)


def _backend(monkeypatch: Any, capturing: bool = False) -> Any:
    b = NativeBackend.__new__(NativeBackend)
    b.control = _Control()
    b.device = torch.device("cpu")
    b._setup_timeout_s = 30.0
    syncs: List[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    b.syncs = syncs
    return b


def _handle(**extras: Any) -> Any:
    h = Handle.__new__(Handle)
    object.__setattr__(h, "extras", dict(extras))
    object.__setattr__(h, "seq", 7)
    return h


def test_first_combine_never_waits(monkeypatch: Any) -> None:
    b = _backend(monkeypatch)
    b._settle_repeated_combine(_handle())
    assert b.syncs == [] and b.control.barriers == []


def test_second_combine_synchronises_then_barriers(monkeypatch: Any) -> None:
    b = _backend(monkeypatch)
    hook = OnceHook(lambda: None)
    hook()
    b._settle_repeated_combine(_handle(combined=1, combine_hook=hook))
    assert len(b.syncs) == 1 and len(b.control.barriers) == 1
    assert "combine #2 of dispatch #7" in b.control.barriers[0]


def test_uncalled_hook_is_refused_before_any_wait(monkeypatch: Any) -> None:
    b = _backend(monkeypatch)
    with pytest.raises(ValueError, match="receive hook was not called"):
        b._settle_repeated_combine(_handle(combined=1, combine_hook=OnceHook(lambda: None)))
    assert b.syncs == [] and b.control.barriers == []


def test_repeated_combine_in_graph_capture_is_refused(monkeypatch: Any) -> None:
    b = _backend(monkeypatch, capturing=True)
    with pytest.raises(ValueError, match="CUDA graph capture"):
        b._settle_repeated_combine(_handle(combined=2, combine_hook=None))
    assert b.syncs == [] and b.control.barriers == []


def test_fast_path_leaves_repeated_combines_to_the_python_path() -> None:
    b = NativeBackend.__new__(NativeBackend)
    b._fast = object()          # any fast path: it must not be reached
    b._buf = 1234
    h = _handle(buffer=1234, backend="native", combined=1)
    assert b.fast_combine(None, None, None, h, None, None, None, False) is None
