"""The provider structs as every provider binding takes and returns them (engine/bindings/
provider_dicts.h), exercised through the softnic's raw binding (the DevX binding shares the code)."""
from __future__ import annotations

import pytest

from pyep._native import load
from pyep.softnic import SoftNic, SoftNicConfig

pytestmark = pytest.mark.skipif(load() is None or not hasattr(load(), "SoftNic"),
                                reason="pyep._engine has no softnic in this build")


def test_placements_attrs_and_errors() -> None:
    nic = SoftNic(SoftNicConfig(node_id=0))
    raw = nic._n
    try:
        cq = raw.create_cq(4, "host")                      # a name ...
        cq2 = raw.create_cq(4, 0)                          # ... or its number
        assert set(cq) == {"cqn", "log_size", "cqes", "dbrec"} and cq["log_size"] == 4 and cq["cqes"]
        qp = raw.create_qp(cq["cqn"], 3, "host_mapped")
        assert set(qp) == {"qpn", "log_sq", "sq", "dbrec", "bf", "bf_size", "cqn"} and qp["cqn"] == cq["cqn"]
        with pytest.raises(ValueError, match="placement must be 'host'"):
            raw.create_cq(4, "gpu")
        with pytest.raises(ValueError, match=r"placement must be 0 \(host\)"):
            raw.create_cq(4, 7)
        with pytest.raises(TypeError, match="placement must be an int or a name"):
            raw.create_cq(4, True)
        raw.modify_qp_rst2init(qp["qpn"], 0)
        with pytest.raises(ValueError, match="unknown connect attribute 'remote_qp'"):
            raw.modify_qp_init2rtr(qp["qpn"], {"remote_qp": 1})
        with pytest.raises(ValueError, match="ack_timeout=40 exceeds 31"):
            raw.modify_qp_init2rtr(qp["qpn"], {"remote_node": 0, "remote_qpn": qp["qpn"], "ack_timeout": 40})
        with pytest.raises(ValueError, match="remote_gid must be exactly 16 bytes"):
            raw.modify_qp_init2rtr(qp["qpn"], {"remote_gid": b"\x00" * 4})
        raw.destroy_qp(qp["qpn"])
        raw.destroy_cq(cq["cqn"])
        raw.destroy_cq(cq2["cqn"])
    finally:
        nic.close()
