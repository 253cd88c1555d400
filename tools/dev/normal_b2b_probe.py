#!/usr/bin/env python3
"""Where the time of a back-to-back normal-mode dispatch goes, on whichever `deep_ep` is importable
(DeepEP itself, or pyep's shim through a `deep_ep` package that re-exports pyep.compat.deep_ep).

DeepEP's tests/test_intranode.py times its tuning loop with utils.bench(): calls queued back to back,
one CUDA event pair around each. This tool runs the same kind of loop on the same inputs (its test's
routing: N tokens, random top-k of E experts; --as-deepep-test also sets the default device and dtype as
its init_dist does, which puts a __torch_function__ mode on every torch call) and splits each call's wall time into
  - the event time per call (what DeepEP's bench() reports),
  - the host time per call (perf_counter around the call, the GPU kept busy by the calls before it),
  - the kernels of the call from a kineto trace of the loop: per kernel name the mean duration, and the
    idle gaps on the rank's stream between one call's last kernel and the next call's first,
  - the same call started together on every rank (barrier, synchronize, then the call alone).
Variants: FP8 with column-major scales (as DeepEP's test passes them), FP8 with dense scales, BF16, and the
combine of the BF16 rows (DeepEP's combine tuning call).

    PYTHONPATH=<deep_ep>:<pyep root> python3 tools/dev/normal_b2b_probe.py --ranks 4 [--json F] [--trace-dir D]

Ranks share the visible GPUs (rank % GPUs) over a gloo group, as the one-GPU method does; start the MPS
daemon first. A diagnostic, not a benchmark: it prints rank 0's table and writes every rank's figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Dict, List, Optional

FP8_FACTOR = (1 + 4 / 128) / 2   # test_intranode.py: FP8 bytes per BF16 byte


def _inputs(rank: int, n: int, h: int, k: int, e: int) -> Dict[str, Any]:
    import torch
    torch.manual_seed(1000 + rank)
    x = torch.ones((n, h), dtype=torch.bfloat16, device="cuda") * rank
    amax = x.float().abs().view(n, h // 128, 128).amax(dim=2).clamp(min=1e-4)
    q = (x.float().view(n, h // 128, 128) * (448.0 / amax.unsqueeze(2))).view(n, h).to(torch.float8_e4m3fn)
    scales = (amax / 448.0).contiguous()
    scores = torch.randn((n, e), dtype=torch.float32, device="cuda").abs() + 1
    topk = torch.topk(scores, k, dim=-1, largest=True, sorted=False)[1].to(torch.int64)
    return {"x": x, "fp8_dense": (q, scales), "fp8_colmajor": (q, scales.T.contiguous().T), "topk": topk,
            "weights": torch.ones((n, k), dtype=torch.float32, device="cuda")}


def _kernel_split(trace_path: str, calls: int) -> Dict[str, Any]:
    """Kernels of one kineto trace (this process): mean duration per name, the stream's idle time per call."""
    with open(trace_path) as f:
        ev = [x for x in json.load(f).get("traceEvents", []) if x.get("cat") == "kernel" and x.get("ph") == "X"]
    ev.sort(key=lambda x: x["ts"])
    per: Dict[str, List[float]] = {}
    for x in ev:
        per.setdefault(x["name"][:90], []).append(float(x["dur"]))
    busy = sum(float(x["dur"]) for x in ev)
    span = (ev[-1]["ts"] + ev[-1]["dur"] - ev[0]["ts"]) if ev else 0.0
    return {"kernels": {name: {"count": len(v), "mean_us": statistics.fmean(v), "median_us": statistics.median(v),
                               "min_us": min(v), "max_us": max(v)}
                        for name, v in per.items()},
            "busy_us_per_call": busy / calls, "span_us_per_call": span / calls,
            "idle_us_per_call": (span - busy) / calls}


def first_dispatch(deep_ep: Any, rank: int, world: int, args: argparse.Namespace, port: int) -> tuple:
    """This rank's gloo group (ranks share the GPUs), DeepEP's Buffer(group, 2e9, 0), its test inputs and
    their first full dispatch: (group, buf, inputs, config, recv_x, handle)."""
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    group = dist.new_group(list(range(world)), backend="gloo")
    buf = deep_ep.Buffer(group, int(2e9), 0)
    inp = _inputs(rank, args.num_tokens, args.hidden, args.num_topk, args.num_experts)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(inp["topk"], args.num_experts)
    cfg = deep_ep.Config(args.sms, args.chunk, args.ring)
    recv_x, _, _, _, handle, _ = buf.dispatch(inp["x"], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert, topk_idx=inp["topk"],
                                              topk_weights=inp["weights"], config=cfg)
    return group, buf, inp, cfg, recv_x, handle


