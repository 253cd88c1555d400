"""The process group and device a benchmark rank runs on (`pyep bench`, both modes), and progress lines
for `pyep launch`'s bar.

`plan_distributed` checks the request against the environment (ValueError, before anything starts);
`start_distributed` then sets the device and joins the group. An existing default group is used as is.
Ranks may outnumber the GPUs: they then share them (sharing.py says how, and how the report names it).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

from .sharing import device_for_rank, ranks_per_gpu


@dataclass(frozen=True)
class DistPlan:
    backend: str          # nccl or gloo
    cuda: bool
    world: int
    rank: int
    local_rank: int
    local_world: int
    own_store: bool       # one rank and no MASTER_ADDR: an in-process HashStore instead of env://
    gpus: int = 0         # CUDA devices visible to this process (0 on a CPU run)
    device_index: Optional[int] = None   # this rank's GPU: local rank % gpus

    @property
    def ranks_per_gpu(self) -> int:
        return ranks_per_gpu(self.local_world, self.gpus) if self.cuda else 0

    @property
    def shared(self) -> bool:
        """More ranks on this node than GPUs: ranks share GPUs (gloo group, data staged)."""
        return self.cuda and self.local_world > self.gpus


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    if not raw.isdigit():
        raise ValueError(f"environment variable {name}={raw!r} is not a non-negative integer")
    return int(raw)


def plan_distributed(device: str, dist_backend: str, environ: Mapping[str, str],
                     gpus: Optional[int] = None) -> Optional[DistPlan]:
    """None when a default process group exists (it is used as is); else how to start one: torchrun's
    env:// variables, or a one-rank group. `device` is auto, cuda or cpu; `dist_backend` auto, nccl or
    gloo; `gpus` the visible CUDA devices (default: torch's count). With more ranks on the node
    (LOCAL_WORLD_SIZE) than GPUs the ranks share them: rank r on cuda:(r % gpus) and a gloo group,
    the benchmark's CUDA tensors staged through host memory. ValueError when the request does not fit
    this machine or itself."""
    import torch
    import torch.distributed as dist
    if dist.is_initialized():
        return None
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = _env_int(environ, "WORLD_SIZE", 1)
    rank = _env_int(environ, "RANK", 0)
    local_rank = _env_int(environ, "LOCAL_RANK", 0)
    local_world = _env_int(environ, "LOCAL_WORLD_SIZE", world)
    if world < 1 or rank >= world:
        raise ValueError(f"RANK={rank} does not fit WORLD_SIZE={world}")
    if local_world < 1 or local_rank >= local_world:
        raise ValueError(f"LOCAL_RANK={local_rank} does not fit LOCAL_WORLD_SIZE={local_world}")
    if device == "cuda" and gpus < 1:
        raise ValueError("--device cuda: no CUDA device is available to this torch")
    cuda = gpus > 0 if device == "auto" else device == "cuda"
    if not cuda:
        if dist_backend == "nccl":
            raise ValueError("--dist-backend nccl needs a CUDA device (this run is on the CPU)")
        return DistPlan("gloo", False, world, rank, local_rank, local_world,
                        own_store=world == 1 and not environ.get("MASTER_ADDR"))
    shared = local_world > gpus
    backend = dist_backend if dist_backend != "auto" else ("gloo" if shared else "nccl")
    if backend == "nccl" and shared:
        raise ValueError(f"--dist-backend nccl: {local_world} ranks on this node but {gpus} GPU(s), and NCCL "
                         "refuses two ranks on one GPU; use --dist-backend gloo (or auto), which stages the "
                         "benchmark's CUDA tensors through host memory")
    return DistPlan(backend, True, world, rank, local_rank, local_world,
                    own_store=world == 1 and not environ.get("MASTER_ADDR"), gpus=gpus,
                    device_index=device_for_rank(local_rank, gpus))


def start_distributed(plan: Optional[DistPlan], timeout_s: float, device: str = "auto") -> Tuple[Any, Any, bool]:
    """(group, device, owned): owned when this call created the group (the caller destroys it). With an
    existing group (plan None) the data goes on the current GPU where there is one (unless `device` is
    cpu), whatever the group's backend: a gloo group then gets its tensors staged."""
    import torch
    import torch.distributed as dist

    from ..ep._dist import group_device
    if plan is None:
        group = dist.group.WORLD
        comm = group_device(group)
        if device == "cpu":
            if comm.type == "cuda":
                raise ValueError("--device cpu: the existing process group is NCCL, which carries CUDA tensors only")
            return group, torch.device("cpu"), False
        if torch.cuda.is_available():
            return group, torch.device("cuda", torch.cuda.current_device()), False
        return group, comm, False
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {}
    if plan.cuda:
        assert plan.device_index is not None
        torch.cuda.set_device(plan.device_index)
        if plan.backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", plan.device_index)
    if plan.backend != "nccl":
        # Ranks on one machine share its cores: one share each keeps them from fighting.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, plan.local_world)))
    if plan.own_store:
        # In-process: a one-rank group needs no rendezvous, and a TCPStore server would listen on every
        # interface (c10d binds them all) for as long as the bench runs (docs/elastic.md, threat model).
        store = dist.HashStore()
        dist.init_process_group(plan.backend, store=store, rank=0, world_size=1, timeout=timeout, **kwargs)
    else:
        dist.init_process_group(plan.backend, init_method="env://", rank=plan.rank, world_size=plan.world,
                                timeout=timeout, **kwargs)
    dev = torch.device("cuda", plan.device_index) if plan.cuda else torch.device("cpu")
    return dist.group.WORLD, dev, True


def init_distributed(device: str, dist_backend: str, timeout_s: float,
                     environ: Mapping[str, str]) -> Tuple[Any, Any, bool]:
    """plan_distributed, then start_distributed: (group, device, owned)."""
    return start_distributed(plan_distributed(device, dist_backend, environ), timeout_s, device)


def progress(done: int, total: int, label: str) -> None:
    """A PYEP_PROGRESS line (pyep.launch.progress) for the launcher's progress bar."""
    from ..launch.progress import report
    report(done, total, label)
