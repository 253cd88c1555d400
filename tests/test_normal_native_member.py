"""The native normal backend's rejoin arithmetic (pyep/ep/normal/native_member.py), checked without a GPU:
the gate flags a survivor sets for a restarted rank, and those the newcomer sets for every survivor, must
be what a peer in step shows before the next call -- checked against engine/kernels/normal_tags.h's own
gate_classify, compiled with g++, along call numbers from the first call to across the 2^32 wrap. The
device side (a rank killed and restarted in the drill) runs on the GPU."""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any, List

import pytest

from pyep.ep.normal.native_member import flags_in_step, next_call

SEQS: List[int] = [0, 1, 2, 3, 4, 41, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFD, 0xFFFFFFFE, 0xFFFFFFFF]


def test_next_call_matches_the_kernels() -> None:
    assert [next_call(s) for s in (0, 1, 41, 0xFFFFFFFE, 0xFFFFFFFF)] == [1, 2, 42, 0xFFFFFFFF, 2]


def test_flags_in_step_against_gate_classify(tmp_path: Any) -> None:
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to compile engine/kernels/normal_tags.h on the host")
    rows = []
    for s in SEQS:
        f = flags_in_step(s)
        rows.append(f"{{{s}u, {f[0]}u, {f[1]}u}}")
    src = tmp_path / "flags.cpp"
    src.write_text(r"""
#include <cstdio>
#include "kernels/normal_tags.h"
using namespace pyep::normal;
struct Row { uint32_t seq, f0, f1; };
int main() {
    const Row rows[] = {""" + ", ".join(rows) + r"""};
    int bad = 0;
    for (const Row& r : rows) {
        const uint32_t nxt = next_call(r.seq);
        const uint32_t mine = (nxt & 1u) ? r.f1 : r.f0, other = (nxt & 1u) ? r.f0 : r.f1;
        // Before the peer posts the next call it is waited for; once it posts it, it has arrived.
        if (gate_classify(mine, other, nxt) != kGateWait) { std::printf("seq %u: not waited for\n", r.seq); ++bad; }
        if (gate_classify(nxt, other, nxt) != kGateArrived) { std::printf("seq %u: not arrived\n", r.seq); ++bad; }
        // And the call after: the peer in step again (its flags now hold the next call).
        const uint32_t nxt2 = next_call(nxt);
        if (gate_classify(other, nxt, nxt2) != kGateWait) { std::printf("seq %u: call after\n", r.seq); ++bad; }
    }
    std::printf("%s\n", bad ? "FAIL" : "OK");
    return bad ? 1 : 0;
}
""")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    exe = tmp_path / "flags"
    subprocess.run(["g++", "-std=c++17", "-O1", "-I", os.path.join(root, "engine"), str(src), "-o", str(exe)],
                   check=True, capture_output=True, timeout=120)
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr


