"""tools/dev/pcsamp_by_reason.py's host-side parts on CPU: the trace stores that bound a range are found
by their slot offset, and samples are summed by reason and by PC inside it (reading a report needs
Nsight Compute, which only the GPU machines have)."""
from __future__ import annotations

from tools.dev.pcsamp_by_reason import Sample, by_pc, by_reason, trace_store_pcs

SAMPLES = [
    Sample("barrier", 0x100, 50, "BAR.SYNC.DEFER_BLOCKING 0x0"),
    Sample("selected", 0x200, 1, "@!P0 STG.E.64 desc[UR12][R4.64+0x30], R2"),      # slot 6: recv_ready
    Sample("no_instructions", 0x300, 7, "UMOV UR14, 0xffffffff"),
    Sample("long_scoreboard", 0x300, 3, "UMOV UR14, 0xffffffff"),
    Sample("long_scoreboard", 0x400, 5, "LOP3.LUT R83, R4, 0xffff0000, RZ, 0xc0, !PT"),
    Sample("selected", 0x500, 1, "@!P0 STG.E.64 desc[UR12][R4.64+0x58], R2"),      # slot 11: recv_reduced
    Sample("no_instructions", 0x600, 9, "EXIT"),
]


def test_trace_store_pcs_by_slot() -> None:
    assert trace_store_pcs(SAMPLES, 6) == [0x200]
    assert trace_store_pcs(SAMPLES, 11) == [0x500]
    assert trace_store_pcs(SAMPLES, 3) == []          # +0x18: no such store


def test_by_reason_whole_and_range() -> None:
    assert by_reason(SAMPLES) == {"barrier": 50, "selected": 2, "no_instructions": 16, "long_scoreboard": 8}
    assert by_reason(SAMPLES, 0x200, 0x500) == {"selected": 2, "no_instructions": 7, "long_scoreboard": 8}


def test_by_pc_merges_reasons_of_one_instruction() -> None:
    got = by_pc(SAMPLES, 0x300, 0x400)
    assert list(got) == [0x300, 0x400]
    sass, counts = got[0x300]
    assert sass.startswith("UMOV") and counts == {"no_instructions": 7, "long_scoreboard": 3}
