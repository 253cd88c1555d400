"""CPU tests of `pyep bench --mode normal` across virtual nodes ($PYEP_VIRTUAL_NODE_SIZE): the guard's
internode contract (contract.combine_order, num_tokens_per_rdma_rank), check_world's node layouts,
the RDMA byte count of DeepEP's test_internode.py, and the whole suite on 2 virtual nodes x 2 gloo
ranks over the reference backend -- which must pass the guard, and must FAIL it when the combine
uses the one-node order or a received row is wrong (mutations of the real backend). Then the CLI end
to end on 4 ranks: tables, JSON (measured rows beside the real-NIC model) and the model's section."""
from __future__ import annotations

import json
import math
import os
import sys
import types
from typing import Any, Dict, List, Optional

import pytest
import torch
from rich.console import Console

from pyep.bench import normal_check as nc
from pyep.bench import normal_internode_report as nir
from pyep.bench.guard import CheckResult
from pyep.bench.metrics import summarize
from pyep.bench.normal import PHASES, SAMPLE_KINDS, NormalBenchConfig, NormalRow, bytes_per_rank
from pyep.bench.reference_numbers import DEEPEP_INTERNODE_RDMA_GBPS

VIRTUAL = "PYEP_VIRTUAL_NODE_SIZE"


# ---------------------------------------------------------------------- pure parts
def test_check_world_node_layouts() -> None:
    cfg = NormalBenchConfig(experts=256)
    for world, p in ((4, 2), (2, 1), (16, 8), (8, 4), (64, 8), (4, None), (8, 8)):
        cfg.check_world(world, p)
    for world, p, words in ((6, 3, "ranks per node"), (12, None, "one node"), (32, 16, "ranks per node"),
                            (66, 2, "2 to 32 nodes"), (6, 2, "divisible"), (12, 8, "nodes of 8")):
        with pytest.raises(ValueError, match=words):
            cfg.check_world(world, p)
    with pytest.raises(ValueError, match="divisible"):
        NormalBenchConfig(experts=100, topk=4).check_world(8, 4)


def test_layout_check_covers_rdma_counts() -> None:
    # R=4 in 2 nodes of 2, E=8 (2 per rank): token 0 -> ranks 0, 3 (both nodes); 1 -> rank 1; 2 -> none.
    topk = torch.tensor([[0, 7], [2, -1], [-1, -1]])
    per_rank, per_exp, in_rank = nc.layout(topk, 8, 4)
    assert nc.per_node(in_rank, 2).tolist() == [2, 1] and nc.per_node(in_rank, 4) is None
    assert nc.per_node(in_rank, 1).tolist() == per_rank.tolist()
    good = (per_rank, torch.tensor([2, 1], dtype=torch.int32), per_exp, in_rank)
    assert nc.check_layout(good, topk, 8, 4, 2) == []
    bad = (per_rank, torch.tensor([2, 2], dtype=torch.int32), per_exp, in_rank)
    assert "num_tokens_per_rdma_rank: 1 of 2" in nc.check_layout(bad, topk, 8, 4, 2)[0]
    assert "missing" in nc.check_layout((per_rank, None, per_exp, in_rank), topk, 8, 4, 2)[0]
    assert "expected None" in nc.check_layout(good, topk, 8, 4, 4)[0]


def _inputs(seed: int, n: int = 64, h: int = 256, e: int = 16, k: int = 4, r: int = 4):
    from pyep.bench.config import RoutingSpec
    from pyep.bench.routing import make_batch
    bs = [make_batch(RoutingSpec("uniform"), n, h, e, k, seed=seed, rank=s) for s in range(r)]
    return [b.x for b in bs], [b.topk_idx for b in bs], [b.topk_weights.float() for b in bs]


