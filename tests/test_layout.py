"""The native low-latency buffer layout (pyep.ep.ll.layout): sizes, alignment, disjoint regions, and a model
of the kernels' slot assignment showing that every message fits its region."""
from __future__ import annotations

import random

import pytest

from pyep.ep.ll.config import EpConfig
from pyep.ep.ll.layout import size_hint
from pyep.ep.ll.layout import FETCH_BYTES, HEADER_BYTES, LLLayout, ll_buffer_bytes, ll_buffer_layout, ws_words

DEEPEP_LL_BYTES_E288 = 2_147_483_648 - 1  # "2.147 GB" for T=128, H=7168, E=288, R=8


def regions(lay: LLLayout):
    """(name, start, end) of every region, both halves, plus the fetch scratch."""
    out = []
    for h in (0, 1):
        b = lay.half_base(h)
        out += [(f"dsig{h}", b + lay.off_dsig, b + lay.off_dsig + 4 * lay.num_local_experts * lay.num_ranks),
                (f"csig{h}", b + lay.off_csig, b + lay.off_csig + 4 * lay.num_ranks),
                (f"cack{h}", b + lay.off_cack, b + lay.off_cack + 4 * lay.num_ranks),
                (f"drecv{h}", b + lay.off_drecv, b + lay.off_drecv + lay.num_ranks * lay.slots_per_src * lay.msg_bytes),
                (f"crecv{h}", b + lay.off_crecv, b + lay.off_crecv + lay.num_max_tokens * lay.max_topk * lay.msg_bytes)]
    out.append(("fetch", lay.off_fetch, lay.off_fetch + FETCH_BYTES))
    return out


SHAPES = [(128, 7168, 288, 8, 16), (128, 7168, 256, 8, 16), (1, 128, 8, 2, 1), (256, 16384, 64, 4, 8),
          (7, 384, 12, 3, 16), (33, 2048, 16, 16, 4), (128, 7168, 288, 1, 8)]


@pytest.mark.parametrize("shape", SHAPES)
def test_regions_disjoint_aligned_and_inside(shape):
    lay = ll_buffer_layout(*shape)
    regs = sorted(regions(lay), key=lambda r: r[1])
    for (n1, s1, e1), (n2, s2, e2) in zip(regs, regs[1:]):
        assert e1 <= s2, f"{n1} [{s1}, {e1}) overlaps {n2} [{s2}, {e2})"
    assert regs[-1][2] <= lay.total_bytes
    for name, start, _ in regs:
        assert start % 16 == 0, name
    assert lay.off_drecv % 4096 == 0 and lay.off_crecv % 4096 == 0 and lay.half_bytes % 4096 == 0
    assert lay.msg_bytes % 16 == 0
    # Both halves' signal ranges are what clean()/update_ep_member() zero, and hold the signals.
    for (off, size), h in zip(lay.signal_ranges, (0, 1)):
        assert off == lay.half_base(h) and off + size == lay.half_base(h) + lay.off_drecv


@pytest.mark.parametrize("shape", SHAPES)
def test_message_formats_fit_a_slot(shape):
    lay = ll_buffer_layout(*shape)
    assert lay.bf16_msg_bytes == HEADER_BYTES + 2 * lay.hidden <= lay.msg_bytes
    assert lay.fp8_msg_bytes <= lay.msg_bytes
    assert lay.fp8_msg_bytes % 16 == 0
    # Whole cache lines per slot, so payloads (at offset 0) start 128-byte aligned.
    # The slot also holds a LogFMT combine row at its largest (meta words + 2H; pyep/ep/ll/logfmt.py).
    from pyep.ep.ll.logfmt import message_bytes
    assert message_bytes(lay.hidden) <= lay.msg_bytes
    assert lay.msg_bytes % 128 == 0 and lay.msg_bytes - max(lay.bf16_msg_bytes, message_bytes(lay.hidden)) < 128
    assert lay.off_drecv % 128 == 0 and lay.off_crecv % 128 == 0
    # The header follows the payload (and the FP8 scales) without overlapping them.
    groups = lay.hidden // 128
    assert lay.header_offset(True) >= lay.hidden + 4 * groups and lay.header_offset(True) % 16 == 0
    assert lay.header_offset(False) == 2 * lay.hidden


def test_far_below_deepep_for_the_reference_shape():
    for e in (288, 256):
        total = ll_buffer_bytes(128, 7168, e, 8)
        assert total < 0.3 * DEEPEP_LL_BYTES_E288, (e, total)
    # The combine receive area is indexed by (token, top-k slot): T*K_max rows, not E*T.
    lay = ll_buffer_layout(128, 7168, 288, 8, 16)
    assert lay.half_bytes - lay.off_crecv < 128 * 16 * lay.msg_bytes + 4096
    assert lay.slots_per_src == 128 * 16


