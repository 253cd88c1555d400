"""Config validation: every mistake is reported with its file, line and key, before anything starts."""
from __future__ import annotations

import textwrap
from typing import List

import pytest

from pyep.config import ConfigError, HostFacts, load_config

# A valid two-node ssh config; each case below breaks one line of it (line numbers are 1-based).
BASE = textwrap.dedent("""\
    name: errs
    nodes:
      - host: node-a
        gpus: 4
        nics: {0: mlx5_0, 1: mlx5_1}
      - host: node-b
        gpus: [0, 1, 2, 3]
    rendezvous:
      master_addr: node-a
      master_port: 29500
    launcher:
      kind: ssh
      ssh:
        port: 22
    env:
      NCCL_DEBUG: WARN
    ep:
      num_experts: 64
      hidden: 1024
      num_topk: 8
      num_max_dispatch_tokens_per_rank: 128
      ib:
        mtu: 4096
        queue_depth: 1024
    workload:
      builtin: bench
      args: [--iters, 10]
    """)

FACTS = HostFacts(gpus=8, names=frozenset({"localhost", "127.0.0.1", "this-host"}), cwd="/work")


def _load(tmp_path, text: str, overrides: List[str] = ()):  # type: ignore[assignment]
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return load_config(str(path), overrides, facts=FACTS), str(path)


def _replace(line_no: int, new: str) -> str:
    lines = BASE.splitlines()
    assert 1 <= line_no <= len(lines)
    indent = len(lines[line_no - 1]) - len(lines[line_no - 1].lstrip())
    lines[line_no - 1] = " " * indent + new
    return "\n".join(lines) + "\n"


def test_base_config_is_valid(tmp_path) -> None:
    cfg, _ = _load(tmp_path, BASE)
    assert [n.gpus for n in cfg.nodes] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert cfg.rendezvous.master_addr == "node-a"


CASES = [
    # (line, replacement, key, message fragment)
    (18, "num_experts: 250", "ep.num_experts", "250 is not divisible by world size 8"),
    (18, "num_expert: 64", "ep.num_expert", "unknown key; did you mean 'num_experts'?"),
    (19, "hidden: 1000", "ep.hidden", "multiple of 128"),
    (19, "hidden: big", "ep.hidden", "expected an integer, got 'big'"),
    (20, "num_topk: 17", "ep.num_topk", "between 1 and 16"),
    (23, "mtu: 1500", "ep.ib.mtu", "not an IB MTU"),
    (24, "queue_depth: 100", "ep.ib.queue_depth", "power of two"),
    (24, "queue_depth: 128", "ep.ib.queue_depth", "2*(num_max_dispatch_tokens_per_rank+1) = 258"),
    (12, "kind: sssh", "launcher.kind", "did you mean 'ssh'?"),
    (14, "port: 70000", "launcher.ssh.port", "outside 1-65535"),
    (3, "- host: 'bad host;rm'", "nodes[0].host", "not a valid host name"),
    (3, "- host: -oProxyCommand=x", "nodes[0].host", "not a valid host name"),
    (4, "gpus: all", "nodes[0].gpus", "say how many GPUs node-a has"),
    (5, "nics: {0: mlx5_0, 7: mlx5_1}", "nodes[0].nics[7]", "GPU 7 is not one of this node's GPUs"),
    (5, "nics: {0: 'mlx5 0'}", "nodes[0].nics[0]", "not a valid RDMA device name"),
    (7, "gpus: [0, 1, 1, 3]", "nodes[1].gpus[2]", "GPU 1 is listed twice"),
    (7, "gpus: [0, 1, x, 3]", "nodes[1].gpus[2]", "expected an integer"),
    (7, "gpus: 2", "nodes[1].gpus", "node 1 runs 2 ranks but node 0 runs 4"),
    (10, "master_port: 0", "rendezvous.master_port", "only works when every node is this machine"),
    (16, "NCCL_NVLS_ENABLE: 1", "env.NCCL_NVLS_ENABLE", "must be '0'"),
    (16, "CUDA_VISIBLE_DEVICES: '0'", "env.CUDA_VISIBLE_DEVICES", "use nodes[i].gpus"),
    (16, "BAD-NAME: x", "env.BAD-NAME", "not a valid environment variable name"),
    (16, "FLAG: yes", "env.FLAG", "expected a string or number"),
    (26, "builtin: bnech", "workload.builtin", "did you mean 'bench'?"),
    (27, "args: [--iters, [10]]", "workload.args[1]", "expected a string or number"),
    (1, "name: 'has space'", "name", "not a valid run name"),
]


@pytest.mark.parametrize("line,new,key,fragment", CASES, ids=[f"{c[2]}:{c[3][:20]}" for c in CASES])
def test_error_names_file_line_and_key(tmp_path, line: int, new: str, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, _replace(line, new))
    path = str(tmp_path / "cfg.yaml")
    expected_prefix = f"{path}:{line}: {key}: "
    lines = str(info.value).splitlines()
    assert any(ln.startswith(expected_prefix) and fragment in ln for ln in lines), str(info.value)
    assert isinstance(info.value, ValueError)


