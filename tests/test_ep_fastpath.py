"""The native backend's C++ fast path, on CPU: its argument predicate (engine/bindings/ll_argcheck.h,
exposed in every build as pyep._engine.llcheck) against pyep/ep/validate.py on the same inputs: it must
decline every call validate.py rejects (the Python path then raises validate.py's error) and take the
ordinary good ones; the fast Handle constructor builds the same Handle; and EpBuffer's fast branch
(over a stand-in fast path on the reference backend) keeps the typed errors, the sequence numbers and
the recorded-error points of the Python path. The CUDA side (ep_fast_bind.cpp) runs in
tests/test_ep_native_gpu.py and tools/dev/host_overhead.py."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch

from pyep.ep.ll.config import EpConfig
from pyep.ep.ll.handle import Handle
from pyep.ep.ll.validate import validate_combine, validate_dispatch
from pyep.ep.validate import check_aligned

T, H, E, R, K = 8, 256, 8, 2, 2
CPU = torch.device("cpu")
_DTYPES = {torch.int32: 3, torch.int64: 4, torch.float32: 6, torch.bfloat16: 15}
_DEVICES = {"cpu": 0, "cuda": 1}


def _llcheck() -> Any:
    from pyep._native import load
    mod = load()
    if mod is None or not hasattr(mod, "llcheck"):
        pytest.skip("pyep._engine is not built or predates the llcheck part (python setup.py build_ext --inplace)")
    return mod.llcheck


def _meta(obj: Any) -> Optional[Tuple[Any, ...]]:
    """What ep_fast_bind.cpp reads from an argument (meta_of)."""
    if obj is None:
        return None
    if not isinstance(obj, torch.Tensor) or obj.layout != torch.strided:
        return (False, -1, [], False, -1, -1, 0)
    return (True, _DTYPES.get(obj.dtype, 99), list(obj.shape), obj.is_contiguous(),
            _DEVICES.get(obj.device.type, 99), -1 if obj.device.index is None else obj.device.index,
            obj.data_ptr())


def _flag(v: Any) -> int:
    return int(v) if isinstance(v, bool) else -1


def _timeout(v: Any) -> Tuple[int, int]:
    if v is None:
        return (0, 0)
    if isinstance(v, bool) or not isinstance(v, int):
        return (2, 0)
    return (1, max(min(v, 2**62), -2**62))


def _cfg() -> EpConfig:
    return EpConfig(num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E, max_topk=K + 2)


SHAPE = (T, H, E, R, K + 2, 0, -1)


def _aligned(n: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(n, cols, dtype=dtype)


def _inputs() -> Dict[str, torch.Tensor]:
    x = torch.randn(5, H).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(5)])
    return {"x": x, "idx": idx}


def _dispatch_cases() -> List[Tuple[str, Dict[str, Any]]]:
    d = _inputs()
    x, idx = d["x"], d["idx"]
    flat = torch.zeros(5 * H + 1, dtype=torch.bfloat16)
    e_l = E // R
    good = dict(x=x, topk_idx=idx, use_fp8=True, round_scale=False, use_ue8m0=False, active_ranks=None,
                timeout_us=None, async_finish=False, return_recv_hook=False,
                cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None)

    def case(**kw: Any) -> Dict[str, Any]:
        return {**good, **kw}
    return [
        ("good", case()),
        ("good bf16", case(use_fp8=False)),
        ("good ue8m0", case(round_scale=True, use_ue8m0=True)),
        ("good all args", case(active_ranks=torch.ones(R, dtype=torch.int32), timeout_us=5,
                               cumulative_local_expert_recv_stats=torch.zeros(e_l, dtype=torch.int32),
                               dispatch_wait_recv_cost_stats=torch.zeros(R, dtype=torch.int64))),
        ("good N=0", case(x=torch.zeros(0, H, dtype=torch.bfloat16), topk_idx=torch.zeros(0, K, dtype=torch.int64))),
        ("x fp32", case(x=x.float())),
        ("x not a tensor", case(x=x.tolist())),
        ("x wrong H", case(x=x[:, :128].contiguous())),
        ("x 3-d", case(x=x.view(5, 1, H))),
        ("x non-contiguous", case(x=torch.cat([x, x], 1)[:, ::2])),
        ("N > T", case(x=torch.zeros(T + 1, H, dtype=torch.bfloat16), topk_idx=torch.zeros(T + 1, 1, dtype=torch.int64))),
        ("idx int32", case(topk_idx=idx.int())),
        ("idx 1-d", case(topk_idx=idx[:, 0].contiguous())),
        ("idx rows", case(topk_idx=idx[:2].contiguous())),
        ("idx K=0", case(topk_idx=torch.zeros(5, 0, dtype=torch.int64))),
        ("idx K > max_topk", case(topk_idx=torch.full((5, K + 3), -1, dtype=torch.int64))),
        ("idx non-contiguous", case(topk_idx=torch.cat([idx, idx], 1)[:, ::2])),
        ("idx not a tensor", case(topk_idx=idx.tolist())),
        ("use_fp8 int", case(use_fp8=1)),
        ("round_scale None", case(round_scale=None)),
        ("ue8m0 w/o round", case(use_ue8m0=True)),
        ("round_scale bf16", case(use_fp8=False, round_scale=True)),
        ("async + hook", case(async_finish=True, return_recv_hook=True)),
        ("async int", case(async_finish=0)),
        ("active size", case(active_ranks=torch.ones(R + 1, dtype=torch.int32))),
        ("active dtype", case(active_ranks=torch.ones(R, dtype=torch.bool))),
        ("active list", case(active_ranks=[1] * R)),
        ("stats shape", case(cumulative_local_expert_recv_stats=torch.zeros(e_l + 1, dtype=torch.int32))),
        ("stats dtype", case(cumulative_local_expert_recv_stats=torch.zeros(e_l, dtype=torch.int64))),
        ("waits dtype", case(dispatch_wait_recv_cost_stats=torch.zeros(R, dtype=torch.int32))),
        ("waits shape", case(dispatch_wait_recv_cost_stats=torch.zeros(R + 1, dtype=torch.int64))),
        ("waits 2-d", case(dispatch_wait_recv_cost_stats=torch.zeros(1, R, dtype=torch.int64))),
        ("waits strided", case(dispatch_wait_recv_cost_stats=torch.zeros(2 * R, dtype=torch.int64)[::2])),
        ("waits list", case(dispatch_wait_recv_cost_stats=[0] * R)),
        ("timeout 0", case(timeout_us=0)),
        ("timeout -1", case(timeout_us=-1)),
        ("timeout float", case(timeout_us=1.5)),
        ("timeout bool", case(timeout_us=True)),
        ("timeout huge", case(timeout_us=10**30)),
        ("timeout over an hour", case(timeout_us=3_600_000_001)),
        ("good timeout of an hour", case(timeout_us=3_600_000_000)),
        ("x misaligned", case(x=flat[1:].view(5, H))),
    ]


def _python_dispatch(kw: Dict[str, Any]) -> Optional[type]:
    """The Python path's verdict: the exception type validate.py (then the native alignment check)
    raises, or None."""
    try:
        validate_dispatch(_cfg(), R, CPU, kw["x"], kw["topk_idx"], **{k: v for k, v in kw.items()
                                                                       if k not in ("x", "topk_idx")})
        check_aligned("x", kw["x"])
    except (TypeError, ValueError) as exc:
        return type(exc)
    return None


def _cpp_dispatch(kw: Dict[str, Any]) -> Optional[str]:
    return _llcheck().dispatch(SHAPE, _meta(kw["x"]), _meta(kw["topk_idx"]), _meta(kw["active_ranks"]),
                               _meta(kw["cumulative_local_expert_recv_stats"]), _flag(kw["use_fp8"]),
                               _flag(kw["round_scale"]), _flag(kw["use_ue8m0"]), _flag(kw["async_finish"]),
                               _flag(kw["return_recv_hook"]), _timeout(kw["timeout_us"]),
                               wait=_meta(kw["dispatch_wait_recv_cost_stats"]))


@pytest.mark.parametrize("name,kw", _dispatch_cases(), ids=[c[0] for c in _dispatch_cases()])
def test_dispatch_predicate_mirrors_validate(name: str, kw: Dict[str, Any]) -> None:
    py = _python_dispatch(kw)
    cpp = _cpp_dispatch(kw)
    if name.startswith("good"):
        assert py is None and cpp is None, (py, cpp)
    else:
        assert py is not None, f"{name}: validate.py accepted it"
        assert cpp is not None, f"{name}: the fast path would take a call validate.py rejects ({py.__name__})"
        if name.startswith("waits"):
            assert cpp == "dispatch_wait_recv_cost_stats", cpp


def _handle(n: int = 5, k: int = K) -> Handle:
    e_l = E // R
    return Handle(src_info=torch.zeros(e_l, R * T, dtype=torch.int32), layout_range=torch.zeros(e_l, R, dtype=torch.int64),
                  num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E, num_tokens=n, num_topk=k,
                  owner="me", epoch=0, seq=1, buffer_idx=1)


def _combine_cases() -> List[Tuple[str, Dict[str, Any]]]:
    e_l = E // R
    y = torch.randn(e_l, R * T, H).to(torch.bfloat16)
    d = _inputs()
    idx, w = d["idx"], torch.rand(5, K)
    flat = torch.zeros(5 * H + 1, dtype=torch.bfloat16)
    good = dict(x=y, topk_idx=idx, topk_weights=w, active_ranks=None, timeout_us=None, zero_copy=False,
                async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None)

    def case(**kw: Any) -> Dict[str, Any]:
        return {**good, **kw}
    return [
        ("good", case()),
        ("good all args", case(active_ranks=torch.ones(R, dtype=torch.int32), timeout_us=7,
                               out=torch.empty(5, H, dtype=torch.bfloat16), zero_copy=True,
                               combine_wait_recv_cost_stats=torch.zeros(R, dtype=torch.int64))),
        ("x fp8", case(x=y.to(torch.float8_e4m3fn))),
        ("x shape", case(x=y[:, :1].contiguous())),
        ("x non-contiguous", case(x=y.transpose(0, 1).contiguous().transpose(0, 1))),
        ("x not a tensor", case(x=None)),
        ("idx shape", case(topk_idx=idx[:, :1].contiguous())),
        ("idx int32", case(topk_idx=idx.int())),
        ("w dtype", case(topk_weights=w.double())),
        ("w shape", case(topk_weights=w[:4].contiguous())),
        ("out dtype", case(out=torch.empty(5, H))),
        ("out shape", case(out=torch.empty(4, H, dtype=torch.bfloat16))),
        ("out misaligned", case(out=flat[1:].view(5, H))),
        ("active dtype", case(active_ranks=torch.ones(R, dtype=torch.int64))),
        ("waits dtype", case(combine_wait_recv_cost_stats=torch.zeros(R, dtype=torch.float32))),
        ("waits shape", case(combine_wait_recv_cost_stats=torch.zeros(R - 1, dtype=torch.int64))),
        ("waits strided", case(combine_wait_recv_cost_stats=torch.zeros(2 * R, dtype=torch.int64)[::2])),
        ("zero_copy int", case(zero_copy=1)),
        ("async + hook", case(async_finish=True, return_recv_hook=True)),
        ("timeout 0", case(timeout_us=0)),
        ("timeout str", case(timeout_us="5")),
    ]


@pytest.mark.parametrize("name,kw", _combine_cases(), ids=[c[0] for c in _combine_cases()])
def test_combine_predicate_mirrors_validate(name: str, kw: Dict[str, Any]) -> None:
    h = _handle()
    try:
        validate_combine(_cfg(), R, CPU, kw["x"], kw["topk_idx"], kw["topk_weights"], h, owner="me", epoch=0,
                         last_seq=1, active_ranks=kw["active_ranks"], timeout_us=kw["timeout_us"],
                         zero_copy=kw["zero_copy"], async_finish=kw["async_finish"],
                         return_recv_hook=kw["return_recv_hook"], out=kw["out"],
                         combine_wait_recv_cost_stats=kw["combine_wait_recv_cost_stats"])
        check_aligned("x", kw["x"])
        if kw["out"] is not None:
            check_aligned("out", kw["out"])
        py: Optional[type] = None
    except (TypeError, ValueError, AttributeError) as exc:
        py = type(exc)
    cpp = _llcheck().combine(SHAPE, h.num_tokens, h.num_topk, _meta(kw["x"]), _meta(kw["topk_idx"]),
                             _meta(kw["topk_weights"]), _meta(kw["out"]), _meta(kw["active_ranks"]),
                             _flag(kw["zero_copy"]), _flag(kw["async_finish"]), _flag(kw["return_recv_hook"]),
                             _timeout(kw["timeout_us"]), wait=_meta(kw["combine_wait_recv_cost_stats"]))
    if name.startswith("good"):
        assert py is None and cpp is None, (py, cpp)
    else:
        assert py is not None, f"{name}: the Python path accepted it"
        assert cpp is not None, f"{name}: the fast path would take a call the Python path rejects"
        if name.startswith("waits"):
            assert cpp == "combine_wait_recv_cost_stats", cpp


def test_device_mismatch_declines() -> None:
    """A tensor on another device than the buffer's: both refuse (the buffer here is cuda:0)."""
    d = _inputs()
    shape = (T, H, E, R, K + 2, 1, 0)
    why = _llcheck().dispatch(shape, _meta(d["x"]), _meta(d["idx"]), None, None, 1, 0, 0, 0, 0, (0, 0))
    assert why == "x"
    with pytest.raises(ValueError, match="must be on cuda:0"):
        validate_dispatch(_cfg(), R, torch.device("cuda", 0), d["x"], d["idx"], use_fp8=True, round_scale=False,
                          use_ue8m0=False, active_ranks=None, timeout_us=None, async_finish=False,
                          return_recv_hook=False, cumulative_local_expert_recv_stats=None)


def test_fast_handle_equals_constructor() -> None:
    h = _handle()
    f = Handle.fast(h.src_info, h.layout_range, T, H, E, h.num_tokens, h.num_topk, "me", 0, 1, False, {})
    assert type(f) is Handle
    for fld in dataclasses.fields(Handle):
        a, b = getattr(f, fld.name), getattr(h, fld.name)
        assert a is b if isinstance(a, torch.Tensor) else a == b, fld.name
    assert f.as_tuple()[2:] == h.as_tuple()[2:] and repr(f) == repr(h)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.seq = 3  # type: ignore[misc]
