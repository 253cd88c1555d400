#!/usr/bin/env python3
"""Host (CPU) time of one native dispatch / combine call, measured with the GPU kept busy, so that it
is host time and not waiting: each window of calls is queued behind a device sleep that outlasts it
(the tool checks that the sleep was still running when the window's last call returned).

    python tools/dev/host_overhead.py [--iters 200] [--ranks 1] [--pieces] [--json FILE]

Works on one GPU: --ranks N starts N processes on a gloo group, all on GPU (rank % GPUs), so two ranks
may share one GPU. Prints, per path (the C++ fast path, and the Python path with PYEP_LL_FAST=0), the
mean / p50 / p99 microseconds a dispatch and a combine spend on the host (rank 0; --json writes every
rank's figures). --pieces also times the parts of the Python path one by one (device idle between
calls), as before the fast path existed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tools.dev.ranks import rank_inputs, run_ranks  # noqa: E402 - after the path set-up above

GOAL_US = 20.0


def _stats(v: List[float]) -> Dict[str, float]:
    s = sorted(v)
    return {"mean": statistics.fmean(s), "p50": s[len(s) // 2], "p99": s[min(len(s) - 1, int(0.99 * len(s)))],
            "n": float(len(s))}


def _busy_loop(buf: Any, x: Any, topk: Any, w: Any, y: Any, iters: int, window: int,
               sleep_cycles: int) -> Dict[str, Any]:
    """iters dispatch+combine pairs, `window` at a time behind a device sleep; host us per call."""
    import torch
    host: Dict[str, List[float]] = {"dispatch": [], "combine": []}
    idle_windows = 0
    done = 0
    while done < iters:
        n = min(window, iters - done)
        torch.cuda._sleep(sleep_cycles)
        busy = torch.cuda.Event()
        busy.record()
        for _ in range(n):
            t0 = time.perf_counter()
            _r, _c, handle, _e, _h = buf.dispatch(x, topk)
            t1 = time.perf_counter()
            buf.combine(y, topk, w, handle)
            t2 = time.perf_counter()
            host["dispatch"].append((t1 - t0) * 1e6)
            host["combine"].append((t2 - t1) * 1e6)
        if busy.query():       # the sleep ended before the host finished queueing: not all host time
            idle_windows += 1
        torch.cuda.synchronize()
        done += n
    return {"dispatch": _stats(host["dispatch"]), "combine": _stats(host["combine"]), "idle_windows": idle_windows,
            "windows": (iters + window - 1) // window}


def _pieces(buf: Any, x: Any, topk: Any, w: Any, y: Any, iters: int) -> List[str]:
    """The old breakdown of the Python path (device idle between calls)."""
    import torch

    from pyep.ep.ll.validate import validate_combine, validate_dispatch
    be, cfg, dev, r = buf.backend, buf.config, buf.device, buf.num_ranks
    lines: List[str] = []

    def timed(name: str, fn: Any) -> None:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        total = 0.0
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
            torch.cuda.synchronize()
        lines.append(f"  {name:<42} {total / iters * 1e6:8.1f} us")

    timed("validate_dispatch", lambda: validate_dispatch(
        cfg, r, dev, x, topk, use_fp8=True, round_scale=False, use_ue8m0=False, active_ranks=None,
        timeout_us=None, async_finish=False, return_recv_hook=False, cumulative_local_expert_recv_stats=None))
    _r, _c, handle, _e, _h = buf.dispatch(x, topk)
    buf.combine(y, topk, w, handle)
    torch.cuda.synchronize()
    _r, _c, handle, _e, _h = buf.dispatch(x, topk)
    timed("validate_combine", lambda: validate_combine(
        cfg, r, dev, y, topk, w, handle, owner=buf._owner, epoch=buf._epoch, last_seq=buf._seq,
        active_ranks=None, timeout_us=None, zero_copy=False, async_finish=False, return_recv_hook=False,
        out=None))
    buf.combine(y, topk, w, handle)
    torch.cuda.synchronize()
    e_l, rows, h = buf.num_local_experts, r * cfg.num_max_dispatch_tokens_per_rank, cfg.hidden
    timed(f"torch.empty recv_x [{e_l},{rows},{h}] e4m3", lambda: torch.empty((e_l, rows, h), dtype=torch.float8_e4m3fn,
                                                                              device=dev))
    timed("torch.empty out bf16", lambda: torch.empty((x.shape[0], h), dtype=torch.bfloat16, device=dev))
    timed("raw stream query", be._raw_current_stream)
    timed("10 x data_ptr()", lambda: [x.data_ptr() for _ in range(10)])
    return lines


def _verify(bufs: List[Any], x: Any, topk: Any, w: Any, y: Any) -> List[str]:
    """The fast path and the Python path give the same bits (FP8, BF16 and UE8M0 dispatch, combine
    with out= and zero_copy), the same typed errors, and the fast path took the plain calls."""
    import torch
    fast, slow = bufs
    problems: List[str] = []
    for kw in ({}, {"use_fp8": False}, {"round_scale": True, "use_ue8m0": True}):
        res = []
        for buf in (fast, slow):
            # One combine per dispatch: plain, out=, zero_copy.
            recv, count, handle, _e, _h = buf.dispatch(x, topk, **kw)
            recv = list(recv) if isinstance(recv, tuple) else [recv]
            out1, _e, _h = buf.combine(y, topk, w, handle)
            _r, _c, h2, _e, _h = buf.dispatch(x, topk, **kw)
            given = torch.empty_like(out1)
            out2, _e, _h = buf.combine(y, topk, w, h2, out=given)
            _r, _c, h3, _e, _h = buf.dispatch(x, topk, **kw)
            buf.get_next_combine_buffer(h3).copy_(y)
            out3, _e, _h = buf.combine(y, topk, w, h3, zero_copy=True)
            if out2 is not given:
                problems.append(f"{kw}: combine(out=) did not return the given tensor")
            res.append((recv, count, handle.src_info, handle.layout_range, [out1, out2, out3]))
        torch.cuda.synchronize()
        (ra, ca, sa, la, oa), (rb, cb, sb, lb, ob) = res
        if not (torch.equal(ca, cb) and torch.equal(la, lb)):
            problems.append(f"{kw}: recv_count / layout_range differ between the paths")
            continue
        # Rows past recv_count[e] are unspecified: compare the received rows only.
        for e, n in enumerate(ca.tolist()):
            pairs = [(t[e, :n], u[e, :n]) for t, u in zip(ra, rb)] + [(sa[e, :n], sb[e, :n])]
            for i, (t, u) in enumerate(pairs):
                t8 = t.contiguous().view(torch.uint8) if t.element_size() == 1 else t
                u8 = u.contiguous().view(torch.uint8) if u.element_size() == 1 else u
                if t.dtype != u.dtype or t.stride() != u.stride() or not torch.equal(t8, u8):
                    problems.append(f"{kw}: expert {e} output {i} differs between the paths")
                    break
        for i, (t, u) in enumerate(zip(oa, ob)):
            if not torch.equal(t, u):
                problems.append(f"{kw}: combine output {i} differs between the paths")
    bad = [("x fp32", lambda b: b.dispatch(x.float(), topk)), ("idx int32", lambda b: b.dispatch(x, topk.int())),
           ("timeout 0", lambda b: b.dispatch(x, topk, timeout_us=0))]
    for name, call in bad:
        msgs = []
        for buf in (fast, slow):
            try:
                call(buf)
                msgs.append("no error")
            except (TypeError, ValueError) as exc:
                msgs.append(f"{type(exc).__name__}: {exc}")
        if msgs[0] != msgs[1] or msgs[0] == "no error":
            problems.append(f"{name}: {msgs}")
    fp = fast.backend.fast_path
    if fp is None or int(fp.calls) == 0:
        problems.append("the fast path took no call")
    return problems or ["fast and Python paths agree"]


def _rank_main(rank: int, dev: Any, args: argparse.Namespace) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    from pyep.ep.ll import EpBuffer
    from pyep.ep.ll.native import FAST_ENV
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    x, topk, w, y = rank_inputs(rank, args.ranks, dev, T, H, E, K)
    out: Dict[str, Any] = {"rank": rank, "device": torch.cuda.get_device_name(dev), "paths": {}}
    bufs = {}
    for path, fast in (("C++ fast path", "1"), ("Python path (PYEP_LL_FAST=0)", "0")):
        os.environ[FAST_ENV] = fast
        bufs[path] = EpBuffer(None, num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E, max_topk=K,
                              backend="native")     # default arguments otherwise: check_values=True
    os.environ.pop(FAST_ENV, None)
    out["verify"] = _verify(list(bufs.values()), x, topk, w, y)
    for path, buf in bufs.items():
        fast = "1" if path.startswith("C++") else "0"
        try:
            for _ in range(5):
                _r, _c, handle, _e, _h = buf.dispatch(x, topk)
                buf.combine(y, topk, w, handle)
            torch.cuda.synchronize()
            dist.barrier()
            res = _busy_loop(buf, x, topk, w, y, args.iters, args.window, args.sleep_cycles)
            fp = buf.backend.fast_path
            res["fast_calls"] = int(fp.calls) if fp is not None else 0
            if args.pieces and rank == 0 and fast == "0":
                res["pieces"] = _pieces(buf, x, topk, w, y, max(20, args.iters // 4))
            dist.barrier()
            out["paths"][path] = res
        finally:
            buf.destroy()
    return out


def _table(outs: List[Dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"host time per call, us, GPU kept busy (T={args.tokens} H={args.hidden} E={args.experts} "
             f"K={args.topk}, {args.ranks} rank(s), FP8 dispatch, default arguments; goal <= {GOAL_US:g} us)",
             f"{'rank':>4}  {'path':<30} {'call':<9} {'mean':>8} {'p50':>8} {'p99':>8}  {'fast calls':>10}  note"]
    for o in sorted(outs, key=lambda o: o["rank"]):
        for path, res in o["paths"].items():
            for call in ("dispatch", "combine"):
                st = res[call]
                note = "" if res["idle_windows"] == 0 else f"GPU idle in {res['idle_windows']}/{res['windows']} windows"
                if path.startswith("C++"):
                    note = (note + "; " if note else "") + ("meets goal" if st["p50"] <= GOAL_US else "ABOVE goal")
                lines.append(f"{o['rank']:>4}  {path:<30} {call:<9} {st['mean']:8.1f} {st['p50']:8.1f} {st['p99']:8.1f}  "
                             f"{res['fast_calls']:>10}  {note}")
            lines += res.get("pieces", [])
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=200, help="measured dispatch+combine pairs per path")
    ap.add_argument("--window", type=int, default=16, help="pairs queued behind one device sleep")
    ap.add_argument("--sleep-cycles", type=int, default=20_000_000,
                    help="device sleep per window (default ~10 ms at H100/H200 clocks)")
    ap.add_argument("--ranks", type=int, default=1, help="processes (gloo group), GPU = rank %% GPUs")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--pieces", action="store_true", help="also break the Python path down (rank 0)")
    ap.add_argument("--json", help="write every rank's figures here")
    args = ap.parse_args()
    if args.ranks < 1 or args.experts % args.ranks or args.iters < 1 or args.window < 1:
        ap.error("need ranks >= 1 dividing experts, iters >= 1, window >= 1")
    outs = run_ranks("host_overhead", _rank_main, args, args.ranks, timeout_s=900)
    if outs is None:
        return 1
    print(_table(outs, args))
    for o in outs:
        print(f"rank {o['rank']} verify: " + "; ".join(o["verify"]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"config": vars(args), "ranks": outs}, fh, indent=1)
    if any(o["verify"] != ["fast and Python paths agree"] for o in outs):
        return 4
    fast_ok = all(o["paths"]["C++ fast path"][c]["p50"] <= GOAL_US for o in outs for c in ("dispatch", "combine"))
    return 0 if fast_ok else 3


if __name__ == "__main__":
    raise SystemExit(main())
