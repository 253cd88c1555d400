"""CPU tests of the native normal buffer's ring geometry (docs/normal_mode.md, "Rings move only with Q
and H"): the slot stride follows the call's hidden size, not the largest hidden the buffer could hold
(the DeepEP shim sizes its buffer by bytes: 2e9 bytes gave 33 KB slots to 7168-wide rows, the 4-rank
FP8 fall of issue 23); a call with another ring depth or hidden than the last one synchronises the device
first, calls of one geometry never do; a change inside a CUDA graph capture is refused and changes
nothing. The kernels' side runs on the GPU (tests/test_normal_gpu.py, DeepEP's test_intranode.py)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pyep.ep.normal import layout  # noqa: E402
from pyep.ep.normal import native as intranode  # noqa: E402


def _backend(monkeypatch: Any, buffer_hidden: int = 16384) -> Any:
    b = intranode.NormalNativeBackend.__new__(intranode.NormalNativeBackend)
    b.device = torch.device("cpu")
    b.hidden = buffer_hidden
    b._geometry = None
    b._static = SimpleNamespace(slot_bytes=layout.slot_bytes(buffer_hidden))
    b.syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: b.syncs.append(device))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return b


def test_stride_follows_the_calls_hidden_not_the_buffers(monkeypatch: Any) -> None:
    b = _backend(monkeypatch, buffer_hidden=16384)
    b._settle_ring_geometry(256, 7168, "normal dispatch")
    assert b._static.slot_bytes == layout.slot_bytes(7168) == 14592
    assert b._static.slot_bytes < layout.slot_bytes(16384)
    assert b.syncs == []                                   # the first call has nothing to wait for


def test_one_geometry_never_synchronises(monkeypatch: Any) -> None:
    b = _backend(monkeypatch)
    for _ in range(5):     # FP8 / BF16 dispatch and combine calls of one model: one geometry
        b._settle_ring_geometry(256, 7168, "call")
    assert b.syncs == []
    assert b._geometry == (256, layout.slot_bytes(7168))


@pytest.mark.parametrize("change", ["hidden", "ring"])
def test_a_new_geometry_synchronises_once(monkeypatch: Any, change: str) -> None:
    b = _backend(monkeypatch)
    b._settle_ring_geometry(256, 7168, "call")
    ring, hidden = (256, 4096) if change == "hidden" else (512, 7168)
    b._settle_ring_geometry(ring, hidden, "call")
    b._settle_ring_geometry(ring, hidden, "call")
    assert b.syncs == [b.device]
    assert b._static.slot_bytes == layout.slot_bytes(hidden)
    assert b._geometry == (ring, layout.slot_bytes(hidden))


def test_a_new_geometry_inside_a_capture_is_refused_and_changes_nothing(monkeypatch: Any) -> None:
    b = _backend(monkeypatch)
    b._settle_ring_geometry(256, 7168, "call")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="ring geometry changes from 256 rows of 14592 bytes to 256 rows of"):
        b._settle_ring_geometry(256, 2048, "normal dispatch")
    assert b._geometry == (256, 14592) and b._static.slot_bytes == 14592 and b.syncs == []
    b._settle_ring_geometry(256, 7168, "call")             # the same geometry is fine inside a capture


@pytest.mark.parametrize("sms,ring", [(8, 256), (10, 256), (12, 64), (16, 64), (24, 64)])
def test_eight_ranks_default_ring_follows_the_channel_count(sms: int, ring: int) -> None:
    """At 8 ranks the default ring is 64 rows from 6 channels up, 256 below (docs/normal_mode.md, "Ring
    depth at 8 ranks"); other rank counts keep 256 at every SM count."""
    from pyep.ep.normal.config import default_config
    for combine in (False, True):
        assert default_config(8, sms, combine).num_max_nvl_chunked_recv_tokens == ring
        for ranks in (1, 2, 4):
            assert default_config(ranks, sms, combine).num_max_nvl_chunked_recv_tokens == 256
        # Across nodes (8 ranks in all) the shallow ring was never measured: the table's 256 rows.
        assert default_config(8, sms, combine, one_node=False).num_max_nvl_chunked_recv_tokens == 256


def test_size_hint_still_holds_deepep_256_row_rings_at_8_ranks() -> None:
    """The shallow default must not shrink a default-sized buffer below DeepEP's own 8-rank config."""
    from pyep.ep.normal import NormalBuffer
    from pyep.ep.normal.config import Config, default_config
    hint = NormalBuffer.size_hint(7168, 8)
    deep = Config(24, 6, 256).get_nvl_buffer_size_hint(2 * 7168, 8)
    assert hint >= deep
    assert default_config(8, 24, False).get_nvl_buffer_size_hint(2 * 7168, 8) < deep
    assert NormalBuffer.size_hint(7168, 3) == Config(NormalBuffer.num_sms).get_nvl_buffer_size_hint(2 * 7168, 3)