def test_setup_links_sequence_without_a_gpu(monkeypatch: Any) -> None:
    """_setup_links with the engine and the links faked: a first process connects, checks the plan
    (NVLink only), fills peer_base, builds the static and meets the others at a barrier (the store's for a
    store-based buffer, the group's bounded one otherwise); a restarted rank only announces itself
    (prepare_join) and keeps a zeroed peer_base until join(); both settle the bulk-copy flags from the
    peers' descriptions."""
    from types import SimpleNamespace

    import torch

    from pyep.ep import peers as peers_mod
    from pyep.ep import _dist
    from pyep.ep.normal.native import NormalNativeBackend
    from pyep.transport.base import PeerLink
    calls: List[Any] = []

    class FakePeers:
        def __init__(self, control: Any, cfg: Any, ep: Any, rank: int, n: int, dev: int, buf: int, size: int,
                     timeout_s: float) -> None:
            calls.append(("PeerSet", control, cfg.transport))
            self.links = [PeerLink(rank=r, kind="local" if r == rank else "nvlink", store_base=1000 + r) for r in range(n)]
            self.infos = [SimpleNamespace(buffer_bytes=size, host="h", pci_bus_id=f"0000:{r:02x}:00.0") for r in range(n)]

        def connect(self) -> None:
            calls.append("connect")

        def prepare_join(self) -> bytes:
            calls.append("prepare_join")
            return b"announce"
    monkeypatch.setattr(peers_mod, "PeerSet", FakePeers)
    monkeypatch.setattr(_dist, "barrier_bounded", lambda *a, **k: calls.append(("group barrier", a[3])))
    monkeypatch.setattr(_dist, "group_device", lambda g: torch.device("cpu"))

    class Control:
        def barrier(self, timeout_s: float, what: str) -> None:
            calls.append(("store barrier", what))

    def backend() -> Any:
        b = NormalNativeBackend.__new__(NormalNativeBackend)
        b.rank, b.num_ranks, b.device, b._ep, b._buf, b._bytes = 1, 3, torch.device("cpu"), None, 0, 0
        b._setup_timeout_s, b.group, b._pool, b._tma_setting = 5.0, "G", None, "1"
        b._tma_dispatch = b._tma_combine = -1
        b._make_static = lambda: calls.append("static") or "S"
        return b
    b = backend()
    b._setup_links("G", None, False)
    assert calls == [("PeerSet", "G", "nvlink"), "connect", "static",
                     ("group barrier", "normal-mode buffer setup (every rank mapped its peers)")]
    assert b._peer_base.tolist() == [1000, 1001, 1002] and b._static == "S"
    assert (b._tma_dispatch, b._tma_combine) == (0, 0)   # peers on other GPUs: the warps' own copies
    calls.clear()
    c = Control()
    b = backend()
    b._setup_links(None, c, False)
    assert calls[0] == ("PeerSet", c, "nvlink") and calls[-1] == ("store barrier",
                                                                  "normal-mode buffer setup (every rank mapped its peers)")
    calls.clear()
    b = backend()
    b._setup_links(None, c, True)
    assert calls == [("PeerSet", c, "nvlink"), "prepare_join", "static"]
    assert b.member_payload() == b"announce" and b._peer_base.tolist() == [0, 0, 0]
    assert (b._tma_dispatch, b._tma_combine) == (0, 0)


def test_grace_window_counts_calls() -> None:
    """A store-based native buffer's first calls and those after an admission run with at least
    REJOIN_CALL_TIMEOUT_US (the kernels read it from the static they are launched with); then the
    buffer's own timeout again."""
    from types import SimpleNamespace

    from pyep.ep.elastic.membership import REJOIN_CALL_TIMEOUT_US, REJOIN_GRACE_CALLS
    from pyep.ep.normal.native import NormalNativeBackend
    b = NormalNativeBackend.__new__(NormalNativeBackend)
    b.timeout_us, b._static = 50_000, SimpleNamespace(timeout_ns=0)
    b._call_timeout()
    assert b._static.timeout_ns == 50_000_000          # no window open: the buffer's timeout
    b.open_grace()
    seen = []
    for _ in range(2 * REJOIN_GRACE_CALLS + 2):
        b._call_timeout()
        seen.append(b._static.timeout_ns)
    assert seen == [REJOIN_CALL_TIMEOUT_US * 1000] * (2 * REJOIN_GRACE_CALLS) + [50_000_000] * 2


def _member_backend(monkeypatch: Any, rank: int = 0, n: int = 3, seq: int = 41) -> Any:
    """A NormalNativeBackend's membership side over CPU tensors: the control words of its buffer as an int32
    tensor (layout.control_words), a faked PeerSet; the device's call number `seq`."""
    import torch

    from pyep.ep.normal import layout
    from pyep.ep.normal.native import NormalNativeBackend
    from pyep.transport.base import PeerLink
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    b = NormalNativeBackend.__new__(NormalNativeBackend)
    b.rank, b.num_ranks, b.device, b._extra, b._epoch = rank, n, torch.device("cpu"), 0, 3
    words = torch.full((layout.control_words(n)["end"],), 7, dtype=torch.int32)
    b._words = lambda: words
    b._ws = torch.zeros(8, dtype=torch.int32)
    b._ws[1] = seq
    b._mask = torch.tensor([1] * n, dtype=torch.int32)
    b._peer_base = torch.tensor([1000 + r for r in range(n)], dtype=torch.int64)

    class Peers:
        def __init__(self) -> None:
            self.links = [PeerLink(rank=r, kind="nvlink", store_base=1000 + r) for r in range(n)]

        def rebuild_peer(self, r: int, payload: bytes) -> bytes:
            self.links[r] = PeerLink(rank=r, kind="nvlink", store_base=5000 + r)
            return b"blob"
    b._peers = Peers()
    return b, words


