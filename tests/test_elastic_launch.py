"""`pyep launch` with launcher.restart.policy = "rank" (issue 12): a rank that dies is restarted alone
(not the whole job), re-admitted by the survivors, and the run directory records the failure, the
restart and the rejoin. Also: the restart settings are validated."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_single_rank_restart_and_rejoin(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "pyep", "launch", os.path.join(ROOT, "configs", "elastic_cpu.yaml"),
                           "--run-dir", str(run_dir), "--quiet"], cwd=ROOT, capture_output=True, text=True,
                          timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "rank 2 failed (status 137); restarting it alone (restart 1 of 2)" in out
    assert "rank 2 rejoined the job (generation 2)" in out
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["rank"]) for e in events] == [("failure", 2), ("restart", 2), ("rejoin", 2)]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 0 and len(summary["events"]) == 3
    results = {p.name: json.loads(p.read_text()) for p in run_dir.glob("elastic-rank-*.json")}
    assert set(results) == {"elastic-rank-0-g1.json", "elastic-rank-1-g1.json", "elastic-rank-2-g2.json"}
    joined = results["elastic-rank-2-g2.json"]["joined_at"]
    assert all(r.get("admitted_at", joined) == joined for r in results.values())
    assert all(r["final_active"] == [1, 1, 1] for r in results.values())


def test_restart_policy_validation() -> None:
    from pyep.config import load_config  # noqa: F401 - the loader the CLI uses
    proc = subprocess.run([sys.executable, "-m", "pyep", "launch", os.path.join(ROOT, "configs", "elastic_cpu.yaml"),
                           "launcher.restart.max_restarts=-1", "--dry-run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "max_restarts" in proc.stdout + proc.stderr


@pytest.mark.parametrize("policy", ["none", "rank"])
def test_dry_run_shows_the_commands(policy: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pyep", "launch", os.path.join(ROOT, "configs", "elastic_cpu.yaml"),
                           f"launcher.restart.policy={policy}", "--dry-run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if policy == "rank":
        assert proc.stdout.count("pyep.launch.rank") == 3 and "torch.distributed.run" not in proc.stdout
        assert "PYEP_STORE_PORT" in proc.stdout and "RANK=2" in proc.stdout
    else:
        assert "torch.distributed.run" in proc.stdout
