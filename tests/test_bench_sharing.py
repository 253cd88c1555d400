"""Ranks that share a GPU, planned and reported on the CPU: which GPU each rank takes and which process
group it gets (plan_distributed with a given GPU count), MPS detection through a fake
nvidia-cuda-mps-control and CUDA_MPS_PIPE_DIRECTORY, the words a run is named with, the SM-fit rule
of the normal mode, and the host-clock start gate that lines up the ranks of a gloo group."""
from __future__ import annotations

import os
import stat
import time
from typing import Any, Dict, List

import pytest

from pyep.bench.dist import plan_distributed
from pyep.bench.sharing import (MPS_CONTROL, MpsStatus, Sharing, detect_mps, device_for_rank, ranks_per_gpu,
                                sm_fit)


def _env(world: int, rank: int, local_world: int = 0) -> Dict[str, str]:
    return {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(local_world or world), "MASTER_ADDR": "127.0.0.1"}


# ---------------------------------------------------------------------- planning
def test_rank_to_device_mapping() -> None:
    assert [device_for_rank(r, 1) for r in range(4)] == [0, 0, 0, 0]
    assert [device_for_rank(r, 2) for r in range(4)] == [0, 1, 0, 1]
    assert [device_for_rank(r, 8) for r in range(8)] == list(range(8))
    assert ranks_per_gpu(4, 1) == 4 and ranks_per_gpu(3, 2) == 2 and ranks_per_gpu(2, 8) == 1
    with pytest.raises(ValueError):
        device_for_rank(0, 0)


@pytest.mark.parametrize("world,gpus,backend,index,per_gpu", [
    (2, 1, "gloo", 1, 2),      # two ranks on one GPU: gloo, both on cuda:0 (rank 1 shown)
    (4, 1, "gloo", 3, 4),
    (4, 2, "gloo", 3, 2),      # rank 3 on cuda:1
    (8, 8, "nccl", 7, 1),      # one rank per GPU: NCCL as before
])
def test_plan_shares_gpus_when_ranks_outnumber_them(world: int, gpus: int, backend: str, index: int,
                                                     per_gpu: int) -> None:
    plan = plan_distributed("auto", "auto", _env(world, world - 1), gpus=gpus)
    assert plan is not None and plan.cuda and plan.backend == backend
    assert plan.device_index == (world - 1) % gpus and plan.ranks_per_gpu == per_gpu
    assert plan.shared == (per_gpu > 1)


def test_plan_refuses_nccl_on_a_shared_gpu_and_keeps_gloo_on_the_gpu() -> None:
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one GPU"):
        plan_distributed("cuda", "nccl", _env(2, 0), gpus=1)
    plan = plan_distributed("cuda", "gloo", _env(2, 0), gpus=1)     # was refused: gloo now stages CUDA data
    assert plan is not None and plan.cuda and plan.backend == "gloo" and plan.device_index == 0
    plan = plan_distributed("cuda", "gloo", _env(2, 1), gpus=2)     # gloo by choice on separate GPUs
    assert plan is not None and plan.cuda and not plan.shared and plan.device_index == 1


def test_plan_on_the_cpu() -> None:
    plan = plan_distributed("cpu", "auto", _env(4, 2), gpus=1)
    assert plan is not None and not plan.cuda and plan.backend == "gloo" and plan.device_index is None
    plan = plan_distributed("auto", "auto", {}, gpus=0)
    assert plan is not None and not plan.cuda and plan.world == 1 and plan.own_store
    with pytest.raises(ValueError, match="no CUDA device"):
        plan_distributed("cuda", "auto", {}, gpus=0)
    with pytest.raises(ValueError, match="nccl needs a CUDA device"):
        plan_distributed("cpu", "nccl", {}, gpus=1)


def test_local_world_decides_the_sharing_across_nodes() -> None:
    # 16 ranks in 2 nodes of 8, 8 GPUs per node: one rank per GPU, NCCL.
    env = {**_env(16, 9), "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"}
    plan = plan_distributed("auto", "auto", env, gpus=8)
    assert plan is not None and plan.backend == "nccl" and plan.device_index == 1 and not plan.shared


