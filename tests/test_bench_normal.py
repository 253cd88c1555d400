"""CPU tests of `pyep bench --mode normal`: the byte counting against a hand count, the contract oracle
against a hand-worked example, DeepEP log parsing (sample text in test_intranode.py's and
test_low_latency.py's print formats), the flags, and the whole suite on two gloo ranks with a stand-in
buffer (a per-token Python implementation of the contract, written apart from the oracle), including
one that corrupts a row and must fail the guard and not be timed, and rows that do not fit a shared
GPU. The tables, JSON and plot: tests/test_bench_normal_report.py."""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any, List, Optional

import pytest
import torch

from pyep.bench import normal_check as nc
from pyep.bench.guard import CheckResult
from pyep.bench.metrics import summarize
from pyep.bench.normal import PHASES, SAMPLE_KINDS, NormalBenchConfig, NormalRow, bytes_per_rank
from pyep.bench import deepep_run as dr
from pyep.bench import normal_report as nr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------- bytes and GB/s
def test_bytes_follow_test_intranode() -> None:
    b = bytes_per_rank(1000, 7168)
    assert b["cached_bf16"] == b["combine"] == 1000 * 7168 * 2 == 14_336_000
    assert b["cached_fp8"] == b["dispatch"] == pytest.approx(14_336_000 * 1.03125 / 2) == 7_392_000
    assert b["eager"] == pytest.approx(14_336_000 + 7_392_000)


def _row(times: dict, recv: List[int], passed: bool = True, aux: Optional[dict] = None) -> NormalRow:
    stats = {k: {} for k in SAMPLE_KINDS}
    for p in PHASES:
        t = times.get(p, 10.0)
        stats["wall"][p] = summarize([[t, t]] * len(recv))
        stats["kernel"][p] = summarize([[t * 0.9, t * 0.9]] * len(recv))
        a = (aux or {}).get(p, math.nan)
        stats["aux"][p] = summarize([[a, a]] * len(recv))
        stats["host"][p] = summarize([[1.0, 1.0]] * len(recv))
    return NormalRow("native", 24, 4096, 7168, "uniform", check=CheckResult(passed, "detail"), recv_tokens=recv,
                     stats=stats, kernel_source="kineto", buffer_bytes=123)


def test_gbps_is_mean_bytes_over_slowest_mean_time() -> None:
    row = _row({"cached_bf16": 200.0, "cached_fp8": 100.0, "combine": 250.0}, [1000, 3000],
               aux={"dispatch": 5.0, "layout": 7.0})
    # mean bytes: 2000 rows x 14336 B = 28,672,000 B; 200 us -> 143.36 GB/s (wall).
    assert row.gbps("wall")["cached_bf16"] == pytest.approx(28_672_000 / 200e-6 / 1e9)
    assert row.gbps("wall")["cached_fp8"] == pytest.approx(28_672_000 * 1.03125 / 2 / 100e-6 / 1e9)
    assert row.gbps("kernel")["combine"] == pytest.approx(28_672_000 / 225e-6 / 1e9)
    # kernel time = main + aux where the phase had aux kernels; layout is its aux time.
    assert row.time_us("kernel", "dispatch") == pytest.approx(9.0 + 5.0)
    assert row.time_us("kernel", "layout") == pytest.approx(9.0 + 7.0)
    assert "layout" not in row.gbps("wall")


# ---------------------------------------------------------------------- the oracle, by hand
def _hand_inputs():
    # R=2, E=4 (2 per rank), N=3 per rank, C=2 channels (P=2: tokens 0,1 in channel 0, token 2 in 1).
    topks = [torch.tensor([[0, 3], [1, -1], [2, 3]]), torch.tensor([[3, 2], [-1, 0], [1, 2]])]
    xs = [torch.full((3, 128), 1.0, dtype=torch.bfloat16) * torch.tensor([[1.0], [2.0], [3.0]]).to(torch.bfloat16),
          torch.full((3, 128), 10.0, dtype=torch.bfloat16) * torch.tensor([[1.0], [2.0], [3.0]]).to(torch.bfloat16)]
    ws = [torch.tensor([[0.5, 0.25], [0.75, 0.125], [0.375, 0.625]]), torch.tensor([[1.5, 2.5], [3.5, 4.5], [5.5, 6.5]])]
    return xs, topks, ws


