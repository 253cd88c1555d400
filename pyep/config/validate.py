"""Semantic checks and resolution: a typed ClusterConfig -> a fully explicit one, or ConfigError.

Resolution fills in what the file left to pyep (GPU lists, ranks per node, master address, process
mode, working directories, mandatory environment) so that the resolved config written to the run
directory describes exactly what ran, and can be loaded again on another node (Slurm).
"""
from __future__ import annotations

import copy
import os
import re
from typing import Dict, List

from .._input import parse_uint
from .host import HostFacts, valid_host
from .schema import MANDATORY_ENV, ClusterConfig, NodeConfig
from .source import ConfigError, Locations, Problem

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DEVICE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
SLURM_WORD_RE = re.compile(r"[A-Za-z0-9_.,-]+")
SLURM_TIME_RE = re.compile(r"([0-9]+-)?[0-9]+(:[0-9]{1,2}){0,2}")   # ASCII: \d also takes '٣'
SBATCH_FLAG_RE = re.compile(r"--[a-z][a-z0-9-]*(=[^\n\r\x00]+)?")
SSH_OPTION_RE = re.compile(r"[A-Za-z][A-Za-z0-9]*=[^\n\r\x00]+")
USER_RE = re.compile(r"[a-z_][a-z0-9_.-]{0,31}\$?", re.IGNORECASE)
VALID_MTU = (256, 512, 1024, 2048, 4096)

# Variables `pyep launch` itself sets per rank or per node: a config value would be overwritten or
# would break the launch, so saying it in `env` is an error pointing at the right setting.
RESERVED_ENV = {
    "RANK": "set by torchrun", "LOCAL_RANK": "set by torchrun", "WORLD_SIZE": "set by torchrun",
    "LOCAL_WORLD_SIZE": "set by torchrun", "MASTER_ADDR": "use rendezvous.master_addr",
    "MASTER_PORT": "use rendezvous.master_port", "CUDA_VISIBLE_DEVICES": "use nodes[i].gpus",
    "PYEP_RUN_DIR": "set by pyep launch", "PYEP_VIRTUAL_NODE_SIZE": "use ep.gpus_per_virtual_node",
    "PYEP_NIC_MAP": "use nodes[i].nics",
}


def _bad_text(value: str) -> bool:
    return any(c in value for c in "\x00\n\r")


def resolve(cfg: ClusterConfig, locs: Locations, facts: HostFacts) -> ClusterConfig:
    """Check everything that can be checked before launch; return the explicit config."""
    out = copy.deepcopy(cfg)
    problems: List[Problem] = []

    def bad(path: tuple, message: str) -> None:
        suffix = "" if locs.given(path) else " (default)"
        problems.append(locs.problem(path, message.replace("{default}", suffix)))

    if not NAME_RE.fullmatch(out.name):
        bad(("name",), f"{out.name!r} is not a valid run name (letters, digits, '.', '_', '-'; at most 64)")
    kind = out.launcher.kind
    if not out.nodes:
        bad(("nodes",), "at least one node is needed")
    ranks_per_node: List[int] = []
    for i, node in enumerate(out.nodes):
        ranks_per_node.append(_resolve_node(i, node, kind, facts, bad))
    for i, n in enumerate(ranks_per_node):
        if n != ranks_per_node[0]:
            key = "gpus" if out.nodes[i].gpus else "procs"
            bad(("nodes", i, key), f"node {i} runs {n} ranks but node 0 runs {ranks_per_node[0]}; every node "
                "must run the same number of ranks")
            break
    _check_gpu_overlap(out.nodes, bad)
    world = sum(ranks_per_node)
    per_node = ranks_per_node[0] if ranks_per_node else 0
    has_gpus = any(len(n.gpus) > 0 for n in out.nodes if isinstance(n.gpus, list))
    all_local = all(facts.is_local(n.host) for n in out.nodes)

    _check_rendezvous(out, all_local, bad)
    _check_launcher(out, all_local, facts, bad)
    _check_env(out, bad)
    _check_ep(out, world, per_node, has_gpus, bad)
    _check_workload(out, bad)
    if problems:
        raise ConfigError(problems)
    return out


