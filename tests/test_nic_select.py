"""NIC/port/GID selection (NCCL_IB_HCA syntax, nearest NIC per GPU, spreading) and the precedence of
explicit settings, PYEP_IB_* and NCCL_IB_* variables."""
from __future__ import annotations

import os

import pytest

from pyep.nic import NicSettings, choose_gid, choose_nics, load_host, parse_hca_filter, resolve
from pyep.nic.discover import GidEntry, Host, NicInfo, PortInfo
from pyep.nic.topology import Affinity, Distance, GpuInfo, PciDevice

HOSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hosts")


def host(name: str):
    root = os.path.join(HOSTS, name)
    return load_host(os.path.join(root, "sys"), os.path.join(root, "proc"), os.path.join(root, "dev"))


def test_hca_filter_syntax() -> None:
    f = parse_hca_filter("mlx5_0:1,mlx5_1")
    assert (f.exclude, f.exact, f.entries) == (False, False, (("mlx5_0", 1), ("mlx5_1", None)))
    assert f.matches("mlx5_0", 1) and not f.matches("mlx5_0", 2) and f.matches("mlx5_1", 2)
    assert f.matches("mlx5_10", 1)                      # prefix match without "="
    exact = parse_hca_filter("=mlx5_1")
    assert exact.matches("mlx5_1", 1) and not exact.matches("mlx5_10", 1)
    excl = parse_hca_filter("^=mlx5_2")
    assert excl.exclude and excl.exact and not excl.matches("mlx5_2", 1) and excl.matches("mlx5_0", 1)
    for bad in ("", "^", "=", "mlx5_0:0", "mlx5_0:x", "mlx5_0:256", "a b", ",,"):
        with pytest.raises(ValueError):
            parse_hca_filter(bad)
    with pytest.raises(TypeError):
        parse_hca_filter(3)  # type: ignore[arg-type]


def test_nearest_nic_per_gpu() -> None:
    h = host("ib_host")
    picks = choose_nics(h)
    assert {g: (c.nic, c.port, str(c.distance)) for g, c in picks.items()} == {
        0: ("mlx5_0", 1, "PIX/4"), 1: ("mlx5_0", 1, "PIX/4"), 2: ("mlx5_1", 1, "PIX/4"), 3: ("mlx5_1", 1, "PIX/4")}


def test_filters_pins_and_errors() -> None:
    h = host("ib_host")
    only1 = choose_nics(h, hca="=mlx5_1")
    assert {c.nic for c in only1.values()} == {"mlx5_1"}
    assert str(only1[0].distance) == "SYS"
    assert {c.nic for c in choose_nics(h, hca="^mlx5_0").values()} == {"mlx5_1"}   # mlx5_2 is DOWN
    pinned = choose_nics(h, nic_map={0: "mlx5_1"})
    assert pinned[0].nic == "mlx5_1" and pinned[0].reason == "pinned by the NIC map" and pinned[1].nic == "mlx5_0"
    with pytest.raises(ValueError, match="pinned to 'mlx5_2'"):
        choose_nics(h, nic_map={0: "mlx5_2"})
    with pytest.raises(ValueError, match="no ACTIVE RDMA port matches mlx5_2.*mlx5_2:1\\(DOWN\\)"):
        choose_nics(h, hca="mlx5_2")
    with pytest.raises(ValueError, match="port 2"):
        choose_nics(h, port=2)
    with pytest.raises(ValueError):
        choose_nics(h, gpus=[-1])


def test_equally_near_nics_are_spread() -> None:
    h = host("ib_host")
    # GPUs the tree has no PCIe position for (e.g. indices beyond it) go to the least-used NIC.
    picks = choose_nics(h, gpus=[10, 11, 12, 13])
    assert [picks[g].nic for g in (10, 11, 12, 13)] == ["mlx5_0", "mlx5_1", "mlx5_0", "mlx5_1"]
    # Four GPUs equally near two NICs (one switch holding all six): spread 2 + 2, not 4 + 0.
    pci = PciDevice("0000:00:00.0", "pci0000:00", ("0000:00:00.0",), 0)
    ports = lambda: [_port("InfiniBand", GidEntry(0, "fe80:0000:0000:0000:0000:0000:0000:0001", "IB"))]  # noqa: E731
    nics = [NicInfo(n, "mlx5_core", "", "", "", pci, "uverbs0", ports()) for n in ("mlx5_a", "mlx5_b")]
    gpus = [GpuInfo(i, pci) for i in range(4)]
    table = Affinity({(g, n): Distance("PIX", 4) for g in range(4) for n in ("mlx5_a", "mlx5_b")})
    picks = choose_nics(Host(nics, gpus, table, None, "/synthetic"))
    assert [picks[g].nic for g in range(4)] == ["mlx5_a", "mlx5_b", "mlx5_a", "mlx5_b"]
    assert "least used of 2 equally near" in picks[1].reason


