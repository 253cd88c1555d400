"""NIC discovery on saved host trees (tests/fixtures/hosts, written by tests/fixtures/make_hosts.py):
devices, ports, GIDs, PCIe distances, IBGDA readiness, and `pyep nic`."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from pyep.cli import main
from pyep.nic import SysfsView, distance, load_host
from pyep.nic.discover import roce_mtu
from pyep.nic.topology import PciDevice

HOSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hosts")


def host(name: str):
    root = os.path.join(HOSTS, name)
    return load_host(os.path.join(root, "sys"), os.path.join(root, "proc"), os.path.join(root, "dev"))


def cli_args(name: str):
    root = os.path.join(HOSTS, name)
    return ["--sysfs", os.path.join(root, "sys"), "--proc", os.path.join(root, "proc"),
            "--dev", os.path.join(root, "dev")]


def test_ib_host_devices_ports_and_affinity() -> None:
    h = host("ib_host")
    assert [n.name for n in h.nics] == ["mlx5_0", "mlx5_1", "mlx5_2"]
    assert [g.pci.address for g in h.gpus] == ["0000:18:00.0", "0000:19:00.0", "0000:9a:00.0", "0000:9b:00.0"]
    assert all(g.model == "NVIDIA H200" for g in h.gpus)
    n0, n1, n2 = h.nics
    assert (n0.pci.address, n0.pci.numa_node, n0.driver, n0.uverbs, n0.hca_type) == \
        ("0000:1a:00.0", 0, "mlx5_core", "uverbs0", "MT4129")
    p = n0.ports[0]
    assert (p.num, p.state, p.phys_state, p.link_layer, p.lid, p.rate_gbps, p.active_mtu) == \
        (1, "ACTIVE", "LinkUp", "InfiniBand", 0x11, 400.0, None)
    assert [(g.index, g.type) for g in p.gids] == [(0, "IB")]        # all-zero slots are skipped
    assert (n0.nearest_gpu, str(n0.gpu_distance)) == (0, "PIX/4")
    assert (n1.nearest_gpu, str(n1.gpu_distance)) == (2, "PIX/4")
    assert str(h.affinity.get(2, "mlx5_0")) == "SYS"                   # other socket
    assert str(h.affinity.get(0, "mlx5_2")) == "NODE"                  # other root complex, same NUMA node
    assert n0.ibgda_ready and n1.ibgda_ready
    assert not n2.ibgda_ready and n2.ibgda_blockers == ["no ACTIVE port"]


def test_roce_host_gids_mtu_and_netdev() -> None:
    h = host("roce_host")
    (nic,) = h.nics
    p = nic.ports[0]
    assert (p.link_layer, p.netdev, p.netdev_mtu, p.active_mtu) == ("Ethernet", "ens1f0np0", 9000, 4096)
    assert [(g.index, g.type, g.ipv4) for g in p.gids] == [
        (0, "RoCE v1", None), (1, "RoCE v2", None), (2, "RoCE v1", "192.168.1.10"), (3, "RoCE v2", "192.168.1.10")]
    assert nic.ibgda_ready                      # DMA-BUF (open modules, Linux 6.5) stands in for peermem
    assert h.facts.dmabuf and h.facts.peermem is None


def test_no_rdma_and_no_regkey_hosts() -> None:
    h = host("no_rdma_host")
    assert h.nics == [] and len(h.gpus) == 8
    h = host("no_regkey_host")
    for n in h.nics:
        assert not n.ibgda_ready
        assert any("PeerMappingOverride" in b for b in n.ibgda_blockers)
        assert any("memlock" in b for b in n.ibgda_blockers)


def test_missing_uverbs_node_blocks_devx(tmp_path) -> None:
    root = os.path.join(HOSTS, "ib_host")
    dev = tmp_path / "dev"
    shutil.copytree(os.path.join(root, "dev"), dev)
    os.remove(dev / "infiniband" / "uverbs1")
    h = load_host(os.path.join(root, "sys"), os.path.join(root, "proc"), str(dev))
    assert h.nic("mlx5_1").devx_access is False
    assert any("uverbs1" in b for b in h.nic("mlx5_1").ibgda_blockers)
    with pytest.raises(ValueError, match="no RDMA device named 'mlx5_9'"):
        h.nic("mlx5_9")


def test_absolute_links_are_rerooted(tmp_path) -> None:
    # A tree copied with absolute links (as `cp -a /sys` keeps them) must still resolve inside itself.
    (tmp_path / "devices" / "pci0000:00" / "0000:00:01.0").mkdir(parents=True)
    (tmp_path / "devices" / "pci0000:00" / "0000:00:01.0" / "numa_node").write_text("1\n")
    (tmp_path / "bus" / "pci" / "devices").mkdir(parents=True)
    os.symlink("/sys/devices/pci0000:00/0000:00:01.0", tmp_path / "bus" / "pci" / "devices" / "0000:00:01.0")
    view = SysfsView(str(tmp_path))
    assert view.resolve("bus/pci/devices/0000:00:01.0") == "devices/pci0000:00/0000:00:01.0"
    assert view.read_int("bus/pci/devices/0000:00:01.0/numa_node") == 1
    with pytest.raises(ValueError):
        SysfsView(str(tmp_path / "missing"))


def test_distance_classes() -> None:
    def dev(root: str, *chain: str, numa: int = 0) -> PciDevice:
        return PciDevice(chain[-1], root, tuple(chain), numa)
    gpu = dev("pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0")
    assert str(distance(gpu, dev("pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:02.0", "0000:1a:00.0"))) == "PIX/4"
    assert str(distance(gpu, dev("pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:02.0", "0000:1a:00.0",
                                 "0000:1b:00.0", "0000:1c:00.0"))) == "PXB/6"
    assert str(distance(gpu, dev("pci0000:15", "0000:15:03.0", "0000:20:00.0"))) == "PHB/6"
    assert str(distance(gpu, dev("pci0000:3a", "0000:3a:00.0", numa=0))) == "NODE"
    assert str(distance(gpu, dev("pci0000:97", "0000:97:01.0", numa=1))) == "SYS"
    assert str(distance(gpu, dev("pci0000:97", "0000:97:01.0", numa=-1))) == "SYS"


def test_roce_mtu_rule() -> None:
    assert [roce_mtu(m) for m in (9000, 4200, 4191, 1500, 1000, 300, None)] == [4096, 4096, 2048, 1024, 512, None, None]


def test_cli_nic_json_on_fixtures(capsys) -> None:
    assert main(["nic", "--json", *cli_args("roce_host")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in doc["devices"]] == ["mlx5_0"]
    assert doc["devices"][0]["gpu_distance"] == "PIX/4" and doc["devices"][0]["ibgda_ready"] is True
    assert [(s["gpu"], s["nic"], s["gid_index"], s["distance"]) for s in doc["selection"]] == \
        [(0, "mlx5_0", 3, "PIX/4"), (1, "mlx5_0", 3, "SYS")]
    assert doc["message"] is None


def test_cli_nic_tables_and_no_device(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")   # rich wraps tables to the terminal width
    assert main(["nic", *cli_args("ib_host")]) == 0
    out = capsys.readouterr().out
    for text in ("mlx5_0", "mlx5_2", "DOWN", "PIX/4", "GPU -> NIC selection", "no ACTIVE port"):
        assert text in out, text
    assert main(["nic", *cli_args("no_rdma_host")]) == 0
    out = capsys.readouterr().out
    assert "no RDMA device found" in out and "NVLink" in out


def test_cli_nic_bad_input(capsys) -> None:
    assert main(["nic", "--sysfs", "/nonexistent/sys"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["nic", "--hca", "=", *cli_args("ib_host")]) == 2
    assert main(["nic", "--gid-index", "7", *cli_args("ib_host")]) == 2
    assert "GID index 7 is empty" in capsys.readouterr().err
