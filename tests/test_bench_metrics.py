"""`pyep bench` arithmetic and settings: bytes per message, GB/s, statistics over ranks, config and CLI
validation, the DeepEP reference constants."""
from __future__ import annotations

import argparse
import math

import pytest

from pyep.bench import metrics
from pyep.bench import reference_numbers as refnum
from pyep.bench.config import BenchConfig, RoutingSpec
from pyep.cli import CliError
from pyep.cli import bench as cli_bench


def test_message_bytes_by_hand() -> None:
    # FP8: 7168 payload bytes + 56 fp32 scales + 16-byte header; BF16: 2 * 7168 + 16.
    assert metrics.dispatch_message_bytes(7168, True) == 7168 + 56 * 4 + 16 == 7408
    assert metrics.dispatch_message_bytes(7168, False) == 14352
    assert metrics.combine_message_bytes(7168) == 14336
    assert metrics.dispatch_message_bytes(256, True) == 280
    assert metrics.dispatch_bytes(24, 256, True) == 6720
    assert metrics.combine_bytes(24, 256) == 12288
    with pytest.raises(ValueError):
        metrics.dispatch_message_bytes(100, True)
    with pytest.raises(ValueError):
        metrics.dispatch_bytes(-1, 256, True)


def test_gbps_matches_deepep_figure() -> None:
    # DeepEP: T=128, K=8 -> 1024 entries per rank; dispatch + combine in 110.5 us ~ 199-201 GB/s.
    total = metrics.dispatch_bytes(1024, 7168, True) + metrics.combine_bytes(1024, 7168)
    assert 195 < metrics.gbps(total, 110.5) < 205
    assert metrics.gbps(1e9, 1e6) == pytest.approx(1.0)
    assert math.isnan(metrics.gbps(100, 0.0)) and math.isnan(metrics.gbps(100, math.nan))


def test_percentile_and_summary_take_max_over_ranks() -> None:
    assert metrics.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert metrics.percentile([5.0], 99) == 5.0
    assert metrics.percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    assert math.isnan(metrics.percentile([math.nan], 50))
    s = metrics.summarize([[1.0, 2.0, 3.0], [10.0, 20.0, math.nan]])
    assert s.mean == 15.0 and s.per_rank_mean == [2.0, 15.0]
    assert s.p50 == 15.0 and s.min == 1.0
    assert s.p99 == pytest.approx(19.9)
    d = metrics.summarize([[math.nan]]).as_dict()
    assert d["mean"] is None and d["per_rank_mean"] == [None]


def test_bench_config_validation() -> None:
    BenchConfig()   # the defaults are valid
    bad = [dict(hidden=100), dict(hidden=0), dict(topk=9, experts=8), dict(topk=17, experts=64),
           dict(tokens=()), dict(tokens=(0,)), dict(tokens=(4, 4)), dict(iters=0), dict(warmup=-1),
           dict(transports=("bogus",)), dict(backend="fast"), dict(dispatch_dtype="fp16"),
           dict(drop_fraction=1.5), dict(hot_expert=288), dict(routings=()),
           dict(routings=(RoutingSpec("hot", 0.5),), topk=8, experts=8),
           dict(routings=(RoutingSpec("zipf", 1.0), RoutingSpec("zipf", 1.0)))]
    for kw in bad:
        with pytest.raises(ValueError):
            BenchConfig(**kw)
    with pytest.raises(TypeError):
        BenchConfig(hidden=7168.0)   # type: ignore[arg-type]
    with pytest.raises(TypeError):
        BenchConfig(hook=1)   # type: ignore[arg-type]
    cfg = BenchConfig(experts=288)
    cfg.check_world(8)
    with pytest.raises(ValueError, match="divisible"):
        cfg.check_world(7)
    with pytest.raises(ValueError, match="ranks_per_node"):
        BenchConfig(ranks_per_node=3).check_world(8)


def _args(argv):  # type: ignore[no-untyped-def]
    p = argparse.ArgumentParser()
    cli_bench.configure(p)
    return p.parse_args(argv)


