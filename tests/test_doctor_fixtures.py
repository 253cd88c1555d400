"""`pyep doctor` on the saved hosts: PASS/WARN/FAIL per check, the fix texts, exit status, --json."""
from __future__ import annotations

import json
import os
from typing import Dict

import pytest

from pyep.cli import main
from pyep.doctor import DoctorInputs, exit_status, run_doctor
from pyep.nic.host import parse_memlock, parse_registry_dwords, read_host_facts

HOSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hosts")


def inputs(name: str) -> DoctorInputs:
    root = os.path.join(HOSTS, name)
    return DoctorInputs(os.path.join(root, "sys"), os.path.join(root, "proc"), os.path.join(root, "dev"))


def statuses(name: str) -> Dict[str, str]:
    return {c.name: c.status for c in run_doctor(inputs(name))}


def test_healthy_ib_host() -> None:
    s = statuses("ib_host")
    assert s["GPUs"] == "PASS" and s["NVIDIA driver"] == "PASS"
    assert s["P2P / NVLink"] == "SKIP" and s["CUDA IPC"] == "SKIP"          # live-only probes
    for name in ("RDMA devices", "GPU memory registration", "PeerMappingOverride", "EnableStreamMemOPs", "memlock",
                 "DevX access mlx5_0", "NIC<->GPU affinity", "IBGDA readiness"):
        assert s[name] == "PASS", name
    assert exit_status(run_doctor(inputs("ib_host"))) == 0


def test_healthy_roce_host_warns_on_cross_socket_gpu() -> None:
    checks = {c.name: c for c in run_doctor(inputs("roce_host"))}
    assert checks["GPU memory registration"].status == "PASS" and "DMA-BUF" in checks["GPU memory registration"].detail
    assert checks["NIC<->GPU affinity"].status == "WARN" and "GPU1->mlx5_0 SYS" in checks["NIC<->GPU affinity"].detail
    assert "not set" in checks["EnableStreamMemOPs"].detail
    assert exit_status(list(checks.values())) == 0


def test_host_without_rdma_says_why_and_passes() -> None:
    checks = {c.name: c for c in run_doctor(inputs("no_rdma_host"))}
    rd = checks["RDMA devices"]
    assert rd.status == "WARN" and "NIC path (IBGDA) is off" in rd.detail and "NVLink" in rd.detail
    for name in ("GPU memory registration", "PeerMappingOverride", "memlock", "DevX access"):
        assert checks[name].status == "SKIP", name
    assert "IBGDA readiness" not in checks
    assert exit_status(list(checks.values())) == 0


def test_missing_regkey_fails_with_fix() -> None:
    checks = {c.name: c for c in run_doctor(inputs("no_regkey_host"))}
    pm = checks["PeerMappingOverride"]
    assert pm.status == "FAIL" and 'NVreg_RegistryDwords="PeerMappingOverride=1;"' in pm.fix
    assert checks["memlock"].status == "FAIL" and "65536" in checks["memlock"].detail
    assert checks["IBGDA readiness"].status == "FAIL"
    assert exit_status(list(checks.values())) == 1


def test_no_peermem_no_dmabuf_fails(tmp_path) -> None:
    root = os.path.join(HOSTS, "ib_host")
    proc = tmp_path / "proc"
    import shutil
    shutil.copytree(os.path.join(root, "proc"), proc)
    (proc / "modules").write_text("nvidia 1 0 - Live 0x0\nmlx5_ib 1 0 - Live 0x0\n")
    checks = {c.name: c for c in run_doctor(DoctorInputs(os.path.join(root, "sys"), str(proc), os.path.join(root, "dev")))}
    reg = checks["GPU memory registration"]
    assert reg.status == "FAIL" and "modprobe nvidia_peermem" in reg.fix and "proprietary" in reg.detail


@pytest.mark.parametrize("name,code", [("ib_host", 0), ("roce_host", 0), ("no_rdma_host", 0), ("no_regkey_host", 1)])
def test_cli_exit_status_and_json(name: str, code: int, capsys) -> None:
    root = os.path.join(HOSTS, name)
    args = ["doctor", "--json", "--sysfs", os.path.join(root, "sys"), "--proc", os.path.join(root, "proc"),
            "--dev", os.path.join(root, "dev")]
    assert main(args) == code
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_status"] == code
    assert all(set(c) == {"name", "status", "detail", "fix"} for c in doc["checks"])
    assert main(args[:1] + args[2:]) == code                         # the rich table form
    out = capsys.readouterr().out
    assert ("check(s) failed" in out) == (code == 1)


def test_cli_rejects_bad_roots(capsys) -> None:
    assert main(["doctor", "--proc", "/nonexistent/proc"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_proc_parsers() -> None:
    assert parse_registry_dwords('RegistryDwords: "PeerMappingOverride=1;EnableStreamMemOPs=1"\nX: 1') == \
        {"PeerMappingOverride": "1", "EnableStreamMemOPs": "1"}
    assert parse_registry_dwords('RegistryDwords: ""') == {}
    assert parse_memlock("Max locked memory         8388608              8388608              bytes") == \
        (8388608, 8388608, True)
    assert parse_memlock("Max locked memory         unlimited            unlimited            bytes") == \
        (None, None, True)
    assert parse_memlock("") == (None, None, False)
    facts = read_host_facts(os.path.join(HOSTS, "roce_host", "proc"))
    assert facts.kernel == (6, 5) and facts.open_kernel_modules and facts.dmabuf and facts.peer_mapping_override
    with pytest.raises(ValueError):
        read_host_facts("/nonexistent/proc")


def test_live_host_runs_without_crashing() -> None:
    # This machine has no GPU and no NIC: doctor must say so and not fail because of it.
    checks = run_doctor()
    names = {c.name: c.status for c in checks}
    assert names["RDMA devices"] in ("WARN", "PASS") and names["GPUs"] in ("WARN", "PASS")
