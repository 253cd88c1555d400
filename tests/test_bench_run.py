"""`pyep bench` end to end on CPU: two gloo ranks started the way torchrun starts them (env://), the
reference backend, tiny shapes; the JSON is checked against hand-computed byte counts. Plus the
correctness guard, which must catch a backend that returns wrong results."""
from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "bench_ep.py")
RUN_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clean_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYEP_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                       "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_ranks(args: List[str], world: int, extra_env: Optional[Dict[str, str]] = None
               ) -> List[Tuple[int, str, str]]:
    """(exit code, stdout, stderr) per rank of `tools/bench_ep.py ARGS` under torchrun-style env."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = _clean_env()
        if world > 1:
            env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                        "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
        env.update(extra_env or {})
        procs.append(subprocess.Popen([sys.executable, TOOL, *args], env=env, cwd=ROOT, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    out = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=RUN_TIMEOUT_S)
            out.append((p.returncode, so, se))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
    return out


SMALL = ["--hidden", "256", "--experts", "8", "--topk", "4", "--iters", "3", "--warmup", "1", "--seed", "5"]


def test_two_rank_reference_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out_dir = tmp_path / "bench"
    res = _run_ranks([*SMALL, "--tokens", "4,8", "--routing", "uniform,hot:0.5", "--drop-fraction", "0.25",
                      "--backend", "reference", "--out", str(out_dir)], world=2)
    for rank, (rc, so, se) in enumerate(res):
        assert rc == 0, f"rank {rank} exited {rc}\nstdout:\n{so}\nstderr:\n{se}"
        assert "PYEP_PROGRESS 4/4 done" in so
    so0 = res[0][1]
    assert "PASS" in so0 and "FAIL" not in so0 and "buffer size hint, T=8" in so0
    assert "DeepEP (measured" not in so0          # only on 8x H200 with the DeepEP shape
    assert "pyep bench" not in res[1][1]          # rank 1 prints no table

    doc = json.loads((out_dir / "bench.json").read_text())
    assert doc["schema"] == "pyep-bench/1"
    assert doc["config"]["tokens"] == [4, 8] and doc["config"]["routings"] == ["uniform", "hot:0.5"]
    env = doc["environment"]
    assert env["world_size"] == 2 and len(env["device_names"]) == 2 and env["dist_backend"] == "gloo"
    assert doc["deepep_reference"]["rows"] == [] and "REFERENCE.md" in doc["deepep_reference"]["label"]
    assert (out_dir / "bench.txt").read_text().count("PASS") == 4
    rows = doc["rows"]
    assert [(r["tokens"], r["routing"]) for r in rows] == [(4, "uniform"), (4, "hot:0.5"), (8, "uniform"),
                                                           (8, "hot:0.5")]
    from pyep.ep.ll import EpBuffer
    for r in rows:
        t = r["tokens"]
        assert r["backend"] == "reference" and r["transport"] == "gloo" and r["skipped"] is None
        assert r["check"]["status"] == "PASS" and r["check"]["failed_ranks"] == []
        # Hand count: T tokens x K=4 entries, a quarter of them dropped; FP8 message 256 + 2*4 + 16.
        valid = t * 4 - round(0.25 * t * 4)
        assert r["num_valid_per_rank"] == [valid, valid]
        assert r["bytes_per_rank"]["dispatch"] == [valid * 280] * 2
        assert r["bytes_per_rank"]["combine"] == [valid * 512] * 2
        assert r["size_hint_bytes"] == EpBuffer.size_hint(t, 256, 8, 2, 4) > 0
        assert r["kernel_time_source"].startswith("wall")
        for metric in ("dispatch", "combine", "dc", "d_send", "d_recv", "c_send", "c_recv"):
            st = r["wall_us"][metric]
            assert st["mean"] > 0 and st["p99"] >= st["p50"] > 0 and st["min"] > 0
            assert len(st["per_rank_mean"]) == 2 and max(st["per_rank_mean"]) == pytest.approx(st["mean"])
            samples = r["samples_us"]["wall"][metric]
            assert len(samples) == 2 and all(len(s) == 3 and min(s) > 0 for s in samples)
            assert r["kernel_us"][metric] == st          # CPU: kernel time is the wall time
        mean_bytes = valid * 280
        assert r["gbps"]["wall"]["dispatch"] == pytest.approx(
            mean_bytes / (r["wall_us"]["dispatch"]["mean"] * 1e-6) / 1e9, rel=1e-3)
        assert r["gbps"]["wall"]["dc"] > 0
        # The eager pass: back-to-back pairs, pair time and host time of each call, per rank.
        for metric in ("pair", "host_dispatch", "host_combine"):
            st = r["eager_us"][metric]
            assert st["mean"] > 0 and len(st["per_rank_mean"]) == 2
            assert len(r["samples_us"]["eager"][metric]) == 2
        assert r["eager_us"]["pair"]["mean"] >= r["eager_us"]["host_dispatch"]["mean"]
        assert r["eager_pair_vs_kernels"] > 0
    assert "eager loop" in so0 and "host us" in so0 and "calls us" in so0
    _check_words_and_width(so0, (out_dir / "bench.txt").read_text(), 2)
    assert env["device"] == "cpu" and env["where"] == f"2 ranks on the CPU ({platform.machine()})"
    assert env["sharing"]["devices_in_use"] == 1 and env["sharing"]["mps"] is None
    _check_plot(out_dir / "bench.png", doc, res)


def _check_words_and_width(stdout: str, saved: str, world: int) -> None:
    """A CPU run's output: within 120 columns, no GPU words, the rank count spelled right."""
    from test_bench_report import assert_fits
    table_text = "\n".join(ln for ln in stdout.splitlines() if not ln.startswith("PYEP_PROGRESS"))
    assert_fits(table_text)
    assert_fits(saved)
    for word in ("kernel", "kineto", "CUDA", "GPU"):
        assert word not in table_text, word
    assert f"{world} rank{'s' if world > 1 else ''} on the CPU" in " ".join(table_text.split())
    assert "1 ranks" not in table_text


