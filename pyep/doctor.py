"""`pyep doctor`: is this host ready for pyep, and for GPU-initiated RDMA in particular?

Each check gives PASS / WARN / FAIL / SKIP, what it saw, and the fix. FAIL means something this host
evidently wants (a NIC is present) cannot work as configured; a host without any RDMA device gets WARN
there, because pyep still runs over NVLink and the softnic. Saved trees (`sysfs`, `proc`, `dev` roots)
make every check reproducible on fixtures; live-only probes (torch P2P / CUDA IPC, opening a DevX
context) run only against the live host.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

from .nic.discover import MEMLOCK_NEEDED, Host, discover
from .nic.host import HostFacts, read_host_facts
from .nic.sysfs import SysfsView

log = logging.getLogger("pyep.doctor")

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
PYVERBS_SYSTEM_PATH = "/usr/lib/python3/dist-packages"
REGKEY_FIX = ('add `options nvidia NVreg_RegistryDwords="PeerMappingOverride=1;"` to /etc/modprobe.d/nvidia.conf, '
              "then rebuild the initramfs and reboot (or reload the nvidia modules)")


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class DoctorInputs:
    sysfs: str = "/sys"
    proc: str = "/proc"
    dev: str = "/dev"
    live_probes: Optional[bool] = None   # None: only when every root is the live one

    @property
    def live(self) -> bool:
        if self.live_probes is not None:
            return self.live_probes
        return (os.path.abspath(self.sysfs), os.path.abspath(self.proc), os.path.abspath(self.dev)) == \
            ("/sys", "/proc", "/dev")


def exit_status(checks: List[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def check_gpus(host: Host, facts: HostFacts, live: bool) -> List[Check]:
    out: List[Check] = []
    torch = _torch_cuda() if live else None
    if torch is not None:
        n = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
        out.append(Check("GPUs", PASS, f"{n} visible to CUDA ({', '.join(names)}); {len(host.gpus)} on the PCI bus"))
    elif host.gpus:
        models = sorted({g.model for g in host.gpus if g.model}) or ["model unknown"]
        why = "saved tree" if not live else "torch has no CUDA here"
        out.append(Check("GPUs", PASS, f"{len(host.gpus)} NVIDIA GPUs on the PCI bus ({', '.join(models)}; {why})"))
    else:
        out.append(Check("GPUs", WARN, "no GPU: only the reference backend and CPU tests (softnic) work",
                         "run on a machine with NVIDIA GPUs"))
    if host.gpus or torch is not None:
        if facts.nvidia_driver:
            out.append(Check("NVIDIA driver", PASS, facts.nvidia_version))
        else:
            out.append(Check("NVIDIA driver", FAIL, "GPUs present but /proc/driver/nvidia is missing",
                             "install/load the NVIDIA driver (nvidia-smi must work)"))
    return out


def check_p2p(live: bool) -> List[Check]:
    torch = _torch_cuda() if live else None
    if torch is None:
        return [Check("P2P / NVLink", SKIP, "no GPU" if live else "not probed on a saved tree"),
                Check("CUDA IPC", SKIP, "no GPU" if live else "not probed on a saved tree")]
    n = torch.cuda.device_count()
    out: List[Check] = []
    if n < 2:
        out.append(Check("P2P / NVLink", SKIP, f"{n} GPU visible: nothing to pair"))
    else:
        rows, missing = [], []
        for i in range(n):
            row = ""
            for j in range(n):
                ok = i == j or torch.cuda.can_device_access_peer(i, j)
                row += "X" if i == j else ("Y" if ok else ".")
                if not ok:
                    missing.append(f"{i}->{j}")
            rows.append(f"GPU{i} {row}")
        nvlink = _nvlink_links()
        detail = "peer access matrix: " + " | ".join(rows) + (f"; {nvlink}" if nvlink else "")
        if missing:
            out.append(Check("P2P / NVLink", WARN, detail + f"; no P2P for {', '.join(missing[:8])}",
                             "ranks without P2P cannot use the NVLink path (check IOMMU/ACS settings, "
                             "nvidia-smi topo -m)"))
        else:
            out.append(Check("P2P / NVLink", PASS, detail))
    try:
        x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda:0")
        handle = x.untyped_storage()._share_cuda_()
        out.append(Check("CUDA IPC", PASS, f"cudaIpcGetMemHandle works ({len(handle)} handle fields)"))
    except Exception as exc:  # noqa: BLE001 - any failure here means IPC is unusable
        out.append(Check("CUDA IPC", FAIL, f"exporting a CUDA IPC handle failed: {exc}",
                         "containers need --ipc=host (or a shared /dev/shm) and the same GPU visibility"))
    return out


def _nvlink_links() -> str:
    import shutil
    import subprocess
    smi = shutil.which("nvidia-smi")
    if not smi:
        return ""
    try:
        res = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=20, check=False)
    except (subprocess.TimeoutExpired, OSError):
        return "nvidia-smi topo -m did not answer within 20 s"
    nv = [tok for line in res.stdout.splitlines() if line.startswith("GPU") for tok in line.split()
          if tok.startswith("NV") and tok[2:].isdigit()]
    return f"nvidia-smi topo: {len(nv)} GPU pairs over NVLink" if nv else "nvidia-smi topo: no NVLink pairs"


def check_rdma(host: Host, facts: HostFacts, live: bool) -> List[Check]:
    out: List[Check] = []
    if not host.nics:
        out.append(Check("RDMA devices", WARN,
                         f"no RDMA device under {host.sysfs_root}/class/infiniband: the NIC path (IBGDA) is off; "
                         "pyep runs over NVLink and the softnic",
                         "for multi-node runs: install a ConnectX NIC with mlx5_ib and ib_uverbs loaded"))
        for name in ("GPU memory registration", "PeerMappingOverride", "memlock", "DevX access", "NIC<->GPU affinity"):
            out.append(Check(name, SKIP, "not needed without an RDMA device"))
        return out
    active = [(n.name, p.num) for n in host.nics for p in n.ports if p.active]
    listing = ", ".join(f"{n.name}:{p.num} {p.state} {p.link_layer} {p.rate or ''}".strip()
                        for n in host.nics for p in n.ports)
    out.append(Check("RDMA devices", PASS if active else WARN, listing,
                     "" if active else "no port is ACTIVE: check cables/switch (ibstat, ip link)"))
    if not facts.nvidia_driver:
        out.append(Check("GPU memory registration", SKIP, "no NVIDIA driver"))
    elif facts.peermem:
        out.append(Check("GPU memory registration", PASS, f"{facts.peermem} loaded"))
    elif facts.dmabuf:
        out.append(Check("GPU memory registration", PASS,
                         f"DMA-BUF: open GPU kernel modules on Linux {facts.kernel_release}"))
    else:
        k = facts.kernel_release or "unknown kernel"
        out.append(Check("GPU memory registration", FAIL,
                         f"nvidia_peermem is not loaded and DMA-BUF is unavailable ({'open' if facts.open_kernel_modules else 'proprietary'} "
                         f"kernel modules, {k})",
                         "modprobe nvidia_peermem, or use the open GPU kernel modules (nvidia-open) on Linux >= 5.12"))
    if not facts.nvidia_driver:
        out.append(Check("PeerMappingOverride", SKIP, "no NVIDIA driver"))
    elif facts.peer_mapping_override:
        out.append(Check("PeerMappingOverride", PASS, "NVreg_RegistryDwords has PeerMappingOverride=1"))
    else:
        have = ";".join(f"{k}={v}" for k, v in facts.registry.items()) or "empty"
        out.append(Check("PeerMappingOverride", FAIL,
                         f"RegistryDwords is {have}: GPU threads cannot map the NIC doorbell "
                         "(cudaHostRegister(IoMemory) fails with error 800)", REGKEY_FIX))
    if facts.nvidia_driver:
        sm = facts.regkey("EnableStreamMemOPs")
        out.append(Check("EnableStreamMemOPs", PASS,
                         "set" if sm == "1" else "not set (pyep does not need it; NVSHMEM-based libraries such as "
                         "DeepEP's IBGDA mode do)"))
    if not facts.memlock_known:
        out.append(Check("memlock", WARN, "memlock limit unknown", "ulimit -l unlimited"))
    elif facts.memlock_soft is None:
        out.append(Check("memlock", PASS, "unlimited"))
    else:
        status = FAIL if facts.memlock_soft < MEMLOCK_NEEDED else WARN
        out.append(Check("memlock", status, f"{facts.memlock_soft} bytes: pinning the EP buffer and rings may fail",
                         "ulimit -l unlimited (limits.conf: `* - memlock unlimited`; docker: --ulimit memlock=-1:-1)"))
    out.extend(check_devx(host, live))
    out.append(check_affinity(host))
    ready = [n.name for n in host.nics if n.ibgda_ready]
    blocked = "; ".join(f"{n.name}: {', '.join(n.ibgda_blockers)}" for n in host.nics if not n.ibgda_ready)
    out.append(Check("IBGDA readiness", PASS if ready else FAIL,
                     (f"ready: {', '.join(ready)}" if ready else "no NIC is ready") + (f"; blocked: {blocked}" if blocked else ""),
                     "" if ready else "fix the FAIL lines above"))
    return out


def check_devx(host: Host, live: bool) -> List[Check]:
    out: List[Check] = []
    for n in host.nics:
        name = f"DevX access {n.name}"
        if not n.devx:
            out.append(Check(name, WARN, f"driver {n.driver or 'unknown'}: not an mlx5 device, no DevX",
                             "IBGDA needs a ConnectX (mlx5) NIC"))
        elif n.uverbs is None:
            out.append(Check(name, FAIL, "no uverbs device in sysfs", "modprobe ib_uverbs"))
        elif n.devx_access is False:
            out.append(Check(name, FAIL, f"/dev/infiniband/{n.uverbs} missing or not read/writable by this user",
                             "add the user to the rdma group, or pass --device=/dev/infiniband to the container"))
        elif live and n.ports and any(p.active for p in n.ports):
            out.append(_open_devx(n.name))
        else:
            out.append(Check(name, PASS, f"/dev/infiniband/{n.uverbs} accessible"
                             + ("" if live else " (context not opened on a saved tree)")))
    return out


def _open_devx(name: str) -> Check:
    from ._native import load
    mod = load()
    devx = getattr(mod, "devx", None) if mod is not None else None
    label = f"DevX access {name}"
    if devx is None or not getattr(devx, "has_provider", False):
        why = getattr(devx, "unavailable", "native engine not built") if devx is not None else "native engine not built"
        return Check(label, WARN, f"cannot open a DevX context: {why}", "build pyep where rdma-core headers exist")
    try:
        prov = devx.DevxProvider(name)
    except RuntimeError as exc:
        return Check(label, FAIL, str(exc), "see the message; `ibv_devinfo -d " + name + "` must work")
    caps = prov.hca_caps()
    del prov
    fa32 = "4-byte masked fetch-add supported" if caps["masked_fetch_add_32"] else "NO 4-byte masked fetch-add"
    return Check(label, PASS if caps["masked_fetch_add_32"] else FAIL,
                 f"DevX context opened: log_max_qp_sz {caps['log_max_qp_sz']}, log_max_msg {caps['log_max_msg']}, "
                 f"cqe_version {caps['cqe_version']}, {fa32}",
                 "" if caps["masked_fetch_add_32"] else "pyep's 32-bit signals need a ConnectX-5 or newer")


def check_affinity(host: Host) -> Check:
    if not host.gpus:
        return Check("NIC<->GPU affinity", SKIP, "no GPU on the PCI bus")
    rows, worst = [], 0
    for g in host.gpus:
        cands = [(d.rank, n, d) for n in host.nics for d in [host.affinity.get(g.index, n.name)]
                 if d is not None and any(p.active for p in n.ports)]
        if not cands:
            rows.append(f"GPU{g.index}: no active NIC")
            worst = max(worst, 4)
            continue
        _, n, d = min(cands, key=lambda c: (c[0], c[1].name))
        rows.append(f"GPU{g.index}->{n.name} {d}")
        worst = max(worst, d.rank[0])
    status = PASS if worst <= 1 else WARN
    return Check("NIC<->GPU affinity", status, "; ".join(rows),
                 "" if status == PASS else "some GPUs reach their nearest NIC through the host bridge or across "
                 "sockets; expect lower RDMA bandwidth for them")


def check_pyverbs(host: Host, live: bool) -> Check:
    mod, where = _import_pyverbs()
    if mod is None:
        return Check("pyverbs", WARN if host.nics else SKIP, f"not importable ({where}); discovery uses sysfs",
                     "apt install python3-pyverbs (it must match the system rdma-core; the PyPI sdist does not)")
    detail = f"importable from {where}"
    if live and host.nics:
        try:
            from pyverbs.device import get_device_list  # type: ignore[import-not-found]
            detail += f"; sees {len(get_device_list())} device(s)"
        except Exception as exc:  # noqa: BLE001 - pyverbs raises its own error types
            return Check("pyverbs", WARN, f"{detail}, but listing devices failed: {exc}")
    return Check("pyverbs", PASS, detail)


def _import_pyverbs():
    try:
        mod = importlib.import_module("pyverbs")
        return mod, os.path.dirname(getattr(mod, "__file__", "") or "?")
    except ImportError as exc:
        first = str(exc)
    if os.path.isdir(os.path.join(PYVERBS_SYSTEM_PATH, "pyverbs")) and PYVERBS_SYSTEM_PATH not in sys.path:
        sys.path.append(PYVERBS_SYSTEM_PATH)
        try:
            mod = importlib.import_module("pyverbs")
            return mod, PYVERBS_SYSTEM_PATH
        except ImportError as exc:
            return None, f"{first}; from {PYVERBS_SYSTEM_PATH}: {exc}"
        finally:
            sys.path.remove(PYVERBS_SYSTEM_PATH)
    return None, first


def run_doctor(inputs: DoctorInputs = DoctorInputs()) -> List[Check]:
    facts = read_host_facts(inputs.proc)
    host = discover(SysfsView(inputs.sysfs), facts, inputs.dev)
    live = inputs.live
    steps: List[Callable[[], List[Check]]] = [
        lambda: check_gpus(host, facts, live), lambda: check_p2p(live), lambda: check_rdma(host, facts, live),
        lambda: [check_pyverbs(host, live)],
    ]
    checks: List[Check] = []
    for step in steps:
        checks.extend(step())
    return checks


def as_json(checks: List[Check]) -> List[dict]:
    return [asdict(c) for c in checks]
