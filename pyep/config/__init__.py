"""Cluster configs for `pyep launch`: schema, YAML loading with file:line errors, overrides, resolution.

    cfg = load_config("configs/two_nodes.yaml", overrides=["ep.timeout_us=5000000"])

Every problem (unknown key, wrong type, impossible value) raises ConfigError (a ValueError) whose
lines read `configs/two_nodes.yaml:12: ep.num_experts: 250 is not divisible by world size 16`. A file
that is not a regular UTF-8 file of at most MAX_CONFIG_BYTES, nests deeper than MAX_DEPTH or uses YAML
anchors/aliases raises ConfigRefused (a ConfigError) before anything is built from it.
"""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

import yaml

from .._input import FileRejected, read_text
from .convert import convert, to_plain
from .env import ep_env, ep_from_env, nic_map_env, parse_nic_map, virtual_node_size
from .host import HostFacts, valid_host
from .schema import (MANDATORY_ENV, ClusterConfig, EpConfig, IbConfig, LauncherConfig, NodeConfig,
                     RendezvousConfig, SlurmConfig, SshConfig, WorkloadConfig)
from .source import (MAX_CONFIG_BYTES, MAX_DEPTH, ConfigError, ConfigRefused, Locations, Problem, apply_override,
                     parse_yaml)
from .validate import local_default_config, resolve


def parse_config(text: str, source: str = "<config>", overrides: Iterable[str] = ()) -> Tuple[ClusterConfig, Locations]:
    """YAML text (+ overrides) -> typed ClusterConfig, not yet resolved against a machine."""
    tree, locs = parse_yaml(text, source)
    if not isinstance(tree, dict):
        raise ConfigError([Problem(f"{source}:1", "<top level>", "a config must be a mapping of sections")])
    for item in overrides:
        apply_override(tree, locs, item)
    problems: list = []
    cfg = convert(tree, ClusterConfig, (), locs, problems)
    if problems:
        raise ConfigError(problems)
    return cfg, locs


def load_config(path: Optional[str], overrides: Iterable[str] = (), facts: Optional[HostFacts] = None,
                default: Optional[ClusterConfig] = None) -> ClusterConfig:
    """Read, check and resolve a config file. `path` None starts from `default` (or the local default
    job). `facts` describes this machine; detected when omitted."""
    overrides = list(overrides)
    if path is None:
        facts = facts or HostFacts.detect()
        base = default or local_default_config(facts)
        text = yaml.safe_dump(to_plain(base), sort_keys=False)
        source = "<default config>"
    else:
        try:
            text = read_text(path, MAX_CONFIG_BYTES)
        except FileRejected as exc:
            reason = "no such config file" if exc.reason == "no such file" else exc.reason
            raise ConfigRefused([Problem(path, "<file>", reason)]) from None
        source = path
    cfg, locs = parse_config(text, source, overrides)
    return resolve(cfg, locs, facts or HostFacts.detect())


def dump_config(cfg: ClusterConfig) -> str:
    """YAML of a (resolved) config; loading it back gives the same config."""
    return yaml.safe_dump(to_plain(cfg), sort_keys=False, default_flow_style=None)




__all__ = [
    "ClusterConfig", "ConfigError", "ConfigRefused", "EpConfig", "HostFacts", "IbConfig", "LauncherConfig", "Locations",
    "MANDATORY_ENV", "MAX_CONFIG_BYTES", "MAX_DEPTH", "NodeConfig", "Problem", "RendezvousConfig", "SlurmConfig", "SshConfig",
    "WorkloadConfig", "dump_config", "ep_env", "ep_from_env", "load_config", "local_default_config",
    "nic_map_env", "parse_config", "parse_nic_map", "resolve", "valid_host", "virtual_node_size",
]