def _check_plot(png, doc, res) -> None:  # type: ignore[no-untyped-def]
    """A PNG whenever matplotlib is importable; else one line of the output says so and nothing warns."""
    try:
        import matplotlib
        assert matplotlib is not None
        assert png.stat().st_size > 1000 and doc["files"]["plot"] == png.name
    except ImportError:
        assert not png.exists() and doc["files"]["plot"] is None
        out = res[0][1] + res[0][2]
        assert sum("matplotlib" in ln for ln in out.splitlines()) == 1
        assert "no PNG: matplotlib is not installed" in res[0][1]
    for _rc, _so, se in res:
        assert "WARNING" not in se, se


def test_four_rank_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """4 gloo ranks on the CPU: one table for 4 ranks, every rank's figures in the JSON."""
    out_dir = tmp_path / "bench4"
    res = _run_ranks([*SMALL, "--tokens", "4", "--backend", "reference", "--iters", "2", "--no-hook",
                      "--out", str(out_dir)], world=4)
    for rank, (rc, so, se) in enumerate(res):
        assert rc == 0, f"rank {rank} exited {rc}\nstdout:\n{so}\nstderr:\n{se}"
    doc = json.loads((out_dir / "bench.json").read_text())
    assert doc["environment"]["world_size"] == 4 and doc["environment"]["sharing"]["devices_in_use"] == 1
    (row,) = doc["rows"]
    assert row["check"]["status"] == "PASS" and len(row["num_valid_per_rank"]) == 4
    assert len(row["wall_us"]["dispatch"]["per_rank_mean"]) == 4
    _check_words_and_width(res[0][1], (out_dir / "bench.txt").read_text(), 4)
    _check_plot(out_dir / "bench.png", doc, res)


