"""GPU tests of the native low-latency EP backend (marked `gpu`; skipped without CUDA or without the CUDA
build of pyep._engine). One process per GPU (DistPool over gloo on 127.0.0.1); with a single GPU, two
ranks share it (CUDA IPC works between processes on one device).

Matrix: 2/4/8 ranks (as many as there are GPUs, at least 2) x transports nvlink, emulated (softnic) and
mixed (two virtual nodes: NVLink inside, softnic between, once via ranks_per_node and once via
$PYEP_VIRTUAL_NODE_SIZE) x shapes (odd H=384 with partial UE8M0 words, H=7168 with K=8, H=16384 with
K=16); BF16 and FP8 in every scale mode; plain, hook and async; zero-copy; N=0, N=T, one hot expert,
mostly -1; two results in flight. Every output is compared with the reference backend (bitwise).
Then: 1000 rounds with stable checksums, the fault drill with a rejoin, CUDA-graph capture + profiler
names, bad expert ids found on the device (raised at the event wait / hook / end of the next combine),
calls one rank refuses and calls at another number (call tags), and a performance report for T=128,
H=7168, K=8, E=288.
"""
from __future__ import annotations

import logging

import pytest
from multiproc import usable_gpus

pytestmark = pytest.mark.gpu
log = logging.getLogger("tests.ep_native_gpu")


NGPU = usable_gpus("ep")
WORLDS = [w for w in (2, 4, 8) if w <= max(NGPU, 2)] if NGPU else [2]
requires_gpu = pytest.mark.skipif(NGPU == 0, reason="needs a CUDA GPU and the CUDA build of pyep._engine")


def shapes(world: int):
    # (T, H, E, K): odd group count; the DeepEP shape's H/K; the largest H with K=16.
    e288 = 288 if 288 % world == 0 else 32 * world
    return {"h384": (16, 384, 4 * world, 3), "h7168": (32, 7168, e288, 8), "h16384": (8, 16384, 16, 16)}


TRANSPORTS = {
    "nvlink": ("nvlink", None, None),
    "emulated": ("emulated", None, None),
    "mixed": ("emulated-internode", "half", None),
    "mixed-env": ("emulated-internode", None, "half"),
}


