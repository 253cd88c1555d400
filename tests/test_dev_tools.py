"""The dev tools' host-side parts on CPU: tools/dev/logfmt_bench.py's error statistics (the part that
failed on the GPU with an empty selection) on ordinary, all-zero, empty and non-finite outputs and on
real LogFMT round trips, and tools/dev/ranks.py (the launcher host_overhead.py and logfmt_bench.py
share): the per-rank inputs, and a rank that cannot start is reported, not waited for; and
tools/dev/normal_front_time.py runs on the CPU."""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

import pytest
import torch

from tools.dev.logfmt_bench import error_stats
from tools.dev.ranks import rank_inputs, run_ranks


def test_error_stats_ordinary() -> None:
    ref = torch.tensor([[1.0, -2.0, 4.0, 1e-6]], dtype=torch.bfloat16)
    got = torch.tensor([[1.0, -2.5, 4.0, 0.0]], dtype=torch.bfloat16)
    st = error_stats(ref, got)
    assert st["elements"] == 4 and st["nonfinite"] == 0
    assert st["compared"] == 3                       # 1e-6 is under 1e-3 * max |ref|: left out
    assert st["max_rel"] == pytest.approx(0.25) and st["mean_rel"] == pytest.approx(0.25 / 3)
    assert 0 < st["calc_diff"] < 1


def test_error_stats_equal_outputs() -> None:
    ref = torch.randn(8, 512).to(torch.bfloat16)
    st = error_stats(ref, ref.clone())
    assert st["max_rel"] == 0.0 and st["mean_rel"] == 0.0 and st["calc_diff"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("shape", [(4, 512), (0, 512)])
def test_error_stats_empty_selection(shape) -> None:
    """An all-zero (or empty) reference selects nothing: reported as 0 compared, no exception."""
    z = torch.zeros(shape, dtype=torch.bfloat16)
    st = error_stats(z, z.clone())
    assert st["compared"] == 0 and st["max_rel"] is None and st["mean_rel"] is None
    assert st["nonfinite"] == 0


def test_error_stats_nonfinite_counted_and_left_out() -> None:
    ref = torch.tensor([1.0, 2.0, float("nan"), 4.0, 8.0])
    got = torch.tensor([1.0, 2.2, 3.0, float("inf"), float("nan")])
    st = error_stats(ref, got)
    assert st["nonfinite"] == 3 and st["compared"] == 2
    assert st["max_rel"] == pytest.approx(0.1) and math.isfinite(st["calc_diff"])
    allbad = error_stats(torch.full((3,), float("nan")), torch.zeros(3))
    assert allbad["nonfinite"] == 3 and allbad["compared"] == 0 and allbad["calc_diff"] is None
    with pytest.raises(ValueError, match="shapes differ"):
        error_stats(torch.zeros(2, 3), torch.zeros(3, 2))


def test_error_stats_on_logfmt_round_trip() -> None:
    """What the tool measures on the GPU, with the bit-exact CPU reference of the kernels' LogFMT:
    randn * 0.1 rows (most groups cast) stay within LogFMT's worst-case bound."""
    from pyep.ep.ll import logfmt
    y = (torch.randn(64, 1024, generator=torch.Generator().manual_seed(3)) * 0.1).to(torch.bfloat16)
    st = error_stats(y, logfmt.roundtrip(y))
    assert st["compared"] > 60000 and st["nonfinite"] == 0
    assert 0 < st["max_rel"] <= 0.0225 and st["mean_rel"] < 0.01


def test_rank_inputs() -> None:
    x, idx, w, y = rank_inputs(1, 2, torch.device("cpu"), 16, 256, 8, 3, y_scale=0.5)
    assert x.shape == (16, 256) and x.dtype == torch.bfloat16
    assert idx.shape == (16, 3) and idx.dtype == torch.int64 and int(idx.max()) < 8
    assert all(len(set(row)) == 3 for row in idx.tolist())      # distinct experts per token
    assert w.shape == (16, 3) and w.dtype == torch.float32 and y.shape == (4, 32, 256)
    x2, idx2, _, _ = rank_inputs(1, 2, torch.device("cpu"), 16, 256, 8, 3, y_scale=0.5)
    assert torch.equal(x, x2) and torch.equal(idx, idx2)       # seeded by the rank
    assert not torch.equal(x, rank_inputs(0, 2, torch.device("cpu"), 16, 256, 8, 3)[0])


def _never_called(rank, dev, args):  # pragma: no cover - the rank fails before it gets here
    return {"rank": rank}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU failure path")
def test_run_ranks_reports_a_rank_that_cannot_start(capsys) -> None:
    assert run_ranks("dev_tools_test", _never_called, argparse.Namespace(), 1, timeout_s=120) is None
    err = capsys.readouterr().err
    assert "dev_tools_test: rank(s) [0] gave no result" in err and "exit codes [1]" in err


def test_normal_front_time_runs_on_cpu() -> None:
    """tools/dev/normal_front_time.py: the front's calls with the backend stubbed, one line per call kind."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "tools/dev/normal_front_time.py", "--calls", "5", "--hidden", "256",
                          "--tokens", "8"], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln.split() for ln in out.stdout.splitlines() if ln.startswith("  ")]
    assert [" ".join(ln[:-1]) for ln in lines] == ["bf16 cached dispatch", "fp8 cached dispatch", "combine",
                                                   "bf16 cached dispatch, Config", "combine, Config"]
    assert all(float(ln[-1]) > 0 for ln in lines)
