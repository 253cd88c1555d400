"""Attribution of profiled GPU kernels to benchmark phases and iterations (synthetic kineto events:
there is no GPU in CI, the parsing of real profiles runs on the GPU machine)."""
from __future__ import annotations

import math
from types import SimpleNamespace

from pyep.bench import kineto
from pyep.bench.kineto import Kernel, Range


def _ranges():  # type: ignore[no-untyped-def]
    # Two iterations of dispatch / combine; gaps between ranges are barriers and device waits.
    return [Range("dispatch", 0, 100.0, 110.0), Range("combine", 0, 200.0, 210.0),
            Range("dispatch", 1, 300.0, 310.0), Range("combine", 1, 400.0, 410.0)]


def test_linked_kernels_go_to_the_range_of_their_launch() -> None:
    kernels = [
        Kernel("pyep_ll_dispatch_send", 112.0, 30.0, 101.0),    # runs after its range ended on the host
        Kernel("pyep_ll_dispatch_recv", 143.0, 8.0, 105.0),
        Kernel("pyep_ll_combine", 215.0, 60.0, 203.0),
        Kernel("pyep_ll_dispatch_send", 311.0, 31.0, 302.0),
        Kernel("pyep_ll_combine", 420.0, 61.0, 401.0),
        Kernel("ncclDevKernel_AllReduce_Sum_i32", 150.0, 5.0, 150.0),  # a barrier: launched outside
        Kernel("elementwise_kernel", 205.0, 2.0, 204.0),              # filtered out by name
    ]
    kw = {"dispatch": ("dispatch",), "combine": ("combine",)}
    att = kineto.attribute(_ranges(), kernels, kw)
    assert att.samples("dispatch", 2) == [38.0, 31.0]
    assert att.samples("combine", 2) == [60.0, 61.0]
    assert att.outside == 1 and att.unlinked == 0
    assert att.ignored == {"combine": {"elementwise_kernel": 1}}
    assert att.counted["dispatch"] == {"pyep_ll_dispatch_send": 2, "pyep_ll_dispatch_recv": 1}
    assert kineto.phases_without_kernels(att, ["dispatch", "combine", "dc"]) == ["dc"]


def test_unlinked_kernels_use_their_start_and_empty_filter_counts_all() -> None:
    kernels = [Kernel("ncclDevKernel_SendRecv", 120.0, 40.0, None),   # starts after its range ended
               Kernel("Memcpy DtoD", 205.0, 3.0, None),
               Kernel("early", 50.0, 1.0, None)]                      # before the first range
    att = kineto.attribute(_ranges(), kernels, {})
    assert att.samples("dispatch", 2) == [40.0, 0.0]
    assert att.samples("combine", 2) == [3.0, 0.0]
    assert att.unlinked == 3 and att.outside == 1


def test_missing_iteration_is_nan_and_range_names_roundtrip() -> None:
    att = kineto.attribute([Range("dc", 0, 0.0, 1.0)], [], {})
    assert att.samples("dc", 2)[0] == 0.0 and math.isnan(att.samples("dc", 2)[1])
    assert kineto.parse_range_name(kineto.range_name("d_send", 12)) == ("d_send", 12)
    assert kineto.parse_range_name("pyep::dispatch") is None
    assert kineto.parse_range_name("pyep_bench::x::y") is None


def _evt(name, dev, start, end, eid=0, link=0, annotation=False):  # type: ignore[no-untyped-def]
    return SimpleNamespace(name=name, device_type=f"DeviceType.{dev}", id=eid, linked_correlation_id=link,
                           is_async=False, is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start, end=end))


def test_collect_from_profiler_events() -> None:
    events = [
        _evt("pyep_bench::dispatch::0", "CPU", 100.0, 110.0, eid=7),
        _evt("pyep::dispatch", "CPU", 101.0, 109.0, eid=8),
        _evt("cudaLaunchKernel", "CPU", 102.0, 103.0, eid=900, link=8),   # runtime call: not an operator
        _evt("ll_dispatch", "CUDA", 115.0, 140.0, eid=900, link=8),
        _evt("pyep_bench::dispatch::0", "CUDA", 100.0, 141.0, annotation=True),   # gpu_user_annotation
        _evt("pyep::native::combine_recv", "CUDA", 100.0, 141.0),    # a label without the annotation flag
        _evt("orphan", "CUDA", 150.0, 151.0),
        # A non-template kernel's demangled name starts with our namespace: it is work, not a label.
        _evt("pyep::ll::(anonymous namespace)::combine(pyep::ll::LLStatic, pyep::ll::LLCombineCall)",
             "CUDA", 160.0, 170.0),
    ]
    prof = SimpleNamespace(events=lambda: events)
    ranges, kernels = kineto.collect(prof)
    assert ranges == [Range("dispatch", 0, 100.0, 110.0)]
    assert kernels[:2] == [Kernel("ll_dispatch", 115.0, 25.0, 101.0), Kernel("orphan", 150.0, 1.0, None)]
    assert len(kernels) == 3 and "combine" in kernels[2].name


def test_collect_on_a_real_cpu_profile() -> None:
    # The attributes collect() reads exist on real profiler events, and ranges come out in order.
    import torch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(2):
            with torch.profiler.record_function(kineto.range_name("dispatch", i)):
                torch.ones(4).add_(1)
    ranges, kernels = kineto.collect(prof)
    assert [(r.phase, r.iteration) for r in sorted(ranges, key=lambda r: r.start_us)] == [("dispatch", 0),
                                                                                          ("dispatch", 1)]
    first, second = sorted(ranges, key=lambda r: r.start_us)
    assert first.start_us < first.end_us <= second.start_us
    assert kernels == []