def test_oracle_combines_per_node() -> None:
    """Only the combine changes across nodes; a token within one node sums as on one node; a token on
    both nodes gets bf16(0 + bf16(node 0's fp32 sum) + bf16(node 1's)), worked out here for one."""
    xs, topks, ws = _inputs(3)
    one = nc.expected(0, xs, topks, ws, 16, num_channels=3)
    two = nc.expected(0, xs, topks, ws, 16, num_channels=3, ranks_per_node=2)
    same_p = nc.expected(0, xs, topks, ws, 16, num_channels=3, ranks_per_node=4)
    for name in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src_idx", "rank_prefix_matrix",
                 "channel_prefix_matrix", "recv_channel_prefix_matrix", "send_head", "is_token_in_rank"):
        assert nc.diff(name, getattr(two, name), getattr(one, name)) is None
        assert nc.diff(name, getattr(same_p, name), getattr(one, name)) is None
    assert nc.diff("x", same_p.combined_x, one.combined_x) is None
    in_rank = one.is_token_in_rank
    one_node = ~(in_rank[:, :2].any(1) & in_rank[:, 2:].any(1))
    assert nc.diff("x", two.combined_x[one_node], one.combined_x[one_node]) is None
    differs = (two.combined_x.view(torch.int16) != one.combined_x.view(torch.int16)).any(1)
    assert bool(differs.any()), "no token tells the orders apart: the mutation test below would be vacuous"
    t = int(differs.nonzero()[0])
    outs = [nc.expert_output(xs[0][t:t + 1], d).float()[0] for d in range(4)]
    parts = []
    for node in ((0, 1), (2, 3)):
        ds = [d for d in node if in_rank[t, d]]
        if ds:
            acc = torch.zeros_like(outs[0])
            for d in ds:
                acc = acc + outs[d]
            parts.append(acc.to(torch.bfloat16).float())
    want = (torch.zeros_like(outs[0]) + parts[0] + parts[1]).to(torch.bfloat16)
    assert torch.equal(two.combined_x[t].view(torch.int16), want.view(torch.int16))
    w = torch.zeros(4)
    for node in ((0, 1), (2, 3)):
        pw = torch.zeros(4)
        for d in node:
            if in_rank[t, d]:
                local = (topks[0][t] >= 4 * d) & (topks[0][t] < 4 * d + 4)
                pw = pw + torch.where(local, ws[0][t], torch.zeros(4))
        w = w + pw
    assert torch.equal(two.combined_topk_weights[t], w)


def _row(recv: List[int], rdma: List[int], t_us: float = 100.0, times: Optional[Dict[str, float]] = None) -> NormalRow:
    stats = {k: {} for k in SAMPLE_KINDS}
    for p in PHASES:
        t = (times or {}).get(p, t_us)
        for k in ("wall", "kernel"):
            stats[k][p] = summarize([[t] * 2] * len(recv))
        stats["aux"][p] = summarize([[math.nan] * 2] * len(recv))
        stats["host"][p] = summarize([[1.0] * 2] * len(recv))
    return NormalRow("native", 24, 4096, 7168, "uniform", check=CheckResult(True, "ok"), recv_tokens=recv,
                     stats=stats, kernel_source="kineto", rdma_tokens=rdma)


def test_rdma_bytes_follow_test_internode() -> None:
    """test_internode.py: RDMA = num_rdma_token_sent x 2H (x (1+4/128)/2 for FP8), NVL = recv rows x 2H;
    combine counts the BF16 dispatch's bytes."""
    row = _row([5000, 7000], [3000, 5000])
    assert row.bytes("cached_bf16", rdma=True) == [3000 * 14336, 5000 * 14336]
    assert row.bytes("combine", rdma=True) == row.bytes("cached_bf16", rdma=True)
    assert row.bytes("cached_fp8", rdma=True)[0] == pytest.approx(3000 * 14336 * 1.03125 / 2)
    assert row.gbps("kernel", rdma=True)["cached_bf16"] == pytest.approx(4000 * 14336 / 100e-6 / 1e9)
    assert row.gbps("kernel")["combine"] == pytest.approx(6000 * 14336 / 100e-6 / 1e9)
    d = row.as_dict()
    assert d["rdma_tokens_per_rank"] == [3000, 5000] and d["gbps_rdma"]["wall"]["combine"] > 0
    assert "rdma_tokens_per_rank" not in _row([1], []).as_dict()      # one node: no new keys


def test_summary_and_render_label_the_emulator() -> None:
    cfg = NormalBenchConfig()
    row = _row([30000, 30000], [7000, 7000], times={"cached_fp8": 1000.0, "cached_bf16": 1500.0, "combine": 2000.0})
    doc = nir.summary(cfg, [row, NormalRow("reference", 24, 4096, 7168, "uniform", skipped="no")], 16, 8,
                      {"native": "emulated", "reference": "reference"})
    assert doc["num_nodes"] == 2 and len(doc["rows"]) == 1
    r = doc["rows"][0]
    assert r["transport"] == "emulated" and r["time_kind"] == "kernel"
    assert r["phases"]["combine"]["rdma_gbps"] == pytest.approx(7000 * 14336 / 2000e-6 / 1e9)
    exp = doc["model_expectation"]["phases"]["cached_bf16"]
    assert exp["us"] == doc["model"]["dispatch_bf16"]["staged_us"] and exp["rdma_gbps"] > 0
    assert doc["model_expectation"]["applies"]
    assert doc["deepep_published"]["rdma_gbps"] == list(DEEPEP_INTERNODE_RDMA_GBPS)
    out = Console(record=True, width=250, file=open(os.devnull, "w"))
    nir.render(out, doc)
    text = out.export_text()
    assert "measure the emulator, not a NIC" in text and "43-58" in text and "model, 50 GB/s NIC" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("native"))
    # columns FP8, BF16, combine: 7000 (RDMA) / 30000 (NVL) rows x 14336 B (x 1.03125/2 for FP8)
    assert line.index("1000.0 / 51.7 / 221.8") < line.index("1500.0 / 66.9 / 286.7") < line.index("2000.0 / 50.2 / 215.0")
    exp = doc["model_expectation"]["phases"]
    model_line = next(ln for ln in text.splitlines() if "model, 50 GB/s NIC" in ln)
    assert model_line.index(f"{exp['cached_fp8']['us']:.1f} / {exp['cached_fp8']['rdma_gbps']:.1f}") < \
        model_line.index(f"{exp['cached_bf16']['us']:.1f} / {exp['cached_bf16']['rdma_gbps']:.1f}")
    hot = nir.summary(NormalBenchConfig(routing=cfg.routing.parse("hot:0.5")), [], 4, 2, {"native": "nic"})
    assert not hot["model_expectation"]["applies"] and "hot:0.5" in hot["model_expectation"]["note"]