# ---------------------------------------------------------------------- MPS
def _fake_control(tmp_path, answer: str) -> str:  # type: ignore[no-untyped-def]
    """A nvidia-cuda-mps-control that answers get_server_list with `answer` (as the real one reads
    commands on stdin)."""
    d = tmp_path / f"bin-{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    exe = d / MPS_CONTROL
    exe.write_text("#!/bin/sh\nread cmd\n[ \"$cmd\" = get_server_list ] && printf '%s\\n' " + repr(answer) + "\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(d)


def test_mps_detection_with_a_fake_control_binary(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PATH", _fake_control(tmp_path, "4242 4343") + os.pathsep + os.environ.get("PATH", ""))
    on = detect_mps({}, default_pipe=str(tmp_path / "none"))
    assert on.on is True and "4242, 4343" in on.how
    monkeypatch.setenv("PATH", _fake_control(tmp_path, "") + os.pathsep + os.environ.get("PATH", ""))
    off = detect_mps({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})      # no server and no control pipe
    assert off.on is False and "no MPS server" in off.how
    (tmp_path / "control").write_text("")                              # a daemon that listed no server yet
    up = detect_mps({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    assert up.on is True and "control pipe" in up.how and "no MPS server" in up.how


def test_mps_detection_from_the_pipe_directory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    def none(_name: str) -> None:
        return None
    assert detect_mps({}, which=none, default_pipe=str(tmp_path / "none")).on is False
    assert detect_mps({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}, which=none).on is False
    (tmp_path / "control").write_text("")
    got = detect_mps({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}, which=none)
    assert got.on is True and str(tmp_path) in got.how


# ---------------------------------------------------------------------- words and the SM fit
def test_words_name_the_run() -> None:
    h100 = "NVIDIA H100 80GB HBM3"
    on, off = MpsStatus(True, "x"), MpsStatus(False, "y")
    assert Sharing(True, [h100] * 2, ["a"] * 2, 132, on).where() == f"2 ranks sharing one {h100} (MPS)"
    sliced = Sharing(True, [h100] * 4, ["a", "b", "a", "b"], 132, off)
    assert sliced.where() == f"4 ranks sharing 2 {h100} (no MPS: time-sliced)" and sliced.time_sliced
    assert any("MPS OFF" in ln and "time-slices" in ln for ln in sliced.header_notes())
    nvlink = Sharing(True, ["NVIDIA H200"] * 8, [str(i) for i in range(8)], 132, off)
    assert nvlink.where() == "8 ranks on 8 NVIDIA H200" and not nvlink.time_sliced and nvlink.header_notes() == []
    assert Sharing(True, [h100], ["a"], 132, on).where() == f"1 rank on {h100}"
    assert Sharing(False, ["CPU (x86_64)"], ["h/cpu"]).where() == "1 rank on the CPU (x86_64)"
    assert Sharing(False, ["CPU (x86_64)"] * 2, ["h/cpu"] * 2).where() == "2 ranks on the CPU (x86_64)"
    d = sliced.as_dict()
    assert d["devices_in_use"] == 2 and d["ranks_per_device"] == 2 and d["mps"]["on"] is False


def test_sm_fit() -> None:
    assert sm_fit(24, 4, 132) == "" and sm_fit(16, 8, 132) == "" and sm_fit(24, 1, 132) == ""
    why = sm_fit(24, 8, 132)
    assert "8 ranks x 24 SMs = 192 SMs exceed the 132 SMs" in why
    assert sm_fit(24, 8, 0) == ""        # unknown SM count (CPU): nothing to check


# ---------------------------------------------------------------------- on two gloo ranks
def _gate(skew_ns: int) -> Any:
    import torch
    import torch.distributed as dist

    from pyep.bench import sync as sync_mod
    rank = dist.get_rank()
    sync = sync_mod.Sync(dist.group.WORLD, torch.device("cpu"), 30.0)

    def clock() -> int:   # rank 1's clock runs skew_ns ahead (hosts not in step)
        return time.time_ns() + (skew_ns if rank == 1 else 0)
    before = clock()
    t0 = time.monotonic()
    sync.gate("test gate", clock)
    after, waited = clock(), time.monotonic() - t0
    note = sync.gate_note()
    share = Sharing.gather(sync, torch.device("cpu"))
    return {"before": before, "after": after, "waited": waited, "late": sync.late_starts, "note": note,
            "where": share.where(), "one": share.one_device, "keys": share.keys}


def test_start_gate_lines_the_ranks_up(pool2) -> None:  # type: ignore[no-untyped-def]
    from pyep.bench.sync import GATE_LEAD_NS
    res: List[Dict[str, Any]] = pool2.run(_gate, 0, timeout_s=120)
    agreed_at_least = max(r["before"] for r in res) + GATE_LEAD_NS
    for r in res:
        # Every rank leaves at or after the agreed moment, unless it got there late (and says so).
        assert r["after"] >= agreed_at_least or r["late"] == 1
        assert r["one"] and len(set(r["keys"])) == 1 and r["where"].startswith("2 ranks on the CPU")
    assert res[0]["note"] == res[1]["note"]


def test_start_gate_bounds_a_skewed_clock(pool2) -> None:  # type: ignore[no-untyped-def]
    from pyep.bench.sync import GATE_MAX_WAIT_NS
    res = pool2.run(_gate, 10_000_000_000, timeout_s=120)   # rank 1's clock 10 s ahead
    assert res[0]["late"] == 1 and res[0]["waited"] < 5.0   # rank 0 waits GATE_MAX_WAIT_NS, not 10 s
    assert res[0]["after"] - res[0]["before"] >= GATE_MAX_WAIT_NS
    assert res[0]["note"] is not None and "rank(s) 0 (1)" in res[0]["note"]
