"""The README's normal-mode example must exit cleanly. It used to abort at interpreter exit in 1-4 of
10-12 runs ("terminate called without an active exception", SIGABRT): gloo's worker thread still held
the tensors of the last collective when Python dropped them, so the worker later destroyed their
Python objects and, the interpreter being finalised by then, died taking the GIL inside a noexcept
frame (pyep/ep/_dist.py says more). Checked twice: the guarantee itself (after a
normal-mode collective returns, gloo holds none of its tensors; before the fix about one collective in
ten returned with them held on a loaded machine) and the README's normal-mode part run 20 times on 2
gloo ranks in fresh interpreters."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from pyep.ep import _dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS, PARALLEL = 20, 4

# The README's normal-mode part ("The two modes"), on the gloo group the two ranks form (smaller shapes).
EXAMPLE = """
import os, sys
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
import torch
import torch.distributed as dist
import pyep
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
group = dist.group.WORLD
torch.manual_seed(rank)
x = torch.randn(32, 1024).to(torch.bfloat16)
topk_idx = torch.stack([torch.randperm(64)[:4] for _ in range(32)])
topk_weights = torch.rand(32, 4)
nb = pyep.NormalBuffer(group, hidden=1024)
n_rank, _, n_expert, in_rank, _ = nb.get_dispatch_layout(topk_idx, num_experts=64)
recv_x, recv_idx, recv_w, counts, handle, _ = nb.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                                          num_tokens_per_expert=n_expert, topk_idx=topk_idx,
                                                          topk_weights=topk_weights)
combined_x, combined_w, _ = nb.combine(recv_x, handle, topk_weights=recv_w)
print("example done", rank)
"""


def check_collectives_release_their_tensors(rounds: int) -> Dict[str, int]:
    group = dist.group.WORLD
    held = {"all_to_all": 0, "all_reduce_min": 0, "all_gather": 0}
    for _ in range(rounds):
        inp, out = torch.ones(2, 8), torch.empty(2, 8)
        _dist.all_to_all_bounded(out, inp, None, None, group, 30_000_000, "test all_to_all")
        held["all_to_all"] += int(inp._use_count() > 1 or out._use_count() > 1)
        t = torch.ones(3, dtype=torch.int32)
        _dist.all_reduce_min_bounded(t, group, 30_000_000, "test all_reduce")
        held["all_reduce_min"] += int(t._use_count() > 1)
        mine, outs = torch.ones(1), [torch.empty(1) for _ in range(dist.get_world_size())]
        _dist.all_gather_bounded(outs, mine, group, 30_000_000, "test all_gather")
        held["all_gather"] += int(any(o._use_count() > 1 for o in [mine, *outs]))
    return held


def test_normal_mode_collectives_leave_gloo_holding_nothing(pool2: Any) -> None:
    for held in pool2.run(check_collectives_release_their_tensors, 300):
        assert held == {"all_to_all": 0, "all_reduce_min": 0, "all_gather": 0}, held


def _run_example(script: str, store_dir: str, i: int) -> List[Tuple[int, str]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    store = os.path.join(store_dir, f"store{i}")
    procs = [subprocess.Popen([sys.executable, script, str(r), store], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=env) for r in range(2)]
    out = []
    for p in procs:
        try:
            text = p.communicate(timeout=240)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            p.kill()
            text = p.communicate()[0].decode(errors="replace") + "\n(killed after 240 s)"
        out.append((p.returncode, text))
    return out


def test_readme_normal_example_exits_cleanly_20_times(tmp_path: Any) -> None:
    script = tmp_path / "readme_normal.py"
    script.write_text(EXAMPLE)
    with ThreadPoolExecutor(PARALLEL) as pool:
        runs = list(pool.map(lambda i: _run_example(str(script), str(tmp_path), i), range(RUNS)))
    bad = [(i, r, rc, text[-600:]) for i, run in enumerate(runs) for r, (rc, text) in enumerate(run)
           if rc != 0 or "terminate called" in text or f"example done {r}" not in text]
    assert not bad, f"{len(bad)} of {2 * RUNS} processes failed; first: {bad[0]}"