def _worker(local_rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist
    import deep_ep
    if args.as_deepep_test:   # as DeepEP's init_dist: its default device puts a __torch_function__ mode on
        torch.set_default_dtype(torch.bfloat16)
        torch.set_default_device("cuda")
    group, buf, inp, cfg, recv_x, handle = first_dispatch(deep_ep, local_rank, world, args, port)
    out: Dict[str, Any] = {"rank": local_rank, "variants": {}, "recv_rows": int(recv_x.shape[0])}
    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")
    os.makedirs(args.trace_dir, exist_ok=True)
    gap_cycles = int(args.gap_us * 1.7e3)   # torch.cuda._sleep counts SM clock cycles (~1.7 GHz)

    def before(mode: str) -> None:
        if mode == "aligned":       # every rank starts the call together, the GPU idle before it
            torch.cuda.synchronize()
            dist.barrier(group)
        elif mode == "gap":         # back to back on the stream, a device sleep between the calls
            torch.cuda._sleep(gap_cycles)

    for name in args.variants:
        if name == "combine":
            fn = (lambda: buf.combine(recv_x, handle=handle, config=cfg))   # noqa: E731 - DeepEP's tuning call
        else:
            x = inp["x"] if name == "bf16" else inp[name]
            fn = (lambda: buf.dispatch(x, handle=handle, config=cfg))   # noqa: E731 - DeepEP's tuning call
        for _ in range(args.warmup):
            fn()
        cache.zero_()
        res: Dict[str, Any] = {}
        for mode in args.modes:
            n = args.iters if mode != "aligned" else args.aligned_iters
            s = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            t = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            host: List[float] = []
            for i in range(n):
                before(mode)
                s[i].record()
                h0 = time.perf_counter()
                fn()
                host.append((time.perf_counter() - h0) * 1e6)
                t[i].record()
            torch.cuda.synchronize()
            ev_us = [a.elapsed_time(b) * 1e3 for a, b in zip(s, t)][1:]
            dist.barrier(group)
            path = os.path.join(args.trace_dir, f"{name}_{mode}_r{local_rank}.json")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.trace_calls):
                    before(mode)
                    fn()
                torch.cuda.synchronize()
            prof.export_chrome_trace(path)
            # GB/s as test_intranode.py counts them: received rows x 2H (FP8: x (1 + 4/128) / 2) per call.
            factor = FP8_FACTOR if name.startswith("fp8") else 1.0
            gbps = out["recv_rows"] * 2 * args.hidden * factor / (statistics.fmean(ev_us) * 1e3)
            res[mode] = {"event_us_mean": statistics.fmean(ev_us), "event_us_min": min(ev_us), "gbps": gbps,
                         "host_us_mean": statistics.fmean(host[1:]), "trace": _kernel_split(path, args.trace_calls)}
        out["variants"][name] = res
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, out, group=group)
    if local_rank == 0:
        _report(gathered, args)
    dist.barrier(group)
    if hasattr(buf, "destroy"):
        try:
            buf.destroy()
        except Exception:   # noqa: BLE001 - DeepEP's destroy needs explicitly_destroy=True; a probe ends anyway
            pass
    dist.destroy_process_group()


MAIN_KERNELS = ("dispatch", "dispatch_one_copy", "combine")


