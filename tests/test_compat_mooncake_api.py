"""pyep.compat.mooncake as SGLang's Mooncake dispatcher (token_dispatcher/mooncake.py) and its elastic
EP recovery call it (reference backend, gloo, 2 ranks; the per-rank checks take backend="native"
too, run on GPUs by tests/test_compat_gpu.py): the size hint, Buffer(group, bytes), the
first call's timeout_us=-1 (a long bound, logged once), active_ranks masking, hooks and events,
zero-copy combine, update_ep_member, and the `mooncake.mooncake_ep_buffer` alias."""
from __future__ import annotations

import logging
import sys
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist

import pyep.compat
from pyep.compat import mooncake
from pyep.ep.ll import EpBuffer

T, H, E, K = 16, 256, 8, 3


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _inputs(seed: int, n: int):
    gen = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    x = torch.randn(n, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)]).to(torch.int64)
    return x, idx, torch.rand(n, K, generator=gen)


def _cpu(t: Any) -> Any:
    return t.detach().cpu() if isinstance(t, torch.Tensor) else t


def _rows_equal(got: torch.Tensor, want: torch.Tensor, count: torch.Tensor) -> bool:
    """Bitwise equality of the defined rows (the first count[e] of local expert e); the rest of a
    receive buffer is unspecified (the native backend leaves it uninitialised)."""
    got = _cpu(got)
    if got.dtype.itemsize == 1:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    return all(torch.equal(got[e, :n], want[e, :n]) for e, n in enumerate(count.tolist()))