def test_oracle_matches_hand_worked_example() -> None:
    xs, topks, ws = _hand_inputs()
    e = nc.expected(0, xs, topks, ws, num_experts=4, num_channels=2, expert_alignment=1)
    assert e.recv_src_idx.tolist() == [0, 1, 1, 2]
    assert e.recv_x[:, 0].float().tolist() == [1.0, 2.0, 20.0, 30.0]
    assert e.recv_topk_idx.tolist() == [[0, -1], [1, -1], [-1, 0], [1, -1]]
    assert e.recv_topk_weights.tolist() == [[0.5, 0.0], [0.75, 0.0], [0.0, 4.5], [5.5, 0.0]]
    assert e.num_recv_tokens_per_expert == [2, 2]
    assert e.rank_prefix_matrix.tolist() == [[2, 2], [4, 4]]
    assert e.channel_prefix_matrix.tolist() == [[2, 2], [1, 2]]
    assert e.recv_channel_prefix_matrix.tolist() == [[0, 2], [0, 1]]   # from each source's first row
    assert e.send_head.tolist() == [[0, 0], [1, -1], [-1, 0]]
    assert e.is_token_in_rank.tolist() == [[True, True], [True, False], [False, True]]
    # combine: token 0 goes to both ranks: 1 * 1.0 + 1 * 1.125; token 1 only rank 0; token 2 only rank 1.
    assert e.combined_x[:, 0].float().tolist() == [2.125, 2.0, 3.375]
    assert e.combined_topk_weights.tolist() == [[0.5, 0.25], [0.75, 0.0], [0.375, 0.625]]
    e128 = nc.expected(0, xs, topks, ws, num_experts=4, num_channels=2, expert_alignment=128)
    assert e128.num_recv_tokens_per_expert == [128, 128]
    lay = nc.layout(topks[1], 4, 2)
    assert lay[0].tolist() == [2, 2] and lay[1].tolist() == [1, 1, 2, 1]


def test_oracle_edges() -> None:
    assert nc.token_channels(0, 4).tolist() == []
    assert nc.token_channels(3, 8).tolist() == [0, 1, 2]       # fewer tokens than channels
    assert nc.token_channels(10, 4).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    empty = torch.zeros(0, 2, dtype=torch.bool)
    assert nc.channel_prefix(empty, 3).tolist() == [[0, 0, 0], [0, 0, 0]]
    assert nc.send_head(empty, 3).shape == (0, 2)
    # An id outside [-1, E) counts as -1.
    assert nc.layout(torch.tensor([[7, 1]]), 4, 2)[1].tolist() == [0, 1, 0, 0]


def test_diff_is_bitwise_and_names_the_first_difference() -> None:
    a = torch.tensor([0.0, 1.0, 2.0])
    assert nc.diff("t", a, a.clone()) is None
    assert "1 of 3 elements differ, first at [0]" in nc.diff("t", torch.tensor([-0.0, 1.0, 2.0]), a)
    assert "shape" in nc.diff("t", a[:2], a) and "dtype" in nc.diff("t", a.double(), a)
    assert nc.diff("t", None, a) == "t: missing (None)"


# ---------------------------------------------------------------------- DeepEP log parsing
INTRANODE_LOG = """[config] num_tokens=4096, hidden=7168, num_topk=8
[layout] Kernel performance: 0.052 ms

[testing] Running with BF16, without top-k (async=False, previous=False) ... passed
[testing] Running with FP8, with top-k (async=True, previous=True) ... passed

[tuning] SMs 24, NVL chunk 4: 180.10 GB/s (NVL), 1500.20 us
[tuning] SMs 24, NVL chunk 20: 247.12 GB/s (NVL), 1093.40 us
[tuning] SMs 24, NVL chunk default: 240.00 GB/s (NVL), 1125.00 us
[tuning] Best dispatch (FP8): SMs 24, NVL chunk 20, 247.12 GB/s (NVL), t: 1093.40 us

[tuning] SMs 24, NVL chunk 4: 300.00 GB/s (NVL), 1700.00 us
[tuning] SMs 24, NVL chunk default: 330.50 GB/s (NVL), 1543.21 us
[tuning] Best dispatch (BF16): SMs 24, NVL chunk 8, 340.00 GB/s (NVL), t: 1500.00 us

[tuning] SMs 24, NVL chunk 1: 100.00 GB/s (NVL), 5100.00 us
[tuning] SMs 24, NVL chunk 7: 289.00 GB/s (NVL), 1764.71 us
[tuning] SMs 24, NVL chunk default: 280.00 GB/s (NVL), 1821.43 us
[tuning] Best combine: SMs 24, NVL chunk 7: 289.00 GB/s (NVL), t: 1764.71 us
"""

