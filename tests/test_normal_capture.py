"""CPU tests of what makes the native normal paths capturable in a CUDA graph (docs/normal_internode.md,
"CUDA graphs"): a dispatch that waits on the host is refused on the intranode path too; on the internode
path, which calls a capture refuses (NotCapturable, raised before
anything is launched: no kernel, no ring-depth settling, no relay launch), that the relay never
synchronises or waits on the host inside a capture, and the host's ticket for the count words it waits on
(the device call number's helpers: tests/test_normal_call_tags.py). The capture itself runs on the GPU:
tests/test_normal_internode_native_gpu.py::test_internode_native_cuda_graph."""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from typing import Any, List

import pytest

torch = pytest.importorskip("torch")

from pyep.ep.normal import internode_relay as relay_mod
from pyep.ep.normal import native as intranode
from pyep.ep.normal import native_internode as ni
from pyep.ep.normal.config import Config  # noqa: E402
from pyep.ep.normal.contract import CombineCall, DispatchCall  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Launched(Exception):
    """Raised by the fakes where the real backend would start launching work."""


def _fake_backend(drains: bool) -> Any:
    """A NormalInternodeBackend without a GPU: every launching part raises Launched."""
    b = ni.NormalInternodeBackend.__new__(ni.NormalInternodeBackend)
    b._warmed = set()
    b._broken = False
    b._zeros = {}
    b.relay = SimpleNamespace(drains=drains)

    def launch(*_a: Any, **_k: Any) -> None:
        raise Launched()
    b.node = SimpleNamespace(settle_ring_geometry=launch)
    return b


def _dispatch_call(nwt: int, cached: bool = False, fp8: bool = False) -> DispatchCall:
    n, h, k = 4, 128, 2
    x = torch.zeros(n, h, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    return DispatchCall(
        x=x, x_scales=torch.ones(n, 1) if fp8 else None,
        topk_idx=None if cached else torch.zeros(n, k, dtype=torch.int64),
        topk_weights=None if cached else torch.zeros(n, k), num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
        is_token_in_rank=torch.zeros(n, 4, dtype=torch.bool), num_tokens_per_expert=None,
        num_experts=0 if cached else 8, expert_alignment=1, num_worst_tokens=nwt, config=Config(),
        handle=SimpleNamespace(internode=object()) if cached else None, timeout_us=1000, seq=1)


def _combine_call(weights: bool) -> CombineCall:
    hd = SimpleNamespace(internode=object(), num_channels=Config().num_channels())
    return CombineCall(x=torch.zeros(4, 128, dtype=torch.bfloat16), topk_weights=torch.zeros(4, 2) if weights else None,
                       bias=(None, None), handle=hd, config=Config(), timeout_us=1000, seq=1)


@pytest.fixture
def capturing(monkeypatch: pytest.MonkeyPatch) -> List[bool]:
    state = [True]
    monkeypatch.setattr(ni, "stream_capturing", lambda: state[0])
    monkeypatch.setattr(relay_mod, "stream_capturing", lambda: state[0])
    return state


# ---------------------------------------------------------------------- which calls a capture refuses
def test_refusal_reasons() -> None:
    why = ni.capture_refusal("an internode dispatch", host_wait=True, drains=False, warmed=True)
    assert why is not None and "num_worst_tokens" in why and "an internode dispatch" in why
    why = ni.capture_refusal("an internode combine", host_wait=False, drains=True, warmed=False)
    assert why is not None and "CUDA_MODULE_LOADING=EAGER" in why and "eager call" in why
    assert ni.capture_refusal("x", host_wait=False, drains=True, warmed=True) is None
    assert ni.capture_refusal("x", host_wait=False, drains=False, warmed=False) is None   # a NIC, or EAGER loading


def test_intranode_dispatch_without_worst_tokens_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The intranode native backend refuses it before anything moves: before, it counted the call,
    captured the notify kernel and then timed out waiting on the host for counts (TimeoutError), with
    its call number ahead of its peers'. A cached dispatch or num_worst_tokens passes the gate."""
    b = intranode.NormalNativeBackend.__new__(intranode.NormalNativeBackend)
    b.device, b.num_ranks = torch.device("cpu"), 4

    def launch(*_a: Any, **_k: Any) -> None:
        raise Launched()
    b._settle_ring_geometry = launch
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ni.NotCapturable, match="a normal dispatch without num_worst_tokens"):
        b.dispatch(_dispatch_call(nwt=0))                     # not Launched: nothing ran, no call number moved
    for call in (_dispatch_call(nwt=8), _dispatch_call(nwt=0, cached=True)):
        with pytest.raises(Launched):
            b.dispatch(call)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(Launched):
        b.dispatch(_dispatch_call(nwt=0))


