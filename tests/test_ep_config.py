"""EpConfig validation, the size hint, the Handle's DeepEP tuple behaviour, and the argument checks of
pyep.ep.ll.validate called directly (no process group needed)."""
from __future__ import annotations

import pytest
import torch

from pyep.ep.ll import EpConfig, Handle
from pyep.ep.ll import validate as V
from pyep.ep.ll.layout import size_hint
from pyep.ep.ll.errors import DuplicateExpertIndex, InvalidExpertIndex

DEEPEP_LL_BYTES_E288 = 2.147e9     # DeepEP V1, T=128, H=7168, E=288 (REFERENCE.md §1)
DEEPEP_LL_BYTES_E256 = 1.908e9


def test_size_hint_well_under_deepep() -> None:
    e288 = size_hint(128, 7168, 288, 8)
    e256 = size_hint(128, 7168, 256, 8)
    assert isinstance(e288, int) and 0 < e256 <= e288
    assert e288 < 0.75 * DEEPEP_LL_BYTES_E288, f"{e288 / 1e9:.3f} GB is not well under DeepEP's 2.147 GB"
    assert e256 < 0.75 * DEEPEP_LL_BYTES_E256
    assert EpConfig(hidden=7168, num_experts=288).size_hint(8) == e288
    # It must grow with the shape it sizes.
    assert size_hint(256, 7168, 288, 8) > e288 and size_hint(128, 8192, 288, 8) > e288
    assert size_hint(128, 7168, 288, 8, max_topk=8) <= e288


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(hidden=100), ValueError, "hidden"),
    (dict(hidden=200), ValueError, "multiple of 128"),
    (dict(hidden=16384 + 128), ValueError, "hidden"),
    (dict(hidden=7168.0), TypeError, "hidden must be an int"),
    (dict(num_max_dispatch_tokens_per_rank=0), ValueError, "num_max_dispatch_tokens_per_rank"),
    (dict(num_max_dispatch_tokens_per_rank=True), TypeError, "num_max_dispatch_tokens_per_rank"),
    (dict(num_experts=0), ValueError, "num_experts"),
    (dict(max_topk=17), ValueError, "max_topk"),
    (dict(transport="rdma"), ValueError, "transport"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(timeout_us=0), ValueError, "timeout_us"),
    (dict(allow_nvlink=1), TypeError, "allow_nvlink"),
    (dict(transport="nvlink", allow_nvlink=False), ValueError, "contradicts"),
    (dict(num_qps_per_peer=0), ValueError, "num_qps_per_peer"),
    (dict(device_name=""), ValueError, "device_name"),
])
def test_config_rejects(kwargs: dict, exc: type, msg: str) -> None:
    with pytest.raises(exc, match=msg):
        EpConfig(**kwargs)


def test_config_group_checks() -> None:
    cfg = EpConfig(num_experts=12, hidden=256, num_max_dispatch_tokens_per_rank=8)
    assert cfg.num_local_experts(4) == 3
    with pytest.raises(ValueError, match="divisible"):
        cfg.check_group_size(5)
    with pytest.raises(ValueError, match="ranks_per_node"):
        EpConfig(num_experts=12, ranks_per_node=3).check_group_size(4)


def test_config_given_buffer_bytes_must_fit() -> None:
    with pytest.raises(ValueError, match="smaller than this shape needs"):
        EpConfig(num_experts=12, hidden=256, num_buffer_bytes=1).check_group_size(4)


def _handle(**over: object) -> Handle:
    base = dict(src_info=torch.zeros(2, 16, dtype=torch.int32),
                layout_range=torch.tensor([[(3 << 32) | 2, 5], [0, 0]], dtype=torch.int64),
                num_max_dispatch_tokens_per_rank=8, hidden=256, num_experts=4, num_tokens=3, num_topk=2,
                owner="me", epoch=0, seq=5, buffer_idx=1)
    base.update(over)
    return Handle(**base)  # type: ignore[arg-type]


def test_handle_unpacks_like_deepep() -> None:
    h = _handle()
    src_info, layout_range, t, hid, e = h
    assert src_info is h.src_info and layout_range is h.layout_range and (t, hid, e) == (8, 256, 4)
    assert len(h) == 5 and h[2] == 8 and h.num_ranks == 2 and h.num_local_experts == 2
    assert h.counts().tolist() == [[2, 5], [0, 0]] and h.begins().tolist() == [[3, 0], [0, 0]]


CFG = EpConfig(num_max_dispatch_tokens_per_rank=8, hidden=256, num_experts=4)
STRICT = EpConfig(num_max_dispatch_tokens_per_rank=8, hidden=256, num_experts=4, check_values="strict")
CPU = torch.device("cpu")


def _dispatch(x: object, idx: object, cfg: EpConfig = CFG, **over: object) -> int:
    kw = dict(use_fp8=False, round_scale=False, use_ue8m0=False, active_ranks=None, timeout_us=None,
              async_finish=False, return_recv_hook=False, cumulative_local_expert_recv_stats=None)
    kw.update(over)
    return V.validate_dispatch(cfg, 2, CPU, x, idx, **kw)


