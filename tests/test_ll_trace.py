"""pyep.ep.ll.trace: summarising per-block kernel timelines (synthetic stamps; the kernels that write
them run on the GPU machine via tools/ll_trace.py)."""
from __future__ import annotations

from pyep.ep.ll import trace as tr


def test_summarize_relative_to_first_block_and_skips_unreached() -> None:
    slots = 16
    b0 = [0] * slots
    b1 = [0] * slots
    b0[:5] = [1_000, 3_000, 10_000, 20_000, 21_000]
    b1[:5] = [2_000, 4_000, 14_000, 22_000, 22_500]     # b1 is not the last block: only b0 signals later
    b1[4] = 0
    stats = tr.summarize([b0, b1])
    by = {p.point: p for p in stats}
    assert [p.point for p in stats] == ["send_begin", "send_routed", "send_issued", "send_fenced", "send_done"]
    assert by["send_begin"].first_us == 0.0 and by["send_begin"].last_us == 1.0
    assert by["send_fenced"].blocks == 2 and by["send_fenced"].median_us == 20.0
    assert by["send_done"].blocks == 1 and by["send_done"].last_us == 20.0
    assert tr.summarize([[0] * slots]) == []


def test_summarize_on_a_common_clock() -> None:
    """Ranks sharing a GPU: a t0 taken over all of them keeps each rank's offset (its skew)."""
    slots = 16
    early = [[0] * slots]
    late = [[0] * slots]
    early[0][:2] = [1_000, 2_000]
    late[0][:2] = [4_000, 6_000]
    assert tr.first_stamp(early) == 1_000 and tr.first_stamp([[0] * slots]) == 0
    t0 = min(tr.first_stamp(early), tr.first_stamp(late))
    own = {p.point: p for p in tr.summarize(late)}
    common = {p.point: p for p in tr.summarize(late, t0)}
    assert own["send_begin"].first_us == 0.0 and own["send_routed"].first_us == 2.0
    assert common["send_begin"].first_us == 3.0 and common["send_routed"].first_us == 5.0


def test_one_clock_summary() -> None:
    r0 = [tr.PointStat("send_begin", 2, 0.0, 0.1, 0.2), tr.PointStat("send_fenced", 2, 3.0, 3.5, 6.0),
          tr.PointStat("recv_ready", 2, 20.0, 20.5, 21.0)]
    r1 = [tr.PointStat("send_begin", 2, 15.0, 15.1, 15.2), tr.PointStat("send_fenced", 2, 18.0, 18.5, 19.0),
          tr.PointStat("recv_ready", 2, 20.0, 20.2, 20.4)]
    line = tr.one_clock_summary([r0, r1])
    assert line == "start skew 15.0 us; last flags after 19.0 us, every rank ready by 20.5 us (+1.5)"
    assert tr.one_clock_summary([r0[:1], r1[:1]]) == "start skew 15.0 us"


def test_mean_stats_and_table() -> None:
    a = [tr.PointStat("send_begin", 4, 0.0, 1.0, 2.0), tr.PointStat("recv_done", 4, 10.0, 12.0, 14.0)]
    b = [tr.PointStat("send_begin", 3, 0.0, 3.0, 4.0)]
    m = tr.mean_stats([a, b])
    assert m == [tr.PointStat("send_begin", 3, 0.0, 2.0, 3.0)]
    text = tr.format_table("dispatch:", m)
    assert "send_begin" in text and "2.0" in text
    assert tr.split_kernels([[[1]], [[2]]]) == {"dispatch": [[1]], "combine": [[2]]}


def test_points_match_the_kernels_trace_point_enum() -> None:
    """POINTS is ll_launch.h's TracePoint in slot order (the kernels stamp by number, the tool names by
    position), and TIME_ORDER lists each point once."""
    import re

    from header_enums import enum_codes, header_text

    text = header_text("ll_launch.h")
    codes = enum_codes(text, "TracePoint")                       # {"TR_SEND_BEGIN": 0, ...}
    slots = {v: k[len("TR_"):].lower() for k, v in codes.items()}
    assert sorted(slots) == list(range(len(slots)))
    assert list(tr.POINTS) == [slots[i] for i in range(len(slots))]
    assert sorted(tr.TIME_ORDER) == sorted(tr.POINTS) and len(set(tr.TIME_ORDER)) == len(tr.TIME_ORDER)
    slot_count = int(re.search(r"kTraceSlots\s*=\s*(\d+)", text).group(1))
    assert len(tr.POINTS) <= slot_count
