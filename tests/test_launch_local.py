"""Real local launches on CPU: the reference config end to end, teardown when a rank fails, timeouts.

Each test starts torchrun with 2-4 gloo ranks on 127.0.0.1; every wait is bounded.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import time
from typing import List, Tuple

import pytest
from rich.console import Console

from pyep.cli import launch as cli_launch
from pyep.config import HostFacts, load_config, parse_config
from pyep.config.validate import resolve
from pyep.launch.runner import LaunchOptions, launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
pytestmark = pytest.mark.timeout(240)

# A workload that records its pid, then either fails on purpose (once every rank is up) or sleeps
# until it is killed. It imports nothing heavy, so the test time is torchrun's own start-up.
WORKLOAD = """\
import os, pathlib, sys, time
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
pids = pathlib.Path(os.environ["PYEP_RUN_DIR"]) / "pids"
pids.mkdir(parents=True, exist_ok=True)
(pids / f"{rank}.pid").write_text(str(os.getpid()))
print(f"rank {rank} of {world} up", flush=True)
if rank == int(sys.argv[1]):
    deadline = time.monotonic() + 60
    while len(list(pids.glob("*.pid"))) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    print("failing on purpose", flush=True)
    sys.exit(3)
time.sleep(300)
"""


def _facts() -> HostFacts:
    return HostFacts(gpus=0, cwd=ROOT)


def _script_config(tmp_path, nodes: str, fail_rank: int, extra: str = ""):
    script = tmp_path / "workload.py"
    script.write_text(WORKLOAD)
    text = (f"name: drill\nnodes:\n{nodes}rendezvous: {{master_addr: 127.0.0.1, master_port: 0}}\n"
            f"launcher: {{kind: local, grace_s: 5, timeout_s: 120}}\n"
            f"ep: {{backend: reference, dist_backend: gloo, num_experts: 12}}\n"
            f"workload: {{script: {script}, args: ['{fail_rank}']}}\n{extra}")
    cfg, locs = parse_config(text, "drill.yaml")
    return resolve(cfg, locs, _facts())


def _run(cfg, run_dir: str) -> Tuple[int, float, str]:
    buf = io.StringIO()
    start = time.monotonic()
    code = launch(cfg, LaunchOptions(run_dir=run_dir, source="test"), _facts(), Console(file=buf, width=200))
    return code, time.monotonic() - start, buf.getvalue()


def _pids(run_dir: str) -> List[int]:
    d = os.path.join(run_dir, "pids")
    return [int(open(os.path.join(d, f)).read()) for f in sorted(os.listdir(d))]


def _assert_all_gone(pids: List[int], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.1)
    assert not alive, f"ranks still running after teardown: {alive}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"    # zombies are dead, merely unreaped
    except FileNotFoundError:
        return False


def _cli(argv: List[str]) -> int:
    p = argparse.ArgumentParser()
    cli_launch.add_parser(p.add_subparsers())
    args = p.parse_args(["launch", *argv])
    return args.func(args)


def test_cpu_reference_config_end_to_end(tmp_path, capsys) -> None:
    run_dir = str(tmp_path / "run")
    code = _cli([os.path.join(CONFIGS, "cpu_reference.yaml"), "--run-dir", run_dir, "workload.args=[--iters, 3]"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["exit_code"] == 0
    assert [(r["rank"], r["code"]) for r in summary["ranks"]] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert {"file": "demo-result.json", "bytes": os.path.getsize(os.path.join(run_dir, "demo-result.json"))} \
        in summary["results"]
    result = json.load(open(os.path.join(run_dir, "demo-result.json")))
    assert result["world_size"] == 4 and result["dist_backend"] == "gloo"
    assert result["ep"]["backend"] == "reference" and result["ep"]["iters"] == 3
    for r in range(4):
        log = open(os.path.join(run_dir, "logs", f"rank-{r:05d}.log")).read()
        assert f"rank {r}: demo passed (4 ranks, gloo, EP backend reference)" in log
    assert os.path.exists(os.path.join(run_dir, "logs", "node-0-localhost.log"))
    # The resolved config is written and loads again.
    again = load_config(os.path.join(run_dir, "config.yaml"), facts=_facts())
    assert again.workload.args == ["--iters", "3"] and again.nodes[0].procs == 4
    assert re.search(r"progress 4/4 \(100%, 4 ranks, \d+\.\d s\) dispatch/combine 3/3", out), out
    assert "[rank 2] rank 2: demo passed" in out
    assert "OK: all nodes finished" in out


def test_one_failing_rank_tears_down_the_rest(tmp_path) -> None:
    cfg = _script_config(tmp_path, "  - {host: localhost, gpus: 0, procs: 3}\n", fail_rank=1)
    run_dir = str(tmp_path / "run")
    code, seconds, out = _run(cfg, run_dir)
    assert code != 0, out
    assert seconds < 60, out
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    codes = {r["rank"]: r["code"] for r in summary["ranks"]}
    assert codes[1] == 3
    assert all(codes[r] != 0 for r in (0, 2)), codes       # killed, not finished
    _assert_all_gone(_pids(run_dir))
    assert "FAILED" in out


def test_failing_node_tears_down_the_other_node(tmp_path) -> None:
    nodes = "  - {host: localhost, gpus: 0, procs: 2}\n  - {host: 127.0.0.1, gpus: 0, procs: 2}\n"
    cfg = _script_config(tmp_path, nodes, fail_rank=3)
    run_dir = str(tmp_path / "run")
    code, seconds, out = _run(cfg, run_dir)
    assert code != 0 and seconds < 60, out
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["reason"].startswith("node 1 (127.0.0.1) exited with status")
    node0 = summary["nodes"][0]
    assert node0["torn_down"] is True and node0["returncode"] != 0
    assert {r["rank"]: r["code"] for r in summary["ranks"]}[3] == 3
    assert "tearing down node 0 (localhost)" in out
    _assert_all_gone(_pids(run_dir))


def test_job_timeout_stops_everything(tmp_path) -> None:
    cfg = _script_config(tmp_path, "  - {host: localhost, gpus: 0, procs: 2}\n", fail_rank=-1)
    cfg.launcher.timeout_s = 8.0
    run_dir = str(tmp_path / "run")
    code, seconds, out = _run(cfg, run_dir)
    assert code == 124, out
    assert seconds < 40, out
    assert "timed out after 8 s" in out
    _assert_all_gone(_pids(run_dir))


def test_ctrl_c_tears_down_and_exits_130(tmp_path) -> None:
    import signal
    import subprocess
    import sys
    cfg_text = (f"name: ctrlc\nnodes:\n  - {{host: localhost, gpus: 0, procs: 2}}\n"
                f"rendezvous: {{master_addr: 127.0.0.1, master_port: 0}}\n"
                f"launcher: {{kind: local, grace_s: 5, timeout_s: 120}}\n"
                f"ep: {{backend: reference, dist_backend: gloo, num_experts: 8}}\n"
                f"workload: {{script: {tmp_path / 'workload.py'}, args: ['-1']}}\n")
    (tmp_path / "workload.py").write_text(WORKLOAD)
    (tmp_path / "c.yaml").write_text(cfg_text)
    run_dir = str(tmp_path / "run")
    # The launcher as a terminal runs it: with SIGINT raising KeyboardInterrupt. A test runner started as a
    # background job of a script inherits SIGINT ignored (POSIX shells do that without job control), and
    # Python then installs no handler in the child: the launcher would rightly keep ignoring it.
    driver = ("import argparse, signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "from pyep.cli import launch as L\np = argparse.ArgumentParser()\n"
              "L.add_parser(p.add_subparsers())\na = p.parse_args(['launch', *sys.argv[1:]])\nsys.exit(a.func(a))\n")
    proc = subprocess.Popen([sys.executable, "-c", driver, str(tmp_path / "c.yaml"), "--run-dir", run_dir],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    pid_dir = os.path.join(run_dir, "pids")
    deadline = time.monotonic() + 90
    while not (os.path.isdir(pid_dir) and len(os.listdir(pid_dir)) == 2):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail("ranks never started:\n" + proc.communicate(timeout=30)[0])
        time.sleep(0.1)
    time.sleep(0.3)     # let both pid files be written completely
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "interrupted (Ctrl-C)" in out
    _assert_all_gone(_pids(run_dir))