X = torch.zeros(3, 256, dtype=torch.bfloat16)
IDX = torch.tensor([[0, 1], [2, -1], [-1, -1]])


@pytest.mark.parametrize("x,idx,over,exc,msg", [
    ("x", IDX, {}, TypeError, "x must be a torch.Tensor"),
    (X.float(), IDX, {}, TypeError, "x must have dtype torch.bfloat16"),
    (X[:, :128], IDX, {}, ValueError, r"x must have shape \[\*, 256\]"),
    (X.reshape(1, 3, 256), IDX, {}, ValueError, "x must have shape"),
    (torch.zeros(256, 3, dtype=torch.bfloat16).t(), IDX, {}, ValueError, "shape"),
    (torch.zeros(3, 512, dtype=torch.bfloat16)[:, ::2], IDX, {}, ValueError, "contiguous"),
    (torch.zeros(9, 256, dtype=torch.bfloat16), torch.zeros(9, 1, dtype=torch.int64), {}, ValueError,
     "more than num_max_dispatch_tokens_per_rank"),
    (X, IDX.int(), {}, TypeError, "topk_idx must have dtype torch.int64"),
    (X, IDX[:2], {}, ValueError, r"topk_idx must have shape \[3, 2\]"),
    (X, torch.zeros(3, 17, dtype=torch.int64), {}, ValueError, "K must be in"),
    (X, torch.zeros(3, 0, dtype=torch.int64), {}, ValueError, "K must be in"),
    (X, IDX.t().contiguous().t(), {}, ValueError, "topk_idx must be contiguous"),
    (X, IDX, dict(use_fp8=True, use_ue8m0=True), ValueError, "requires round_scale"),
    (X, IDX, dict(round_scale=True), ValueError, "only apply to FP8"),
    (X, IDX, dict(use_fp8=1), TypeError, "use_fp8 must be a bool"),
    (X, IDX, dict(async_finish=True, return_recv_hook=True), ValueError, "exclusive"),
    (X, IDX, dict(active_ranks=torch.ones(3, dtype=torch.int32)), ValueError, r"active_ranks must have shape \[2\]"),
    (X, IDX, dict(active_ranks=torch.ones(2, dtype=torch.int64)), TypeError, "active_ranks must have dtype torch.int32"),
    (X, IDX, dict(active_ranks=[1, 1]), TypeError, "active_ranks must be a torch.Tensor"),
    (X, IDX, dict(timeout_us=0), ValueError, "timeout_us must be > 0"),
    (X, IDX, dict(timeout_us=1.5), TypeError, "timeout_us must be an int"),
    (X, IDX, dict(cumulative_local_expert_recv_stats=torch.zeros(4, dtype=torch.int32)), ValueError,
     r"cumulative_local_expert_recv_stats must have shape \[2\]"),
    (X, IDX, dict(cumulative_local_expert_recv_stats=torch.zeros(2, dtype=torch.int64)), TypeError,
     "cumulative_local_expert_recv_stats must have dtype torch.int32"),
])
def test_validate_dispatch_rejects(x: object, idx: object, over: dict, exc: type, msg: str) -> None:
    with pytest.raises(exc, match=msg):
        _dispatch(x, idx, **over)


def test_validate_dispatch_accepts() -> None:
    assert _dispatch(X, IDX) == CFG.timeout_us
    assert _dispatch(X, IDX, timeout_us=5) == 5
    assert _dispatch(X[:0], IDX[:0]) == CFG.timeout_us                # N = 0
    assert _dispatch(X, IDX, use_fp8=True, round_scale=True, use_ue8m0=True) > 0
    loose = EpConfig(num_max_dispatch_tokens_per_rank=8, hidden=256, num_experts=4, check_values=False)
    V.validate_dispatch(loose, 2, CPU, X, torch.tensor([[0, 9], [1, 2], [3, -1]]), use_fp8=False,
                        round_scale=False, use_ue8m0=False, active_ranks=None, timeout_us=None,
                        async_finish=False, return_recv_hook=False, cumulative_local_expert_recv_stats=None)


