"""Ranks that share a GPU: which GPU a rank takes, whether the CUDA MPS daemon lets their kernels run
side by side, how the group's devices are laid out, and how a run is named in the report.

With more ranks on a node than GPUs, rank r runs on cuda:(r % GPUs), the group is gloo (NCCL refuses two
ranks on one GPU) and the benchmark's own collectives stage CUDA tensors through host memory (sync.py).
Kernels of different processes on one GPU run at the same time only under MPS; without it the GPU
time-slices between the processes and every figure counts the other ranks' slices. The report says
which it was (`MpsStatus`), from `nvidia-cuda-mps-control`'s server list, else CUDA_MPS_PIPE_DIRECTORY.
"""
from __future__ import annotations

import math
import os
import platform
import shutil
import socket
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional

if TYPE_CHECKING:
    import torch

    from .sync import Sync

MPS_CONTROL = "nvidia-cuda-mps-control"
# Fields of a device identity as gathered (kept short: Sync.gather_strings carries 256 bytes).
_SEP = "\t"


def device_for_rank(local_rank: int, gpus: int) -> int:
    """The CUDA device index of a rank: local rank modulo the visible GPUs."""
    if gpus < 1:
        raise ValueError(f"no GPU to map local rank {local_rank} onto")
    if local_rank < 0:
        raise ValueError(f"local rank must be >= 0, got {local_rank}")
    return local_rank % gpus


def ranks_per_gpu(local_world: int, gpus: int) -> int:
    """The most ranks any one GPU carries when local_world ranks are spread round-robin."""
    if gpus < 1:
        raise ValueError("ranks_per_gpu needs at least one GPU")
    return max(1, math.ceil(local_world / gpus))


@dataclass(frozen=True)
class MpsStatus:
    """Whether the CUDA MPS daemon serves this machine's GPUs (on: None = not a CUDA run)."""
    on: Optional[bool]
    how: str

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


DEFAULT_MPS_PIPE = "/tmp/nvidia-mps"   # the daemon's pipe directory when CUDA_MPS_PIPE_DIRECTORY is unset


def detect_mps(environ: Mapping[str, str], which: Callable[[str], Optional[str]] = shutil.which,
               servers: Optional[Callable[[], List[int]]] = None, default_pipe: str = DEFAULT_MPS_PIPE) -> MpsStatus:
    """Call after this process created its CUDA context (a running daemon has then started a server for
    it). The control binary's server list wins where it names a server. When it names none (or the
    binary is missing: a container that only mounts the pipes), a pipe directory that holds the daemon's
    control pipe counts as on: several ranks asking the daemon at once were seen to get an empty list
    while their kernels ran under MPS."""
    pipe = environ.get("CUDA_MPS_PIPE_DIRECTORY", "") or default_pipe
    control = os.path.join(pipe, "control") if pipe else ""
    listed = ""
    if which(MPS_CONTROL) is not None:
        if servers is None:
            from ..ep.elastic.mps import mps_servers as servers
        pids = servers()
        if pids:
            return MpsStatus(True, f"{MPS_CONTROL} get_server_list: server pid(s) {', '.join(map(str, pids))}")
        listed = f"{MPS_CONTROL} get_server_list: no MPS server"
    if control and os.path.exists(control):
        return MpsStatus(True, f"{pipe} holds the daemon's control pipe" + (f" ({listed})" if listed else ""))
    if listed:
        return MpsStatus(False, f"{listed} and no control pipe in {pipe} (daemon not running)")
    if environ.get("CUDA_MPS_PIPE_DIRECTORY", ""):
        return MpsStatus(False, f"CUDA_MPS_PIPE_DIRECTORY={pipe} has no control pipe")
    return MpsStatus(False, f"{MPS_CONTROL} not found, CUDA_MPS_PIPE_DIRECTORY unset, no control pipe in {pipe}")


def device_identity(device: "torch.device") -> Dict[str, Any]:
    """What a rank tells the others about its device: name, a key equal for ranks on the same physical
    device (GPU uuid; the host for CPU ranks) and, on a GPU, its SM count."""
    import torch
    host = socket.gethostname()
    if device.type != "cuda":
        return {"name": f"CPU ({platform.machine()})", "key": f"{host}/cpu", "sms": 0}
    props = torch.cuda.get_device_properties(device)
    return {"name": str(props.name), "key": f"{host}/{props.uuid}", "sms": int(props.multi_processor_count)}


