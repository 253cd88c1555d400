"""PYEP_NORMAL_TMA (native_state.bulk_copy_setting / bulk_copy_flags): which row copies of the intranode normal kernels go by
the SM's bulk copy engine. The flags must be those of normal_tma.cuh (kTmaLocal = 1, kTmaPeer = 2)."""
from __future__ import annotations

import os
import re
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_settings(monkeypatch: Any) -> None:
    from pyep.ep.normal.native_state import TMA_LOCAL, TMA_PEER, bulk_copy_flags, bulk_copy_setting
    monkeypatch.delenv("PYEP_NORMAL_TMA", raising=False)
    assert bulk_copy_setting() == "1"
    both = TMA_LOCAL | TMA_PEER
    # (setting, (dispatch, combine) when every peer shares this GPU, the same when some peer is on another GPU)
    for value, shared, apart in (("1", (both, both), (0, 0)), ("all", (both, both), (both, both)),
                                 ("0", (0, 0), (0, 0)), ("local", (TMA_LOCAL,) * 2, (TMA_LOCAL,) * 2),
                                 ("peer", (TMA_PEER,) * 2, (TMA_PEER,) * 2),
                                 ("0/peer", (0, TMA_PEER), (0, TMA_PEER)), ("all/0", (both, 0), (both, 0)),
                                 ("local/local", (TMA_LOCAL,) * 2, (TMA_LOCAL,) * 2)):
        monkeypatch.setenv("PYEP_NORMAL_TMA", value)
        assert bulk_copy_setting() == value
        assert bulk_copy_flags(value, True) == shared, value
        assert bulk_copy_flags(value, False) == apart, value
    for bad in ("", "2", "yes", "Local", " 1", "ALL", "1/0", "0/1", "0/peer/0", "/", "0/", "peer/ 0"):
        monkeypatch.setenv("PYEP_NORMAL_TMA", bad)
        with pytest.raises(ValueError, match="PYEP_NORMAL_TMA must be"):
            bulk_copy_setting()


def test_topology_from_peer_descriptions() -> None:
    """The default's bulk copies follow the peers' (host, PCI bus id): on only when all share our GPU."""
    from types import SimpleNamespace

    from pyep.ep.normal.native_member import NativeNormalMembership
    from pyep.ep.normal.native_state import TMA_LOCAL, TMA_PEER

    def flags(buses: Any, hosts: Any = None, setting: str = "1") -> Any:
        hosts = hosts or ["h"] * len(buses)
        obj = NativeNormalMembership()
        obj.rank, obj._tma_setting = 0, setting
        obj._peers = SimpleNamespace(infos=[SimpleNamespace(host=h, pci_bus_id=b) for h, b in zip(hosts, buses)])
        obj._settle_bulk_copies()
        return obj._tma_dispatch, obj._tma_combine

    both = (TMA_LOCAL | TMA_PEER,) * 2
    assert flags(["0000:18:00.0"] * 4) == both
    assert flags(["0000:18:00.0", "0000:18:00.0".upper()]) == both   # bus ids compare caseless
    assert flags(["0000:18:00.0", "0000:2a:00.0"]) == (0, 0)
    assert flags(["0000:18:00.0"] * 2, hosts=["a", "b"]) == (0, 0)
    assert flags(["0000:18:00.0", "0000:2a:00.0"], setting="all") == both
    assert flags(["0000:18:00.0", "0000:2a:00.0"], setting="0/peer") == (0, TMA_PEER)
    assert flags(["0000:18:00.0"]) == both   # one rank


def test_flags_match_the_kernels() -> None:
    from pyep.ep.normal.native_state import TMA_LOCAL, TMA_PEER
    with open(os.path.join(ROOT, "engine", "kernels", "normal_tma.cuh")) as f:
        src = f.read()
    got = {m.group(1): int(m.group(2)) for m in re.finditer(r"constexpr int (kTma(?:Local|Peer)) = (\d+);", src)}
    assert got == {"kTmaLocal": TMA_LOCAL, "kTmaPeer": TMA_PEER}
