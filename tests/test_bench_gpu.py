"""`pyep bench` on GPUs (marked gpu): two ranks over NCCL started torchrun-style, small shapes. Checks
that the profiled pass attributes kernels (kineto), the guard passes, and the native backend, where it
runs, is measured beside the reference."""
from __future__ import annotations

import json

import pytest

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