def _resolve_node(i: int, node: NodeConfig, kind: str, facts: HostFacts, bad) -> int:
    p = ("nodes", i)
    if not valid_host(node.host):
        bad(p + ("host",), f"{node.host!r} is not a valid host name or address")
        return 0
    local = facts.is_local(node.host)
    if kind == "local" and not local:
        bad(p + ("host",), f"{node.host!r} is not this machine; the local launcher only starts ranks here "
            "(use launcher: ssh or slurm for other hosts)")
    gpus = node.gpus
    if gpus == "all":
        if not local:
            bad(p + ("gpus",), f"say how many GPUs {node.host} has (a count or a list); "
                "'all' can only be looked up on this machine")
            return 0
        gpus = list(range(facts.gpus))
    elif isinstance(gpus, int):
        if gpus < 0:
            bad(p + ("gpus",), f"{gpus} GPUs is negative")
            return 0
        gpus = list(range(gpus))
    else:
        seen = set()
        for j, g in enumerate(gpus):
            if g < 0:
                bad(p + ("gpus", j), f"GPU index {g} is negative")
            if g in seen:
                bad(p + ("gpus", j), f"GPU {g} is listed twice")
            seen.add(g)
    if local and kind == "local":
        for j, g in enumerate(gpus):
            if g >= facts.gpus:
                path = p + ("gpus", j) if isinstance(node.gpus, list) else p + ("gpus",)
                has = f"0-{facts.gpus - 1}" if facts.gpus else "none"
                bad(path, f"GPU {g} is not on this machine (it has {facts.gpus} GPUs: {has})")
                break
    node.gpus = list(gpus)
    if node.procs is not None and node.procs < 1:
        bad(p + ("procs",), f"procs must be at least 1, got {node.procs}")
    if gpus and node.procs is not None and node.procs != len(gpus):
        bad(p + ("procs",), f"a GPU node runs one rank per GPU ({len(gpus)}), not {node.procs}; "
            "drop procs or change gpus")
    if not gpus and node.procs is None:
        bad(p + ("procs",), f"node {node.host} has no GPUs{{default}}; say how many CPU ranks it runs "
            "with procs")
    ranks = len(gpus) if gpus else (node.procs or 0)
    node.procs = ranks
    if isinstance(node.nics, dict):
        for g, dev in node.nics.items():
            if g not in gpus:
                bad(p + ("nics", g), f"GPU {g} is not one of this node's GPUs {gpus}")
            if not DEVICE_RE.fullmatch(dev):
                bad(p + ("nics", g), f"{dev!r} is not a valid RDMA device name")
            elif local and facts.rdma_devices is not None and dev not in facts.rdma_devices:
                have = ", ".join(sorted(facts.rdma_devices)) or "none"
                bad(p + ("nics", g), f"RDMA device {dev!r} is not on this machine (it has: {have})")
    return ranks


def _check_gpu_overlap(nodes: List[NodeConfig], bad) -> None:
    used: Dict[str, Dict[int, int]] = {}
    for i, node in enumerate(nodes):
        owner = used.setdefault(node.host, {})
        for g in node.gpus if isinstance(node.gpus, list) else []:
            if g in owner:
                bad(("nodes", i, "gpus"), f"GPU {g} of {node.host} is already used by node {owner[g]}")
                break
            owner[g] = i


def _check_rendezvous(cfg: ClusterConfig, all_local: bool, bad) -> None:
    rv = cfg.rendezvous
    if rv.endpoint is not None:
        if rv.master_addr is not None:
            bad(("rendezvous", "endpoint"), "give either endpoint (c10d) or master_addr (static), not both")
        host, _, port = rv.endpoint.rpartition(":")
        number = parse_uint(port, 5) if port == port.strip() else None
        if not valid_host(host.strip("[]")) or number is None or not 0 < number < 65536:
            bad(("rendezvous", "endpoint"), f"{rv.endpoint!r} is not HOST:PORT")
    if rv.id is not None and not NAME_RE.fullmatch(rv.id):
        bad(("rendezvous", "id"), f"{rv.id!r} is not a valid rendezvous id")
    if not 0 <= rv.master_port < 65536:
        bad(("rendezvous", "master_port"), f"port {rv.master_port} is outside 0-65535")
    elif rv.master_port == 0 and not all_local:
        bad(("rendezvous", "master_port"), "port 0 (pick a free port) only works when every node is this "
            "machine; give a fixed port")
    if rv.master_addr is not None:
        if not valid_host(rv.master_addr):
            bad(("rendezvous", "master_addr"), f"{rv.master_addr!r} is not a valid host name or address")
    elif rv.endpoint is None and cfg.nodes and cfg.launcher.kind != "slurm":
        # Slurm leaves it unset: the batch script takes the allocation's first node.
        rv.master_addr = "127.0.0.1" if all_local else cfg.nodes[0].host