def main_kernel(trace: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The call's dispatch or combine kernel among a trace split's kernels (not the notify / gate
    kernel, not the gap's sleep): the one of those names that took the most time; None if none ran.
    A one-copy dispatch runs two (dispatch_one_copy, then the ring kernel, which then ends at once):
    their statistics are added, every call having run both."""
    ks = sorted(trace["kernels"].items(), key=lambda kv: -kv[1]["mean_us"] * kv[1]["count"])
    main = [d for k, d in ks if any(f"{w}{c}" in k for w in MAIN_KERNELS for c in "<(") and "notify" not in k]
    if not main:
        return None
    pair = [d for k, d in ks if "dispatch_one_copy(" in k or "dispatch_one_copy<" in k]
    if pair and len(main) > 1 and main[1]["count"] == pair[0]["count"] == main[0]["count"]:
        return {f: main[0][f] + main[1][f] for f in ("mean_us", "median_us", "min_us", "max_us")} | \
            {"count": main[0]["count"]}
    return main[0]


def _report(ranks: List[Dict[str, Any]], args: argparse.Namespace) -> None:
    import deep_ep
    lib = "pyep shim" if hasattr(deep_ep, "_m") else "DeepEP"
    print(f"{lib}: {len(ranks)} ranks, N={args.num_tokens} H={args.hidden} K={args.num_topk} E={args.num_experts}, "
          f"Config({args.sms}, {args.chunk}, {args.ring}); microseconds per call; gap = {args.gap_us} us device sleep")
    print(f"{'variant':<13} {'mode':<8} {'rank':>4} {'event':>8} {'host':>7} {'main median':>11} {'min':>7} "
          f"{'max':>7} {'idle':>7}  other kernels (mean us)")
    for name in args.variants:
        for mode in args.modes:
            for r in ranks:
                v = r["variants"][name][mode]
                tr = v["trace"]
                ks = sorted(tr["kernels"].items(), key=lambda kv: -kv[1]["mean_us"] * kv[1]["count"])
                m = main_kernel(tr) or {"mean_us": 0.0, "median_us": 0.0, "min_us": 0.0, "max_us": 0.0}
                other = ", ".join(f"{k.split('(')[0][-24:]}={d['mean_us']:.0f}" for k, d in ks if d is not m)[:70]
                print(f"{name:<13} {mode:<8} {r['rank']:>4} {v['event_us_mean']:>8.1f} {v['host_us_mean']:>7.1f} "
                      f"{m['median_us']:>11.1f} {m['min_us']:>7.1f} {m['max_us']:>7.1f} {tr['idle_us_per_call']:>7.1f}  {other}")
    # DeepEP's test_intranode.py byte counts: received rows x 2H (FP8: x (1 + 4/128) / 2), per rank.
    print("GB/s per rank, DeepEP's byte count over the back-to-back event time (its bench()): ", end="")
    parts = []
    for name in args.variants:
        if "b2b" not in args.modes:
            break
        g = [r["variants"][name]["b2b"]["gbps"] for r in ranks]
        parts.append(f"{name} {g[0]:.0f} (rank 0; min {min(g):.0f})")
    print(", ".join(parts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"library": lib, "args": vars(args), "ranks": ranks}, f, indent=1)


def add_shape_args(p: argparse.ArgumentParser, ranks: int) -> None:
    """DeepEP's test shape and the Config, as this probe and tools/dev/normal_combine_trace.py take them."""
    p.add_argument("--ranks", type=int, default=ranks)
    p.add_argument("--num-tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--num-topk", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--sms", type=int, default=24)
    p.add_argument("--chunk", type=int, default=8, help="Config's NVL send chunk")
    p.add_argument("--ring", type=int, default=256, help="Config's NVL receive ring (DeepEP's test: 256)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(p, ranks=4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--aligned-iters", type=int, default=10)
    p.add_argument("--trace-calls", type=int, default=20)
    p.add_argument("--variants", nargs="+", default=["fp8_colmajor", "fp8_dense", "bf16", "combine"],
                   choices=["fp8_colmajor", "fp8_dense", "bf16", "combine"])
    p.add_argument("--modes", nargs="+", default=["b2b", "gap", "aligned"],
                   help="b2b: calls back to back (DeepEP's bench()); gap: a device sleep between calls; "
                        "aligned: synchronize + barrier before each call")
    p.add_argument("--gap-us", type=float, default=300.0)
    p.add_argument("--trace-dir", default="/tmp/b2b_traces")
    p.add_argument("--json", default="")
    p.add_argument("--as-deepep-test", action="store_true",
                   help="set the default dtype (bfloat16) and device (cuda) as DeepEP's tests do")
    args = p.parse_args()
    import torch.multiprocessing as mp
    port = 29000 + os.getpid() % 2000
    mp.spawn(_worker, args=(args.ranks, args, port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