def test_survivor_restarts_only_the_streams_shared_with_the_restarted_rank(monkeypatch: Any) -> None:
    from pyep.ep.normal import layout
    from pyep.ep.normal.limits import MAX_CHANNELS
    b, w = _member_backend(monkeypatch, rank=0, n=3, seq=41)
    b._mask[2] = 0                                     # rank 2 died and was marked
    assert b.prepare_peer(2, b"payload") == b"blob"
    assert b._peer_base.tolist() == [1000, 1001, 5002]  # only its entry of the peer table moved
    off = layout.control_words(3)
    for name in ("tail", "head", "tx_pos", "rx_pos"):
        col = w[off[name]:off[name] + MAX_CHANNELS * 3].view(MAX_CHANNELS, 3)
        assert col[:, 2].tolist() == [0] * MAX_CHANNELS, name          # its streams restart at 0
        assert col[:, :2].eq(7).all(), name                             # the others' are untouched
    pulled = w[off["pulled"]:off["pulled"] + 2 * MAX_CHANNELS * 3].view(2 * MAX_CHANNELS, 3)
    assert pulled[:, 2].tolist() == [0] * (2 * MAX_CHANNELS) and pulled[:, :2].eq(7).all()   # pull combine words
    b.activate_peer(2, None)
    flags = w[off["notify_flag"]:off["notify_flag"] + 6].view(2, 3)
    want = flags_in_step(41)                           # in step before call 42: (40, 41) by parity
    assert flags[:, 2].tolist() == [want[0], want[1]] == [40, 41]
    assert flags[:, :2].eq(7).all() and b._mask.tolist() == [1, 1, 1]


def test_newcomer_takes_the_survivors_counters(monkeypatch: Any) -> None:
    from pyep.ep.normal import layout
    b, w = _member_backend(monkeypatch, rank=2, n=3, seq=0)
    survivor, _ = _member_backend(monkeypatch, rank=0, n=3, seq=0xFFFFFFFF - 2**32)   # -1 as int32: 0xffffffff
    assert survivor.step_state() == (3, 0xFFFFFFFF)
    b.take_step_state(*survivor.step_state())
    assert (int(b._ws[1]) & 0xFFFFFFFF, int(b._ws[2])) == (0xFFFFFFFF, 3) and b._epoch == 3
    off = layout.control_words(3)["notify_flag"]
    flags = w[off:off + 6].view(2, 3)
    want = flags_in_step(0xFFFFFFFF)                   # next call is 2 (the wrap skips 0)
    for src in (0, 1):
        assert [v & 0xFFFFFFFF for v in flags[:, src].tolist()] == [want[0], want[1]]
    assert flags[:, 2].eq(7).all()                     # its own column is not a peer's
    assert b._grace_left > 0                           # the grace window is open


@pytest.mark.parametrize("rank, back, moved", [(0, [2], [2]), (2, [2], [0, 1]), (1, [0, 2], [0, 2])])
def test_live_rank_taken_back_restarts_the_shared_streams_on_both_sides(monkeypatch: Any, rank: int,
                                                                       back: List[int], moved: List[int]) -> None:
    """A group's unmask (the DeepEP shim's): a survivor restarts only its streams with the ranks it takes
    back and sets their flags in step; the rank taken back (its own entry came back) does so with every
    peer; the call number is untouched (every rank advanced it through the masked calls)."""
    from pyep.ep.normal import layout
    from pyep.ep.normal.limits import MAX_CHANNELS
    b, w = _member_backend(monkeypatch, rank=rank, n=3, seq=41)
    b.take_back(back)
    off = layout.control_words(3)
    for name in ("tail", "head", "tx_pos", "rx_pos"):
        col = w[off[name]:off[name] + MAX_CHANNELS * 3].view(MAX_CHANNELS, 3)
        for p in range(3):
            assert col[:, p].eq(0 if p in moved else 7).all(), (name, p)
    flags = w[off["notify_flag"]:off["notify_flag"] + 6].view(2, 3)
    for p in range(3):
        assert flags[:, p].tolist() == ([40, 41] if p in moved else [7, 7]), p
    assert int(b._ws[1]) == 41


def test_peer_words_report_the_streams_and_flags_shared_with_a_peer(monkeypatch: Any) -> None:
    from pyep.ep.normal import layout
    b, w = _member_backend(monkeypatch, rank=0, n=3, seq=41)
    b.take_back([2])
    off = layout.control_words(3)
    w[off["tail"] + 1 * 3 + 1] = 5                      # channel 1, peer 1
    got = b.peer_words(2, channels=2)
    assert got["tail"] == got["rx_pos"] == [0, 0] and got["flags"] == [40, 41] and got["workspace"][1] == 41
    assert b.peer_words(1, channels=2)["tail"] == [7, 5]
