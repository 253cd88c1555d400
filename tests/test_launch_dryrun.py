"""Dry-run commands for the local, ssh and slurm launchers: exact argv, quoting, environment."""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from typing import List

import pytest

from pyep.cli import CliError
from pyep.cli import launch as cli_launch
from pyep.config import HostFacts, load_config, parse_config
from pyep.config.validate import resolve
from pyep.launch import slurm
from pyep.launch.plan import build_plan, torchrun_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
GPU_BOX = HostFacts(gpus=8, names=frozenset({"localhost", "127.0.0.1"}), cwd="/work/here")
CPU_BOX = HostFacts(gpus=0, names=frozenset({"localhost", "127.0.0.1"}), cwd="/work/here")


def _cfg(text: str, facts: HostFacts = GPU_BOX, overrides: List[str] = ()):  # type: ignore[assignment]
    cfg, locs = parse_config(text, "t.yaml", overrides)
    return resolve(cfg, locs, facts)


def test_local_cpu_argv_exact() -> None:
    cfg = load_config(os.path.join(CONFIGS, "cpu_reference.yaml"), ["rendezvous.master_port=29555"], facts=CPU_BOX)
    plan = build_plan(cfg, "runs/x", CPU_BOX, parent_env={})
    (cmd,) = plan.commands
    assert cmd.argv == [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "4",
                        "--max-restarts", "0", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
                        "29555", "-m", "pyep.launch.rank", "--grace", "10", "module", "pyep.launch.demo",
                        "--iters", "4", "--tokens", "16"]
    assert cmd.cwd == "/work/here" and not cmd.remote
    assert plan.run_dir == "/work/here/runs/x"
    env = cmd.env
    assert env["PYEP_RUN_DIR"] == "/work/here/runs/x"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert env["PYEP_EP_BACKEND"] == "reference" and env["PYEP_EP_NUM_EXPERTS"] == "16"
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert cmd.shell_line().startswith("cd /work/here && env NCCL_NVLS_ENABLE=0 ")


def test_port_zero_picks_a_free_port() -> None:
    cfg = load_config(os.path.join(CONFIGS, "cpu_reference.yaml"), facts=CPU_BOX)
    plan = build_plan(cfg, "runs/x", CPU_BOX, parent_env={})
    assert plan.master_port > 0 and str(plan.master_port) in plan.commands[0].argv


def test_virtual_nodes_env() -> None:
    cfg = load_config(os.path.join(CONFIGS, "two_virtual_nodes.yaml"), facts=GPU_BOX)
    (cmd,) = build_plan(cfg, "runs/v", GPU_BOX, parent_env={}).commands
    assert cmd.env["PYEP_VIRTUAL_NODE_SIZE"] == "4"
    assert cmd.env["PYEP_EP_TRANSPORT"] == "emulated-internode"
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert cmd.argv[cmd.argv.index("--nproc-per-node") + 1] == "8"


def test_local_multi_node_splits_gpus_and_maps_visible_devices() -> None:
    text = ("name: split\nnodes:\n  - {host: localhost, gpus: [0, 1], nics: {1: mlx5_1}}\n"
            "  - {host: 127.0.0.1, gpus: [2, 3]}\nrendezvous: {master_port: 29600}\nep: {num_experts: 8}\n"
            "workload: {module: my.job, args: [--x, 1]}\n")
    cfg = _cfg(text)
    plan = build_plan(cfg, "/abs/run", GPU_BOX, parent_env={"CUDA_VISIBLE_DEVICES": "7,6,5,4,3,2,1,0"})
    a, b = plan.commands
    assert a.env["CUDA_VISIBLE_DEVICES"] == "7,6" and b.env["CUDA_VISIBLE_DEVICES"] == "5,4"
    assert a.env["PYEP_NIC_MAP"] == "1=mlx5_1" and "PYEP_NIC_MAP" not in b.env
    assert a.argv[a.argv.index("--node-rank") + 1] == "0" and b.argv[b.argv.index("--node-rank") + 1] == "1"
    assert a.argv[-4:] == ["module", "my.job", "--x", "1"]
    assert (a.first_rank, b.first_rank) == (0, 2)
    assert plan.run_dir == "/abs/run"