def test_native_unavailable_is_reported_not_hidden(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # One rank, no torchrun variables: a one-rank group on 127.0.0.1. This machine has no CUDA, so
    # --backend native cannot run: the row says why and the exit status is 1 (nothing measured).
    ((rc, so, se),) = _run_ranks([*SMALL, "--tokens", "8", "--backend", "native", "--no-plot",
                                  "--out", str(tmp_path)], world=1)
    assert rc == 1, so + se
    doc = json.loads((tmp_path / "bench.json").read_text())
    (row,) = doc["rows"]
    assert row["backend"] == "native" and "native" in row["skipped"] and "check" not in row
    assert "no benchmark row could be measured" in se
    assert "1 rank on the CPU" in " ".join(so.split()) and "1 ranks" not in so


def test_launcher_environment_and_run_dir(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # `pyep launch` exports PYEP_EP_* settings and PYEP_RUN_DIR; flags still win over them.
    env = {"PYEP_RUN_DIR": str(tmp_path), "PYEP_EP_NUM_EXPERTS": "4", "PYEP_EP_HIDDEN": "128",
           "PYEP_EP_NUM_TOPK": "2", "PYEP_EP_MAX_DISPATCH_TOKENS": "4", "PYEP_EP_BACKEND": "reference"}
    ((rc, so, se),) = _run_ranks(["--iters", "2", "--warmup", "0", "--no-hook", "--no-plot", "--topk", "3"],
                                 world=1, extra_env=env)
    assert rc == 0, so + se
    doc = json.loads((tmp_path / "bench.json").read_text())
    cfg = doc["config"]
    assert (cfg["experts"], cfg["hidden"], cfg["topk"], cfg["tokens"]) == (4, 128, 3, [4])
    assert any("PYEP_EP_NUM_EXPERTS" in n for n in doc["notes"])
    (row,) = doc["rows"]
    assert row["wall_us"]["d_send"]["mean"] is None and row["wall_us"]["dispatch"]["mean"] > 0


def test_python_m_pyep_bench_help() -> None:
    res = subprocess.run([sys.executable, "-m", "pyep", "bench", "--help"], cwd=ROOT, env=_clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--tokens-sweep" in res.stdout and "--routing" in res.stdout


# ---------------------------------------------------------------------- the guard
class _Corrupting:
    """An EpBuffer stand-in that returns a wrong combine result on the chosen rank."""

    def __init__(self, inner, corrupt: bool) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.corrupt = inner, corrupt

    def dispatch(self, *a, **kw):  # type: ignore[no-untyped-def]
        return self.inner.dispatch(*a, **kw)

    def combine(self, *a, **kw):  # type: ignore[no-untyped-def]
        out, ev, hook = self.inner.combine(*a, **kw)
        if self.corrupt:
            out = out.clone()
            out[1, 3] += 0.5
        return out, ev, hook


def _guard_worker(bad_rank: int):  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist

    from pyep.bench.config import RoutingSpec
    from pyep.bench.guard import run_guard
    from pyep.bench.routing import make_batch
    from pyep.bench.sync import Sync
    from pyep.ep.ll import EpBuffer
    rank = dist.get_rank()
    kw = dict(num_max_dispatch_tokens_per_rank=8, hidden=256, num_experts=8, backend="reference",
              max_topk=4, check_values=False)
    ref, other = EpBuffer(None, **kw), EpBuffer(None, **kw)
    bad = _Corrupting(other, corrupt=(rank == bad_rank))
    batch = make_batch(RoutingSpec("zipf", 1.0), 8, 256, 8, 4, seed=1, rank=rank)
    sync = Sync(dist.group.WORLD, torch.device("cpu"), 30.0)
    results, outs = run_guard([("bad/x", bad), ("reference/gloo", ref)], batch, True, "reference/gloo", sync)
    ref.destroy()
    other.destroy()
    return {k: (v.passed, v.failed_ranks, v.detail) for k, v in results.items()}, sorted(outs)


def test_guard_catches_a_wrong_backend(pool2) -> None:  # type: ignore[no-untyped-def]
    per_rank = pool2.run(_guard_worker, 1, timeout_s=120)
    for rank, (results, keys) in enumerate(per_rank):
        assert keys == ["bad/x", "reference/gloo"]
        assert results["reference/gloo"][:2] == (True, [])
        passed, failed, detail = results["bad/x"]
        assert not passed and failed == [1]
        assert ("token 1 channel 3" in detail) if rank == 1 else ("rank(s) [1]" in detail)
