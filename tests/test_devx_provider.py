"""The DevX provider binding on a machine without a NIC: it must say clearly why it cannot open, and its
bit-field convention must agree with rdma-core's own DEVX_SET (an independent oracle)."""
from __future__ import annotations

import random

import pytest

from pyep._native import engine

devx = engine().devx
needs_rdma_core = pytest.mark.skipif(not devx.has_provider, reason=getattr(devx, "unavailable", ""))


@needs_rdma_core
def test_set_field_matches_rdma_core_devx_set() -> None:
    rng = random.Random(7)
    buf = bytes(64)
    for _ in range(2000):
        width = rng.randint(1, 32)
        bit_off = rng.randrange(0, 16) * 32 + rng.randint(0, 32 - width)
        value = rng.getrandbits(width)
        ours = devx.set_field(buf, bit_off, width, value)
        theirs = devx.rdma_core_set_field(buf, bit_off, width, value)
        assert ours == theirs, (bit_off, width, value)
        assert devx.get_field(ours, bit_off, width) == value
        buf = ours   # accumulate: neighbours must stay intact too


@needs_rdma_core
def test_open_without_device_explains_why() -> None:
    reason = devx.unavailable_reason("mlx5_0")
    if reason == "":
        pytest.skip("this machine has an RDMA device named mlx5_0")
    assert len(reason) > 10
    with pytest.raises(RuntimeError) as err:
        devx.DevxProvider("mlx5_0")
    msg = str(err.value)
    assert any(k in msg for k in ("not found", "ibv_get_device_list", "libibverbs", "libmlx5", "no RDMA")), msg


@needs_rdma_core
def test_constructor_validation() -> None:
    with pytest.raises(RuntimeError, match="device name"):
        devx.DevxProvider("")
    with pytest.raises(ValueError, match="port"):
        devx.DevxProvider("mlx5_0", port=0)
    with pytest.raises(ValueError, match="gid_index"):
        devx.DevxProvider("mlx5_0", gid_index=300)


def test_build_reports_provider_availability() -> None:
    from pyep import availability
    av = availability()
    assert av.rdma_core == bool(devx.has_provider)
    if not devx.has_provider:
        assert "rdma-core" in devx.unavailable