def test_size_hint_is_the_layout_size():
    assert size_hint(128, 7168, 288, 8) == ll_buffer_bytes(128, 7168, 288, 8, 16)
    cfg = EpConfig(num_max_dispatch_tokens_per_rank=64, hidden=1024, num_experts=32, max_topk=4)
    assert cfg.size_hint(4) == ll_buffer_bytes(64, 1024, 32, 4, 4)


def test_slots_per_source_bounded_by_local_experts():
    lay = ll_buffer_layout(16, 128, 8, 4, 16)   # E_l = 2 < K_max
    assert lay.slots_per_src == 16 * 2


def test_offsets_match_formulas():
    lay = ll_buffer_layout(4, 256, 8, 2, 2)
    assert lay.dsig_offset(1, 3, 1) == lay.half_bytes + lay.off_dsig + 4 * (3 * 2 + 1)
    assert lay.csig_offset(0, 1) == lay.off_csig + 4
    assert lay.drecv_offset(1, 1, 5) == lay.half_bytes + lay.off_drecv + (lay.slots_per_src + 5) * lay.msg_bytes
    assert lay.crecv_offset(0, 3, 1) == lay.off_crecv + (3 * 2 + 1) * lay.msg_bytes
    with pytest.raises(ValueError):
        lay.half_base(2)
    assert lay.cack_offset(1, 1) == lay.half_bytes + lay.off_cack + 4
    assert ws_words(8, 128, 8) == 16 + 72 + 2 * 128 * 8
    assert lay.workspace_words() == ws_words(2, 4, 2)


@pytest.mark.parametrize("bad,exc", [((128, 100, 8, 2), ValueError), ((128, 128, 9, 2), ValueError),
                                     ((0, 128, 8, 2), ValueError), ((1.0, 128, 8, 2), TypeError),
                                     ((4, 128, 8, 2, 0), ValueError), ((True, 128, 8, 2), TypeError)])
def test_bad_shapes(bad, exc):
    with pytest.raises(exc):
        ll_buffer_layout(*bad)


def _kernel_slots(topk, n_experts, n_ranks, T, active):
    """Python model of ll_dispatch.cu's sender addressing: per destination rank, messages ordered by
    (local expert, token, k); an expert's count is clamped to T. Returns {(dst, slot): (t, k)}."""
    e_l = n_experts // n_ranks
    hist = [0] * n_experts
    for row in topk:
        for e in row:
            if e >= 0 and active[e // e_l]:
                hist[e] += 1
    clamped = [min(h, T) for h in hist]
    base = [0] * (n_experts + 1)
    for e in range(n_experts):
        base[e + 1] = base[e] + clamped[e]
    seen = [0] * n_experts
    out = {}
    for t, row in enumerate(topk):
        for k, e in enumerate(row):
            if e < 0 or not active[e // e_l]:
                continue
            rank_in_expert = seen[e]
            seen[e] += 1
            if rank_in_expert >= T:
                continue
            dst = e // e_l
            slot = base[e] - base[dst * e_l] + rank_in_expert
            assert (dst, slot) not in out
            out[(dst, slot)] = (t, k)
    return out, clamped


@pytest.mark.parametrize("seed", range(6))
def test_kernel_slot_model_fits_the_region(seed):
    rng = random.Random(seed)
    n_ranks = rng.choice([1, 2, 3, 4, 8])
    e_l = rng.choice([1, 2, 3, 8])
    n_experts = n_ranks * e_l
    T = rng.choice([1, 5, 16])
    k_max = rng.choice([1, 4, 16])
    K = rng.randint(1, k_max)
    lay = ll_buffer_layout(T, 128, n_experts, n_ranks, k_max)
    n = rng.randint(0, T)
    # Repeated experts in a row (which validation rejects) are allowed here: the clamp must still keep
    # every slot inside the region.
    topk = [[rng.choice([-1] + list(range(n_experts))) for _ in range(K)] for _ in range(n)]
    active = [rng.random() > 0.2 for _ in range(n_ranks)]
    slots, clamped = _kernel_slots(topk, n_experts, n_ranks, T, active)
    for (dst, slot) in slots:
        assert 0 <= slot < lay.slots_per_src
    # The receiver's view: expert e of rank dst from this source starts at sum of counts of e' < e.
    for dst in range(n_ranks):
        per_dst = sum(clamped[dst * e_l:(dst + 1) * e_l])
        assert per_dst <= lay.slots_per_src
        assert sorted(s for (d, s) in slots if d == dst) == list(range(per_dst))