def test_tests_builtin_runs_one_process_per_node() -> None:
    cfg = load_config(os.path.join(CONFIGS, "single_node.yaml"),
                      ["workload.builtin=tests", "workload.args=[-m, gpu, -q]"], facts=GPU_BOX)
    argv = torchrun_argv(cfg, 0, "python3", "127.0.0.1", 1234, "rid")
    assert argv[argv.index("--nproc-per-node") + 1] == "1"
    assert argv[-7:] == ["module", "pytest", "-p", "pyep.launch.pytest_progress", "-m", "gpu", "-q"]


def test_c10d_endpoint() -> None:
    text = ("name: c\nnodes:\n  - {host: n0, gpus: 2}\n  - {host: n1, gpus: 2}\nlauncher: ssh\n"
            "rendezvous: {endpoint: 'n0:29400', id: job7}\nep: {num_experts: 8}\n")
    cfg = _cfg(text)
    argv = torchrun_argv(cfg, 1, "python3", None, 0, "rid")
    i = argv.index("--rdzv-backend")
    assert argv[i:i + 6] == ["--rdzv-backend", "c10d", "--rdzv-endpoint", "n0:29400", "--rdzv-id", "job7"]
    assert "--node-rank" not in argv


SSH_TEXT = """\
name: ssh-job
nodes:
  - {host: node-a, gpus: 2}
  - {host: node-b, gpus: 2}
rendezvous: {master_addr: node-a, master_port: 29500}
launcher:
  kind: ssh
  ssh: {user: alice, port: 2222, identity_file: /home/alice/.ssh/id_ed25519, workdir: /opt/my pyep,
        python: /opt/venv/bin/python, options: [StrictHostKeyChecking=accept-new]}
env: {WEIRD: "it's $(touch /tmp/pwned) `x` \\"q\\" ;&|"}
ep: {num_experts: 8}
workload: {script: "tools/my job.py", args: ["--name", "a b", "$HOME"]}
"""