@dataclass
class Sharing:
    """How the group's ranks sit on devices (the same on every rank)."""
    cuda: bool
    device_names: List[str]                 # per rank
    keys: List[str]                         # per rank: equal for ranks on one physical device
    sms: int = 0                            # SMs of rank 0's GPU (0 on CPU)
    mps: MpsStatus = field(default_factory=lambda: MpsStatus(None, "not a CUDA run"))
    collectives: str = ""                   # how the group's collectives carry the benchmark's tensors

    @property
    def world_size(self) -> int:
        return len(self.keys)

    @property
    def devices_in_use(self) -> int:
        return len(set(self.keys))

    @property
    def ranks_per_device(self) -> int:
        """The most ranks on one device."""
        return max((self.keys.count(k) for k in set(self.keys)), default=1)

    @property
    def shared_gpu(self) -> bool:
        return self.cuda and self.ranks_per_device > 1

    @property
    def one_device(self) -> bool:
        """All ranks on one device (one GPU, or one host's CPU): the case the copy-rate bound describes."""
        return self.devices_in_use == 1

    @property
    def time_sliced(self) -> bool:
        """Ranks share a GPU without MPS: their kernels take turns instead of running side by side."""
        return self.shared_gpu and not self.mps.on

    def where(self) -> str:
        """'2 ranks sharing one NVIDIA H100 (MPS)', '8 ranks on 8 NVIDIA H200', '1 rank on the CPU (x86_64)'."""
        n = self.world_size
        ranks = f"{n} rank" + ("" if n == 1 else "s")
        name = self.device_names[0] if self.device_names else "?"
        if not self.cuda:
            return f"{ranks} on the {name}" if n == 1 or self.one_device else f"{ranks} on {self.devices_in_use} CPUs"
        if self.shared_gpu:
            mps = "MPS" if self.mps.on else "no MPS: time-sliced"
            gpus = "one" if self.devices_in_use == 1 else str(self.devices_in_use)
            return f"{ranks} sharing {gpus} {name} ({mps})"
        return f"{ranks} on {n} {name}" if n > 1 else f"{ranks} on {name}"

    def header_notes(self) -> List[str]:
        """Lines printed under the tables about how the ranks shared devices."""
        out: List[str] = []
        if self.shared_gpu:
            gpus = "one GPU" if self.devices_in_use == 1 else f"{self.devices_in_use} GPUs"
            out.append(f"{self.world_size} ranks on {gpus}, up to {self.ranks_per_device} per GPU: bytes move HBM "
                       f"to HBM through CUDA IPC, a proxy for NVLink; {self.collectives}")
            if self.mps.on:
                out.append(f"MPS on ({self.mps.how}): the ranks' kernels run side by side")
            else:
                out.append(f"MPS OFF ({self.mps.how}): the GPU time-slices between the ranks, so every figure "
                           f"counts the other ranks' turns; start `{MPS_CONTROL} -d` first")
        return out

    def as_dict(self) -> Dict[str, Any]:
        return {"devices_in_use": self.devices_in_use, "ranks_per_device": self.ranks_per_device,
                "shared_gpu": self.shared_gpu, "time_sliced": self.time_sliced, "sms_per_gpu": self.sms or None,
                "mps": self.mps.as_dict() if self.cuda else None, "collectives": self.collectives,
                "device_keys": self.keys}

    @staticmethod
    def gather(sync: "Sync", device: "torch.device", environ: Optional[Mapping[str, str]] = None) -> "Sharing":
        """Collective: every rank's device identity; MPS as this rank sees it."""
        me = device_identity(device)
        got = sync.gather_strings(_SEP.join((me["key"], str(me["sms"]), me["name"])), "device identities")
        keys, sms, names = [], [], []
        for text in got:
            parts = text.split(_SEP, 2)
            if len(parts) != 3 or not parts[1].isdigit():
                raise ValueError(f"a rank sent a malformed device identity {text!r}")
            keys.append(parts[0])
            sms.append(int(parts[1]))
            names.append(parts[2])
        cuda = device.type == "cuda"
        if cuda:
            import torch
            # The daemon starts a server at a client's first context: make this rank's context first, or
            # get_server_list answers "none" under a running daemon (a run reported MPS off wrongly).
            torch.empty(1, device=device)
            torch.cuda.synchronize(device)
        mps = detect_mps(os.environ if environ is None else environ) if cuda else MpsStatus(None, "not a CUDA run")
        if not cuda:
            how = f"{sync.comm.type} tensors over {sync.backend}"
        elif sync.staged:
            how = f"the benchmark's collectives go over {sync.backend}, CUDA tensors staged through host memory"
        else:
            how = f"the benchmark's collectives go over {sync.backend} on the GPUs"
        return Sharing(cuda, names, keys, sms[0] if sms else 0, mps, how)


def sm_fit(num_sms: int, ranks_on_gpu: int, gpu_sms: int) -> str:
    """'' when ranks_on_gpu ranks of num_sms SMs each fit on one GPU of gpu_sms SMs, else why not. The
    normal-mode kernels pair a sender with a receiver block per channel that wait on each other, so all
    of every rank's blocks must be resident at once; rows that do not fit are skipped, not hung."""
    if gpu_sms <= 0 or ranks_on_gpu <= 1:
        return ""
    need = num_sms * ranks_on_gpu
    if need <= gpu_sms:
        return ""
    return (f"{ranks_on_gpu} ranks x {num_sms} SMs = {need} SMs exceed the {gpu_sms} SMs of the shared GPU "
            f"(every block must be resident)")
