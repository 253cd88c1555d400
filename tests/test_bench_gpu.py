"""`pyep bench` on GPUs (marked gpu): two ranks over NCCL started torchrun-style, small shapes. Checks
that the profiled pass attributes kernels (kineto), the guard passes, and the native backend, where it
runs, is measured beside the reference."""
from __future__ import annotations

import json

import pytest

from multiproc import usable_gpus
from test_bench_run import SMALL, _run_ranks

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpu_bench(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import test_bench_run
    monkeypatch.setattr(test_bench_run, "_clean_env", _gpu_env(test_bench_run._clean_env))
    res = _run_ranks([*SMALL, "--tokens", "8", "--routing", "uniform,zipf", "--out", str(tmp_path)], world=2)
    for rank, (rc, so, se) in enumerate(res):
        assert rc == 0, f"rank {rank} exited {rc}\nstdout:\n{so}\nstderr:\n{se}"
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["environment"]["dist_backend"] == "nccl"
    backends = {r["backend"] for r in doc["rows"] if not r["skipped"]}
    assert "reference" in backends
    for r in doc["rows"]:
        if r["skipped"]:
            continue
        assert r["check"]["status"] == "PASS", r["check"]
        assert r["kernel_time_source"] == "kineto"
        for metric in ("dispatch", "combine", "dc", "d_send", "d_recv", "c_send", "c_recv"):
            assert r["wall_us"][metric]["mean"] > 0
            assert r["kernel_us"][metric]["mean"] > 0, (metric, r["kineto"])
        # Per-kernel time of a call cannot exceed its wall time by much (both max over ranks).
        assert r["kernel_us"]["dc"]["mean"] <= 1.5 * r["wall_us"]["dc"]["mean"] + 20


def _gpu_env(base):  # type: ignore[no-untyped-def]
    def env():  # type: ignore[no-untyped-def]
        e = base()
        e.pop("CUDA_VISIBLE_DEVICES", None)
        return e
    return env


# ---------------------------------------------------------------------- ranks sharing one GPU
def _one_gpu_env(base):  # type: ignore[no-untyped-def]
    def env():  # type: ignore[no-untyped-def]
        e = base()
        e["CUDA_VISIBLE_DEVICES"] = "0"
        return e
    return env


def _shared_run(tmp_path, monkeypatch, args):  # type: ignore[no-untyped-def]
    import test_bench_run
    from test_bench_report import assert_fits
    monkeypatch.setattr(test_bench_run, "_clean_env", _one_gpu_env(test_bench_run._clean_env))
    res = _run_ranks([*args, "--out", str(tmp_path)], world=2)
    for rank, (rc, so, se) in enumerate(res):
        assert rc == 0, f"rank {rank} exited {rc}\nstdout:\n{so}\nstderr:\n{se}"
    assert_fits("\n".join(ln for ln in res[0][1].splitlines() if not ln.startswith("PYEP_PROGRESS")))
    return res


def _check_shared_env(env) -> None:  # type: ignore[no-untyped-def]
    # Two ranks on one GPU: a gloo group (NCCL refuses it), data on the GPU, the sharing and MPS named.
    assert env["dist_backend"] == "gloo" and env["device"] == "cuda"
    sh = env["sharing"]
    assert sh["shared_gpu"] and sh["devices_in_use"] == 1 and sh["ranks_per_device"] == 2
    assert sh["mps"]["on"] in (True, False) and "staged through host memory" in sh["collectives"]
    assert "sharing one" in env["where"]


@pytest.mark.skipif(usable_gpus("ep") < 1, reason="needs a CUDA GPU and the CUDA build of pyep._engine")
def test_ll_bench_two_ranks_share_one_gpu(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _shared_run(tmp_path, monkeypatch, [*SMALL, "--tokens", "8"])
    doc = json.loads((tmp_path / "bench.json").read_text())
    _check_shared_env(doc["environment"])
    rows = [r for r in doc["rows"] if not r["skipped"]]
    assert {r["backend"] for r in rows} == {"native"}          # the reference would need host tensors
    for r in rows:
        assert r["check"]["status"] == "PASS", r["check"]
        assert r["kernel_time_source"] == "kineto" and r["kernel_us"]["dispatch"]["mean"] > 0


@pytest.mark.skipif(usable_gpus("normal") < 1, reason="needs a CUDA GPU and the CUDA build of pyep._engine")
def test_normal_bench_two_ranks_share_one_gpu(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _shared_run(tmp_path, monkeypatch, ["--mode", "normal", "--tokens", "256", "--hidden", "1024", "--experts", "16",
                                        "--topk", "4", "--sweep-sms", "4,8", "--iters", "3", "--warmup", "1",
                                        "--copy-mb", "64"])
    doc = json.loads((tmp_path / "bench_normal.json").read_text())
    _check_shared_env(doc["environment"])
    assert doc["copy_rate"]["device"] == "cuda" and doc["copy_rate"]["best_gbps"] > 100
    for r, e in zip(doc["rows"], doc["sweep"]["entries"]):
        assert r["check"]["status"] == "PASS", r["check"]
        assert e["of_copy_rate"]["dispatch_bf16"] > 0           # ranks on one GPU: the bound applies