def test_plot_draws_rdma_and_the_model(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With a recording stand-in for matplotlib (it may not be installed): the RDMA curve, the model's
    line and DeepEP's band are drawn across nodes, none of them on one node."""
    calls: List[Any] = []

    class Ax:
        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: calls.append((name, k.get("label")))

    class Fig(Ax):
        pass
    plt = types.SimpleNamespace(subplots=lambda *a, **k: (Fig(), [Ax(), Ax(), Ax()]), close=lambda f: None)
    mpl = types.SimpleNamespace(use=lambda b: None, pyplot=plt)
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)
    from pyep.bench import normal_plot
    cfg = NormalBenchConfig()
    row = _row([30000, 30000], [7000, 7000])
    section = nir.summary(cfg, [row], 4, 2, {"native": "emulated"})
    assert normal_plot.plot(str(tmp_path / "p.png"), [row], None, "t", section) == str(tmp_path / "p.png")
    labels = [lab for _, lab in calls if lab]
    assert "pyep native RDMA (kernel)" in labels and labels.count("model RDMA (real NIC)") == 3
    assert labels.count("DeepEP internode RDMA, published") == 3
    calls.clear()
    normal_plot.plot(str(tmp_path / "q.png"), [_row([1, 1], [])], None, "t")
    assert not any("RDMA" in (lab or "") for _, lab in calls)


# ---------------------------------------------------------------------- the suite on 2 x 2 virtual nodes
def _mutated_buffer(kind: str) -> Any:
    """NormalBuffer (reference backend) with one thing wrong: "order" combines in the one-node order
    (contract.combine_order patched in the reference backend), "row" swaps two received rows."""
    from pyep.ep.normal import NormalBuffer
    from pyep.ep.normal import reference

    class Mutated(NormalBuffer):
        def dispatch(self, x, *a, **kw):  # type: ignore[no-untyped-def]
            out = super().dispatch(x, *a, **kw)
            if kind == "row" and self.rank == 0 and not isinstance(out[0], tuple) and out[0].shape[0] > 1:
                out[0][[0, 1]] = out[0][[1, 0]]
            return out

        def combine(self, *a, **kw):  # type: ignore[no-untyped-def]
            if kind != "order":
                return super().combine(*a, **kw)
            saved = reference.combine_order
            reference.combine_order = lambda num_ranks, ranks_per_node: [list(range(num_ranks))]
            try:
                return super().combine(*a, **kw)
            finally:
                reference.combine_order = saved
    return Mutated


def _suite_on_virtual_nodes(mutation: str) -> Dict[str, Any]:
    import torch.distributed as dist

    from pyep.bench.normal import NormalSuite, exit_code
    from pyep.bench.routing import make_batch
    os.environ[VIRTUAL] = "2"
    try:
        cfg = NormalBenchConfig(tokens=24, hidden=256, topk=4, experts=16, num_sms=(4, 6), backends=("reference",),
                                iters=2, warmup=1, wait_timeout_s=60.0, plot=False, transport="emulated-internode")
        cls = _mutated_buffer(mutation) if mutation else None
        suite = NormalSuite(cfg, dist.group.WORLD, torch.device("cpu"), buffer_class=cls)
        rows = suite.run()
        me = dist.get_rank()
        b = make_batch(cfg.routing, cfg.tokens, cfg.hidden, cfg.experts, cfg.topk, seed=cfg.seed, rank=me)
        mine = nc.per_node(nc.layout(b.topk_idx, cfg.experts, 4)[2], 2)
        return {"rows": [r.as_dict() for r in rows], "code": exit_code(rows), "nodes": suite.ranks_per_node,
                "transport": suite.transport("reference"), "native": suite.transport("native"),
                "my_rdma_tokens": int(mine.sum()),
                "section": nir.summary(cfg, rows, 4, 2, {"reference": suite.transport("reference")})}
    finally:
        del os.environ[VIRTUAL]