@pytest.mark.parametrize("drains", [False, True])
def test_dispatch_without_worst_tokens_is_refused_before_any_launch(capturing: List[bool], drains: bool) -> None:
    b = _fake_backend(drains)
    b._warmed.add(("dispatch", False, True, True, False))     # warmed or not: the host wait is the reason
    with pytest.raises(ni.NotCapturable, match="num_worst_tokens"):
        b.dispatch(_dispatch_call(nwt=0))
    assert isinstance(ni.NotCapturable("x"), ValueError)
    assert not b._broken and not b._warmed - {("dispatch", False, True, True, False)}


def test_unwarmed_calls_are_refused_on_a_draining_softnic(capturing: List[bool]) -> None:
    b = _fake_backend(drains=True)
    for call in (_dispatch_call(nwt=16), _dispatch_call(nwt=0, cached=True)):
        with pytest.raises(ni.NotCapturable, match="CUDA_MODULE_LOADING"):
            b.dispatch(call)
    with pytest.raises(ni.NotCapturable, match="CUDA_MODULE_LOADING"):
        b.combine(_combine_call(weights=True))


def test_eager_calls_warm_their_kind_only(capturing: List[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    """An eager call that completes marks its kind; a capture of that kind proceeds to the launches,
    one of another kind (FP8 instead of BF16, combine without weights) is still refused."""
    b = _fake_backend(drains=True)
    b.node = SimpleNamespace(settle_ring_geometry=lambda *a: None)
    monkeypatch.setattr(b, "_dispatch", lambda call: "dispatched", raising=False)
    monkeypatch.setattr(b, "_cached_dispatch", lambda call: "cached", raising=False)
    monkeypatch.setattr(b, "_combine", lambda call, st: "combined", raising=False)
    capturing[0] = False
    assert b.dispatch(_dispatch_call(nwt=16)) == "dispatched"
    assert b.dispatch(_dispatch_call(nwt=0, cached=True)) == "cached"
    assert b.combine(_combine_call(weights=True)) == "combined"
    capturing[0] = True
    assert b.dispatch(_dispatch_call(nwt=16)) == "dispatched"
    assert b.dispatch(_dispatch_call(nwt=0, cached=True)) == "cached"
    assert b.combine(_combine_call(weights=True)) == "combined"
    with pytest.raises(ni.NotCapturable):
        b.dispatch(_dispatch_call(nwt=16, fp8=True))
    with pytest.raises(ni.NotCapturable):
        b.dispatch(_dispatch_call(nwt=0, cached=True, fp8=True))
    with pytest.raises(ni.NotCapturable):
        b.combine(_combine_call(weights=False))
    n_warm = len(b._warmed)
    b.dispatch(_dispatch_call(nwt=16))                         # captured calls warm nothing
    assert len(b._warmed) == n_warm == 3


def test_layout_is_gated_like_the_calls(capturing: List[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    b = _fake_backend(drains=True)
    topk = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ni.NotCapturable, match="get_dispatch_layout"):
        b.get_dispatch_layout(topk, 8)
    b.device, b.num_ranks, b.nodes = torch.device("cpu"), 4, SimpleNamespace(num_nodes=2)
    b.contract_nodes = b.nodes
    b.node = SimpleNamespace(records=SimpleNamespace(num_experts=0))
    b._static = None
    b._r = SimpleNamespace(layout=lambda *a: None)
    monkeypatch.setattr(ni, "raw_current_stream", lambda dev: 0)
    capturing[0] = False
    b.get_dispatch_layout(topk, 8)
    capturing[0] = True
    assert b.get_dispatch_layout(topk, 8).num_tokens_per_rdma_rank.shape == (2,)


def test_a_nic_needs_no_warm_up(capturing: List[bool]) -> None:
    b = _fake_backend(drains=False)
    with pytest.raises(Launched):                              # got past the gate to the first launch step
        b.dispatch(_dispatch_call(nwt=16))
    with pytest.raises(Launched):
        b.combine(_combine_call(weights=True))


def test_zeros_made_inside_a_capture_are_not_cached(capturing: List[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    b = _fake_backend(drains=False)
    b.device = torch.device("cpu")
    z = b._zero(6)
    assert z.shape == (6,) and not b._zeros                   # replay-zeroed graph memory: never for eager calls
    capturing[0] = False
    assert b._zero(6) is b._zero(6) and 6 in b._zeros


# ---------------------------------------------------------------------- the relay's host side
def _fake_relay(drains: bool) -> Any:
    r = relay_mod.Relay.__new__(relay_mod.Relay)
    r._drain = drains
    r.rank = 0
    r.timeout_us = 1000
    r.nodes = SimpleNamespace(num_nodes=2)
    r._host = torch.zeros(6, dtype=torch.int32)
    r.device = torch.device("cpu")
    r.static = object()
    r._launches = []

    def counts(*args: Any) -> None:
        r._launches.append(args)
    r._r = SimpleNamespace(counts=counts)
    return r


def test_relay_never_synchronises_inside_a_capture(capturing: List[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    synced: List[int] = []
    monkeypatch.setattr(relay_mod, "raw_current_stream", lambda dev: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: SimpleNamespace(
        synchronize=lambda: synced.append(1)))
    r = _fake_relay(drains=True)
    r.counts_async(0, torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), host=False)
    assert len(r._launches) == 1 and r._launches[0][1] == 0 and r._launches[0][4] == 0   # no ticket, no host words
    assert synced == []
    capturing[0] = False
    r.counts_async(0, torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), host=False)
    assert synced == [1]                                       # eager on the softnic: drained as before
    capturing[0] = True
    with pytest.raises(ValueError, match="CUDA graph"):
        r.counts_async(5, torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), host=True)
    assert len(r._launches) == 2                               # refused before the launch
    with pytest.raises(ValueError, match="relay_into"):       # the host-list helper is not capturable
        r.relay(4, torch.zeros(2, 16, dtype=torch.uint8), [0, 2], [0, 0], 8, 3)


def test_host_counts_carry_the_ticket(monkeypatch: pytest.MonkeyPatch) -> None:
    """wait_counts returns once the kernel's answer carries this call's ticket (a late answer of
    another call does not count); a negative ticket reads the error record."""
    r = _fake_relay(drains=False)
    host = r._host.numpy()
    host[0] = 6                                                # a stale answer of call 6
    done = threading.Event()

    def kernel() -> None:
        host[2:4] = [0, 11]
        host[4:6] = [3, 0]
        host[0] = 7
        done.set()
    t = threading.Timer(0.05, kernel)
    t.start()
    assert r.wait_counts(7) == ([0, 11], [3, 0])
    assert done.is_set()
    t.join()
    raised: List[int] = []
    r.check_errors = lambda: raised.append(1)
    host[0] = -8
    r.wait_counts(8)
    assert raised == [1]


def test_tickets_stay_positive_int32() -> None:
    assert relay_mod.next_ticket(0) == 1 and relay_mod.next_ticket(1) == 2
    assert relay_mod.next_ticket(0x7FFFFFFF) == 1 and relay_mod.next_ticket(0x7FFFFFFE) == 0x7FFFFFFF
