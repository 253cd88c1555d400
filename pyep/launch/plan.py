"""Turns a resolved ClusterConfig into the exact commands a launch runs (one torchrun per node).

Commands are argv lists. Config values never pass through a local shell; for ssh the one string the
remote shell must parse is built with shlex.quote on every element, and everything in it (hosts,
paths) was validated by pyep.config first. Environment values are never on a command line: local
commands get them in their environment, ssh commands on the connection's stdin (pyep.launch.guard
--env-stdin reads them there), together with the job secret (pyep.launch.secret).
"""
from __future__ import annotations

import os
import shlex
import socket
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..config import ClusterConfig, HostFacts, ep_env
from ..config.host import visible_gpu_ids
from ..softnic.cuda_env import VARIABLE as CUDA_CONNECTIONS_VAR, softnic_cuda_env
from .secret import SECRET_FILE_VAR, secret_path

TORCHRUN_MODULE = "torch.distributed.run"


@dataclass
class NodeCommand:
    """One process the launcher starts: torchrun itself (local) or the ssh client (remote)."""
    index: int
    host: str
    argv: List[str]
    env: Dict[str, str]          # variables added for this node (local: on top of ours; ssh: sent on stdin)
    cwd: str
    remote: bool
    nproc: int                   # ranks torchrun starts on this node
    first_rank: Optional[int]    # static rendezvous: ranks are first_rank .. first_rank+nproc-1

    def shell_line(self) -> str:
        """The command as one copy-pasteable line (what --dry-run prints)."""
        if self.remote:
            return shlex.join(self.argv)
        env = [f"{k}={v}" for k, v in self.env.items()]
        return f"cd {shlex.quote(self.cwd)} && " + shlex.join((["env", *env] if env else []) + self.argv)


@dataclass
class LaunchPlan:
    config: ClusterConfig
    run_dir: str                 # on this machine
    remote_run_dir: str          # as the nodes see it (ssh/slurm); equal to run_dir for local
    master_port: int
    commands: List[NodeCommand] = field(default_factory=list)

    @property
    def total_ranks(self) -> int:
        return sum(c.nproc for c in self.commands)


def workload_target(cfg: ClusterConfig) -> Tuple[str, str, List[str]]:
    """(kind, target, args) for pyep.launch.rank."""
    wl = cfg.workload
    args = [str(a) for a in wl.args]
    if wl.builtin == "bench":
        return "module", "pyep", ["bench", *args]
    if wl.builtin == "tests":
        return "module", "pytest", ["-p", "pyep.launch.pytest_progress", *args]
    if wl.builtin == "reference-demo":
        return "module", "pyep.launch.demo", args
    if wl.module is not None:
        return "module", wl.module, args
    if wl.script is not None:
        return "script", wl.script, args
    raise ValueError("workload has no builtin, module or script (the config was not resolved)")


def ranks_per_node(cfg: ClusterConfig) -> int:
    node = cfg.nodes[0]
    return 1 if cfg.workload.processes == "per-node" else int(node.procs or 0)


def torchrun_argv(cfg: ClusterConfig, node_index: int, python: str, master_addr: Optional[str],
                  master_port: int, run_id: str) -> List[str]:
    rv = cfg.rendezvous
    argv = [python, "-m", TORCHRUN_MODULE, "--nnodes", str(len(cfg.nodes)),
            "--nproc-per-node", str(ranks_per_node(cfg)), "--max-restarts", "0"]
    if rv.endpoint is not None:
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rv.endpoint, "--rdzv-id", rv.id or run_id]
    else:
        if master_addr is None:
            raise ValueError("static rendezvous needs a master address")
        argv += ["--node-rank", str(node_index), "--master-addr", master_addr, "--master-port", str(master_port)]
    kind, target, args = workload_target(cfg)
    return argv + ["-m", "pyep.launch.rank", "--grace", f"{cfg.launcher.grace_s:g}", kind, target, *args]


def node_env(cfg: ClusterConfig, node_index: int, run_dir: str, local: bool,
             parent_env: Optional[Dict[str, str]] = None, secret_file: bool = True) -> Dict[str, str]:
    """Variables a node's ranks get on top of the environment torchrun inherits (see pyep.config.env).
    `secret_file`: the job secret's path in the run directory (ssh nodes get theirs from the guard)."""
    node = cfg.nodes[node_index]
    env: Dict[str, str] = {str(k): str(v) for k, v in cfg.env.items()}
    env.update(ep_env(cfg.ep))
    env["PYEP_RUN_DIR"] = run_dir
    env["PYEP_CONFIG"] = os.path.join(run_dir, "config.yaml")
    if secret_file:
        env[SECRET_FILE_VAR] = secret_path(run_dir)
    gpus = list(node.gpus) if isinstance(node.gpus, list) else []
    if gpus:
        ids = [str(g) for g in gpus]
        visible = visible_gpu_ids(parent_env) if local else None
        if visible is not None:     # our own CUDA_VISIBLE_DEVICES renumbers GPUs; map through it
            ids = [visible[g] for g in gpus]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    if isinstance(node.nics, dict) and node.nics:
        # Keyed by CUDA ordinal as a rank sees it (position in `gpus`), i.e. by LOCAL_RANK.
        env["PYEP_NIC_MAP"] = ",".join(f"{gpus.index(g)}={dev}" for g, dev in sorted(node.nics.items()))
    if str(getattr(cfg.ep, "transport", "")).startswith("emulated") and \
            CUDA_CONNECTIONS_VAR not in (parent_env or os.environ):
        softnic_cuda_env(env)    # before CUDA starts in the ranks (pyep/softnic/cuda_env.py)
    return env


