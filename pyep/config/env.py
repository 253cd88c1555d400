"""The environment contract between `pyep launch` and the ranks it starts.

Each rank gets the config's `env`, the mandatory NVLink-multicast switches, and these pyep variables:

- PYEP_RUN_DIR            run directory; workloads write JSON/PNG results there (logs/ holds rank logs)
- PYEP_VIRTUAL_NODE_SIZE  ranks per virtual node (ep.gpus_per_virtual_node). Ranks r and s are in the
                          same virtual node iff r // size == s // size; the EP library treats ranks in
                          different virtual nodes as remote (IBGDA, or the softnic when emulated).
- PYEP_NIC_MAP            this node's GPU->RDMA device map, "0=mlx5_0,1=mlx5_1" (absent = automatic)
- PYEP_EP_BACKEND, PYEP_EP_TRANSPORT, PYEP_EP_DIST_BACKEND, PYEP_EP_NUM_EXPERTS, PYEP_EP_HIDDEN,
  PYEP_EP_NUM_TOPK, PYEP_EP_MAX_DISPATCH_TOKENS, PYEP_EP_TIMEOUT_US
- PYEP_IB_GID_INDEX (absent = automatic), PYEP_IB_TRAFFIC_CLASS, PYEP_IB_SL, PYEP_IB_MTU,
  PYEP_IB_QPS_PER_PEER, PYEP_IB_QUEUE_DEPTH

`ep_from_env()` reads them back into an EpConfig (for workloads and the EP library), so a launched
benchmark uses the config's settings without parsing YAML.
"""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, get_args

from .._input import parse_uint
from .schema import DistBackend, EpBackend, EpConfig, IbConfig, Transport

_EP_VARS = {
    "backend": "PYEP_EP_BACKEND", "transport": "PYEP_EP_TRANSPORT", "dist_backend": "PYEP_EP_DIST_BACKEND",
    "num_experts": "PYEP_EP_NUM_EXPERTS", "hidden": "PYEP_EP_HIDDEN", "num_topk": "PYEP_EP_NUM_TOPK",
    "num_max_dispatch_tokens_per_rank": "PYEP_EP_MAX_DISPATCH_TOKENS", "timeout_us": "PYEP_EP_TIMEOUT_US",
    "gpus_per_virtual_node": "PYEP_VIRTUAL_NODE_SIZE",
}
_IB_VARS = {
    "gid_index": "PYEP_IB_GID_INDEX", "traffic_class": "PYEP_IB_TRAFFIC_CLASS", "sl": "PYEP_IB_SL",
    "mtu": "PYEP_IB_MTU", "qps_per_peer": "PYEP_IB_QPS_PER_PEER", "queue_depth": "PYEP_IB_QUEUE_DEPTH",
}
_STR_FIELDS = {"backend", "transport", "dist_backend"}


def ep_env(ep: EpConfig) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for name, var in _EP_VARS.items():
        val = getattr(ep, name)
        if val is not None:
            out[var] = str(val)
    for name, var in _IB_VARS.items():
        val = getattr(ep.ib, name)
        if val is not None:
            out[var] = str(val)
    return out


def nic_map_env(nics: object) -> Optional[str]:
    if not isinstance(nics, dict) or not nics:
        return None
    return ",".join(f"{g}={dev}" for g, dev in sorted(nics.items()))


def parse_nic_map(text: str) -> Dict[int, str]:
    """PYEP_NIC_MAP -> {gpu: device}; ValueError on anything malformed."""
    out: Dict[int, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        gpu, sep, dev = item.partition("=")
        index = parse_uint(gpu, 6)
        if not sep or index is None or not dev.strip():
            raise ValueError(f"PYEP_NIC_MAP entry {item!r} is not GPU=DEVICE")
        out[index] = dev.strip()
    return out


def ep_from_env(environ: Optional[Mapping[str, str]] = None) -> EpConfig:
    """EpConfig from PYEP_* variables; unset ones keep their defaults. ValueError names a bad variable."""
    env = os.environ if environ is None else environ

    def read(var: str, as_str: bool):
        raw = env[var]
        if as_str:
            return raw
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"environment variable {var}={raw!r} is not an integer") from None

    ep_kwargs = {name: read(var, name in _STR_FIELDS) for name, var in _EP_VARS.items() if var in env}
    ib_kwargs = {name: read(var, False) for name, var in _IB_VARS.items() if var in env}
    ep = EpConfig(**ep_kwargs, ib=IbConfig(**ib_kwargs))
    for name, choices in (("backend", EpBackend), ("transport", Transport), ("dist_backend", DistBackend)):
        if getattr(ep, name) not in get_args(choices):
            raise ValueError(f"environment variable {_EP_VARS[name]}={getattr(ep, name)!r} is not one of "
                             f"{', '.join(get_args(choices))}")
    return ep


def virtual_node_size(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """PYEP_VIRTUAL_NODE_SIZE as a positive int, None when unset."""
    env = os.environ if environ is None else environ
    raw = env.get("PYEP_VIRTUAL_NODE_SIZE")
    if raw is None or raw == "":
        return None
    size = parse_uint(raw, 9) if raw == raw.strip() else None
    if size is None or size < 1:
        raise ValueError(f"PYEP_VIRTUAL_NODE_SIZE={raw!r} must be a positive integer")
    return size
