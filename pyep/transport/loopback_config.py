"""What a loopback run (pyep.transport.loopback, `pyep qp loopback`) is asked to do, and the checks that
this host can do it, made before any NIC, QP or GPU memory is set up: which NIC "auto" means here,
whether DevX can open the named devices, whether GPU posters have a CUDA build and the GPUs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Tuple

log = logging.getLogger("pyep.transport.loopback")


@dataclass(frozen=True)
class LoopbackConfig:
    nic: str = "softnic"                 # "softnic" or "devx"
    devices: Tuple[str, ...] = ()        # DevX device per endpoint (one name: both endpoints use it)
    gpus: Tuple[int, int] = (0, 0)
    poster: str = "gpu"                  # "gpu" (the loopback kernels) or "cpu" (HostQp threads)
    sizes: Tuple[int, ...] = (8, 64, 512, 4096, 65536, 1 << 20)
    tests: Tuple[str, ...] = ("lat", "bw")
    lat_iters: int = 1000
    bw_iters: int = 1000
    warmup: int = 50
    window: int = 128                    # send ring WQEBBs (= most writes outstanding)
    timeout_s: float = 10.0              # bounds every wait of a poster

    def __post_init__(self) -> None:
        if self.nic not in ("softnic", "devx"):
            raise ValueError(f"nic must be 'softnic' or 'devx', got {self.nic!r}")
        if self.poster not in ("gpu", "cpu"):
            raise ValueError(f"poster must be 'gpu' or 'cpu', got {self.poster!r}")
        if self.poster == "cpu" and self.nic != "softnic":
            raise ValueError("the CPU poster needs the softnic (a real NIC is driven by GPU threads here)")
        if self.nic == "devx" and not 1 <= len(self.devices) <= 2:
            raise ValueError("nic='devx' needs one or two device names (e.g. mlx5_0)")
        if len(self.gpus) != 2 or any(isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in self.gpus):
            raise ValueError(f"gpus must be two GPU indices, got {self.gpus!r}")
        if not self.sizes or any(isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= 1 << 30
                                 for s in self.sizes):
            raise ValueError(f"sizes must be 1 .. 2^30 bytes, got {self.sizes!r}")
        if not self.tests or any(t not in ("lat", "bw") for t in self.tests):
            raise ValueError(f"tests must be 'lat' and/or 'bw', got {self.tests!r}")
        for name, lo, hi in (("lat_iters", 1, 1 << 24), ("bw_iters", 1, 1 << 24), ("warmup", 0, 1 << 20),
                             ("window", 4, 1 << 15)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {v!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or \
                not 0 < self.timeout_s <= 3600:
            raise ValueError(f"timeout_s must be in (0, 3600] seconds, got {self.timeout_s!r}")

    @property
    def log_sq(self) -> int:
        return max(3, (self.window - 1).bit_length())

    @property
    def max_size(self) -> int:
        return max(self.sizes)


def usable_devx() -> Tuple[str, str]:
    """(device name, "") for the first RDMA device DevX can open here, else ("", why not)."""
    from .._native import load
    eng = load()
    devx = getattr(eng, "devx", None) if eng is not None else None
    if devx is None or not getattr(devx, "has_provider", False):
        return "", getattr(devx, "unavailable", "pyep._engine has no DevX provider")
    try:
        names = list(devx.device_names())
    except RuntimeError as exc:
        return "", str(exc)
    for name in names:
        if not devx.unavailable_reason(name):
            return name, ""
    return "", "no RDMA device" if not names else f"no usable RDMA device among {', '.join(names)}"


def resolve_nic(nic: str, devices: Tuple[str, ...], poster: str) -> Tuple[str, Tuple[str, ...]]:
    """(nic, devices) with nic "auto" made concrete: DevX when devices are named, or for GPU posters
    when this host has a usable RDMA device (the first one); else the softnic."""
    if nic != "auto":
        return nic, devices
    if devices:
        return "devx", devices
    if poster == "cpu":
        return "softnic", devices
    name, why = usable_devx()
    if name:
        return "devx", (name,)
    log.info("using the softnic: %s", why)
    return "softnic", ()


def check_devx(names: Tuple[str, ...]) -> None:
    """ValueError saying why DevX or one of the named devices cannot be used here."""
    from .._native import load
    eng = load()
    devx = getattr(eng, "devx", None) if eng is not None else None
    if devx is None or not getattr(devx, "has_provider", False):
        raise ValueError(getattr(devx, "unavailable", "pyep._engine has no DevX provider"))
    for name in names:
        why = devx.unavailable_reason(name)
        if why:
            raise ValueError(f"device {name} cannot be used: {why}")


def check_gpus(gpus: Tuple[int, int]) -> None:
    """RuntimeError when this installation cannot run GPU posters at all (host-only engine, no GPU);
    ValueError naming a GPU index this host does not have."""
    from .._native import load
    eng = load()
    if eng is None or not getattr(eng, "has_cuda", False) or not hasattr(eng, "launch_loop_latency"):
        raise RuntimeError("GPU posters need the CUDA build of pyep._engine (this one is host-only); "
                           "use --poster cpu for the softnic's CPU baseline")
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("GPU posters need a CUDA GPU and none is available; use --poster cpu")
    n = torch.cuda.device_count()
    bad = [g for g in gpus if g >= n]
    if bad:
        raise ValueError(f"GPU {bad[0]} does not exist (this host has {n})")
