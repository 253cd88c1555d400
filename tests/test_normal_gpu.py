"""GPU tests of the native normal-mode backend (marked `gpu`; skipped without CUDA, without the CUDA build
of pyep._engine or with fewer than 2 GPUs). Ranks are DistPool workers over gloo; each drives a native
NormalBuffer on GPU rank % device_count beside a reference NormalBuffer on the CPU, with the same
inputs, and compares every output bit for bit (tests/normal_gpu_cases.py, tests/normal_gpu_drills.py).

Worlds: 2 ranks (one per GPU) and 4 ranks (one per GPU, or two per GPU on a 2-GPU machine); 8 where
there are 8 GPUs. Matrix per H in {128, 7168, 16384}: random, hot, masked (-1), empty (N=0 on one
rank) and all-on-one-rank routings; BF16 and FP8; cached dispatch; expert_alignment 1 and 128;
num_worst_tokens; async_finish + previous_event; a small-ring config (every ring wraps). Then: CUDA
graph capture of dispatch + combine with num_worst_tokens and of a cached dispatch with a handle,
1000 rounds with a stable output hash, and InvalidExpertIndex with the buffer working afterwards.
"""
from __future__ import annotations


import pytest
from multiproc import usable_gpus

pytestmark = pytest.mark.gpu


NGPU = usable_gpus("normal")
WORLDS = [w for w in (2, 4, 8) if w <= max(NGPU, 4)]
# Ranks share GPUs (rank % device_count) where there are fewer GPUs than ranks: slow (the processes
# time-slice one GPU) but the same protocol, so one GPU is enough to check correctness.
requires_gpus = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU and the CUDA build of pyep._engine")


def shape(world: int, h: int):
    """(N, H, E, K): an odd token count with small H; the DeepEP-like H=7168 with K=8; the largest H."""
    if h == 128:
        return (301, 128, 8 * world, 4)
    if h == 7168:
        return (512, 7168, 32 * world, 8)
    return (96, 16384, 4 * world, 8)


@requires_gpus
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("hidden", [128, 7168, 16384])
def test_matches_reference(pools, world, hidden):
    from normal_gpu_cases import correctness
    cases = "all" if hidden == 128 or (hidden == 7168 and world == 2) else "core"
    pools[world].run(correctness, shape(world, hidden), cases, timeout_s=220)


@requires_gpus
@pytest.mark.timeout(240)
def test_traced_combine_matches_reference_and_names_its_blocks(pools):
    """PYEP_NORMAL_TRACE=1: the traced combine kernel (normal_trace.cuh) gives the reference's bits and a
    per-block trace (normal_gpu_cases.traced_combine)."""
    from normal_gpu_cases import traced_combine
    pools[2].run(traced_combine, shape(2, 7168), timeout_s=220)


@requires_gpus
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_one_copy_dispatch_matches_reference_and_keeps_outputs(pools, world):
    """A buffer with an output pool: one-copy dispatch, its ring fallback when the pool is full of kept
    outputs, and the kept outputs never overwritten (normal_gpu_cases.one_copy)."""
    from normal_gpu_cases import one_copy
    pools[world].run(one_copy, shape(world, 7168), "core", timeout_s=220)


@requires_gpus
@pytest.mark.timeout(240)
@pytest.mark.parametrize("setting", ["0", "all", "peer/local", "local/peer"])
def test_bulk_copy_settings_match_reference(pools, setting):
    """Every other test runs the default (every row copy by the bulk copy engine where the ranks share a
    GPU, none across GPUs); here the warp copies (PYEP_NORMAL_TMA=0), every copy by bulk copy whatever the
    topology (all), and each side alone in each kernel (dispatch/combine)."""
    from normal_gpu_cases import bulk_copy_setting
    pools[2].run(bulk_copy_setting, setting, shape(2, 7168), "core", timeout_s=220)


@requires_gpus
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_cuda_graph_with_worst_tokens_and_cached_handle(pools, world):
    from normal_gpu_drills import graph_case
    pools[world].run(graph_case, (64, 1024, 8 * world, 4), 3, timeout_s=220)


@requires_gpus
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_row_kinds_back_to_back(pools, world):
    """FP8 dispatch, combine without weights, cached BF16 dispatch, combine with weights, queued with no
    host wait: a fast peer's next call must not write over rows a slow rank still reads."""
    from normal_gpu_cases import mixed_rows
    pools[world].run(mixed_rows, (64, 1024, 8 * world, 4), 6, timeout_s=220)


