"""The cluster-config schema: what a `configs/*.yaml` file may say, with defaults.

Every section is a dataclass; `pyep.config.load_config` turns YAML into these classes, reporting any
wrong key, type or value with the file and line it came from. Field types drive that conversion, so
they are deliberately narrow (`Literal` for choices, `Text` for values that end up in an environment
or on a command line).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Literal, NewType, Optional, Union

# A string that YAML may also have written as a number (`OMP_NUM_THREADS: 8`, `args: [--iters, 10]`).
# Booleans and nulls are refused: `true` would become "True", which no program expects.
Text = NewType("Text", str)
# A Slurm time limit. Only strings: YAML 1.1 reads an unquoted 1:00:00 as the number 3600.
SlurmTime = NewType("SlurmTime", str)

LauncherKind = Literal["local", "ssh", "slurm"]
Transport = Literal["auto", "nvlink", "ibgda", "emulated", "emulated-internode"]
EpBackend = Literal["auto", "native", "reference"]
DistBackend = Literal["auto", "nccl", "gloo"]
Builtin = Literal["bench", "tests", "reference-demo"]
ProcessMode = Literal["auto", "per-gpu", "per-node"]

# Exported to every rank no matter what the config says: NVLink SHARP / multicast objects hang or fail
# on the machines pyep runs on (NVSwitch systems lent without multicast), and NCCL, torch's symmetric
# memory and NVSHMEM each use them by default.
MANDATORY_ENV: Dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass
class NodeConfig:
    """One machine. `gpus` is a count, a list of GPU indices, or "all" (only for this machine, where
    pyep can look). `procs` is the number of ranks on a node without GPUs (CPU reference runs); on a
    GPU node there is one rank per GPU. `nics` maps GPU index -> RDMA device, or "auto" (nearest)."""
    host: str = "localhost"
    gpus: Union[int, List[int], Literal["all"]] = "all"
    procs: Optional[int] = None
    nics: Union[Literal["auto"], Dict[int, str]] = "auto"


@dataclass
class RendezvousConfig:
    """Static rendezvous (`master_addr`/`master_port`; node 0 hosts the store) or a c10d `endpoint`
    ("host:port", any node order). master_addr defaults to the first node; master_port 0 picks a free
    port at launch time, which only works when every node is this machine."""
    master_addr: Optional[str] = None
    master_port: int = 29500
    endpoint: Optional[str] = None
    id: Optional[str] = None


@dataclass
class SshConfig:
    user: Optional[str] = None
    port: int = 22
    identity_file: Optional[str] = None
    options: List[str] = field(default_factory=list)   # extra `-o Key=Value` options for ssh
    connect_timeout_s: int = 15
    workdir: Optional[str] = None     # remote working directory; default: this directory
    python: str = "python3"           # remote interpreter (a venv's python, for example)
    binary: str = "ssh"               # the ssh client to run
    collect_results: bool = False     # copy each node's run directory back (tar over ssh)


@dataclass
class SlurmConfig:
    partition: Optional[str] = None
    account: Optional[str] = None
    time: SlurmTime = SlurmTime("01:00:00")
    qos: Optional[str] = None
    use_nodelist: bool = True         # pin the job to the configured hosts
    extra_sbatch: List[str] = field(default_factory=list)   # more `--flag=value` sbatch options
    python: str = "python3"
    workdir: Optional[str] = None


RestartPolicy = Literal["none", "rank"]


@dataclass
class RestartConfig:
    """What happens when a rank fails. "none": the whole job is torn down (torchrun's way). "rank"
    (local launcher): the launcher starts each rank itself, hosts the job's TCPStore (ranks reach it at
    PYEP_STORE_ADDR / PYEP_STORE_PORT, and torch's env:// rendezvous uses it as torchrun's agent store),
    and restarts only the failed rank, at most max_restarts times per rank, after delay_s; a
    store-based EpBuffer re-admits it (docs/elastic.md). Each failure, restart and rejoin is a line on
    the console and a record in the run directory's events.jsonl."""
    policy: RestartPolicy = "none"
    max_restarts: int = 3
    delay_s: float = 0.0


@dataclass
class LauncherConfig:
    """How ranks are started. In YAML `launcher: ssh` is short for `launcher: {kind: ssh}`."""
    kind: LauncherKind = "local"
    timeout_s: float = 7200.0         # whole-job limit; the job is torn down when it passes
    grace_s: float = 15.0             # SIGTERM -> SIGKILL delay during teardown
    run_root: str = "runs"
    restart: RestartConfig = field(default_factory=RestartConfig)
    ssh: SshConfig = field(default_factory=SshConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)


@dataclass
class IbConfig:
    """RDMA settings for the IBGDA transport (real NIC or softnic). None = not set here: the rank falls
    back to NCCL_IB_GID_INDEX / NCCL_IB_TC / NCCL_IB_SL from its environment, then to automatic/0."""
    gid_index: Optional[int] = None
    traffic_class: Optional[int] = None
    sl: Optional[int] = None
    mtu: int = 4096
    qps_per_peer: int = 1
    queue_depth: int = 1024


@dataclass
class EpConfig:
    """Expert-parallel settings, exported to ranks as PYEP_EP_* variables (see pyep.config.env).

    gpus_per_virtual_node splits each machine into virtual nodes of that many ranks: ranks in the same
    virtual node talk over NVLink, ranks in different ones are treated as remote (IBGDA, or the softnic
    with transport "emulated"). Ranks see it as PYEP_VIRTUAL_NODE_SIZE."""
    backend: EpBackend = "auto"
    transport: Transport = "auto"
    dist_backend: DistBackend = "auto"
    num_experts: int = 256
    hidden: int = 7168
    num_topk: int = 8
    num_max_dispatch_tokens_per_rank: int = 128
    timeout_us: int = 10_000_000
    gpus_per_virtual_node: Optional[int] = None
    ib: IbConfig = field(default_factory=IbConfig)


@dataclass
class WorkloadConfig:
    """Exactly one of builtin / module / script. Built-ins: "bench" (`python -m pyep bench ARGS`),
    "tests" (`python -m pytest ARGS`, one process per node since the tests start their own ranks),
    "reference-demo" (pyep.launch.demo: a small EP run over the reference backend).
    processes: "per-gpu" (one rank per GPU / proc) or "per-node"; "auto" picks per the workload."""
    builtin: Optional[Builtin] = None
    module: Optional[str] = None
    script: Optional[str] = None
    args: List[Text] = field(default_factory=list)
    processes: ProcessMode = "auto"


@dataclass
class ClusterConfig:
    name: str = "pyep"
    nodes: List[NodeConfig] = field(default_factory=lambda: [NodeConfig()])
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    env: Dict[str, Text] = field(default_factory=dict)
    ep: EpConfig = field(default_factory=EpConfig)
    workload: WorkloadConfig = field(default_factory=lambda: WorkloadConfig(builtin="bench"))


# Sections that accept a bare string as shorthand for {<key>: string}.
SHORTHAND = {LauncherConfig: "kind"}