def test_ssh_argv_and_quoting() -> None:
    cfg = _cfg(SSH_TEXT)
    plan = build_plan(cfg, "runs/s", GPU_BOX, parent_env={})
    assert plan.remote_run_dir == "/opt/my pyep/runs/s"
    for i, cmd in enumerate(plan.commands):
        host = ["node-a", "node-b"][i]
        assert cmd.remote
        assert cmd.argv[:13] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=15", "-o",
                                 "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4", "-p", "2222", "-i",
                                 "/home/alice/.ssh/id_ed25519"]
        assert cmd.argv[13:19] == ["-l", "alice", "-o", "StrictHostKeyChecking=accept-new", host, "--"]
        remote = cmd.argv[19]
        assert len(cmd.argv) == 20
        # What the remote shell will execute, word by word: no environment values (they go on stdin).
        words = shlex.split(remote)
        assert words[:4] == ["cd", "/opt/my pyep", "&&", "exec"]
        assert not any("=" in w and w.split("=", 1)[0].isupper() for w in words[:words.index("--")])
        assert "touch /tmp/pwned" not in remote and "PYEP_RUN_DIR" not in remote
        assert cmd.env["WEIRD"] == "it's $(touch /tmp/pwned) `x` \"q\" ;&|"
        assert cmd.env["PYEP_RUN_DIR"] == "/opt/my pyep/runs/s" and cmd.env["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert "PYEP_JOB_SECRET_FILE" not in cmd.env          # the guard makes the node's own
        g = words.index("pyep.launch.guard")
        assert words[g - 2:g + 7] == ["/opt/venv/bin/python", "-m", "pyep.launch.guard", "--grace", "15",
                                      "--env-stdin", "--expect-gpus", "2", "--"]
        tr = words[g + 7:]
        assert tr[:3] == ["/opt/venv/bin/python", "-m", "torch.distributed.run"]
        assert tr[tr.index("--node-rank") + 1] == str(i)
        assert tr[-5:] == ["script", "tools/my job.py", "--name", "a b", "$HOME"]


def test_ssh_remote_command_survives_a_real_shell(tmp_path) -> None:
    """Run the remote command through /bin/sh with the real guard and a probe in place of torchrun, the
    environment and the job secret on its stdin as the launcher sends them: every value and argument
    arrives literally, nothing is expanded or executed, the secret reaches the ranks as a 0600 file
    that is gone when the guard exits."""
    import json
    from pyep.launch.guard import stdin_payload
    cfg = _cfg(SSH_TEXT)
    cmd0 = build_plan(cfg, "runs/s", GPU_BOX, parent_env={}).commands[0]
    remote = cmd0.argv[-1]
    prog = remote.split(" && exec ", 1)[1]
    probe = shlex.join([sys.executable, "-c",
                        "import os,sys,json,stat; p=os.environ['PYEP_JOB_SECRET_FILE']; "
                        "print(json.dumps([os.environ['WEIRD'], sys.argv[1:], open(p).read().strip(), "
                        "oct(stat.S_IMODE(os.stat(p).st_mode)), p]))"])
    # Keep the guard and the quoted arguments exactly as generated; swap only the program torchrun runs.
    torchrun = shlex.quote("/opt/venv/bin/python") + " -m torch.distributed.run"
    assert torchrun in prog
    head, tail = prog.split(" -- ", 1)
    head = head.replace(shlex.quote("/opt/venv/bin/python"), shlex.quote(sys.executable), 1)
    head = head.replace(" --expect-gpus 2", "")            # this machine has no GPU
    tail = probe + " " + tail.split(" -m pyep.launch.rank ", 1)[1]
    marker = tmp_path / "pwned"
    cmd = (head + " -- " + tail).replace("/tmp/pwned", str(marker))
    env = {k: v.replace("/tmp/pwned", str(marker)) for k, v in cmd0.env.items()}
    secret = bytes(range(32))
    # stdin stays open while the guard runs, as ssh's does (its EOF means "the launcher is gone").
    proc = subprocess.Popen(["/bin/sh", "-c", cmd], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.stdin is not None
    proc.stdin.write(stdin_payload(env, secret))
    proc.stdin.flush()
    try:
        code = proc.wait(60)
    finally:
        proc.stdin.close()
        if proc.poll() is None:
            proc.kill()
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    assert code == 0, stderr
    weird, argv, hexed, mode, path = json.loads(stdout)
    assert weird == f"it's $(touch {marker}) `x` \"q\" ;&|"
    assert argv[-3:] == ["--name", "a b", "$HOME"]
    assert hexed == secret.hex() and mode == "0o600"
    assert not marker.exists() and not os.path.exists(path)


def test_slurm_script_and_node_commands(tmp_path) -> None:
    cfg = load_config(os.path.join(CONFIGS, "four_nodes.yaml"), ["launcher.slurm.workdir=/shared/pyep"],
                      facts=GPU_BOX)
    script = slurm.sbatch_script(cfg, "/shared/pyep/runs/r/config.yaml", "/shared/pyep/runs/r", "four.yaml")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for want in ["#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --time=02:00:00",
                 "#SBATCH --nodelist=gpu-node-0,gpu-node-1,gpu-node-2,gpu-node-3",
                 "#SBATCH --output=/shared/pyep/runs/r/slurm-%j.out", "#SBATCH --exclusive", "cd /shared/pyep",
                 "srun --nodes=4 --ntasks-per-node=1 --kill-on-bad-exit=1 --label python3 -m pyep.launch.slurm "
                 "node /shared/pyep/runs/r/config.yaml /shared/pyep/runs/r"]:
        assert want in lines, want
    assert any(ln.startswith("export PYEP_SLURM_MASTER=") for ln in lines)
    # Slurm orders nodes by its nodelist; the node entry matches its host name instead.
    env = {"SLURMD_NODENAME": "gpu-node-2", "SLURM_NODEID": "1", "PYEP_SLURM_MASTER": "gpu-node-0", "SLURM_JOB_ID": "77"}
    argv, extra = slurm.node_command(cfg, env, "/shared/pyep/runs/r")
    assert argv[argv.index("--node-rank") + 1] == "1" and argv[argv.index("--master-addr") + 1] == "gpu-node-0"
    assert extra["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and extra["PYEP_RUN_DIR"] == "/shared/pyep/runs/r"
    with pytest.raises(ValueError, match="run directory"):
        slurm.sbatch_script(cfg, "/x/config.yaml", "/x/run dir", "four.yaml")


def test_slurm_node_entry_prints_its_command(tmp_path) -> None:
    cfg = load_config(os.path.join(CONFIGS, "four_nodes.yaml"), facts=GPU_BOX)
    from pyep.config import dump_config
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    env = dict(os.environ, SLURMD_NODENAME="gpu-node-3", SLURM_NODEID="3", PYEP_SLURM_MASTER="gpu-node-0",
               PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "pyep.launch.slurm", "node", str(path), str(tmp_path), "--print"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    words = shlex.split(out.stdout)
    assert words[words.index("--node-rank") + 1] == "3"
    env["SLURMD_NODENAME"] = "stranger"
    cfg.nodes[0].gpus = [0, 1, 2, 3, 4, 5, 6, 7]
    path.write_text(dump_config(cfg).replace("gpus: [0, 1, 2, 3, 4, 5, 6, 7]", "gpus: [0, 1, 2, 3]", 1)
                    .replace("num_experts: 256", "num_experts: 28"))
    out = subprocess.run([sys.executable, "-m", "pyep.launch.slurm", "node", str(path), str(tmp_path), "--print"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert out.returncode == 2 and "pyep slurm node:" in out.stderr


def _cli(argv: List[str]) -> int:
    p = argparse.ArgumentParser()
    cli_launch.add_parser(p.add_subparsers())
    args = p.parse_args(["launch", *argv])
    return args.func(args)


def test_cli_dry_run_prints_commands(capsys, tmp_path) -> None:
    cfg = os.path.join(CONFIGS, "two_nodes.yaml")
    assert _cli([cfg, "--dry-run", "ep.timeout_us=123", "--run-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out.splitlines()
    ssh_lines = [ln for ln in out if ln.startswith("ssh ")]
    assert len(ssh_lines) == 2
    assert not any("PYEP_EP_TIMEOUT_US" in ln for ln in ssh_lines)     # environment values go on stdin
    env_lines = [ln for ln in out if ln.startswith("# sent on the connection's stdin")]
    assert len(env_lines) == 2 and all("PYEP_EP_TIMEOUT_US=123" in ln for ln in env_lines)
    assert not os.path.exists(tmp_path / "r"), "a dry run creates nothing"
    assert _cli([os.path.join(CONFIGS, "four_nodes.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=4" in out and "# node 3 (gpu-node-3): env " in out


def test_cli_bad_input(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: b\nep:\n  num_experts: 7\n")
    with pytest.raises(CliError, match=r"bad.yaml:3: ep.num_experts"):
        _cli([str(bad), "--dry-run", "nodes[0].gpus=0", "nodes[0].procs=2"])
    with pytest.raises(CliError, match="more than one config"):
        _cli(["a.yaml", "b.yaml"])
    with pytest.raises(CliError, match="--submit is for the slurm launcher"):
        _cli([os.path.join(CONFIGS, "cpu_reference.yaml"), "--submit"])
    assert cli_launch.split_items(["x.yaml", "ep.hidden=256"]) == ("x.yaml", ["ep.hidden=256"])
