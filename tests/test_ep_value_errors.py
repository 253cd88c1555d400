"""Bad expert ids (out of [-1, E), or an expert twice in a row) through EpBuffer on the reference
backend, which reports them at the points the native kernels' error record is raised: the end of the
next combine (after its exchange), event.wait() and the receive hook. The error names
row, slot and value; the bad entry was routed as -1; the buffer works afterwards. check_values="strict"
raises before launch; False never raises. And the default front path reads no tensor value on the
host (the no-sync guarantee): checked with a tensor subclass that fails on any value access."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from pyep.ep.ll import EpBuffer
from pyep.ep.ll.errors import CombineAfterRefusal, DuplicateExpertIndex, InvalidExpertIndex
from pyep.ep.ll.validate import sanitize_topk

T, H, E, K = 8, 256, 8, 2


def _make(seed: int, n: int = 5):
    gen = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    x = torch.randn(n, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)])
    return x, idx, torch.rand(n, K, generator=gen)


def _new(**kw: Any) -> EpBuffer:
    return EpBuffer(backend="reference", num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E, **kw)


def _expected(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Identity experts: out = sum over valid k of w * x (fp32, k ascending), bf16 once."""
    acc = torch.zeros(x.shape[0], H)
    for k in range(idx.shape[1]):
        acc = torch.where((idx[:, k:k + 1] >= 0), acc + w[:, k:k + 1] * x.float(), acc)
    return acc.to(torch.bfloat16)


def _round_trip(buf: EpBuffer, seed: int) -> None:
    x, idx, w = _make(seed)
    recv, _, h, _, _ = buf.dispatch(x, idx, use_fp8=False)
    out, _, _ = buf.combine(recv, idx, w, h)
    assert torch.equal(out, _expected(x, idx, w))


def check_default_mode() -> Dict[str, Any]:
    rank = dist.get_rank()
    buf = _new()
    seen: Dict[str, Any] = {}

    # 1. Not by the next dispatch (a dispatch that raised would leave this rank without the handle whose
    #    combine its peers make): by the next combine, once its exchange is done. Its output stands.
    x, idx, w = _make(1)
    bad = idx.clone()
    bad[rank + 1, 1] = E + rank              # rank-specific row and value
    bad[4, 0] = -7                           # a later bad entry: not the one reported
    recv, count, h, ev, _ = buf.dispatch(x, bad, use_fp8=False)   # no exception: nothing read on the host
    clean = sanitize_topk(bad, E)
    assert clean[rank + 1, 1] == -1 and clean[4, 0] == -1
    x2, idx2, w2 = _make(11)
    recv2, _, h2, _, _ = buf.dispatch(x2, idx2, use_fp8=False)     # two in flight: this one is not refused
    out = torch.empty(x.shape[0], H, dtype=torch.bfloat16)
    with pytest.raises(InvalidExpertIndex) as ei:
        buf.combine(recv, clean, w, h, out=out)
    err = ei.value
    assert type(err) is InvalidExpertIndex and isinstance(err, ValueError)
    assert (err.row, err.k, err.value) == (rank + 1, 1, E + rank)
    seen["next_call"] = str(err)
    assert torch.equal(out, _expected(x, clean, w))      # the combine ran; the bad entries went as -1
    out2, _, _ = buf.combine(recv2, idx2, w2, h2)       # reported once
    assert torch.equal(out2, _expected(x2, idx2, w2))
    _round_trip(buf, 2)                      # cleared after raising: the buffer works

    # 1b. Only rank 0 has a bad id: its peer is not left waiting (both combines exchange, only rank 0
    #     raises), and both ranks go on in step.
    x, idx, w = _make(12)
    bad = idx.clone()
    if rank == 0:
        bad[0, 0] = E
    recv, _, h, _, _ = buf.dispatch(x, bad, use_fp8=False)
    clean = sanitize_topk(bad, E)
    out = torch.empty(x.shape[0], H, dtype=torch.bfloat16)
    if rank == 0:
        with pytest.raises(InvalidExpertIndex):
            buf.combine(recv, clean, w, h, out=out)
    else:
        buf.combine(recv, clean, w, h, out=out)
    assert torch.equal(out, _expected(x, clean, w))
    _round_trip(buf, 13)

    # 2. Raised by event.wait() (async), then not again.
    x, idx, w = _make(3)
    dup = idx.clone()
    dup[2, 1] = dup[2, 0]
    recv, _, h, ev, _ = buf.dispatch(x, dup, use_fp8=False, async_finish=True)
    with pytest.raises(DuplicateExpertIndex) as ei:
        ev.wait()
    assert (ei.value.row, ei.value.k, ei.value.first_k, ei.value.value) == (2, 1, 0, int(idx[2, 0]))
    seen["event"] = str(ei.value)
    ev.wait()                                # reported once
    out, ev2, _ = buf.combine(recv, dup, w, h, async_finish=True)    # combine treats it as -1, quietly
    ev2.wait()
    assert torch.equal(out, _expected(x, sanitize_topk(dup, E), w))

    # 3. Raised by the receive hook, after the receive half ran (peers are not left waiting).
    x, idx, w = _make(4)
    bad = idx.clone()
    bad[0, 0] = -2
    recv, count, h, _, hook = buf.dispatch(x, bad, use_fp8=False, return_recv_hook=True)
    with pytest.raises(InvalidExpertIndex, match=r"topk_idx\[0, 0\] = -2"):
        hook()
    hook()                                   # a second call does nothing and raises nothing
    assert int(count.sum()) > 0              # the receive half did run
    out, _, chook = buf.combine(recv, bad, w, h, return_recv_hook=True)
    chook()
    assert torch.equal(out, _expected(x, sanitize_topk(bad, E), w))

    # 4. Synchronous calls: the returned event's wait() reports too.
    x, idx, w = _make(5)
    bad = idx.clone()
    bad[3, 1] = 100
    _, _, h, ev, _ = buf.dispatch(x, bad, use_fp8=False)
    with pytest.raises(InvalidExpertIndex, match="row|100"):
        ev.wait()
    _round_trip(buf, 6)
    buf.destroy()
    return seen