def check_sglang_flow(return_recv_hook: bool, backend: str = "reference") -> Dict[str, Any]:
    """_MooncakeEPDispatcherImpl: dispatch_a/_b and combine_a/_b with timeout -1 first, then 10 s, on
    `backend`; every output equals a reference EpBuffer's on the CPU bit for bit."""
    from ep_native_cases import rank_device
    r_n = dist.get_world_size()
    dev = rank_device(backend)
    group = dist.group.WORLD
    cap = _Capture()
    logging.getLogger("pyep.compat.mooncake").addHandler(cap)
    logging.getLogger("pyep.compat.mooncake").setLevel(logging.DEBUG)
    try:
        num_ep_buffer_bytes = mooncake.Buffer.get_ep_buffer_size_hint(T, H, group.size(), E)
        buffer = mooncake.Buffer(group, num_ep_buffer_bytes, backend=backend)
        assert (buffer.group_size, buffer.rank, buffer.num_ep_buffer_bytes) == (r_n, dist.get_rank(), num_ep_buffer_bytes)
        ref = EpBuffer(backend="reference", num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E)
        first_execution, timeout_us = True, 10_000_000
        outs = []
        for step in range(3):
            x, topk_ids, topk_weights = _inputs(step, T - step)
            x_d, ids_d, w_d = x.to(dev), topk_ids.to(dev), topk_weights.to(dev)
            active_ranks = torch.ones(group.size(), dtype=torch.int32, device=dev)
            expected_m = (x.shape[0] * buffer.group_size * topk_ids.shape[1] + E) // E
            recv, masked_m, handle, event, hook = buffer.dispatch(
                x_d, ids_d, active_ranks, T, E, -1 if first_execution else timeout_us, use_fp8=True,
                async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
            hook() if return_recv_hook else event.current_stream_wait()
            hidden, scale = recv
            assert hidden.dtype == torch.float8_e4m3fn and scale.shape == (E // r_n, r_n * T, H // 128)
            (rq, rs), rcount, rh, _, _ = ref.dispatch(x, topk_ids, use_fp8=True)
            assert torch.equal(_cpu(masked_m), rcount) and expected_m >= 1
            assert _rows_equal(hidden, rq, rcount) and _rows_equal(scale, rs, rcount)
            y = (rq.float() * 0.5).to(torch.bfloat16)       # the experts (SGLang runs them in between)
            combined, event, hook = buffer.combine(y.to(dev), ids_d, w_d, active_ranks,
                                                   -1 if first_execution else timeout_us, handle,
                                                   async_finish=not return_recv_hook,
                                                   return_recv_hook=return_recv_hook)
            hook() if return_recv_hook else event.current_stream_wait()
            first_execution = False
            want, _, _ = ref.combine(y, topk_ids, topk_weights, rh)
            assert torch.equal(_cpu(combined), want)
            assert _cpu(active_ranks).tolist() == [1] * r_n
            outs.append(int(masked_m.sum()))
        buffer.destroy()
        ref.destroy()
        infos = [r.getMessage() for r in cap.records if r.levelno == logging.INFO]
        return {"received": outs, "infos": infos}
    finally:
        logging.getLogger("pyep.compat.mooncake").removeHandler(cap)


def check_active_ranks_and_recovery(backend: str = "reference") -> Dict[str, Any]:
    """A dead rank is marked 0 in active_ranks (SGLang's ElasticEPStateManager tensor): nobody sends
    to it or waits for it; after recovery the caller sets it to 1 and calls update_ep_member().
    The last rank dies after a healthy round. On the reference backend (collectives need every rank)
    it keeps calling and gets nothing; on the native backend it makes no call until the recovery,
    as a dead rank would (one that kept calling would wait for peers that no longer send to it)."""
    from ep_native_cases import rank_device
    r_n, rank = dist.get_world_size(), dist.get_rank()
    dev = rank_device(backend)
    dead = rank == r_n - 1 and backend == "native"
    # Live ranks never wait for a masked one; the bound only has to outlast a GPU shared by two ranks.
    bound_us = 5_000_000
    buffer = mooncake.Buffer(dist.group.WORLD, 0, backend=backend)
    x, idx, w = (t.to(dev) for t in _inputs(5, 6))
    active = torch.ones(r_n, dtype=torch.int32, device=dev)
    _, count, handle, _, _ = buffer.dispatch(x, idx, active, T, E, bound_us, use_fp8=False)   # healthy round
    healthy = int(count.sum())
    active[r_n - 1] = 0
    if not dead:
        recv, count, handle, _, _ = buffer.dispatch(x, idx, active, T, E, bound_us, use_fp8=False)
        if rank == r_n - 1:
            assert int(count.sum()) == 0
        zc = buffer.get_next_combine_buffer(handle)
        assert zc.shape == (E // r_n, r_n * T, H) and zc.dtype == torch.bfloat16
        zc.copy_(recv)
        out = torch.empty(x.shape[0], H, dtype=torch.bfloat16, device=dev)
        combined, _, _ = buffer.combine(torch.empty_like(zc), idx, w, active, bound_us, handle, zero_copy=True,
                                        out=out)
        assert combined.data_ptr() == out.data_ptr()
        owner_dead = (idx // (E // r_n)) == r_n - 1
        want = x.float() * w.masked_fill(owner_dead | (idx < 0), 0).sum(1, keepdim=True)
        if rank != r_n - 1:
            assert torch.allclose(_cpu(combined).float(), _cpu(want), rtol=1e-2, atol=1e-2)
    assert _cpu(active).tolist() == [1] * (r_n - 1) + [0]  # the caller's marks are kept, never reset
    active.fill_(1)                                        # the rank came back (SGLang copies the new mask)
    buffer.update_ep_member()
    with pytest.raises(ValueError, match="stale"):
        buffer.get_next_combine_buffer(handle)
    recv, count, handle, _, _ = buffer.dispatch(x, idx, active, T, E, bound_us, use_fp8=False)
    full = int(count.sum())
    assert full == healthy
    with pytest.raises(TypeError, match="active_ranks is required"):
        buffer.dispatch(x, idx, None, T, E, bound_us)      # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeout_us must be an int"):
        buffer.dispatch(x, idx, active, T, E, 1.5)        # type: ignore[arg-type]
    with pytest.raises(ValueError, match="active_ranks must have shape"):
        buffer.dispatch(x, idx, torch.ones(r_n + 1, dtype=torch.int32, device=dev), T, E, bound_us)
    buffer.destroy()
    with pytest.raises(RuntimeError, match="after destroy"):
        buffer.update_ep_member()
    return {"full": full}


@pytest.mark.parametrize("return_recv_hook", [False, True])
def test_sglang_flow(pool2: Any, return_recv_hook: bool) -> None:
    res = pool2.run(check_sglang_flow, return_recv_hook)
    for r in res:
        assert len(r["infos"]) == 1 and "timeout_us=-1" in r["infos"][0]
        assert str(mooncake.NO_TIMEOUT_BOUND_US) in r["infos"][0]
    assert sum(sum(r["received"]) for r in res) > 0


def test_active_ranks_and_recovery(pool2: Any) -> None:
    res = pool2.run(check_active_ranks_and_recovery)
    assert all(r["full"] > 0 for r in res)


def test_size_hint_and_signature() -> None:
    assert mooncake.Buffer.get_ep_buffer_size_hint(128, 7168, 8, 256) == EpBuffer.size_hint(128, 7168, 256, 8)
    import inspect
    params = list(inspect.signature(mooncake.Buffer.dispatch).parameters)
    assert params[:10] == ["self", "x", "topk_idx", "active_ranks", "num_max_dispatch_tokens_per_rank",
                           "num_experts", "timeout_us", "use_fp8", "async_finish", "return_recv_hook"]
    params = list(inspect.signature(mooncake.Buffer.combine).parameters)
    assert params[:11] == ["self", "x", "topk_idx", "topk_weights", "active_ranks", "timeout_us", "handle",
                           "zero_copy", "async_finish", "return_recv_hook", "out"]


@pytest.fixture
def clean_modules() -> Iterator[None]:
    saved = {k: v for k, v in sys.modules.items() if k == "mooncake" or k.startswith("mooncake.")}
    yield
    for k in [k for k in sys.modules if k == "mooncake" or k.startswith("mooncake.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_import_alias(clean_modules: None, tmp_path: Any, monkeypatch: Any) -> None:
    assert pyep.compat.install_mooncake_alias() == ["mooncake", "mooncake.mooncake_ep_buffer"]
    from mooncake.mooncake_ep_buffer import Buffer  # type: ignore[import-not-found]
    assert Buffer is mooncake.Buffer
    for k in ("mooncake", "mooncake.mooncake_ep_buffer"):
        del sys.modules[k]
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    importlib.invalidate_caches()
    with pytest.raises(pyep.compat.AliasConflict, match="real 'mooncake'"):
        pyep.compat.install_mooncake_alias()