def _check_launcher(cfg: ClusterConfig, all_local: bool, facts: HostFacts, bad) -> None:
    la = cfg.launcher
    if not 0 < la.timeout_s <= 30 * 24 * 3600:
        bad(("launcher", "timeout_s"), f"timeout_s must be in (0, 2592000], got {la.timeout_s}")
    if not 0 < la.grace_s <= 600:
        bad(("launcher", "grace_s"), f"grace_s must be in (0, 600], got {la.grace_s}")
    if not la.run_root or _bad_text(la.run_root):
        bad(("launcher", "run_root"), "run_root must be a non-empty path")
    rs = la.restart
    if rs.policy == "rank" and la.kind != "local":
        bad(("launcher", "restart", "policy"), f"restart policy 'rank' needs the local launcher (got {la.kind!r}): "
                                                "the launcher must start and watch each rank itself")
    if not 0 <= rs.max_restarts <= 1000:
        bad(("launcher", "restart", "max_restarts"), f"max_restarts must be in [0, 1000], got {rs.max_restarts}")
    if not 0 <= rs.delay_s <= 3600:
        bad(("launcher", "restart", "delay_s"), f"delay_s must be in [0, 3600], got {rs.delay_s}")
    ssh = la.ssh
    if ssh.user is not None and not USER_RE.fullmatch(ssh.user):
        bad(("launcher", "ssh", "user"), f"{ssh.user!r} is not a valid user name")
    if not 0 < ssh.port < 65536:
        bad(("launcher", "ssh", "port"), f"port {ssh.port} is outside 1-65535")
    if not 0 < ssh.connect_timeout_s <= 600:
        bad(("launcher", "ssh", "connect_timeout_s"), "connect_timeout_s must be in 1-600")
    for j, opt in enumerate(ssh.options):
        if not SSH_OPTION_RE.fullmatch(opt):
            bad(("launcher", "ssh", "options", j), f"{opt!r} is not an ssh Key=Value option")
    for key in ("identity_file", "workdir", "python", "binary"):
        val = getattr(ssh, key)
        if val is not None and (not val or _bad_text(val) or val.startswith("-")):
            bad(("launcher", "ssh", key), f"{val!r} is not a usable value")
    sl = la.slurm
    for key in ("partition", "account", "qos"):
        val = getattr(sl, key)
        if val is not None and not SLURM_WORD_RE.fullmatch(val):
            bad(("launcher", "slurm", key), f"{val!r} is not a valid Slurm {key} name")
    if not SLURM_TIME_RE.fullmatch(sl.time):
        bad(("launcher", "slurm", "time"), f"{sl.time!r} is not a Slurm time (MM, HH:MM:SS or D-HH:MM:SS)")
    for j, flag in enumerate(sl.extra_sbatch):
        if not SBATCH_FLAG_RE.fullmatch(flag):
            bad(("launcher", "slurm", "extra_sbatch", j), f"{flag!r} is not an sbatch --flag or --flag=value")
    for key in ("python", "workdir"):
        val = getattr(sl, key)
        if val is not None and (not val or _bad_text(val) or val.startswith("-")):
            bad(("launcher", "slurm", key), f"{val!r} is not a usable value")
    for key, section in (("ssh", ssh), ("slurm", sl)):
        if section.workdir is None:
            section.workdir = facts.cwd
        elif not os.path.isabs(section.workdir):
            bad(("launcher", key, "workdir"), f"{section.workdir!r} must be an absolute path")


def _check_env(cfg: ClusterConfig, bad) -> None:
    for key, val in list(cfg.env.items()):
        p = ("env", key)
        if not ENV_KEY_RE.fullmatch(str(key)):
            bad(p, f"{key!r} is not a valid environment variable name")
        elif key in RESERVED_ENV or str(key).startswith("PYEP_EP_") or str(key).startswith("PYEP_IB_"):
            bad(p, f"{key} is set by pyep launch ({RESERVED_ENV.get(key, 'use the ep section')})")
        elif key in MANDATORY_ENV and val != MANDATORY_ENV[key]:
            bad(p, f"{key} must be {MANDATORY_ENV[key]!r} on pyep's machines (NVLink multicast is off); "
                f"got {val!r}")
        if val is not None and _bad_text(val):
            bad(p, "values may not contain newlines or NUL characters")
    cfg.env = {**cfg.env, **MANDATORY_ENV}