def _port(link: str, *gids: GidEntry) -> PortInfo:
    return PortInfo(1, "ACTIVE", "LinkUp", link, "", None, 0, 0, None, None, None, list(gids))


def test_gid_preference() -> None:
    h = host("roce_host")
    port = h.nics[0].ports[0]
    assert choose_gid(port).index == 3                     # RoCE v2 + IPv4-mapped
    assert choose_gid(port, 1).type == "RoCE v2"
    v6 = GidEntry(4, "2001:0db8:0000:0000:0000:0000:0000:0001", "RoCE v2")
    ll = GidEntry(1, "fe80:0000:0000:0000:ba3f:d2ff:fe10:2001", "RoCE v2")
    v1 = GidEntry(0, "fe80:0000:0000:0000:ba3f:d2ff:fe10:2001", "RoCE v1")
    assert choose_gid(_port("Ethernet", v1, ll, v6)).index == 4   # global v2 before link-local v2
    assert choose_gid(_port("Ethernet", v1, ll)).index == 1
    assert choose_gid(_port("Ethernet", v1)).index == 0
    ib = host("ib_host").nics[0].ports[0]
    assert choose_gid(ib).index == 0
    with pytest.raises(ValueError, match="GID index 5 is empty"):
        choose_gid(port, 5)
    with pytest.raises(ValueError):
        choose_gid(port, 256)
    with pytest.raises(ValueError, match="no GID"):
        choose_gid(_port("Ethernet"))


def test_settings_precedence() -> None:
    env = {"NCCL_IB_HCA": "=mlx5_1", "NCCL_IB_GID_INDEX": "3", "NCCL_IB_TC": "106", "NCCL_IB_SL": "3",
           "NCCL_IB_TIMEOUT": "22", "NCCL_IB_RETRY_CNT": "5", "PYEP_IB_SL": "4"}
    r = resolve(NicSettings(traffic_class=41), env)
    s = r.settings
    assert (s.hca, s.gid_index, s.traffic_class, s.sl, s.timeout, s.retry_cnt, s.rnr_retry, s.mtu) == \
        ("=mlx5_1", 3, 41, 4, 22, 5, 7, 4096)
    assert r.sources == {"hca": "NCCL_IB_HCA", "gid_index": "NCCL_IB_GID_INDEX", "traffic_class": "explicit",
                         "sl": "PYEP_IB_SL", "timeout": "NCCL_IB_TIMEOUT", "retry_cnt": "NCCL_IB_RETRY_CNT",
                         "rnr_retry": "default", "mtu": "default", "port": "default"}
    d = resolve(None, {})
    assert (d.settings.timeout, d.settings.retry_cnt, d.settings.gid_index, d.settings.traffic_class) == (20, 7, None, 0)
    assert resolve(None, {"NCCL_IB_TC": "0x68"}).settings.traffic_class == 0x68


@pytest.mark.parametrize("env,match", [
    ({"NCCL_IB_SL": "16"}, "NCCL_IB_SL"), ({"NCCL_IB_TIMEOUT": "0"}, "NCCL_IB_TIMEOUT"),
    ({"NCCL_IB_RETRY_CNT": "8"}, "NCCL_IB_RETRY_CNT"), ({"NCCL_IB_GID_INDEX": "x"}, "NCCL_IB_GID_INDEX"),
    ({"PYEP_IB_MTU": "1500"}, "PYEP_IB_MTU"), ({"NCCL_IB_TC": "-1"}, "NCCL_IB_TC"),
])
def test_bad_environment_names_the_variable(env, match) -> None:
    with pytest.raises(ValueError, match=match):
        resolve(None, env)


def test_bad_explicit_settings() -> None:
    with pytest.raises(ValueError, match="explicit"):
        resolve(NicSettings(sl=20), {})
    with pytest.raises(TypeError):
        resolve(NicSettings(timeout="20"), {})  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        resolve(NicSettings(hca="  "), {})
    with pytest.raises(TypeError):
        resolve({"sl": 1}, {})  # type: ignore[arg-type]