LL_LOG = """[rank 0] Dispatch + combine bandwidth: 199.00 GB/s, avg_t=110.50 us, min_t=108.00 us, max_t=115.20 us
[rank 1] Dispatch + combine bandwidth: 198.00 GB/s, avg_t=111.00 us, min_t=108.00 us, max_t=115.20 us
[rank 0] Dispatch bandwidth: 180.00 GB/s, avg_t=31.80 us | Combine bandwidth: 290.00 GB/s, avg_t=38.90 us
[rank 0] Dispatch send/recv time: 20.00 + 8.20 us | Combine send/recv time: 31.80 + 9.70 us
"""


def test_parse_intranode() -> None:
    tool = dr.load_baseline_tool()
    f = tool.parse_intranode(INTRANODE_LOG)
    assert f["dispatch_fp8"] == {"num_sms": 24, "nvl_chunk": 20, "gbps": 247.12, "t_us": 1093.40}
    assert f["dispatch_bf16"] == {"num_sms": 24, "nvl_chunk": 8, "gbps": 340.0, "t_us": 1500.0}
    assert f["combine"] == {"num_sms": 24, "nvl_chunk": 7, "gbps": 289.0, "t_us": 1764.71}
    assert f["default"]["dispatch_bf16"]["gbps"] == 330.5 and f["default"]["combine"]["t_us"] == 1821.43
    assert [p["nvl_chunk"] for p in f["sweeps"]["dispatch_fp8"]] == [4, 20, None]
    assert len(f["sweeps"]["combine"]) == 3
    assert f["layout_us"] == pytest.approx(52.0) and f["checks_passed"] == 2
    assert f["shape"] == {"num_tokens": 4096, "hidden": 7168, "num_topk": 8}
    assert tool.has_figures("intranode", f)
    assert not tool.has_figures("intranode", tool.parse_intranode(INTRANODE_LOG.split("[tuning] Best combine")[0]))


def test_parse_ll() -> None:
    tool = dr.load_baseline_tool()
    f = tool.parse_ll(LL_LOG)
    assert f["dispatch_combine"] == {"gbps": 199.0, "avg_us": 110.5, "min_us": 108.0, "max_us": 115.2}
    assert f["kernels"]["dispatch_us"] == 31.8 and f["kernels"]["combine_gbps"] == 290.0
    assert f["hooks"]["combine_send_us"] == 31.8 and len(f["runs"]["dispatch_combine"]) == 1
    assert tool.has_figures("ll", f) and not tool.has_figures("ll", tool.parse_ll("nothing"))
    # Ranks print without a lock: rank 0's line can follow rank 1's on one line of the log.
    joined = tool.parse_ll("[rank 1] Dispatch + combine bandwidth: 261.38 GB/s, avg_t=84.35 us, min_t=70.98 us, "
                           "max_t=128.16 us[rank 0] Dispatch + combine bandwidth: 265.44 GB/s, avg_t=83.06 us, "
                           "min_t=70.69 us, max_t=106.18 us\n")
    assert joined["dispatch_combine"] == {"gbps": 265.44, "avg_us": 83.06, "min_us": 70.69, "max_us": 106.18}


