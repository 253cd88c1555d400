"""Where the time of DeepEP's own test loops goes, on DeepEP or on pyep's shim, without editing the test.

A sitecustomize that wraps the `bench()` of DeepEP's tests/utils.py (when a module named `utils` with a
`bench` is imported) with the same loop plus, per call of bench() and per rank, one `[diag rR bK]` line:
  - ev_us: the event time per call (what the test reports), mean / median / min / max;
  - host_us: the host time of each call inside that loop (perf_counter around fn());
  - every PYEP_DIAG_EVERY-th bench (default 4, from the first): a kineto pass of 20 calls, the kernels'
    durations by name and the stream's idle time per call (a rank whose stream idles is paced by its host
    or by a peer);
  - bench 1, 5, 9, ...: busy-host_us, the host time of 20 calls queued behind a long device sleep (CPU
    time alone: if it matches host_us the host is busy, not waiting), and with PYEP_DIAG_PROFILE=1 rank
    0's cProfile of 20 more calls by own time. Every rank makes the same extra calls, so the ranks stay
    at the same call (a rank that made more would make its peers' gates mismatch, and pyep raises that).

It first runs the sitecustomize it replaces (`sitecustomize_next.py` beside it, if any), so it can stand in
for .anchors/onegpu's:

    cp .anchors/onegpu/sitecustomize.py .anchors/onegpu/sitecustomize_next.py
    cp tools/dev/harness_diag/sitecustomize.py .anchors/onegpu/sitecustomize.py
    OUT=/tmp/d DEEPEP_ON=pyep bash .anchors/deepep_v1.sh intranode 2; grep diag /tmp/d/*.log
    mv .anchors/onegpu/sitecustomize_next.py .anchors/onegpu/sitecustomize.py     # restore

A diagnostic (docs/results/2026-11-26i-h200x1 found with it that the shim's host time paced the test).
"""
import importlib.abc
import importlib.machinery
import os
import sys

_next = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sitecustomize_next.py")
if os.path.exists(_next):
    with open(_next) as _f:
        exec(compile(_f.read(), _next, "exec"))


def _kineto_line(fn, calls):
    import json
    import statistics
    import tempfile
    import torch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        ev = [x for x in json.load(f).get("traceEvents", []) if x.get("cat") == "kernel" and x.get("ph") == "X"]
    ev.sort(key=lambda x: x["ts"])
    per = {}
    for x in ev:
        per.setdefault(x["name"].split("(")[0][-48:], []).append(float(x["dur"]))
    busy = sum(float(x["dur"]) for x in ev)
    span = (ev[-1]["ts"] + ev[-1]["dur"] - ev[0]["ts"]) if ev else 0.0
    kernels = "; ".join(f"{n} x{len(v)} med {statistics.median(v):.1f} max {max(v):.1f}" for n, v in per.items())
    return f" | kineto span/call {span / calls:.1f} idle/call {(span - busy) / calls:.1f} :: {kernels}"


def _profile_lines(fn, calls):
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    rows = sorted(pstats.Stats(pr).stats.items(), key=lambda kv: -kv[1][2])[:25]
    return "".join(f"\n   prof own {tt / calls * 1e6:8.1f} us  cum {ct / calls * 1e6:8.1f} us  x{nc / calls:.0f}  "
                   f"{os.path.basename(file)}:{line}({name})" for (file, line, name), (_, nc, tt, ct, _) in rows)


def _patch(mod):
    import statistics
    import time
    import numpy as np
    import torch
    import torch.distributed as dist
    count = [0]
    every = int(os.environ.get("PYEP_DIAG_EVERY", "4"))
    profile = os.environ.get("PYEP_DIAG_PROFILE", "0") == "1"

    def bench(fn, num_warmups=50, num_tests=50, post_fn=None):
        torch.cuda.synchronize()
        cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")
        for _ in range(num_warmups):
            fn()
        cache.zero_()
        st = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
        en = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
        host = []
        for i in range(num_tests):
            st[i].record()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e6)
            en[i].record()
            if post_fn is not None:
                post_fn()
        torch.cuda.synchronize()
        times = np.array([s.elapsed_time(e) / 1e3 for s, e in zip(st, en)])[1:]
        k = count[0]
        count[0] += 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        line = (f"[diag r{rank} b{k}] ev_us mean {times.mean() * 1e6:.1f} med {np.median(times) * 1e6:.1f} "
                f"min {times.min() * 1e6:.1f} max {times.max() * 1e6:.1f} | host_us med {statistics.median(host):.1f} "
                f"max {max(host):.1f}")
        if every > 0 and k % every == 0:
            line += _kineto_line(fn, 20)
        if every > 0 and k % every == 1:
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e7))       # ~12 ms: the 20 calls below only queue
            busy = []
            for _ in range(20):
                t0 = time.perf_counter()
                fn()
                busy.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            line += f" | busy-host_us med {statistics.median(busy):.1f} min {min(busy):.1f}"
            if profile:
                lines = _profile_lines(fn, 20)   # every rank makes these calls
                torch.cuda.synchronize()
                if rank == 0:
                    line += lines
        print(line, flush=True)
        return np.average(times), np.min(times), np.max(times)

    mod.bench = bench


class _UtilsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "utils":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            if hasattr(module, "bench"):
                _patch(module)
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _UtilsFinder())