def check_strict_and_off() -> List[str]:
    x, idx, w = _make(7)
    bad = idx.clone()
    bad[1, 0] = E
    msgs = []
    strict = _new(check_values="strict")
    with pytest.raises(InvalidExpertIndex) as ei:     # before launch, on the call itself
        strict.dispatch(x, bad, use_fp8=False)
    assert (ei.value.row, ei.value.k, ei.value.value) == (1, 0, E)
    msgs.append(str(ei.value))
    recv, _, h, _, _ = strict.dispatch(x, idx, use_fp8=False)      # the refused call kept its number: in step
    dup = idx.clone()
    dup[0, 1] = dup[0, 0]
    with pytest.raises(DuplicateExpertIndex):
        strict.combine(recv, dup, w, h)              # strict checks combine's ids too
    with pytest.raises(CombineAfterRefusal):         # the refused combine stood for h's combine
        strict.combine(recv, idx, w, h)
    recv, _, h, _, _ = strict.dispatch(x, idx, use_fp8=False)
    out, _, _ = strict.combine(recv, idx, w, h)
    assert torch.equal(out, _expected(x, idx, w))
    strict.destroy()

    off = _new(check_values=False)
    recv, _, h, ev, _ = off.dispatch(x, bad, use_fp8=False)        # never reported, routed as -1
    ev.wait()
    out, _, _ = off.combine(recv, bad, w, h)
    assert torch.equal(out, _expected(x, sanitize_topk(bad, E), w))
    _round_trip(off, 8)
    off.destroy()
    return msgs


def test_default_mode_reports_later(pool2: Any) -> None:
    res = pool2.run(check_default_mode)
    for rank, seen in enumerate(res):
        assert f"topk_idx[{rank + 1}, 1] = {E + rank}" in seen["next_call"], seen
        assert "twice" in seen["event"] and "[2, 1]" in seen["event"], seen


def test_strict_raises_before_launch_and_off_never(pool2: Any) -> None:
    msgs = pool2.run(check_strict_and_off)
    assert all("topk_idx[1, 0] = 8" in m[0] for m in msgs), msgs