def test_missing_deepep_is_a_note(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tool = dr.load_baseline_tool()
    with pytest.raises(tool.DeepEpUnavailable, match="deepep_v1.sh is missing"):
        tool.run("intranode", 2, root=str(tmp_path))
    (tmp_path / ".anchors").mkdir()
    (tmp_path / ".anchors" / "deepep_v1.sh").write_text("exit 2\n")
    with pytest.raises(tool.DeepEpUnavailable, match="no DeepEP checkout"):
        tool.run("intranode", 2, root=str(tmp_path))
    doc, note = dr.deepep_figures("intranode", 2, [], str(tmp_path), json_path=str(tmp_path / "absent.json"))
    assert doc is None and "unavailable" in note
    path = tmp_path / "deepep.json"
    tool.write(str(path), {"ok": True, "figures": tool.parse_intranode(INTRANODE_LOG)})
    doc, note = dr.deepep_figures("intranode", 2, [], str(tmp_path), json_path=str(path))
    assert doc["figures"]["combine"]["gbps"] == 289.0 and str(path) in note


def _args(*argv: str) -> argparse.Namespace:
    from pyep.cli.bench import configure
    p = argparse.ArgumentParser()
    configure(p)
    return p.parse_args(list(argv))


def test_flags() -> None:
    cfg, _ = nr.config_from_args(_args("--mode", "normal"), cuda=True)
    assert (cfg.tokens, cfg.hidden, cfg.topk, cfg.experts, cfg.backends) == (4096, 7168, 8, 256, ("native",))
    assert len(cfg.num_sms) == 1
    cfg, notes = nr.config_from_args(_args("--mode", "normal", "--sweep-sms"), cuda=False)
    assert cfg.num_sms == (4, 6, 8, 12, 16, 24) and cfg.backends == ("reference",) and notes
    cfg, _ = nr.config_from_args(_args("--mode", "normal", "--sweep-sms", "8,16", "--backend", "both"), cuda=True)
    assert cfg.num_sms == (8, 16) and cfg.backends == ("native", "reference")
    for bad in (["--num-sms", "24", "--sweep-sms"], ["--num-sms", "7"], ["--tokens-sweep"], ["--routing", "uniform,hot"],
                ["--experts", "6", "--topk", "8"]):
        with pytest.raises(ValueError):
            nr.config_from_args(_args("--mode", "normal", *bad), cuda=True)
    from pyep.cli import CliError
    from pyep.cli.bench import run
    with pytest.raises(CliError, match="--mode normal"):
        run(_args("--num-sms", "24"), environ={})


# ---------------------------------------------------------------------- the suite on 2 gloo ranks
class FakeConfig:
    def __init__(self, num_sms: int) -> None:
        self.num_sms = num_sms

    def num_channels(self) -> int:
        return self.num_sms // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes * num_ranks * self.num_sms


class FakeNormalBuffer:
    """The contract token by token with all_gather_object (small shapes only). corrupt=True swaps
    the first two received rows of rank 0, which the guard must catch."""
    num_sms = 24
    corrupt = False

    @classmethod
    def set_num_sms(cls, n: int) -> None:
        cls.num_sms = n

    @classmethod
    def get_dispatch_config(cls, num_ranks: int) -> FakeConfig:
        return FakeConfig(cls.num_sms)

    get_combine_config = get_dispatch_config

    def __init__(self, group: Any, num_nvl_bytes: int, *, hidden: int, backend: str, transport: str,
                 timeout_us: int) -> None:
        import torch.distributed as dist
        self.group, self.rank, self.R = group, dist.get_rank(group), dist.get_world_size(group)
        self.buffer_bytes = num_nvl_bytes
        self.hidden = hidden
        self.handed_out: List[Any] = []          # tensors get_combine_input made
        self.combined_from_pool: List[bool] = []   # per combine: was x one of them
        FakeNormalBuffer.last = self

    def destroy(self) -> None:
        pass

    def _all(self, obj: Any) -> List[Any]:
        import torch.distributed as dist
        out: List[Any] = [None] * self.R
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def get_dispatch_layout(self, topk_idx, num_experts, **kw):  # type: ignore[no-untyped-def]
        n, el = topk_idx.shape[0], num_experts // self.R
        in_rank = torch.zeros(n, self.R, dtype=torch.bool)
        per_exp = torch.zeros(num_experts, dtype=torch.int32)
        for t in range(n):
            for e in topk_idx[t].tolist():
                if 0 <= e < num_experts:
                    per_exp[e] += 1
                    in_rank[t, e // el] = True
        return in_rank.sum(0).to(torch.int32), None, per_exp, in_rank, None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,  # type: ignore[no-untyped-def]
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None, **kw):
        from pyep.ep.normal.handle import NormalHandle
        fp8 = isinstance(x, tuple)
        C = self.num_sms // 2
        if handle is not None:
            in_rank, topk_idx = handle.is_token_in_rank, None
            topk_weights = None
        else:
            in_rank = is_token_in_rank
        per = max(1, -(-in_rank.shape[0] // C))
        # float8 tensors do not pickle: they travel as bytes
        sent = (x[0].view(torch.uint8), x[1]) if fp8 else x
        everyone = [((xs[0].view(torch.float8_e4m3fn), xs[1]) if fp8 else xs, *rest)
                    for xs, *rest in self._all((sent, topk_idx, topk_weights, in_rank))]
        rows, idx, ws, src, rpm, rcpm, counts = [], [], [], [], [], [], {}
        total = [0] * self.R
        el = len(num_tokens_per_expert) // self.R if num_tokens_per_expert is not None else 0
        for s, (xs, ts, wts, ir) in enumerate(everyone):
            chan_start: List[int] = []
            first = len(rows)
            for t in range(ir.shape[0]):
                if t % per == 0 and t // per < C:
                    chan_start.append(len(rows) - first)
                if not ir[t, self.rank]:
                    continue
                rows.append((xs[0][t], xs[1][t]) if fp8 else xs[t])
                src.append(t)
                if ts is not None:
                    ids = [e - self.rank * el if self.rank * el <= e < (self.rank + 1) * el else -1 for e in ts[t].tolist()]
                    idx.append(ids)
                    ws.append([float(w) if i >= 0 else 0.0 for w, i in zip(wts[t].tolist(), ids)])
                    for i in ids:
                        if i >= 0:
                            counts[i] = counts.get(i, 0) + 1
            chan_start += [len(rows) - first] * (C - len(chan_start))
            rcpm.append(chan_start)
            for d in range(self.R):
                total[d] += int(ir[:, d].sum())
            rpm.append(list(total))
        if self.corrupt and self.rank == 0 and len(rows) > 1:
            rows[0], rows[1] = rows[1], rows[0]
        H = everyone[0][0][0].shape[1] if fp8 else everyone[0][0].shape[1]
        if fp8:
            recv = (torch.stack([r[0] for r in rows]) if rows else torch.empty(0, H, dtype=torch.float8_e4m3fn),
                    torch.stack([r[1] for r in rows]) if rows else torch.empty(0, H // 128))
        else:
            recv = torch.stack(rows) if rows else torch.empty(0, H, dtype=torch.bfloat16)
        if handle is not None:
            return recv, None, None, None, None, None
        n = in_rank.shape[0]
        cpm = torch.zeros(self.R, C, dtype=torch.int32)
        head = torch.full((n, self.R), -1, dtype=torch.int32)
        for d in range(self.R):
            pos = [0] * C
            for t in range(n):
                if in_rank[t, d]:
                    head[t, d] = pos[t // per]
                    pos[t // per] += 1
            cpm[d] = torch.tensor(pos).cumsum(0)
        h = NormalHandle(torch.tensor(rpm, dtype=torch.int32), cpm, torch.tensor(rcpm, dtype=torch.int32),
                         torch.tensor(src, dtype=torch.int32), in_rank, head, owner="fake", epoch=0, num_channels=C,
                         num_tokens=n, num_recv_tokens=len(rows), num_worst_tokens=0, hidden=H,
                         num_topk=topk_idx.shape[1])
        k = topk_idx.shape[1]
        return (recv, torch.tensor(idx, dtype=torch.int64).reshape(-1, k),
                torch.tensor(ws, dtype=torch.float32).reshape(-1, k),
                [counts.get(e, 0) for e in range(el)], h, None)

    def get_combine_input(self, handle):  # type: ignore[no-untyped-def]
        t = torch.full((int(handle.recv_src_idx.shape[0]), self.hidden), float("nan"), dtype=torch.bfloat16)
        self.handed_out.append(t)
        return t

    def combine(self, x, handle, topk_weights=None, **kw):  # type: ignore[no-untyped-def]
        self.combined_from_pool.append(any(x is t for t in self.handed_out))
        everyone = self._all((x, topk_weights, handle.recv_src_idx, handle.rank_prefix_matrix))
        n, H = handle.is_token_in_rank.shape[0], x.shape[1]
        out = torch.zeros(n, H, dtype=torch.float32)
        out_w = torch.zeros(n, topk_weights.shape[1]) if topk_weights is not None else None
        for d, (xd, wd, srcd, rpmd) in enumerate(everyone):
            start = int(rpmd[self.rank - 1, d]) if self.rank > 0 else 0
            end = int(rpmd[self.rank, d])
            for row in range(start, end):
                t = int(srcd[row])
                out[t] += xd[row].float()
                if out_w is not None:
                    out_w[t] += wd[row]
        return out.to(torch.bfloat16), out_w, None


def _suite(corrupt: bool, gpu_sms: int = 0, combine_input: str = "fresh") -> Any:
    """gpu_sms > 0: the ranks pretend to share one GPU of that many SMs (native rows that do not fit it
    must be skipped, not run)."""
    import torch.distributed as dist
    from pyep.bench.normal import NormalSuite, exit_code
    from pyep.bench.sharing import MpsStatus, Sharing
    FakeNormalBuffer.corrupt = corrupt
    cfg = NormalBenchConfig(tokens=24, hidden=256, topk=3, experts=8, num_sms=(4, 6),
                            backends=("native",) if gpu_sms else ("reference",),
                            iters=2, warmup=1, wait_timeout_s=60.0, plot=False, copy_mb=1, combine_input=combine_input)
    suite = NormalSuite(cfg, dist.group.WORLD, torch.device("cpu"), buffer_class=FakeNormalBuffer)
    if gpu_sms:
        suite.sharing = Sharing(True, ["fake GPU"] * 2, ["h/gpu0"] * 2, gpu_sms, MpsStatus(True, "fake"))
    rows = suite.run()
    copy = suite.copy.as_dict() if suite.copy is not None else None
    if combine_input == "pool":   # which combines read a get_combine_input tensor (the last row's buffer)
        return [r.as_dict() for r in rows], exit_code(rows), FakeNormalBuffer.last.combined_from_pool
    return [r.as_dict() for r in rows], exit_code(rows), FakeNormalBuffer.num_sms, copy


def test_suite_skips_rows_that_do_not_fit_a_shared_gpu(pool2) -> None:  # type: ignore[no-untyped-def]
    # 2 ranks x 6 SMs = 12 > 10 SMs: the 6-SM row is skipped with the reason; 2 x 4 = 8 fits and runs.
    res = pool2.run(_suite, False, 10, timeout_s=120)
    rows, code, _sms, _copy = res[0]
    assert code == 0 and [r["num_sms"] for r in rows] == [4, 6]
    assert rows[0]["check"]["status"] == "PASS" and rows[0]["skipped"] is None
    assert "2 ranks x 6 SMs = 12 SMs exceed the 10 SMs of the shared GPU" in rows[1]["skipped"]
    assert [r["num_sms"] for r in res[1][0]] == [4, 6] and res[1][0][1]["skipped"]


def test_suite_with_stand_in_buffer(pool2) -> None:  # type: ignore[no-untyped-def]
    res = pool2.run(_suite, False, timeout_s=120)
    rows, code, sms_after, copy = res[0]
    assert copy["device"] == "cpu" and copy["bytes"] == 1 << 20 and copy["best_gbps"] > 0
    assert res[1][3] is None                             # rank 0 measures, the others wait
    assert code == 0 and sms_after == 24                    # set_num_sms restored after the sweep
    assert [r["num_sms"] for r in rows] == [4, 6]
    for r in rows:
        assert r["check"]["status"] == "PASS", r["check"]
        n = r["recv_tokens_per_rank"]
        assert len(n) == 2 and all(0 < v <= 48 for v in n)
        assert r["bytes_per_rank"]["cached_bf16"] == [v * 512 for v in n]
        for p in PHASES:
            assert r["wall_us"][p]["mean"] > 0 and len(r["samples_us"]["wall"][p][0]) == 2
        assert r["kernel_time_source"].startswith("wall")
    assert res[1][1] == 0


def test_suite_combines_a_pool_input(pool2) -> None:  # type: ignore[no-untyped-def]
    # --combine-input pool: the guard writes the expert output into get_combine_input's tensor (NaN until
    # then, so a combine of the unwritten tensor fails the guard) and every timed combine reads it.
    res = pool2.run(_suite, False, 0, "pool", timeout_s=120)
    for rows, code, from_pool in res:
        assert code == 0 and all(r["check"]["status"] == "PASS" for r in rows)
        assert from_pool and all(from_pool), from_pool


def test_guard_catches_a_wrong_row(pool2) -> None:  # type: ignore[no-untyped-def]
    res = pool2.run(_suite, True, timeout_s=120)
    rows, code, _, _ = res[0]
    assert code == 1
    for r in rows:
        assert r["check"]["status"] == "FAIL" and r["check"]["failed_ranks"] == [0]
        assert "wall_us" not in r or not r["wall_us"]        # a wrong kernel gets no speed figures
    assert "recv_x" in res[0][0][0]["check"]["detail"] or "failed on rank" in rows[0]["check"]["detail"]


@pytest.mark.parametrize("world", [2, 4])
def test_cli_reference_end_to_end(tmp_path, world: int) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("pyep.ep.normal.buffer", reason="NormalBuffer (pyep/ep/normal/buffer.py) not there yet")
    from test_bench_run import _check_plot, _check_words_and_width, _run_ranks
    res = _run_ranks(["--mode", "normal", "--backend", "reference", "--tokens", "32", "--hidden", "256",
                      "--experts", "8", "--topk", "4", "--sweep-sms", "4,8", "--iters", "2", "--warmup", "1",
                      "--copy-mb", "2", "--out", str(tmp_path)], world=world)
    for rank, (rc, so, se) in enumerate(res):
        assert rc == 0, f"rank {rank} exited {rc}\nstdout:\n{so}\nstderr:\n{se}"
    doc = json.loads((tmp_path / "bench_normal.json").read_text())
    assert [r["num_sms"] for r in doc["rows"]] == [4, 8]
    assert all(r["check"]["status"] == "PASS" for r in doc["rows"])
    assert all(len(r["recv_tokens_per_rank"]) == world for r in doc["rows"])
    _check_words_and_width(res[0][1], (tmp_path / "bench_normal.txt").read_text(), world)
    _check_plot(tmp_path / "bench_normal.png", doc, res)
    # The sweep and the copy rate of the same run: the host's memory here, all ranks on it.
    copy = doc["copy_rate"]
    assert copy["device"] == "cpu" and copy["bytes"] == 2 << 20 and copy["best_gbps"] > 0
    entries = doc["sweep"]["entries"]
    assert [e["num_sms"] for e in entries] == [4, 8] and doc["sweep"]["time"] == "wall"
    for e, r in zip(entries, doc["rows"]):
        g = r["gbps"]["wall"]["cached_bf16"]
        assert e["gbps"]["dispatch_bf16"] == pytest.approx(g)
        assert e["of_copy_rate"]["dispatch_bf16"] == pytest.approx(g * world * 2 / copy["best_gbps"])
        assert e["vs_deepep"]["dispatch_bf16"] is None          # no DeepEP on a CPU run
    assert "SM sweep" in res[0][1] and "copy rate:" in res[0][1]
    assert "pyep bench --mode normal" in res[0][1] and "pyep bench" not in res[1][1]
    # one node: none of the internode output (tests/test_bench_normal_nodes.py)
    assert "internode" not in doc and "internode_model" not in doc and "real-NIC" not in res[0][1]
    assert not any("rdma_tokens_per_rank" in r or "gbps_rdma" in r for r in doc["rows"])