@requires_gpu
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("shape", ["h384", "h7168", "h16384"])
def test_matches_reference(pools, world, transport, shape):
    from ep_native_cases import correctness
    if transport == "mixed-env" and shape != "h384":
        pytest.skip("the environment variable path is covered once")
    mode, rpn, env = TRANSPORTS[transport]
    half = max(1, world // 2)
    rpn = half if rpn == "half" else None
    env = str(half) if env == "half" else None
    cases = "all" if shape == "h384" else "core"
    res = pools[world].run(correctness, shapes(world)[shape], mode, rpn, env, cases, timeout_s=900)
    table = res[0]["transports"]
    assert table[0] == "local"
    if transport == "nvlink":
        assert set(table[1:]) == {"nvlink"}
    elif transport == "emulated":
        assert set(table[1:]) == {"emulated"}
    else:
        assert table[1:half] == ["nvlink"] * (half - 1) and set(table[half:]) == {"emulated"}, table


@requires_gpu
def test_thousand_rounds_hash_stable(pools):
    from ep_native_drills import stability
    world = WORLDS[-1]
    pools[world].run(stability, (32, 2048, 8 * world, 4), 1000, timeout_s=900)


@requires_gpu
@pytest.mark.skipif(NGPU < 2, reason="timing of the fault drill needs one GPU per rank")
@pytest.mark.parametrize("transport", ["nvlink", "emulated"])
def test_fault_drill_and_rejoin(pools, transport):
    from ep_native_drills import fault_drill
    world = min(4, WORLDS[-1])
    timeout_us = 20_000 if transport == "nvlink" else 200_000
    res = pools[world].run(fault_drill, (16, 1024, 4 * world, 4), transport, timeout_us, 5, timeout_s=600)
    for r, out in enumerate(res[:-1]):
        log.info("rank %d: first degraded dispatch %.3f ms, later rounds %s ms (healthy %.3f ms)", r,
                 out["first_dispatch_ms"], out["degraded_ms"], out["baseline_ms"])


@requires_gpu
@pytest.mark.parametrize("transport", ["nvlink", "emulated"])
def test_cuda_graph_and_profiler(pools, transport):
    from ep_native_drills import graph_and_profiler
    pools[WORLDS[-1]].run(graph_and_profiler, (16, 1024, 4 * WORLDS[-1], 4), transport, 3, timeout_s=600)


@requires_gpu
def test_fp8_definition_same_on_cuda_and_cpu():
    """pyep.ep.fp8 on CUDA must quantize bit-identically to the CPU (and so to the kernels): torch's CUDA
    division by a Python scalar is a reciprocal multiply, which changed ~0.2% of FP8 values of the
    benchmark's guard oracle (N(0,1) tokens, H=7168) when compute_scales divided by 448.0."""
    import torch
    from pyep.ep import fp8
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(128, 7168, generator=gen).to(torch.bfloat16)
    for round_scale in (False, True):
        q_c, s_c = fp8.quantize_fp8(x, round_scale)
        q_g, s_g = fp8.quantize_fp8(x.cuda(), round_scale)
        assert torch.equal(s_g.cpu().view(torch.int32), s_c.view(torch.int32)), f"scales differ ({round_scale=})"
        assert torch.equal(q_g.cpu().view(torch.uint8), q_c.view(torch.uint8)), f"FP8 values differ ({round_scale=})"


@requires_gpu
def test_bad_handles_are_refused(pools):
    pools[2].run(_bad_handles, timeout_s=300)


def _bad_handles() -> None:
    import torch
    from ep_native_cases import Shape, make_inputs, new_buffers, setup_device
    setup_device()
    s = Shape(8, 256, 4, 2)
    nat, ref = new_buffers(s, "nvlink")
    x, t, w = make_inputs(1, 0, s, 8, "uniform")
    _, _, h_ref, _, _ = ref.dispatch(x, t, use_fp8=False)
    y = torch.zeros(nat.num_local_experts, 2 * s.T, s.H, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError):
        nat.combine(y, t.cuda(), w.cuda(), h_ref)
    recv, cnt, h, _, _ = nat.dispatch(x.cuda(), t.cuda(), use_fp8=False)
    out, _, _ = nat.combine(y, t.cuda(), w.cuda(), h)       # the buffer still works afterwards
    torch.cuda.synchronize()
    assert out.shape == (8, 256)
    ref.combine(torch.zeros(ref.num_local_experts, 2 * s.T, s.H, dtype=torch.bfloat16), t, w, h_ref)
    nat.destroy()
    ref.destroy()


@requires_gpu
@pytest.mark.parametrize("transport", ["nvlink", "emulated"])
def test_device_value_checks(pools, transport):
    """A bad expert id, found by the dispatch kernel, raised at the end of the next combine / event wait /
    hook."""
    from ep_native_cases import device_value_checks
    res = pools[2].run(device_value_checks, transport, timeout_s=600)
    for rank, seen in enumerate(res):
        assert f"[{rank + 1}, 1] = " in seen["next_call"] and "twice" in seen["event"], seen


@requires_gpu
@pytest.mark.parametrize("transport", ["nvlink", "emulated"])
def test_refused_calls_and_tags(pools, transport):
    """Call tags (docs/ll_kernels.md): a dispatch / combine one rank refuses, its peers' PeerRefusedCall
    (with and without a host sync before their combine), no rank marked, a call-number mismatch seen by
    every rank, clean() realigning; every call in between bitwise equal to the reference."""
    from ep_native_tags import refused_calls_and_tags
    res = pools[2].run(refused_calls_and_tags, transport, timeout_s=600)
    assert res[0]["dispatch sync=True"] == ["TypeError"] and res[1]["dispatch sync=True"] == ["PeerRefusedCall"]
    assert all("rank 0 is at call" in r["mismatch"][0] or "rank 1 is at call" in r["mismatch"][0] for r in res)


@requires_gpu
@pytest.mark.skipif(NGPU < 8, reason="the reference performance shape needs 8 GPUs")
def test_performance_report(pools):
    from ep_native_drills import perf
    res = pools[8].run(perf, (128, 7168, 288, 8), 50, timeout_s=600)
    worst = {k: max(r[k] for r in res) for k in res[0] if k.endswith("_us")}
    print(f"\nnative LL, 8 ranks, T=128 H=7168 K=8 E=288, FP8 dispatch / BF16 combine "
          f"(buffer {res[0]['buffer_bytes'] / 2**20:.0f} MiB): " +
          ", ".join(f"{k} {v:.1f}" for k, v in sorted(worst.items())))
