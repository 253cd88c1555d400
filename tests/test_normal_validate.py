"""NormalBuffer's argument checks: bad calls raise TypeError/ValueError before anything is sent (the
ranks stay in step: the next good call works and gives the right result), the checks never read
tensor values on the host, errors an earlier call left on the device are raised first, and the
events behave like DeepEP's EventOverlap."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from pyep.ep.normal import Config, NormalBuffer, NormalEvent, NormalHandle, NormalModeError
from pyep.ep.normal import validate as v

H, E, K = 256, 8, 3
CPU = torch.device("cpu")


def _inputs(n: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + 10 * dist.get_rank() if dist.is_initialized() else seed)
    x = torch.randn(n, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)])
    return x, idx, torch.rand(n, K, generator=gen)


def _handle(n: int = 6, rows: int = 5, r_n: int = 2, c_n: int = 12, worst: int = 0) -> NormalHandle:
    i32 = torch.int32
    return NormalHandle(torch.zeros(r_n, r_n, dtype=i32), torch.zeros(r_n, c_n, dtype=i32),
                        torch.zeros(r_n, c_n, dtype=i32), torch.zeros(rows, dtype=i32),
                        torch.zeros(n, r_n, dtype=torch.bool), torch.zeros(n, r_n, dtype=i32), owner="me", epoch=0,
                        num_channels=c_n, num_tokens=n, num_recv_tokens=rows, num_worst_tokens=worst, hidden=H,
                        num_topk=K)


def _dispatch_kwargs(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, r_n: int = 2) -> Dict[str, Any]:
    n = x.shape[0]
    return dict(x=x, handle=None, num_tokens_per_rank=torch.zeros(r_n, dtype=torch.int32),
                num_tokens_per_rdma_rank=None, is_token_in_rank=torch.zeros(n, r_n, dtype=torch.bool),
                num_tokens_per_expert=torch.zeros(E, dtype=torch.int32), topk_idx=idx, topk_weights=w,
                expert_alignment=1, num_worst_tokens=0, num_ranks=r_n, device=CPU, buffer_hidden=H, owner="me",
                epoch=0)


def test_checks_never_read_tensor_values(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("the host read a tensor value")
    x, idx, w = _inputs()
    fp8 = (x.to(torch.float8_e4m3fn), torch.ones(H // 128, 6).T)    # strided scales
    kwargs = _dispatch_kwargs(x, idx, w)
    for name in ("item", "tolist", "__bool__", "any", "all", "nonzero", "__index__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    v.validate_layout(idx, E, 2, CPU)
    args = v.validate_dispatch(**kwargs)
    assert (args.hidden, args.num_experts, args.num_topk) == (H, E, K)
    assert v.validate_dispatch(**dict(kwargs, x=fp8)).x_scales is fp8[1]
    h = _handle()
    assert v.validate_dispatch(**dict(kwargs, handle=h, num_tokens_per_rank=None, is_token_in_rank=None,
                                      num_tokens_per_expert=None, topk_idx=None, topk_weights=None)).num_experts == 0
    bias = torch.zeros(6, H, dtype=torch.bfloat16)
    assert v.validate_combine(x=torch.zeros(5, H, dtype=torch.bfloat16), handle=h, topk_weights=torch.zeros(5, K),
                              bias=(bias, bias), device=CPU, buffer_hidden=H) == (bias, bias)


BAD_DISPATCH: List[Any] = [
    (TypeError, "bfloat16", dict(x=torch.zeros(6, H))),
    (TypeError, "without scales", dict(x=torch.zeros(6, H).to(torch.float8_e4m3fn))),
    (ValueError, "scales", dict(x=(torch.zeros(6, H).to(torch.float8_e4m3fn), torch.ones(6, 3)))),
    (ValueError, "multiple of 128", dict(x=torch.zeros(6, 200, dtype=torch.bfloat16))),
    (ValueError, "larger than this buffer", dict(x=torch.zeros(6, 2 * H, dtype=torch.bfloat16))),
    (ValueError, "contiguous", dict(x=torch.zeros(H, 6, dtype=torch.bfloat16).T)),
    (ValueError, "K must be", dict(topk_idx=torch.zeros(6, 17, dtype=torch.int64),
                                   topk_weights=torch.zeros(6, 17))),
    (TypeError, "int64", dict(topk_idx=torch.zeros(6, K, dtype=torch.int32))),
    (ValueError, "go together", dict(topk_weights=None)),
    (ValueError, "shape", dict(topk_weights=torch.zeros(5, K))),
    (ValueError, "multiple of the group", dict(num_tokens_per_expert=torch.zeros(7, dtype=torch.int32))),
    (ValueError, "at most 1024", dict(num_tokens_per_expert=torch.zeros(2 * 1026, dtype=torch.int32))),
    (ValueError, "layout", dict(is_token_in_rank=None)),
    (ValueError, "intranode", dict(num_tokens_per_rdma_rank=torch.zeros(1, dtype=torch.int32))),
    (ValueError, ">= 1", dict(expert_alignment=0)),
    (ValueError, ">= 0", dict(num_worst_tokens=-1)),
    (TypeError, "int", dict(expert_alignment=1.5)),
    (ValueError, "needs topk_idx", dict(topk_idx=None, topk_weights=None, num_worst_tokens=64)),
    (ValueError, "shape", dict(is_token_in_rank=torch.zeros(5, 2, dtype=torch.bool))),
]


@pytest.mark.parametrize("exc,match,change", BAD_DISPATCH, ids=[m for _, m, _ in BAD_DISPATCH])
def test_dispatch_rejections(exc: type, match: str, change: Dict[str, Any]) -> None:
    x, idx, w = _inputs()
    with pytest.raises(exc, match=match):
        v.validate_dispatch(**dict(_dispatch_kwargs(x, idx, w), **change))


def test_handle_and_flag_rejections() -> None:
    x, idx, w = _inputs()
    cached = dict(_dispatch_kwargs(x, idx, w), num_tokens_per_rank=None, is_token_in_rank=None,
                  num_tokens_per_expert=None, topk_idx=None, topk_weights=None)
    with pytest.raises(TypeError, match="handle"):
        v.validate_dispatch(**dict(cached, handle=tuple(_handle())))
    with pytest.raises(ValueError, match="another NormalBuffer"):
        v.validate_dispatch(**dict(cached, handle=_handle(), owner="you"))
    with pytest.raises(ValueError, match="stale"):
        v.validate_dispatch(**dict(cached, handle=_handle(), epoch=1))
    with pytest.raises(ValueError, match="made for 7"):
        v.validate_dispatch(**dict(cached, handle=_handle(n=7)))
    with pytest.raises(ValueError, match="topk_idx"):
        v.validate_dispatch(**dict(cached, handle=_handle(), topk_idx=idx))
    with pytest.raises(ValueError, match="num_worst_tokens"):
        v.validate_dispatch(**dict(cached, handle=_handle(), num_worst_tokens=9))
    with pytest.raises(ValueError, match="channels"):
        v.check_channels("combine", Config(8), _handle())
    with pytest.raises(TypeError, match="Config"):
        v.check_config((24, 6, 256))
    with pytest.raises(ValueError, match="requires previous_event"):
        v.check_stream_flags(None, True, True)
    with pytest.raises(ValueError, match="requires previous_event"):
        v.check_stream_flags(NormalEvent(None, CPU, "e", 1.0), False, True)
    with pytest.raises(TypeError, match="previous_event"):
        v.check_stream_flags(42, True, False)
    with pytest.raises(TypeError, match="bool"):
        v.check_stream_flags(None, 1, False)
    h = _handle()
    xc = torch.zeros(5, H, dtype=torch.bfloat16)
    for exc, match, kw in [(ValueError, "shape", dict(x=torch.zeros(4, H, dtype=torch.bfloat16))),
                           (TypeError, "bias", dict(bias=[xc, xc])),
                           (ValueError, "bias\\[1\\]", dict(bias=(None, torch.zeros(5, H, dtype=torch.bfloat16)))),
                           (TypeError, "float32", dict(topk_weights=torch.zeros(5, K, dtype=torch.float64))),
                           (ValueError, "K must be", dict(topk_weights=torch.zeros(5, 17)))]:
        with pytest.raises(exc, match=match):
            v.validate_combine(**dict(dict(x=xc, handle=h, topk_weights=None, bias=None, device=CPU,
                                           buffer_hidden=H), **kw))
    with pytest.raises(ValueError, match="multiple of the group"):
        v.validate_layout(idx, 9, 2, CPU)


def test_constructor_rejections() -> None:
    for kw, exc, match in [(dict(backend="gpu"), ValueError, "backend"), (dict(hidden=100), ValueError, "hidden"),
                           (dict(transport="pigeon"), ValueError, "transport"),
                           (dict(num_sms=7), ValueError, "even"), (dict(num_nvl_bytes=-1), ValueError, ">= 0"),
                           (dict(timeout_us=0), ValueError, "timeout_us")]:
        with pytest.raises(exc, match=match):
            NormalBuffer(None, **kw)
    with pytest.raises(ValueError, match="even"):
        NormalBuffer.set_num_sms(5)
    assert NormalBuffer.size_hint(7168, 8) >= NormalBuffer.size_hint(4096, 8) > 0


def test_event_wait_runs_the_error_check() -> None:
    seen: List[int] = []
    ev = NormalEvent(None, CPU, "x", 1.0, check=lambda: seen.append(1))
    ev.wait()
    with ev:
        pass
    ev.current_stream_wait()
    assert seen == [1] and ev.query() and ev.event is ev


# ---------------------------------------------------------------- through NormalBuffer, 2 ranks
# (calls refused on one rank only, with the others making them: tests/test_normal_call_tags.py)
def check_epochs_and_pending_errors() -> Dict[str, Any]:
    x, idx, w = _inputs()
    buf = NormalBuffer(hidden=H, backend="auto")       # no CUDA here: the ranks agree on the reference
    ntpr, _, ntpe, tir, _ = buf.get_dispatch_layout(idx, E)
    layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=tir, num_tokens_per_expert=ntpe)
    recv, r_idx, r_w, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
    out, out_w, _ = buf.combine(recv, handle, topk_weights=r_w)
    assert torch.equal(out, (x.float() * tir.sum(1, keepdim=True)).to(torch.bfloat16))
    assert torch.equal(out_w, torch.where(tir.any(1, keepdim=True), w, torch.zeros_like(w)))
    # clean() starts a new epoch: older handles are refused on every rank (a refusal every rank makes
    # alike), new ones work.
    buf.clean()
    with pytest.raises(ValueError, match="stale"):
        buf.combine(recv, handle)
    with pytest.raises(ValueError, match="stale"):
        buf.dispatch(x, handle=handle)
    recv2, _, _, _, handle2, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
    assert torch.equal(recv2, recv)
    # An error the device recorded for an earlier call (the reference never records one; stand in for
    # the kernels' record) is raised by the next call once that call was made on every rank, or -- if
    # the call is refused -- in place of the refusal's own error, which it notes.
    pending = [NormalModeError("recorded by an earlier call"), NormalModeError("recorded by an earlier call")]
    buf._backend.pending_error = lambda: pending.pop() if pending else None   # type: ignore[method-assign]
    with pytest.raises(NormalModeError, match="earlier call") as made:
        buf.combine(recv2, handle2)
    assert "which was made" in "".join(made.value.__notes__)
    with pytest.raises(NormalModeError, match="earlier call") as refused:
        buf.combine("not a tensor", handle2)  # type: ignore[arg-type]
    assert "refused: TypeError" in "".join(refused.value.__notes__)
    out2, _, _ = buf.combine(recv2, handle2)
    assert torch.equal(out2, out)
    text = buf.describe()
    with buf:
        pass
    with pytest.raises(RuntimeError, match="after destroy"):
        buf.dispatch(x, handle=handle2)
    return {"describe": text, "rows": int(recv.shape[0])}


def test_epochs_and_pending_errors(pool2: Any) -> None:
    res = pool2.run(check_epochs_and_pending_errors)
    assert all("backend reference" in r["describe"] for r in res)
    assert sum(r["rows"] for r in res) > 0


def test_fit_rings_shrinks_only_what_does_not_fit() -> None:
    """layout.fit_rings (NormalBuffer.fit_config on the native backend): a config sized for more SMs
    than a buffer was built for (DeepEP V2 picks num_sms per call) gets fewer ring rows, then fewer
    SMs, never a config that check_rings would refuse; one that fits comes back unchanged."""
    from pyep.ep.normal import layout
    from pyep.ep.normal.config import Config
    hidden, ranks = 2048, 2
    cfg = Config(32, 8, 256)
    need = layout.ring_bytes(ranks, cfg.num_channels(), 256, layout.slot_bytes(hidden))
    assert layout.fit_rings(cfg, ranks, hidden, need) is cfg
    for capacity in (need * 3 // 4, need // 4, need // 40):
        got = layout.fit_rings(cfg, ranks, hidden, capacity)
        layout.check_rings(got, ranks, hidden, capacity)            # runs on this buffer
        assert got.num_max_nvl_chunked_send_tokens <= got.num_max_nvl_chunked_recv_tokens
        assert (got.num_sms, got.num_max_nvl_chunked_recv_tokens) < (cfg.num_sms, 257)
    assert layout.fit_rings(cfg, ranks, hidden, need * 3 // 4).num_sms == 32    # rows first
    with pytest.raises(ValueError, match="rings of this config need"):
        layout.fit_rings(cfg, ranks, hidden, 100)