def _check_ep(cfg: ClusterConfig, world: int, per_node: int, has_gpus: bool, bad) -> None:
    ep, ib = cfg.ep, cfg.ep.ib
    e = ("ep",)
    if ep.num_experts < 1:
        bad(e + ("num_experts",), f"{ep.num_experts} must be at least 1")
    elif world and ep.num_experts % world:
        bad(e + ("num_experts",), f"{ep.num_experts}{{default}} is not divisible by world size {world}")
    if ep.hidden < 128 or ep.hidden % 128 or ep.hidden > 65536:
        bad(e + ("hidden",), f"{ep.hidden}{{default}} must be a multiple of 128 between 128 and 65536")
    if not 1 <= ep.num_topk <= 16:
        bad(e + ("num_topk",), f"{ep.num_topk} must be between 1 and 16")
    elif ep.num_topk > ep.num_experts:
        bad(e + ("num_topk",), f"{ep.num_topk}{{default}} is more than num_experts {ep.num_experts}")
    t = ep.num_max_dispatch_tokens_per_rank
    if not 1 <= t <= 65536:
        bad(e + ("num_max_dispatch_tokens_per_rank",), f"{t} must be between 1 and 65536")
    if ep.timeout_us < 1:
        bad(e + ("timeout_us",), f"{ep.timeout_us} must be a positive number of microseconds")
    v = ep.gpus_per_virtual_node
    if v is not None:
        if v < 1 or (per_node and per_node % v):
            bad(e + ("gpus_per_virtual_node",), f"{v} must be at least 1 and divide the {per_node} ranks per node")
        if ep.transport == "nvlink":
            bad(e + ("transport",), "nvlink cannot reach other virtual nodes; use auto, ibgda or emulated")
    if ep.transport == "nvlink" and len(cfg.nodes) > 1:
        bad(e + ("transport",), "nvlink only reaches ranks on one node; use auto, ibgda or emulated")
    if not has_gpus:
        if ep.backend == "native":
            bad(e + ("backend",), "the native backend needs GPUs; these nodes have none (use reference)")
        if ep.transport != "auto":
            bad(e + ("transport",), f"transport {ep.transport!r} needs GPUs; these nodes have none")
        if ep.dist_backend == "nccl":
            bad(e + ("dist_backend",), "NCCL needs GPUs; these nodes have none (use gloo)")
    if ib.gid_index is not None and not 0 <= ib.gid_index < 256:
        bad(e + ("ib", "gid_index"), f"{ib.gid_index} must be in 0-255")
    if ib.traffic_class is not None and not 0 <= ib.traffic_class < 256:
        bad(e + ("ib", "traffic_class"), f"{ib.traffic_class} must be in 0-255")
    if ib.sl is not None and not 0 <= ib.sl < 16:
        bad(e + ("ib", "sl"), f"{ib.sl} must be in 0-15")
    if ib.mtu not in VALID_MTU:
        bad(e + ("ib", "mtu"), f"{ib.mtu} is not an IB MTU ({', '.join(map(str, VALID_MTU))})")
    if not 1 <= ib.qps_per_peer <= 64:
        bad(e + ("ib", "qps_per_peer"), f"{ib.qps_per_peer} must be in 1-64")
    q = ib.queue_depth
    if q < 64 or q > 65536 or q & (q - 1):
        bad(e + ("ib", "queue_depth"), f"{q} must be a power of two in 64-65536")
    elif 1 <= t <= 65536 and q < 2 * (t + 1):
        # A QP must hold a full dispatch's writes plus signals without waiting on its own CQ.
        bad(e + ("ib", "queue_depth"), f"{q}{{default}} is below 2*(num_max_dispatch_tokens_per_rank+1) "
            f"= {2 * (t + 1)}")


def _check_workload(cfg: ClusterConfig, bad) -> None:
    wl = cfg.workload
    given = [k for k in ("builtin", "module", "script") if getattr(wl, k) is not None]
    if len(given) != 1:
        bad(("workload",), "give exactly one of builtin, module or script"
            + (f" (got {', '.join(given)})" if given else ""))
    if wl.module is not None and not MODULE_RE.fullmatch(wl.module):
        bad(("workload", "module"), f"{wl.module!r} is not a Python module name")
    if wl.script is not None and (not wl.script or _bad_text(wl.script) or wl.script.startswith("-")):
        bad(("workload", "script"), f"{wl.script!r} is not a usable script path")
    for j, arg in enumerate(wl.args):
        if arg is not None and "\x00" in arg:
            bad(("workload", "args", j), "arguments may not contain NUL characters")
    if wl.processes == "auto":
        wl.processes = "per-node" if wl.builtin == "tests" else "per-gpu"


def local_default_config(facts: HostFacts) -> ClusterConfig:
    """The job `pyep launch` runs with no config: the EP benchmark on every local GPU, or on a
    machine without GPUs the CPU reference demo on 4 gloo ranks."""
    from .schema import EpConfig, NodeConfig, RendezvousConfig, WorkloadConfig
    n = facts.gpus
    if n > 0:
        # DeepEP's benchmark shape (E=288) where the GPU count divides it, else the nearest E >= 256 that works.
        experts = 288 if 288 % n == 0 else n * -(-256 // n)
        return ClusterConfig(name="bench-local", nodes=[NodeConfig(host="localhost", gpus="all")],
                             rendezvous=RendezvousConfig(master_port=0), ep=EpConfig(num_experts=experts),
                             workload=WorkloadConfig(builtin="bench"))
    return ClusterConfig(name="cpu-reference", nodes=[NodeConfig(host="localhost", gpus=0, procs=4)],
                         rendezvous=RendezvousConfig(master_port=0),
                         ep=EpConfig(backend="reference", dist_backend="gloo", num_experts=16, hidden=256,
                                     num_topk=4, num_max_dispatch_tokens_per_rank=32),
                         workload=WorkloadConfig(builtin="reference-demo"))

