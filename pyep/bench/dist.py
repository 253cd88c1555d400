"""The process group and device a benchmark rank runs on (`pyep bench`, both modes), the device's name
for the report, and progress lines for `pyep launch`'s bar.

`plan_distributed` checks the request against the environment (ValueError, before anything starts);
`start_distributed` then sets the device and joins the group. An existing default group is used as is.
"""
from __future__ import annotations

import datetime
import os
import platform
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple


@dataclass(frozen=True)
class DistPlan:
    backend: str          # nccl or gloo
    cuda: bool
    world: int
    rank: int
    local_rank: int
    local_world: int
    own_store: bool       # one rank and no MASTER_ADDR: a TCPStore on 127.0.0.1 instead of env://


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    if not raw.isdigit():
        raise ValueError(f"environment variable {name}={raw!r} is not a non-negative integer")
    return int(raw)


def plan_distributed(device: str, dist_backend: str, environ: Mapping[str, str]) -> Optional[DistPlan]:
    """None when a default process group exists (it is used as is); else how to start one: torchrun's
    env:// variables, or a one-rank group. `device` is auto, cuda or cpu; `dist_backend` auto, nccl or
    gloo. ValueError when they do not fit this machine or each other."""
    import torch
    import torch.distributed as dist
    if dist.is_initialized():
        return None
    world = _env_int(environ, "WORLD_SIZE", 1)
    rank = _env_int(environ, "RANK", 0)
    local_rank = _env_int(environ, "LOCAL_RANK", 0)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available to this torch")
    cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    backend = dist_backend if dist_backend != "auto" else ("nccl" if cuda else "gloo")
    if cuda and backend != "nccl":
        if device == "cuda":
            raise ValueError("--device cuda needs --dist-backend nccl (gloo groups work on CPU tensors)")
        cuda = False
    if backend == "nccl" and not cuda:
        raise ValueError("--dist-backend nccl needs a CUDA device")
    local_world = world if cuda else _env_int(environ, "LOCAL_WORLD_SIZE", world)
    return DistPlan(backend, cuda, world, rank, local_rank, local_world,
                    own_store=world == 1 and not environ.get("MASTER_ADDR"))


def start_distributed(plan: Optional[DistPlan], timeout_s: float) -> Tuple[Any, Any, bool]:
    """(group, device, owned): owned when this call created the group (the caller destroys it)."""
    import torch
    import torch.distributed as dist

    from ..ep._dist import group_device
    if plan is None:
        return dist.group.WORLD, group_device(dist.group.WORLD), False
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {}
    if plan.cuda:
        torch.cuda.set_device(plan.local_rank)
        kwargs["device_id"] = torch.device("cuda", plan.local_rank)
    else:
        # Ranks on one machine share its cores: one thread each keeps them from fighting.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, plan.local_world)))
    if plan.own_store:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
        dist.init_process_group(plan.backend, store=store, rank=0, world_size=1, timeout=timeout, **kwargs)
    else:
        dist.init_process_group(plan.backend, init_method="env://", rank=plan.rank, world_size=plan.world,
                                timeout=timeout, **kwargs)
    return dist.group.WORLD, group_device(dist.group.WORLD), True


def init_distributed(device: str, dist_backend: str, timeout_s: float,
                     environ: Mapping[str, str]) -> Tuple[Any, Any, bool]:
    """plan_distributed, then start_distributed: (group, device, owned)."""
    return start_distributed(plan_distributed(device, dist_backend, environ), timeout_s)


def device_name(device: Any) -> str:
    import torch
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()})"


def progress(done: int, total: int, label: str) -> None:
    """A PYEP_PROGRESS line (pyep.launch.progress) for the launcher's progress bar."""
    from ..launch.progress import report
    report(done, total, label)