# ------------------------------------------------------------------ no host reads in the default path
_METADATA = {"dim", "get:device", "get:dtype", "get:shape", "is_contiguous", "size", "stride", "numel",
             "get:is_cuda", "data_ptr", "get:ndim", "__len__", "get:layout"}


class NoHostRead(torch.Tensor):
    """A tensor whose values must not be looked at: any torch function other than a metadata query
    (item, tolist, any, comparisons, sort, nonzero, __bool__, ...) fails the test."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", repr(func))
        if name == "__get__":
            name = "get:" + getattr(getattr(func, "__self__", None), "__name__", "?")
        if name not in _METADATA:
            raise AssertionError(f"the default dispatch/combine path called {name} on a tensor argument")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _guard(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(NoHostRead)


def test_guard_catches_host_reads() -> None:
    g = _guard(torch.tensor([[0, 1]]))
    for read in (lambda: g.tolist(), lambda: g.item(), lambda: bool(g.any()), lambda: g.sort(),
                 lambda: (g < 0), lambda: g.nonzero()):
        with pytest.raises(AssertionError, match="called"):
            read()
    assert g.shape == (1, 2) and g.dtype == torch.int64


class _StubBackend:
    """Stands in for the native backend in the front-path test: returns outputs of the right shape
    and touches no input value. take_error() says what a device record would hold."""
    name = "stub"

    def __init__(self, device: torch.device, e_l: int, r_n: int) -> None:
        self.device, self.e_l, self.r_n = device, e_l, r_n
        self.pending: Any = None

    def take_error(self, latest_call: Any = None) -> Any:
        err, self.pending = self.pending, None
        return err

    def dispatch(self, x: Any, topk_idx: Any, opts: Any) -> Any:
        from pyep.ep.ll.contract import DispatchResult
        from pyep.ep.backend import OnceHook
        rows = self.r_n * T
        return DispatchResult(recv_x=torch.zeros(self.e_l, rows, H, dtype=torch.bfloat16), recv_scales=None,
                              recv_count=torch.zeros(self.e_l, dtype=torch.int32),
                              src_info=torch.zeros(self.e_l, rows, dtype=torch.int32),
                              layout_range=torch.zeros(self.e_l, self.r_n, dtype=torch.int64),
                              hook=OnceHook(lambda: None) if opts.return_recv_hook else None)

    def combine(self, x: Any, topk_idx: Any, topk_weights: Any, handle: Any, opts: Any) -> Any:
        from pyep.ep.ll.contract import CombineResult
        from pyep.ep.backend import OnceHook
        return CombineResult(out=torch.zeros(handle.num_tokens, H, dtype=torch.bfloat16),
                             hook=OnceHook(lambda: None) if opts.return_recv_hook else None)

    def destroy(self) -> None:
        pass


def check_front_reads_no_values() -> int:
    buf = _new()
    real = buf._backend
    stub = _StubBackend(buf.device, E // dist.get_world_size(), dist.get_world_size())
    buf._backend = stub
    buf._take_error = stub.take_error
    x, idx, w = _make(9)
    idx[0, 0] = E * 5                                   # a bad value: the front must not notice
    gx, gi, gw = _guard(x), _guard(idx), _guard(w)
    calls = 0
    for kw in ({}, {"async_finish": True}, {"return_recv_hook": True}):
        recv, _, h, ev, hook = buf.dispatch(gx, gi, use_fp8=False, **kw)
        if hook is not None:
            hook()
        ev.wait()
        out, ev, hook = buf.combine(_guard(recv), gi, gw, h, **kw)
        if hook is not None:
            hook()
        ev.wait()
        calls += 2
    stub.pending = InvalidExpertIndex(3, 1, 77, E)      # what a device record would report
    recv, _, h, _, _ = buf.dispatch(gx, gi, use_fp8=False)
    with pytest.raises(InvalidExpertIndex, match=r"\[3, 1\] = 77"):
        buf.combine(_guard(recv), gi, gw, h)            # raised after the combine's exchange
    buf._backend = real
    buf.destroy()
    return calls


def test_default_front_path_reads_no_values(pool2: Any) -> None:
    assert pool2.run(check_front_reads_no_values) == [6, 6]