def test_suite_on_two_virtual_nodes_passes_the_guard(pool4) -> None:  # type: ignore[no-untyped-def]
    res = pool4.run(_suite_on_virtual_nodes, "", timeout_s=240)
    r0 = res[0]
    assert r0["code"] == 0 and r0["nodes"] == 2 and r0["transport"] == "reference" and r0["native"] == "emulated"
    assert [r["num_sms"] for r in r0["rows"]] == [4, 6]
    for r in r0["rows"]:
        assert r["check"]["status"] == "PASS", r["check"]
        assert r["rdma_tokens_per_rank"] == [x["my_rdma_tokens"] for x in res]
        assert all(0 < v <= 48 for v in r["rdma_tokens_per_rank"])
        assert r["rdma_bytes_per_rank"]["cached_bf16"] == [v * 512 for v in r["rdma_tokens_per_rank"]]
        assert r["gbps_rdma"]["wall"]["combine"] > 0 and r["wall_us"]["combine"]["mean"] > 0
    sec = r0["section"]
    assert [r["num_sms"] for r in sec["rows"]] == [4, 6] and sec["rows"][0]["time_kind"] == "wall"
    assert "no NIC" in sec["transports"]["reference"]["label"]


@pytest.mark.parametrize("mutation", ["order", "row"])
def test_guard_fails_on_a_wrong_internode_result(pool4, mutation: str) -> None:  # type: ignore[no-untyped-def]
    res = pool4.run(_suite_on_virtual_nodes, mutation, timeout_s=240)
    r0 = res[0]
    assert r0["code"] == 1
    for r in r0["rows"]:
        assert r["check"]["status"] == "FAIL", r["check"]
        assert "wall_us" not in r or not r["wall_us"]          # a wrong result gets no speed figures
        assert not any(r["gbps_rdma"].values())                # nor RDMA figures
    assert r0["section"]["rows"] == []
    details = [x["rows"][0]["check"]["detail"] for x in res]
    word = "combine combined_x" if mutation == "order" else "BF16 dispatch recv_x"
    assert any(word in d for d in details), details
    if mutation == "row":
        assert r0["rows"][0]["check"]["failed_ranks"] == [0]


# ---------------------------------------------------------------------- the CLI on 4 ranks
def test_cli_on_two_virtual_nodes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from test_bench_run import _run_ranks
    res = _run_ranks(["--mode", "normal", "--backend", "reference", "--tokens", "32", "--hidden", "256",
                      "--experts", "16", "--topk", "4", "--num-sms", "4", "--iters", "2", "--warmup", "1",
                      "--transport", "emulated-internode", "--out", str(tmp_path)], world=4,
                     extra_env={VIRTUAL: "2"})
    for rank, (rc, so, se) in enumerate(res):
        assert rc == 0, f"rank {rank} exited {rc}\nstdout:\n{so}\nstderr:\n{se}"
    doc = json.loads((tmp_path / "bench_normal.json").read_text())
    assert doc["rows"][0]["check"]["status"] == "PASS" and len(doc["rows"][0]["rdma_tokens_per_rank"]) == 4
    sec = doc["internode"]
    assert (sec["num_nodes"], sec["ranks_per_node"]) == (2, 2) and len(sec["rows"]) == 1
    assert sec["transports"]["reference"]["kind"] == "reference"
    assert doc["internode_model"] == sec["model"] and doc["internode_model"]["num_nodes"] == 2
    assert set(sec["model_expectation"]["phases"]) == {"cached_fp8", "cached_bf16", "combine"}
    text = res[0][1]
    assert "across 2 nodes x 2 ranks" in text and "real-NIC model" in text and "DeepEP published" in text
    assert "no NIC" in text
    assert (tmp_path / "bench_normal.txt").read_text().count("PASS") >= 1


def test_cli_refuses_uneven_virtual_nodes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from test_bench_run import _run_ranks
    res = _run_ranks(["--mode", "normal", "--backend", "reference", "--tokens", "8", "--hidden", "128",
                      "--experts", "6", "--topk", "2", "--num-sms", "4", "--out", str(tmp_path)], world=3,
                     extra_env={VIRTUAL: "2"})
    for rc, so, se in res:
        assert rc != 0 and "does not divide the 3 ranks" in (so + se), (so, se)
