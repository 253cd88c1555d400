"""pyep.ep.normal.errors.RefusingArgs, the context of a normal call's host checks: a TypeError or
ValueError refuses the call on the peers (backend.refuse) and propagates, or gives way to an earlier
call's pending error; anything else passes through untouched."""
from __future__ import annotations

from typing import List, Optional, Tuple

import pytest

from pyep.ep.normal.errors import RefusingArgs


class FakeBackend:
    def __init__(self, problem: Optional[str] = None) -> None:
        self.problem = problem
        self.refused: List[Tuple[int, str]] = []

    def refuse(self, kind: int, reason: str) -> Optional[str]:
        self.refused.append((kind, reason))
        return self.problem


def test_a_bad_argument_is_refused_on_the_peers_and_raised() -> None:
    b = FakeBackend(problem="peer 1 refused it too")
    with pytest.raises(ValueError, match="x must be") as info:
        with RefusingArgs(b, 3, None):
            raise ValueError("x must be bf16")
    assert b.refused == [(3, "ValueError: x must be bf16")]
    assert any("peer 1 refused it too" in n for n in info.value.__notes__)


def test_a_pending_error_is_raised_in_its_place() -> None:
    b = FakeBackend()
    pending = RuntimeError("rank 1 timed out in the last dispatch")
    with pytest.raises(RuntimeError) as info:
        with RefusingArgs(b, 1, pending):
            raise TypeError("config must be a Config")
    assert info.value is pending and info.value.__suppress_context__
    assert b.refused == [(1, "TypeError: config must be a Config")]
    assert any("refused: TypeError: config must be a Config" in n for n in pending.__notes__)


def test_other_errors_and_clean_exits_refuse_nothing() -> None:
    b = FakeBackend()
    with pytest.raises(KeyError):
        with RefusingArgs(b, 2, RuntimeError("pending")):
            raise KeyError("not an argument problem")
    with RefusingArgs(b, 2, None):
        pass
    assert b.refused == []


def test_subclasses_of_value_error_count() -> None:
    class Narrow(ValueError):
        pass
    b = FakeBackend()
    with pytest.raises(Narrow):
        with RefusingArgs(b, 0, None):
            raise Narrow("n")
    assert b.refused == [(0, "Narrow: n")]