def _loopback_gloo(env: Dict[str, str], parent_env: Dict[str, str]) -> None:
    # Gloo picks its interface by resolving the hostname, which fails or picks an unreachable address
    # in containers; when every rank is on this machine loopback is always right.
    if "GLOO_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in parent_env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"


def _same_pyep(env: Dict[str, str], parent_env: Dict[str, str]) -> None:
    # Ranks must import the pyep this launcher runs from, installed or not, from any directory.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [p for p in parent_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _abs_under(base: str, path: str) -> str:
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base, path))


def ssh_argv(cfg: ClusterConfig, host: str, remote_command: str) -> List[str]:
    ssh = cfg.launcher.ssh
    argv = [ssh.binary, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={ssh.connect_timeout_s}",
            "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4", "-p", str(ssh.port)]
    if ssh.identity_file:
        argv += ["-i", ssh.identity_file]
    if ssh.user:
        argv += ["-l", ssh.user]
    for opt in ssh.options:
        argv += ["-o", opt]
    return argv + [host, "--", remote_command]


def remote_command(workdir: str, argv: List[str]) -> str:
    """`cd DIR && exec ARGV`, every element shell-quoted (the environment goes on stdin)."""
    return f"cd {shlex.quote(workdir)} && exec " + shlex.join(argv)


def build_plan(cfg: ClusterConfig, run_dir_rel: str, facts: HostFacts,
               parent_env: Optional[Dict[str, str]] = None) -> LaunchPlan:
    """Commands for a local or ssh launch. `run_dir_rel` is the run directory relative to the working
    directory (or absolute); each side resolves it against its own working directory."""
    parent = dict(os.environ if parent_env is None else parent_env)
    kind = cfg.launcher.kind
    if kind not in ("local", "ssh"):
        raise ValueError(f"build_plan handles the local and ssh launchers, not {kind!r}")
    run_dir = _abs_under(facts.cwd, run_dir_rel)
    port = cfg.rendezvous.master_port or free_port()
    run_id = os.path.basename(run_dir.rstrip("/"))
    if kind == "local":
        remote_run_dir = run_dir
    else:
        remote_run_dir = _abs_under(str(cfg.launcher.ssh.workdir), run_dir_rel)
    plan = LaunchPlan(cfg, run_dir, remote_run_dir, port)
    nproc = ranks_per_node(cfg)
    static = cfg.rendezvous.endpoint is None
    if kind == "local" and cfg.launcher.restart.policy == "rank":
        _per_rank_commands(plan, cfg, facts, parent, run_dir, port, nproc)
        return plan
    for i, node in enumerate(cfg.nodes):
        first = i * nproc if static else None
        if kind == "local":
            env = node_env(cfg, i, run_dir, True, parent)
            if all(facts.is_local(n.host) for n in cfg.nodes):
                _loopback_gloo(env, parent)
            _same_pyep(env, parent)
            argv = torchrun_argv(cfg, i, sys.executable, cfg.rendezvous.master_addr, port, run_id)
            plan.commands.append(NodeCommand(i, node.host, argv, env, facts.cwd, False, nproc, first))
            continue
        ssh = cfg.launcher.ssh
        env = node_env(cfg, i, remote_run_dir, False, secret_file=False)
        inner = torchrun_argv(cfg, i, ssh.python, cfg.rendezvous.master_addr, port, run_id)
        gpus = len(node.gpus) if isinstance(node.gpus, list) else 0
        guard = [ssh.python, "-m", "pyep.launch.guard", "--grace", f"{cfg.launcher.grace_s:g}", "--env-stdin"]
        if gpus:
            guard += ["--expect-gpus", str(gpus)]
        cmd = remote_command(str(ssh.workdir), guard + ["--", *inner])
        plan.commands.append(NodeCommand(i, node.host, ssh_argv(cfg, node.host, cmd), env, facts.cwd, True,
                                         nproc, first))
    return plan


STORE_ADDR = "127.0.0.1"


def _per_rank_commands(plan: LaunchPlan, cfg: ClusterConfig, facts: HostFacts, parent: Dict[str, str], run_dir: str,
                       port: int, nproc: int) -> None:
    """launcher.restart.policy = "rank": one command per rank, started (and restarted) by the launcher,
    which hosts the job's TCPStore on `port` (torch's env:// rendezvous connects to it as to torchrun's
    agent store; a store-based EpBuffer uses it for its membership)."""
    world = nproc * len(cfg.nodes)
    kind, target, args = workload_target(cfg)
    argv = [sys.executable, "-m", "pyep.launch.rank", "--grace", f"{cfg.launcher.grace_s:g}", kind, target, *args]
    for i, node in enumerate(cfg.nodes):
        base = node_env(cfg, i, run_dir, True, parent)
        _loopback_gloo(base, parent)
        _same_pyep(base, parent)
        for j in range(nproc):
            rank = i * nproc + j
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(j), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(nproc),
                       GROUP_RANK=str(i), MASTER_ADDR=STORE_ADDR, MASTER_PORT=str(port), PYEP_STORE_ADDR=STORE_ADDR,
                       PYEP_STORE_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", PYEP_RESTART_COUNT="0")
            plan.commands.append(NodeCommand(rank, node.host, list(argv), env, facts.cwd, False, 1, rank))


def collect_argv(cfg: ClusterConfig, host: str, remote_run_dir: str) -> List[str]:
    """ssh command that streams a node's run directory back as a tar archive (logs and results)."""
    # nodes/ holds earlier copies when the run directory is shared; never copy those again. private/
    # holds the job secret where the node shares the launcher's run directory: it stays where it is.
    return ssh_argv(cfg, host, shlex.join(["tar", "-C", remote_run_dir, "--exclude=./nodes", "--exclude=./private",
                                           "-cf", "-", "."]))
