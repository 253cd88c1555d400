"""The DeepEP shim's one mask per Buffer (issue 26): with enable_shrink=True, a rank masked through
DeepEP's mask API (low_latency_update_mask_buffer) is left out of the Buffer's normal-mode calls too --
on the reference backend, the one whose normal calls take a mask -- and low_latency_clean_mask_buffer
takes it back. The survivors get what a run without that rank gives (tests/test_normal_elastic.py's
oracle), bit for bit."""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

from multiproc import DistPool
from pyep.compat import deep_ep
from pyep.ep.elastic import drill_normal as dn
from test_normal_elastic import A, _gloo_step


@pytest.fixture(scope="module")
def pool3() -> Any:
    with DistPool(3) as pool:
        yield pool


def _shim_step(masked: int) -> Dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, idx, w = dn.inputs(A["seed"], 1, rank, A["T"], A["H"], A["E"], A["K"])
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e8), 0, enable_shrink=True, backend="reference",
                         timeout_us=20_000_000, explicitly_destroy=True)
    buf.low_latency_update_mask_buffer(masked, True)
    status = torch.zeros(world, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, A["E"])
    recv_x, r_idx, r_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx,
        topk_weights=w)
    out, out_w, _ = buf.combine(dn.expert(recv_x, rank), handle, topk_weights=r_w)
    res = {"status": status.tolist(), "ntpr": ntpr, "ntpe": ntpe, "in_rank": in_rank,
           "recv_x": recv_x.view(torch.int16), "r_idx": r_idx, "r_w": r_w, "counts": counts,
           "out": out.view(torch.int16), "out_w": out_w,
           "normal_mask": buf.normal_buffer().get_active_ranks().tolist()}
    buf.low_latency_clean_mask_buffer()          # the rank is back for every later call of the Buffer
    ntpr2, *_ = buf.get_dispatch_layout(idx, A["E"])
    res["back"] = ntpr2.tolist()
    res["routed"] = [int(dn.routed(idx, d, A["E"] // world).sum()) for d in range(world)]
    buf.destroy()
    return res


def test_shim_mask_reaches_the_normal_mode(pool3: DistPool) -> None:
    masked = 1
    got = pool3.run(_shim_step, masked, timeout_s=120)
    want = pool3.run(_gloo_step, masked, False, timeout_s=120)
    for r in range(3):
        g = got[r]
        assert g["status"] == [1 if d == masked else 0 for d in range(3)]
        assert g["normal_mask"] == [0 if d == masked else 1 for d in range(3)]
        assert g["back"] == g["routed"]
        if r == masked:
            assert g["recv_x"].shape[0] == 0 and g["ntpr"].tolist() == [0, 0, 0]
            continue
        for k in ("ntpr", "ntpe", "in_rank", "recv_x", "r_idx", "r_w", "out", "out_w"):
            assert torch.equal(g[k], want[r][k]), (r, k)
        assert g["counts"] == want[r]["counts"]


def test_active_mask_reports_the_ranks_it_takes_back() -> None:
    """What the shim hands the normal mode to restart (NormalBuffer.take_back_ranks): the ranks an unmask
    or a clean takes back, before and after the mask tensor exists."""
    from pyep.compat._shapes import ActiveMask
    m = ActiveMask(4)
    assert m.update(2, True) == [] and m.update(2, False) == [2] and m.update(2, False) == []
    m.update(1, True)
    m.update(3, True)
    assert m.clean() == [1, 3] and m.clean() == []
    t = m.bind(torch.device("cpu"))
    assert m.update(0, True) == [] and t.tolist() == [0, 1, 1, 1]
    assert m.update(0, False) == [0] and m.update(3, True) == [] and m.clean() == [3] and t.tolist() == [1] * 4


def _shared_mask() -> Dict[str, Any]:
    from pyep.ep.normal import NormalBuffer
    buf = NormalBuffer(dist.group.WORLD, hidden=256, backend="reference")
    t = torch.ones(3, dtype=torch.int32)
    assert buf.takes_active_ranks and buf.mask_device == t.device
    buf.use_active_ranks(t)
    t[1] = 0                                  # the caller's tensor, not a copy
    out: Dict[str, Any] = {"seen": buf.get_active_ranks().tolist(), "errors": []}
    for bad in (torch.ones(3, dtype=torch.int64), torch.ones(2, dtype=torch.int32), torch.full((3,), 2, dtype=torch.int32)):
        try:
            buf.use_active_ranks(bad)
        except ValueError as exc:
            out["errors"].append(str(exc)[:24])
    try:
        buf.take_back_ranks([5])
    except ValueError as exc:
        out["errors"].append(str(exc)[:24])
    try:
        buf.take_back_ranks([1])              # still 0 in the mask: nothing to take back yet
    except ValueError as exc:
        out["errors"].append(str(exc)[:24])
    t[1] = 1
    buf.take_back_ranks([1])                  # the reference backend has nothing to restart
    out["back"] = buf.get_active_ranks().tolist()
    buf.destroy()
    return out


def test_normal_buffer_shares_a_caller_mask(pool3: DistPool) -> None:
    for r in pool3.run(_shared_mask, timeout_s=60):
        assert r["seen"] == [1, 0, 1] and r["back"] == [1, 1, 1]
        assert len(r["errors"]) == 5, r["errors"]