@pytest.mark.parametrize("idx,exc,row,k,value", [
    (torch.tensor([[0, 4], [1, 2], [3, -1]]), InvalidExpertIndex, 0, 1, 4),
    (torch.tensor([[0, 1], [1, -2], [3, -1]]), InvalidExpertIndex, 1, 1, -2),
    (torch.tensor([[0, 1], [2, 2], [3, -1]]), DuplicateExpertIndex, 1, 1, 2),
    (torch.tensor([[0, 1], [2, 3], [9, 9]]), InvalidExpertIndex, 2, 0, 9),     # first in row-major order
    (torch.tensor([[0, 1], [3, 3], [9, 1]]), DuplicateExpertIndex, 1, 1, 3),
])
def test_strict_mode_rejects_values_before_launch(idx: torch.Tensor, exc: type, row: int, k: int,
                                                  value: int) -> None:
    with pytest.raises(exc) as ei:
        _dispatch(X, idx, STRICT)
    assert (ei.value.row, ei.value.k, ei.value.value) == (row, k, value)
    assert isinstance(ei.value, ValueError) and f"[{row}, {k}]" in str(ei.value)
    if exc is DuplicateExpertIndex:
        assert ei.value.first_k == k - 1
    # The default (device-side checks) and False accept the same call: nothing is read on the host.
    assert _dispatch(X, idx) == CFG.timeout_us
    loose = EpConfig(num_max_dispatch_tokens_per_rank=8, hidden=256, num_experts=4, check_values=False)
    assert _dispatch(X, idx, loose) == CFG.timeout_us


@pytest.mark.parametrize("value,exc", [("yes", ValueError), (1, TypeError), (None, TypeError)])
def test_check_values_setting(value: object, exc: type) -> None:
    with pytest.raises(exc, match="check_values must be True, False or 'strict'"):
        EpConfig(num_max_dispatch_tokens_per_rank=8, hidden=256, num_experts=4, check_values=value)


def test_sanitize_matches_the_kernel_rule() -> None:
    idx = torch.tensor([[0, 0, 5, -1], [-3, 1, 1, 1], [2, -1, 2, 3]])
    assert V.sanitize_topk(idx, 4).tolist() == [[0, -1, -1, -1], [-1, 1, -1, -1], [2, -1, -1, 3]]
    assert V.find_bad_entry(idx, 4) == (0, 1, 0, 0)
    assert V.find_bad_entry(V.sanitize_topk(idx, 4), 4) is None


def _combine(handle: object, **over: object) -> object:
    kw = dict(x=torch.zeros(2, 16, 256, dtype=torch.bfloat16), topk_idx=IDX,
              topk_weights=torch.ones(3, 2), handle=handle, owner="me", epoch=0, last_seq=5,
              active_ranks=None, timeout_us=None, zero_copy=False, async_finish=False,
              return_recv_hook=False, out=None)
    kw.update(over)
    x, idx, w, h = kw.pop("x"), kw.pop("topk_idx"), kw.pop("topk_weights"), kw.pop("handle")
    cfg = kw.pop("cfg", CFG)
    return V.validate_combine(cfg, 2, CPU, x, idx, w, h, **kw)


@pytest.mark.parametrize("over,exc,msg", [
    (dict(handle=("a", "b", 8, 256, 4)), TypeError, "handle must be the pyep Handle"),
    (dict(owner="other"), ValueError, "another EpBuffer"),
    (dict(epoch=1), ValueError, "predates update_ep_member"),
    (dict(last_seq=7), ValueError, r"dispatch #5 whose buffer half was reused by dispatch #7"),
    (dict(x=torch.zeros(2, 16, 128, dtype=torch.bfloat16)), ValueError, r"x must have shape \[2, 16, 256\]"),
    (dict(x=torch.zeros(2, 16, 256)), TypeError, "x must have dtype torch.bfloat16"),
    (dict(topk_idx=IDX[:, :1].contiguous()), ValueError, r"topk_idx must have shape \[3, 2\]"),
    (dict(topk_weights=torch.ones(3, 2, dtype=torch.bfloat16)), TypeError, "topk_weights must have dtype torch.float32"),
    (dict(topk_weights=torch.ones(2, 3).t()), ValueError, "topk_weights must be contiguous"),
    (dict(out=torch.zeros(3, 128, dtype=torch.bfloat16)), ValueError, r"out must have shape \[3, 256\]"),
    (dict(out=torch.zeros(3, 256)), TypeError, "out must have dtype"),
    (dict(zero_copy="yes"), TypeError, "zero_copy must be a bool"),
    (dict(active_ranks=torch.ones(2, 1, dtype=torch.int32)), ValueError, "active_ranks must have shape"),
])
def test_validate_combine_rejects(over: dict, exc: type, msg: str) -> None:
    with pytest.raises(exc, match=msg):
        _combine(over.pop("handle", _handle()), **over)


def test_validate_combine_values_strict_only() -> None:
    bad = torch.tensor([[0, 1], [2, 5], [-1, -1]])
    with pytest.raises(InvalidExpertIndex, match=r"topk_idx\[1, 1\] = 5 .* \[-1, 4\)"):
        _combine(_handle(), topk_idx=bad, cfg=STRICT)
    _combine(_handle(), topk_idx=bad)     # default: the device treats it as -1; dispatch reports


def test_validate_combine_accepts_previous_and_latest() -> None:
    for last in (5, 6):
        h, t = _combine(_handle(), last_seq=last)
        assert t == CFG.timeout_us
    with pytest.raises(ValueError, match="does not match"):
        _combine(_handle(hidden=512))
