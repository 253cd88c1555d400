"""`pyep bench --mode normal` on the native internode path (marked gpu): NormalSuite over DistPool workers
(gloo) on 2 virtual nodes ($PYEP_VIRTUAL_NODE_SIZE), buffers on GPU rank % device_count (one GPU is
enough: the ranks share it, as tests/test_normal_internode_native_gpu.py does), the column relay on
the softnic (transport "emulated-internode"). The guard must pass bit for bit against the internode
contract, every row must carry RDMA and NVL figures labelled "emulated", and rank 0 writes what the
CLI writes (bench_normal.json / .txt, the tables with the real-NIC model beside the measured rows) to
$PYEP_BENCH_OUT (else a pytest temporary directory) and prints the tables (pytest -s shows them).
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict

import pytest
from multiproc import usable_gpus

pytestmark = pytest.mark.gpu
NGPU = usable_gpus("relay")   # the internode kernels live in pyep._engine.relay
requires_gpus = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU and the CUDA build of pyep._engine")
VIRTUAL = "PYEP_VIRTUAL_NODE_SIZE"


def bench_on_virtual_nodes(ranks_per_node: int, out_dir: str, use_kineto: bool) -> Dict[str, Any]:
    import sys

    import torch
    import torch.distributed as dist
    from ep_native_cases import setup_device
    from rich.console import Console

    from pyep.bench import normal_report as nr
    from pyep.bench.normal import NormalBenchConfig, NormalSuite, exit_code
    from pyep.bench.normal_internode_report import attach
    from pyep.bench.report import environment, write_json
    os.environ[VIRTUAL] = str(ranks_per_node)
    try:
        dev = torch.device("cuda", setup_device())
        world = dist.get_world_size()
        cfg = NormalBenchConfig(tokens=512, hidden=2048, topk=4, experts=8 * world, num_sms=(8, 16),
                                backends=("native",), iters=5, warmup=2, kineto=use_kineto,
                                transport="emulated-internode", timeout_us=10_000_000, wait_timeout_s=180.0,
                                plot=False)
        suite = NormalSuite(cfg, dist.group.WORLD, dev)
        names = suite.sync.gather_strings(torch.cuda.get_device_name(dev), "device names")
        rows = suite.run()
        out: Dict[str, Any] = {"code": exit_code(rows), "transport": suite.transport("native"),
                               "ranks_per_node": suite.ranks_per_node,
                               "rows": [{k: v for k, v in r.as_dict().items() if k != "samples_us"} for r in rows]}
        if dist.get_rank() == 0:
            os.makedirs(out_dir, exist_ok=True)
            console = Console(record=True, width=220, file=sys.stdout)
            env = environment(names, suite.dist_backend)
            nr.render(console, cfg, env, rows, [], None)
            doc = nr.document(cfg, env, rows, [], None)
            attach(console, doc, cfg, rows, world, ranks_per_node, {"native": suite.transport("native")})
            tag = f"{world // ranks_per_node}x{ranks_per_node}"
            write_json(os.path.join(out_dir, f"bench_normal_{tag}.json"), doc)
            console.save_text(os.path.join(out_dir, f"bench_normal_{tag}.txt"))
            out["json"] = os.path.join(out_dir, f"bench_normal_{tag}.json")
        torch.cuda.synchronize()
        return out
    finally:
        del os.environ[VIRTUAL]


@requires_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,p,use_kineto", [(4, 2, True), (2, 1, False)])
def test_bench_normal_native_on_virtual_nodes(pools, tmp_path, world, p, use_kineto):  # type: ignore[no-untyped-def]
    out_dir = os.environ.get("PYEP_BENCH_OUT") or str(tmp_path)
    res = pools[world].run(bench_on_virtual_nodes, p, out_dir, use_kineto, timeout_s=580)
    r0 = res[0]
    assert r0["code"] == 0 and r0["transport"] == "emulated" and r0["ranks_per_node"] == p
    assert [r["num_sms"] for r in r0["rows"]] == [8, 16]
    for r in r0["rows"]:
        assert r["check"]["status"] == "PASS", r["check"]
        assert len(r["rdma_tokens_per_rank"]) == world and all(v > 0 for v in r["rdma_tokens_per_rank"])
        for phase in ("cached_fp8", "cached_bf16", "combine"):
            assert r["gbps_rdma"]["wall"][phase] > 0 and r["gbps"]["wall"][phase] > 0
            if use_kineto:
                assert r["kernel_time_source"] == "kineto"
                assert r["kernel_us"][phase]["mean"] is not None, (phase, r["kineto"].get("ignored"))
    doc = json.loads(open(r0["json"]).read())
    sec = doc["internode"]
    assert (sec["num_nodes"], sec["ranks_per_node"]) == (world // p, p)
    assert [x["transport"] for x in sec["rows"]] == ["emulated", "emulated"]
    assert "measure the emulator, not a NIC" in sec["transports"]["native"]["label"]
    print(f"\nbench_normal {world // p}x{p}: {r0['json']}")