def test_cli_defaults_env_and_flags() -> None:
    cfg, dist_backend, notes = cli_bench.config_from_args(_args([]), {})
    assert (cfg.tokens, cfg.hidden, cfg.topk, cfg.experts) == ((128,), 7168, 8, 288)
    assert cfg.use_fp8 and cfg.backend == "auto" and cfg.transports == ("auto",) and dist_backend == "auto"
    env = {"PYEP_EP_NUM_EXPERTS": "256", "PYEP_EP_HIDDEN": "4096", "PYEP_EP_TRANSPORT": "nvlink",
           "PYEP_VIRTUAL_NODE_SIZE": "4", "PYEP_EP_DIST_BACKEND": "gloo"}
    cfg, dist_backend, notes = cli_bench.config_from_args(_args([]), env)
    assert (cfg.experts, cfg.hidden, cfg.transports, cfg.ranks_per_node) == (256, 4096, ("nvlink",), 4)
    assert dist_backend == "gloo" and any("PYEP_EP_NUM_EXPERTS" in n for n in notes)
    cfg, _, _ = cli_bench.config_from_args(_args(["--experts", "288", "--tokens-sweep"]), env)
    assert cfg.experts == 288 and cfg.tokens == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    cfg, _, _ = cli_bench.config_from_args(
        _args(["--routing", "uniform,zipf:1.5,hot", "--hot-fraction", "0.4", "--transport", "nvlink,emulated",
               "--tokens", "1,32,128", "--dispatch-dtype", "bf16"]), {})
    assert [r.label for r in cfg.routings] == ["uniform", "zipf:1.5", "hot:0.4"]
    assert cfg.transports == ("nvlink", "emulated") and cfg.tokens == (1, 32, 128) and not cfg.use_fp8


@pytest.mark.parametrize("argv,env,msg", [
    (["--hidden", "100"], {}, "hidden must be in"),
    (["--hidden", "1000"], {}, "multiple of 128"),
    (["--routing", "gauss"], {}, "unknown routing"),
    (["--topk", "9", "--experts", "8"], {}, "cannot exceed"),
    (["--tokens", "a,b"], {}, "integers"),
    (["--tokens", "8", "--tokens-sweep"], {}, "exclusive"),
    (["--transport", "pigeon"], {}, "transport"),
    ([], {"PYEP_EP_NUM_EXPERTS": "many"}, "PYEP_EP_NUM_EXPERTS"),
    ([], {"PYEP_EP_DIST_BACKEND": "mpi"}, "dist backend"),
])
def test_cli_bad_input(argv, env, msg) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CliError, match=msg):
        cli_bench.config_from_args(_args(argv), env)


def test_cli_bad_input_exit_status_2(capsys) -> None:  # type: ignore[no-untyped-def]
    # Rejected before any process group exists, so this runs in the test process itself.
    assert cli_bench.main(["--hidden", "1000"]) == 2
    assert "hidden must be a multiple of 128" in capsys.readouterr().err


def test_deepep_reference_row_only_where_it_was_measured() -> None:
    row = refnum.deepep_row(8, "NVIDIA H200", 128, 7168, 8, 288, True)
    assert row is not None and row.dispatch_us == (36.0, 41.0) and row.combine_us == (66.0, 68.0)
    assert row.dispatch_combine_us == 110.5 and row.dispatch_combine_gbps == 199.0
    assert refnum.deepep_row(4, "NVIDIA H200", 128, 7168, 8, 288, True) is None
    assert refnum.deepep_row(8, "NVIDIA H100 80GB HBM3", 128, 7168, 8, 288, True) is None
    assert refnum.deepep_row(8, "NVIDIA H200", 64, 7168, 8, 288, True) is None
    assert refnum.deepep_row(8, "NVIDIA H200", 128, 7168, 8, 256, True) is None
    assert refnum.deepep_row(8, "NVIDIA H200", 128, 7168, 8, 288, False) is None
    assert refnum.deepep_buffer_bytes(128, 7168, 288) == 2_147_000_000
    assert refnum.fmt_range((36.0, 41.0)) == "36-41" and refnum.fmt_range((8.0, 8.0)) == "8"
