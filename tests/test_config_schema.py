"""Config schema: shipped examples load, overrides are typed, resolved configs round-trip, env contract."""
from __future__ import annotations

import os

import pytest

from pyep.config import (MANDATORY_ENV, ClusterConfig, ConfigError, EpConfig, HostFacts, dump_config, ep_env,
                         ep_from_env, load_config, local_default_config, parse_config, parse_nic_map,
                         virtual_node_size)
from pyep.config.host import valid_host
from pyep.config.validate import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
GPU_BOX = HostFacts(gpus=8, names=frozenset({"localhost", "127.0.0.1"}), cwd="/work")
CPU_BOX = HostFacts(gpus=0, names=frozenset({"localhost", "127.0.0.1"}), cwd="/work")


@pytest.mark.parametrize("name", ["single_node", "two_virtual_nodes", "two_nodes", "four_nodes", "cpu_reference"])
def test_shipped_configs_load(name: str) -> None:
    cfg = load_config(os.path.join(CONFIGS, f"{name}.yaml"), facts=GPU_BOX)
    world = sum(len(n.gpus) or n.procs for n in cfg.nodes)
    assert cfg.ep.num_experts % world == 0
    for key, val in MANDATORY_ENV.items():
        assert cfg.env[key] == val


def test_example_shapes() -> None:
    single = load_config(os.path.join(CONFIGS, "single_node.yaml"), facts=GPU_BOX)
    assert single.nodes[0].gpus == list(range(8)) and single.launcher.kind == "local"
    virt = load_config(os.path.join(CONFIGS, "two_virtual_nodes.yaml"), facts=GPU_BOX)
    assert virt.ep.gpus_per_virtual_node == 4 and virt.ep.transport == "emulated-internode"
    two = load_config(os.path.join(CONFIGS, "two_nodes.yaml"), facts=GPU_BOX)
    assert two.launcher.kind == "ssh" and len(two.nodes) == 2 and two.nodes[1].nics[7] == "mlx5_7"
    four = load_config(os.path.join(CONFIGS, "four_nodes.yaml"), facts=GPU_BOX)
    assert four.launcher.kind == "slurm" and four.rendezvous.master_addr is None
    cpu = load_config(os.path.join(CONFIGS, "cpu_reference.yaml"), facts=CPU_BOX)
    assert cpu.nodes[0].procs == 4 and cpu.ep.backend == "reference" and cpu.ep.dist_backend == "gloo"


def test_single_node_on_a_box_without_gpus_says_so() -> None:
    with pytest.raises(ConfigError, match="has no GPUs"):
        load_config(os.path.join(CONFIGS, "single_node.yaml"), facts=CPU_BOX)


def test_overrides_are_typed() -> None:
    cfg = load_config(os.path.join(CONFIGS, "two_nodes.yaml"), [
        "ep.timeout_us=5000000", "ep.ib.sl=3", "nodes[1].host=10.0.0.7", "nodes.0.gpus=[0,1,2,3,4,5,6,7]",
        "workload.args=[--iters, 20]", "launcher.ssh.collect_results=false", "env.NCCL_DEBUG=INFO",
        "launcher.timeout_s=60"], facts=GPU_BOX)
    assert cfg.ep.timeout_us == 5_000_000 and cfg.ep.ib.sl == 3
    assert cfg.nodes[1].host == "10.0.0.7" and cfg.nodes[0].gpus == list(range(8))
    assert cfg.workload.args == ["--iters", "20"]
    assert cfg.launcher.ssh.collect_results is False and cfg.launcher.timeout_s == 60.0
    assert cfg.env["NCCL_DEBUG"] == "INFO"
    with pytest.raises(ConfigError, match="expected an integer, got 'soon'"):
        load_config(os.path.join(CONFIGS, "two_nodes.yaml"), ["ep.timeout_us=soon"], facts=GPU_BOX)


def test_launcher_shorthand() -> None:
    cfg, _ = parse_config("launcher: ssh\n")
    assert cfg.launcher.kind == "ssh"


def test_resolved_config_round_trips() -> None:
    cfg = load_config(os.path.join(CONFIGS, "two_virtual_nodes.yaml"), facts=GPU_BOX)
    text = dump_config(cfg)
    again, locs = parse_config(text, "<resolved>")
    assert resolve(again, locs, GPU_BOX) == cfg


def test_default_job_depends_on_gpus() -> None:
    gpu = load_config(None, facts=GPU_BOX)
    assert gpu.workload.builtin == "bench" and gpu.nodes[0].gpus == list(range(8))
    assert gpu.ep.num_experts == 288
    for n in (1, 5, 7):     # any GPU count gets a valid default job
        assert load_config(None, facts=HostFacts(gpus=n, names=GPU_BOX.names, cwd="/w")).ep.num_experts % n == 0
    cpu = load_config(None, facts=CPU_BOX)
    assert cpu.workload.builtin == "reference-demo" and cpu.nodes[0].procs == 4
    assert cpu.ep.backend == "reference" and cpu.ep.dist_backend == "gloo"
    assert isinstance(local_default_config(CPU_BOX), ClusterConfig)
    with pytest.raises(ConfigError, match="override 'ep.num_experts=6'"):
        load_config(None, ["ep.num_experts=6"], facts=CPU_BOX)


def test_ep_env_round_trip() -> None:
    ep = EpConfig(transport="emulated", num_experts=64, hidden=2048, gpus_per_virtual_node=4)
    ep.ib.gid_index = 3
    env = ep_env(ep)
    assert env["PYEP_VIRTUAL_NODE_SIZE"] == "4" and env["PYEP_IB_GID_INDEX"] == "3"
    assert ep_from_env(env) == ep
    assert virtual_node_size(env) == 4 and virtual_node_size({}) is None
    with pytest.raises(ValueError, match="PYEP_EP_HIDDEN='big' is not an integer"):
        ep_from_env({"PYEP_EP_HIDDEN": "big"})
    with pytest.raises(ValueError, match="PYEP_EP_TRANSPORT='carrier-pigeon'"):
        ep_from_env({"PYEP_EP_TRANSPORT": "carrier-pigeon"})
    with pytest.raises(ValueError, match="PYEP_VIRTUAL_NODE_SIZE"):
        virtual_node_size({"PYEP_VIRTUAL_NODE_SIZE": "0"})


def test_nic_map_parsing() -> None:
    assert parse_nic_map("0=mlx5_0, 1=mlx5_3") == {0: "mlx5_0", 1: "mlx5_3"}
    with pytest.raises(ValueError, match="not GPU=DEVICE"):
        parse_nic_map("0:mlx5_0")


@pytest.mark.parametrize("host,ok", [("node-1", True), ("a.b.example.com", True), ("10.0.0.1", True), ("::1", True),
                                     ("fe80::1", True), ("-oProxyCommand", False), ("a b", False), ("a;b", False),
                                     ("", False), ("$(id)", False), ("host_name", False), ("300.1.1.1", True)])
def test_valid_host(host: str, ok: bool) -> None:
    # "300.1.1.1" is not an IPv4 address but is a syntactically valid DNS name; harmless for ssh.
    assert valid_host(host) is ok
