"""GPU tests of the IBGDA engine through the softnic (marked `gpu`; skipped without a GPU or without the
CUDA build of pyep._engine). The rank code is tests/gda_gpu_cases.py.

Worlds of 2 ranks and of min(8, #GPUs) ranks, one process per GPU (with a single GPU, two ranks share
it: CUDA IPC works between processes on one device). Each rank's kernel posts thousands of RDMA writes
+ signals on many QPs to every other GPU; every byte and signal is checked at the receiver; a ring of
8 WQEBBs wraps under CQ flow control; injected rkey errors reach the posting kernel as kErrQp with
REMOTE_ACCESS_ERR in the QP's error slot (and in `pyep.transport.qp_dump`), not as a hang. Then
`pyep qp loopback` runs through the softnic on one GPU and between two.

The unmarked test at the end runs the same rank code with CPU posters (CI): same exchange, tables and
checks, so a GPU machine only has the kernel left to prove.

    python -m pytest -q -m gpu tests/test_gda_gpu.py -s     # -s shows the summary lines
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

log = logging.getLogger("tests.gda_gpu")
ROOT = Path(__file__).resolve().parents[1]


def _gpus() -> int:
    try:
        import torch
        if not torch.cuda.is_available():
            return 0
        from pyep._native import load
        mod = load()
        if mod is None or not getattr(mod, "has_cuda", False) or not hasattr(mod, "launch_post_writes") \
                or not hasattr(mod, "launch_loop_latency"):
            return 0
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - any failure here means "no usable GPU build"
        return 0


NGPU = _gpus()
WORLDS = sorted({2, min(8, NGPU)}) if NGPU >= 2 else [2]
_skip_no_gpu = pytest.mark.skipif(NGPU == 0, reason="needs a CUDA GPU and the CUDA build of pyep._engine")


def requires_gpu(fn):
    return pytest.mark.gpu(_skip_no_gpu(fn))


def _cases():
    from gda_gpu_cases import Case
    return {
        # CPU posters (CI): smaller, same shapes of trouble.
        "cpu_small_ring": Case("cpu_small_ring", qps_per_peer=2, warps_per_qp=2, msgs_per_warp=60, msg_bytes=200,
                               log_sq=3),
        "cpu_rkey_faults": Case("cpu_rkey_faults", qps_per_peer=3, warps_per_qp=1, msgs_per_warp=16, msg_bytes=100,
                                log_sq=4, faults=True, timeout_s=10.0),
        # 4 QPs per peer, 2 warps per QP, 256 writes of 3000 B (odd length) per warp.
        "many_qps": Case("many_qps", qps_per_peer=4, warps_per_qp=2, msgs_per_warp=256, msg_bytes=3000, log_sq=10),
        # 8 WQEBBs per QP: each write+signal takes 2, so every QP's ring wraps 100 times.
        "small_ring": Case("small_ring", qps_per_peer=2, warps_per_qp=2, msgs_per_warp=200, msg_bytes=512, log_sq=3),
        # Lower to higher rank: QP 0 writes to an invalidated MR, QP 1 uses a corrupted rkey; QPs 2-3 healthy.
        "rkey_faults": Case("rkey_faults", qps_per_peer=4, warps_per_qp=1, msgs_per_warp=64, msg_bytes=1024,
                            log_sq=6, faults=True, timeout_s=10.0),
    }


@requires_gpu
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case_name", ["many_qps", "small_ring", "rkey_faults"])
def test_gpu_posted_writes(pools, tmp_path, world: int, case_name: str) -> None:
    from gda_gpu_cases import run_case
    case = _cases()[case_name]
    store = str(tmp_path / "store")
    results: List[dict] = pools[world].run(run_case, case, store, f"gda/{case_name}/{world}", timeout_s=600.0)
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:40])
    writes = sum(r["writes"] for r in results)
    nbytes = sum(r["bytes"] for r in results)
    seconds = max(r["seconds"] for r in results)
    qps = sum(r["qps"] for r in results)
    gpus = sorted({r["device"] for r in results})
    line = (f"[gda-gpu] {case_name}: world {world} on GPUs {gpus}: {writes} RDMA writes + {writes} signals on "
            f"{qps} QPs, {nbytes / 1e6:.1f} MB, every byte and signal verified, {seconds:.2f} s "
            f"({nbytes / seconds / 1e9:.2f} GB/s aggregate)")
    if case.faults:
        errs = sum(r["errors_seen"] for r in results)
        assert errs == world * (world - 1), f"expected 2 failed QPs per pair of ranks, saw {errs}"
        line += f"; {errs} QPs failed with REMOTE_ACCESS_ERR as injected, the rest delivered"
    print(line)
    log.info("%s", line)
    assert writes == world * (world - 1) * case.msgs_per_qp * (case.qps_per_peer - (2 if case.faults else 0))


def _loopback(args: List[str], timeout_s: float = 300.0) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "pyep", "qp", "loopback", "--nic", "softnic", "--json"] + args,
                          capture_output=True, text=True, timeout=timeout_s, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, f"pyep qp loopback {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout)


@requires_gpu
@pytest.mark.parametrize("gpus", ["0", "0,1"])
def test_qp_loopback_cli(gpus: str) -> None:
    if gpus == "0,1" and NGPU < 2:
        pytest.skip("needs two GPUs")
    report = _loopback(["--gpus", gpus, "--sizes", "8,4K,1M", "--iters", "300", "--warmup", "20"])
    lat = {r["size"]: r for r in report["latency"]}
    bw = {r["size"]: r for r in report["bandwidth"]}
    assert sorted(lat) == sorted(bw) == [8, 4096, 1 << 20]
    for r in lat.values():
        assert 0 < r["t_min_us"] <= r["t_median_us"] <= r["t_max_us"] < 1e6
    for r in bw.values():
        assert r["gb_s"] > 0 and r["iterations"] == 300
    line = (f"[qp-loopback] GPUs {gpus} via softnic: latency 8 B median {lat[8]['t_median_us']:.2f} us, "
            f"4 KiB {lat[4096]['t_median_us']:.2f} us; bandwidth 1 MiB {bw[1 << 20]['gb_s']:.2f} GB/s, "
            f"8 B {bw[8]['mmsg_s']:.3f} Mmsg/s")
    print(line)
    log.info("%s", line)


@pytest.mark.parametrize("case_name", ["cpu_small_ring", "cpu_rkey_faults"])
def test_cpu_posters_same_checks(pool2, tmp_path, case_name: str) -> None:
    """The rank code of the GPU tests with one CPU thread per warp and host buffers (no GPU needed)."""
    from gda_gpu_cases import run_case
    case = _cases()[case_name]
    results = pool2.run(run_case, case, str(tmp_path / "store"), f"gda-cpu/{case_name}", "cpu", timeout_s=120.0)
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:40])
    healthy = case.qps_per_peer - (2 if case.faults else 0)
    assert sum(r["writes"] for r in results) == 2 * case.msgs_per_qp * healthy
    assert sum(r["errors_seen"] for r in results) == (2 if case.faults else 0)
