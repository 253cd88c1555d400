"""NIC settings and where each value came from.

Users of NCCL already set NCCL_IB_HCA, NCCL_IB_GID_INDEX, NCCL_IB_TC, NCCL_IB_SL, NCCL_IB_TIMEOUT and
NCCL_IB_RETRY_CNT for their fabric; pyep honours them as defaults. Precedence, highest first:
  1. values passed explicitly (pyep's API / YAML config),
  2. pyep's environment variables (PYEP_IB_*; `pyep launch` exports the config's ib section this way),
  3. the NCCL_IB_* variables,
  4. built-in defaults.
Every value is range-checked; a bad one raises ValueError naming the variable it came from.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Dict, Mapping, Optional, Tuple

# field -> (pyep variable, NCCL variable, default, (min, max) or None for strings)
_SPEC: Dict[str, Tuple[str, Optional[str], object, Optional[Tuple[int, int]]]] = {
    "hca": ("PYEP_IB_HCA", "NCCL_IB_HCA", None, None),
    "gid_index": ("PYEP_IB_GID_INDEX", "NCCL_IB_GID_INDEX", None, (0, 255)),
    "traffic_class": ("PYEP_IB_TRAFFIC_CLASS", "NCCL_IB_TC", 0, (0, 255)),
    "sl": ("PYEP_IB_SL", "NCCL_IB_SL", 0, (0, 15)),
    # ack timeout exponent: 4.096 us * 2^t per try. 0 would mean "wait forever", which pyep never does.
    "timeout": ("PYEP_IB_TIMEOUT", "NCCL_IB_TIMEOUT", 20, (1, 31)),
    "retry_cnt": ("PYEP_IB_RETRY_CNT", "NCCL_IB_RETRY_CNT", 7, (0, 7)),
    "rnr_retry": ("PYEP_IB_RNR_RETRY", None, 7, (0, 7)),
    "mtu": ("PYEP_IB_MTU", None, 4096, (256, 4096)),
    "port": ("PYEP_IB_PORT", None, None, (1, 255)),
}
_MTUS = (256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class NicSettings:
    """Explicit settings; None = not set here (fall through to the environment / defaults)."""
    hca: Optional[str] = None          # device name, or an NCCL_IB_HCA-style filter
    gid_index: Optional[int] = None    # None = automatic (RoCE v2 IPv4-mapped first)
    traffic_class: Optional[int] = None
    sl: Optional[int] = None
    timeout: Optional[int] = None
    retry_cnt: Optional[int] = None
    rnr_retry: Optional[int] = None
    mtu: Optional[int] = None
    port: Optional[int] = None         # None = every port (the selection picks an ACTIVE one)


@dataclass(frozen=True)
class Resolved:
    settings: NicSettings              # every field decided (hca/gid_index/port may stay None = automatic)
    sources: Dict[str, str]            # field -> "explicit", a variable name, or "default"

    def describe(self) -> Dict[str, str]:
        return {f: f"{getattr(self.settings, f)!r} ({self.sources[f]})" for f in self.sources}


def _check(name: str, source: str, value: object) -> object:
    spec = _SPEC[name][3]
    if spec is None:
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"{source}: {name} must be a non-empty string, got {value!r}")
        return value.strip() if isinstance(value, str) else value
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{source}: {name} must be an integer, got {type(value).__name__}")
    lo, hi = spec
    if not lo <= value <= hi:
        raise ValueError(f"{source}: {name}={value} is outside [{lo}, {hi}]")
    if name == "mtu" and value not in _MTUS:
        raise ValueError(f"{source}: mtu={value} is not one of {', '.join(map(str, _MTUS))}")
    return value


def _from_env(name: str, var: str, raw: str) -> object:
    if _SPEC[name][3] is None:
        return _check(name, f"environment variable {var}", raw)
    text = raw.strip()
    try:
        value = int(text, 0) if text.lower().startswith("0x") else int(text, 10)
    except ValueError:
        raise ValueError(f"environment variable {var}={raw!r} is not an integer") from None
    return _check(name, f"environment variable {var}", value)


def resolve(explicit: Optional[NicSettings] = None, environ: Optional[Mapping[str, str]] = None) -> Resolved:
    explicit = explicit or NicSettings()
    if not isinstance(explicit, NicSettings):
        raise TypeError(f"explicit settings must be a NicSettings, got {type(explicit).__name__}")
    env = os.environ if environ is None else environ
    values: Dict[str, object] = {}
    sources: Dict[str, str] = {}
    for f in fields(NicSettings):
        pyep_var, nccl_var, default, _ = _SPEC[f.name]
        given = getattr(explicit, f.name)
        if given is not None:
            values[f.name], sources[f.name] = _check(f.name, "explicit setting", given), "explicit"
        elif env.get(pyep_var, "").strip():
            values[f.name], sources[f.name] = _from_env(f.name, pyep_var, env[pyep_var]), pyep_var
        elif nccl_var and env.get(nccl_var, "").strip():
            values[f.name], sources[f.name] = _from_env(f.name, nccl_var, env[nccl_var]), nccl_var
        else:
            values[f.name], sources[f.name] = default, "default"
    return Resolved(NicSettings(**values), sources)  # type: ignore[arg-type]