def test_all_problems_reported_at_once(tmp_path) -> None:
    text = _replace(19, "hidden: 1000").replace("mtu: 4096", "mtu: 1500")
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, text)
    keys = [p.key for p in info.value.problems]
    assert "ep.hidden" in keys and "ep.ib.mtu" in keys


def test_default_values_are_blamed_on_their_section(tmp_path) -> None:
    text = BASE.replace("  num_experts: 64\n", "")   # default 256 is fine for 8; make the world 24
    text = text.replace("gpus: 4", "gpus: 12").replace("gpus: [0, 1, 2, 3]", "gpus: 12")
    text = text.replace("nics: {0: mlx5_0, 1: mlx5_1}", "nics: auto")
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, text)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.startswith("ep:"))
    assert f"cfg.yaml:{line}: ep.num_experts: 256 (default) is not divisible by world size 24" in str(info.value)


def test_yaml_syntax_error_has_line(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"cfg.yaml:4: <yaml>: .*flow sequence on line 3"):
        _load(tmp_path, "name: x\nnodes:\n  - host: [a\n")
    with pytest.raises(ConfigError, match=r"cfg.yaml:3: <yaml>: mapping values are not allowed"):
        _load(tmp_path, "name: x\nep:\n  hidden: 1: 2\n")


def test_duplicate_key(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"cfg.yaml:19: ep.num_experts: duplicate key \(first given on line 18\)"):
        _load(tmp_path, BASE.replace("  num_experts: 64\n", "  num_experts: 64\n  num_experts: 32\n"))


def test_top_level_not_mapping(tmp_path) -> None:
    with pytest.raises(ConfigError, match="must be a mapping"):
        _load(tmp_path, "- a\n- b\n")


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config("/nonexistent/x.yaml", facts=FACTS)


def test_override_errors_name_the_override(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, BASE, ["ep.num_experts=250"])
    assert "override 'ep.num_experts=250': ep.num_experts: 250 is not divisible by world size 8" in str(info.value)
    with pytest.raises(ConfigError, match=r"override 'ep.timeout=5': ep.timeout: unknown key; did you mean 'timeout_us'"):
        _load(tmp_path, BASE, ["ep.timeout=5"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        _load(tmp_path, BASE, ["ep.timeout_us"])
    with pytest.raises(ConfigError, match=r"nodes\[5\]: no such list element"):
        _load(tmp_path, BASE, ["nodes[5].host=x"])


def test_local_launcher_checks_this_machine(tmp_path) -> None:
    local = "name: l\nnodes:\n  - host: localhost\n    gpus: [0, 9]\nlauncher: local\n"
    with pytest.raises(ConfigError, match=r"cfg.yaml:4: nodes\[0\].gpus\[1\]: GPU 9 is not on this machine \(it has 8"):
        _load(tmp_path, local)
    remote = "name: l\nnodes:\n  - host: elsewhere\n    gpus: 2\nlauncher: local\n"
    with pytest.raises(ConfigError, match=r"cfg.yaml:3: nodes\[0\].host: 'elsewhere' is not this machine"):
        _load(tmp_path, remote)
    cpu = "name: l\nnodes:\n  - host: localhost\n    gpus: 0\nlauncher: local\n"
    with pytest.raises(ConfigError, match=r"nodes\[0\].procs: node localhost has no GPUs"):
        _load(tmp_path, cpu)


def test_cpu_nodes_reject_gpu_only_settings(tmp_path) -> None:
    cpu = ("name: c\nnodes:\n  - {host: localhost, gpus: 0, procs: 2}\nlauncher: local\n"
           "ep:\n  backend: native\n  transport: nvlink\n  dist_backend: nccl\n  num_experts: 8\n")
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, cpu)
    text = str(info.value)
    for key in ("ep.backend", "ep.transport", "ep.dist_backend"):
        assert any(ln.split(": ")[1] == key for ln in text.splitlines() if "cfg.yaml:" in ln), key


def test_virtual_node_size_must_divide_ranks(tmp_path) -> None:
    text = BASE.replace("  num_topk: 8\n", "  num_topk: 8\n  gpus_per_virtual_node: 3\n")
    with pytest.raises(ConfigError, match=r"cfg.yaml:21: ep.gpus_per_virtual_node: 3 must be at least 1 and divide the 4"):
        _load(tmp_path, text)


def test_slurm_time_must_be_quoted(tmp_path) -> None:
    text = BASE.replace("kind: ssh\n  ssh:\n    port: 22", "kind: slurm\n  slurm:\n    time: 2:00:00")
    with pytest.raises(ConfigError, match=r"cfg.yaml:14: launcher.slurm.time: expected a quoted time"):
        _load(tmp_path, text)


def test_workload_needs_exactly_one_target(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"cfg.yaml:25: workload: give exactly one of builtin, module or script \(got builtin, module\)"):
        _load(tmp_path, BASE.replace("  builtin: bench\n", "  builtin: bench\n  module: my.mod\n"))
    with pytest.raises(ConfigError, match=r"workload.module: 'my mod' is not a Python module name"):
        _load(tmp_path, BASE.replace("  builtin: bench\n", "  module: my mod\n"))
