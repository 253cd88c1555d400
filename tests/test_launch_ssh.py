"""The ssh launcher end to end, with a stand-in `ssh` that runs the remote command through /bin/sh on
this machine: the quoting, the remote guard, per-node streaming and cross-node teardown all run for
real; only the network hop is skipped."""
from __future__ import annotations

import io
import json
import os
import re
import sys
import time

import pytest
from rich.console import Console

from pyep.config import HostFacts, parse_config
from pyep.config.validate import resolve
from pyep.launch.plan import free_port
from pyep.launch.runner import LaunchOptions, launch

from test_launch_local import WORKLOAD, _assert_all_gone, _pids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(240)

# Parses ssh's options the way OpenSSH does for the ones pyep passes, records the call, and runs the
# remote command string with a POSIX shell, as sshd would.
FAKE_SSH = """\
import os, sys
args = sys.argv[1:]
with_value = {"-o", "-p", "-i", "-l", "-F", "-J"}
i = 0
while i < len(args) and args[i].startswith("-"):
    i += 2 if args[i] in with_value else 1
host, rest = args[i], args[i + 1:]
if not rest or rest[0] != "--":
    sys.exit("fake ssh: expected -- after the host")
with open(os.environ["FAKE_SSH_LOG"], "a") as fh:
    fh.write(host + "\\n")
os.execv("/bin/sh", ["/bin/sh", "-c", " ".join(rest[1:])])
"""


def _setup(tmp_path, fail_rank: int):
    fake = tmp_path / "fake-ssh"
    fake.write_text(f"#!{sys.executable}\n" + FAKE_SSH)
    fake.chmod(0o755)
    script = tmp_path / "workload.py"
    script.write_text(WORKLOAD)
    text = f"""\
name: ssh-drill
nodes:
  - {{host: node-a.example, gpus: 0, procs: 2}}
  - {{host: node-b.example, gpus: 0, procs: 2}}
rendezvous: {{master_addr: 127.0.0.1, master_port: {free_port()}}}
launcher:
  kind: ssh
  grace_s: 5
  timeout_s: 120
  ssh: {{binary: {fake}, workdir: {ROOT}, python: {sys.executable}, collect_results: true}}
env: {{GLOO_SOCKET_IFNAME: lo, MARKER: "a b $(echo no) 'q'"}}
ep: {{backend: reference, dist_backend: gloo, num_experts: 8}}
workload: {{script: {script}, args: ['{fail_rank}']}}
"""
    facts = HostFacts(gpus=0, cwd=str(tmp_path))
    cfg, locs = parse_config(text, "ssh.yaml")
    return resolve(cfg, locs, facts), facts


def _run(cfg, facts, run_dir: str, env_log: str):
    os.environ["FAKE_SSH_LOG"] = env_log
    buf = io.StringIO()
    start = time.monotonic()
    try:
        code = launch(cfg, LaunchOptions(run_dir=run_dir, source="ssh.yaml"), facts, Console(file=buf, width=200))
    finally:
        del os.environ["FAKE_SSH_LOG"]
    return code, time.monotonic() - start, buf.getvalue()


def test_ssh_failure_on_one_node_tears_down_the_other(tmp_path) -> None:
    cfg, facts = _setup(tmp_path, fail_rank=2)
    run_dir = str(tmp_path / "run")
    code, seconds, out = _run(cfg, facts, run_dir, str(tmp_path / "ssh.log"))
    assert code != 0 and seconds < 90, out
    calls = open(tmp_path / "ssh.log").read().split()
    assert sorted(calls[:2]) == ["node-a.example", "node-b.example"]     # then the result collection
    # Output is streamed per node with the host as prefix.
    assert "[node-b.example] [rank 2] rank 2 of 4 up" in out
    assert "[node-a.example] [rank 0] rank 0 of 4 up" in out
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["reason"].startswith("node 1 (node-b.example) exited with status")
    assert summary["nodes"][0]["torn_down"] is True
    assert {r["rank"]: r["code"] for r in summary["ranks"]}[2] == 3
    # The nodes wrote into the run directory as their workdir resolves it (the same path here).
    _assert_all_gone(_pids(run_dir))


def test_ssh_success_with_env_and_collection(tmp_path) -> None:
    cfg, facts = _setup(tmp_path, fail_rank=-1)
    # Replace the sleeping workload by one that checks its environment and exits.
    check = tmp_path / "check.py"
    check.write_text(
        "import os, json, pathlib\n"
        "d = pathlib.Path(os.environ['PYEP_RUN_DIR'])\n"
        "assert os.environ['MARKER'] == \"a b $(echo no) 'q'\", os.environ['MARKER']\n"
        "assert os.environ['NCCL_NVLS_ENABLE'] == '0' and os.environ['PYEP_EP_NUM_EXPERTS'] == '8'\n"
        "r = int(os.environ['RANK'])\n"
        "(d / f'result-{r}.json').write_text(json.dumps({'rank': r, 'cwd': os.getcwd()}))\n"
        "from pyep.launch.progress import report\n"
        "report(1, 1, 'checked')\n")
    cfg.workload.script = str(check)
    cfg.workload.args = []
    run_dir = str(tmp_path / "run")
    code, _, out = _run(cfg, facts, run_dir, str(tmp_path / "ssh.log"))
    assert code == 0, out
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert [r["code"] for r in summary["ranks"]] == [0, 0, 0, 0]
    for r in range(4):
        res = json.load(open(os.path.join(run_dir, f"result-{r}.json")))
        assert res["cwd"] == ROOT                  # the remote workdir, not the launcher's
    # collect_results copied each node's directory (logs and results) under nodes/.
    for i, host in enumerate(["node-a.example", "node-b.example"]):
        assert os.path.isdir(os.path.join(run_dir, "nodes", f"{i}-{host}", "logs"))
    assert re.search(r"progress 1/1 \(100%, 4 ranks, \d+\.\d s\) checked", out), out