@requires_gpus
@pytest.mark.timeout(240)
def test_thousand_rounds_hash_stable(pools):
    from normal_gpu_drills import stability
    res = pools[2].run(stability, (128, 1024, 16, 4), 1000, timeout_s=220)
    assert len(res) == 2


@requires_gpus
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_invalid_expert_raises_and_buffer_recovers(pools, world):
    from normal_gpu_drills import invalid_expert
    pools[world].run(invalid_expert, (64, 512, 8 * world, 4), timeout_s=220)


@requires_gpus
@pytest.mark.timeout(240)
def test_absent_peer_times_out_and_clean_recovers(pools):
    """A rank that skips a dispatch is named by PeerTimeout on the others within the timeout (plus the
    host's slack), nothing hangs, and clean() makes the buffer usable again."""
    from normal_gpu_drills import peer_timeout
    timeout_us = 500_000
    took = pools[2].run(peer_timeout, (64, 512, 16, 4), timeout_us, timeout_s=220)
    assert 0 < took[0] < timeout_us / 1e6 + 5.0, f"rank 0 took {took[0]:.2f} s to report the absent peer"


@requires_gpus
@pytest.mark.timeout(240)
def test_deep_ep_shim_on_native(pools):
    """pyep.compat.deep_ep.Buffer(low_latency_mode=False) on the kernels, as DeepEP's intranode test
    calls it, equal to the same shim on the reference backend."""
    from normal_gpu_drills import deep_ep_shim
    pools[2].run(deep_ep_shim, (200, 1024, 16, 4), timeout_s=220)


@requires_gpus
@pytest.mark.timeout(240)
def test_kernel_names_in_profiles(pools):
    """One kernel named *dispatch* per dispatch call and one *combine* per combine call (profiling
    helpers written for DeepEP look for exactly that)."""
    from normal_gpu_drills import kernel_names
    pools[2].run(kernel_names, (128, 1024, 16, 4), timeout_s=220)


@pytest.mark.skipif(NGPU < 2, reason="the bench runs NCCL, one rank per GPU: needs 2 GPUs")
@requires_gpus
@pytest.mark.timeout(300)
def test_bench_guard_passes_on_native(tmp_path, monkeypatch):
    """`pyep bench --mode normal` on 2 GPUs (NCCL, torchrun-style), small shape: the guard passes for
    native and reference, kineto finds the dispatch and combine kernels."""
    import json

    import test_bench_run
    from test_bench_gpu import _gpu_env
    monkeypatch.setattr(test_bench_run, "_clean_env", _gpu_env(test_bench_run._clean_env))
    res = test_bench_run._run_ranks(["--mode", "normal", "--backend", "both", "--tokens", "256", "--hidden", "1024",
                                     "--experts", "16", "--topk", "4", "--sweep-sms", "8,24", "--iters", "3",
                                     "--warmup", "1", "--out", str(tmp_path)], world=2)
    for rank, (rc, so, se) in enumerate(res):
        assert rc == 0, f"rank {rank} exited {rc}\nstdout:\n{so}\nstderr:\n{se}"
    doc = json.loads((tmp_path / "bench_normal.json").read_text())
    assert [(r["backend"], r["num_sms"]) for r in doc["rows"]] == [("native", 8), ("native", 24), ("reference", 8),
                                                                   ("reference", 24)]
    for r in doc["rows"]:
        assert r["check"]["status"] == "PASS", r["check"]
        assert r["kernel_time_source"] == "kineto"
        for p in ("dispatch", "cached_fp8", "cached_bf16", "combine", "eager"):
            assert r["kernel_us"][p]["mean"] > 0, (r["backend"], p, r["kineto"])
            assert r["wall_us"][p]["mean"] > 0


@requires_gpus
@pytest.mark.timeout(240)
@pytest.mark.parametrize("pooled", [False, True])
def test_fast_path_matches_reference_and_declines(pools, pooled):
    """The C++ fast path of cached dispatch and combine (normal_gpu_fast.fast_path): taken after the
    Python path's first call of a handle and config, bit for bit the reference's, and leaving wrong
    arguments, refusals and stale handles to the Python path."""
    from normal_gpu_fast import fast_path
    pools[2].run(fast_path, (256, 7168, 32, 8), pooled, timeout_s=220)


@requires_gpus
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_pull_combine_matches_reference(pools, world):
    """Pull combine (normal_gpu_pull.pull_combine): combines of pooled inputs read the peers' rows where they
    lie, bit for bit the reference's, on the Python and the fast path; inputs outside the pool push."""
    from normal_gpu_pull import pull_combine
    pools[world].run(pull_combine, (256, 7168, 32, 8), timeout_s=220)
