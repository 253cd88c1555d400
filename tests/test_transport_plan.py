"""Transport selection of the native EP backend (pyep.transport.base): symmetric plans, virtual nodes,
and clear errors when a mode cannot connect a pair. Pure Python, no GPU."""
from __future__ import annotations

import pytest

from pyep.transport.base import RankInfo, node_ids, plan_transports


def full(n, v=1):
    return [[v] * n for _ in range(n)]


def symmetric(plan):
    return all(plan[i][j] == plan[j][i] for i in range(len(plan)) for j in range(len(plan)))


def test_auto_same_node_uses_nvlink_and_self_is_local():
    plan = plan_transports("auto", True, [0] * 4, full(4), [""] * 4)
    assert [plan[i][i] for i in range(4)] == ["local"] * 4
    assert all(plan[i][j] == "nvlink" for i in range(4) for j in range(4) if i != j)


def test_auto_cross_node_needs_a_nic():
    nodes = [0, 0, 1, 1]
    plan = plan_transports("auto", True, nodes, full(4), ["mlx5_0"] * 4)
    assert plan[0][1] == "nvlink" and plan[0][2] == "ibgda" and symmetric(plan)
    with pytest.raises(RuntimeError, match="no usable RDMA NIC"):
        plan_transports("auto", True, nodes, full(4), ["mlx5_0", "mlx5_0", "", "mlx5_0"])


def test_auto_without_nvlink_or_p2p_falls_back_to_the_nic():
    plan = plan_transports("auto", False, [0, 0], full(2), ["mlx5_0"] * 2)
    assert plan[0][1] == "ibgda"
    p2p = [[1, 0], [1, 1]]           # one direction missing: NVLink needs both
    plan = plan_transports("auto", True, [0, 0], p2p, ["mlx5_0"] * 2)
    assert plan[0][1] == plan[1][0] == "ibgda"
    with pytest.raises(RuntimeError, match="allow_nvlink=False"):
        plan_transports("auto", False, [0, 0], full(2), ["", ""])


def test_nvlink_mode_rejects_unreachable_peers():
    with pytest.raises(ValueError, match="another node"):
        plan_transports("nvlink", True, [0, 1], full(2), [""] * 2)
    with pytest.raises(ValueError, match="P2P"):
        plan_transports("nvlink", True, [0, 0], [[1, 0], [0, 1]], [""] * 2)


def test_emulated_modes():
    plan = plan_transports("emulated", True, [0] * 3, full(3), [""] * 3)
    assert all(plan[i][j] == ("local" if i == j else "emulated") for i in range(3) for j in range(3))
    plan = plan_transports("emulated-internode", True, [0, 0, 1, 1], full(4), [""] * 4)
    assert plan[0][1] == "nvlink" and plan[1][2] == "emulated" and plan[2][3] == "nvlink"
    assert symmetric(plan)


def test_unknown_mode_and_bad_sizes():
    with pytest.raises(ValueError, match="unknown transport mode"):
        plan_transports("carrier-pigeon", True, [0, 0], full(2), [""] * 2)
    with pytest.raises(ValueError, match="inconsistent sizes"):
        plan_transports("auto", True, [0, 0], full(3), [""] * 2)


def test_node_ids_hosts_and_virtual_nodes(monkeypatch):
    monkeypatch.delenv("PYEP_VIRTUAL_NODE_SIZE", raising=False)
    assert node_ids(["a", "a", "b", "b"], None) == [0, 0, 1, 1]
    assert node_ids(["b", "a", "b", "a"], None) == [0, 1, 0, 1]
    assert node_ids(["a"] * 4, 2) == [0, 0, 1, 1]
    monkeypatch.setenv("PYEP_VIRTUAL_NODE_SIZE", "1")
    assert node_ids(["a"] * 3, None) == [0, 1, 2]
    assert node_ids(["a"] * 4, 4) == [0, 0, 0, 0]      # the explicit setting wins
    monkeypatch.setenv("PYEP_VIRTUAL_NODE_SIZE", "3")
    with pytest.raises(ValueError, match="does not divide"):
        node_ids(["a"] * 4, None)
    monkeypatch.setenv("PYEP_VIRTUAL_NODE_SIZE", "zero")
    with pytest.raises(ValueError, match="positive int"):
        node_ids(["a"] * 4, None)


def test_rank_info_roundtrip_and_validation():
    info = RankInfo(rank=3, host="h", node=0, pci_bus_id="0000:18:00.0", pid=7, buffer_addr=1 << 40,
                    buffer_bytes=4096, ipc_handle="AAEC", generation=2, nic="", p2p=[1, 0])
    raw = info.encode().ljust(4096, b"\0")
    assert RankInfo.decode(raw, 3) == info
    assert info.handle_bytes() == b"\x00\x01\x02"
    with pytest.raises(ValueError, match="holds rank 3"):
        RankInfo.decode(raw, 2)
    with pytest.raises(ValueError, match="malformed"):
        RankInfo.decode(b"\0" * 16, 0)


@pytest.mark.parametrize("field,value,why", [
    ("buffer_bytes", "4096", "buffer_bytes is str"), ("buffer_bytes", -1, "buffer_bytes is negative"),
    ("buffer_bytes", True, "buffer_bytes is bool"), ("buffer_addr", 1.5, "buffer_addr is float"),
    ("host", 7, "host is int"), ("p2p", [1, 2], "p2p must hold 0 or 1"), ("p2p", "11", "p2p is str"),
    ("evil", 1, "unknown fields"), ("rank", None, "rank is NoneType")])
def test_rank_info_fields_are_checked_like_input(field, value, why):
    """A peer's description is input: a field of the wrong type or range, an unknown or a missing one is a
    ValueError naming the rank, never a TypeError from deep inside or a value used as is."""
    import json
    doc = dict(rank=3, host="h", node=-1, pci_bus_id="0000:18:00.0", pid=7, buffer_addr=1 << 40,
               buffer_bytes=4096, ipc_handle="AAEC", generation=2, nic="", p2p=[1, 0])
    data = json.dumps(doc).encode()
    assert RankInfo.decode(len(data).to_bytes(4, "little") + data, 3).node == -1   # as peers.py sends it
    doc[field] = value
    data = json.dumps(doc).encode()
    with pytest.raises(ValueError, match=f"rank 3 sent a malformed transport description: {why}"):
        RankInfo.decode(len(data).to_bytes(4, "little") + data, 3)
    del doc[field]
    if field not in ("evil", "nic", "p2p"):
        data = json.dumps(doc).encode()
        with pytest.raises(ValueError, match="missing fields"):
            RankInfo.decode(len(data).to_bytes(4, "little") + data, 3)
    with pytest.raises(ValueError, match="malformed transport description"):
        RankInfo.decode(len(b"[1,").to_bytes(4, "little") + b"[1,", 3)


def test_rank_info_checks_cover_every_field():
    """The decode checks name every RankInfo field and no other, with the JSON type of its annotation."""
    import dataclasses

    from pyep.transport import base
    names = {f.name: f.type for f in dataclasses.fields(base.RankInfo)}
    assert set(base._INFO_FIELDS) == set(names)
    for name, (kind, _) in base._INFO_FIELDS.items():
        assert str(names[name]).lower().startswith(kind.__name__), (name, names[name], kind)
