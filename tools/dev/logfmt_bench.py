#!/usr/bin/env python3
"""LogFMT combine (use_logfmt=True) next to BF16 combine on the native backend: the error of LogFMT's
output against BF16's, and the combine kernel time of both (kineto: device time of combine).

    python tools/dev/logfmt_bench.py [--ranks 2] [--tokens 128] [--hidden 7168] [--experts 288]
                                     [--topk 8] [--iters 50] [--scale 0.1] [--json FILE]

Works on one GPU: --ranks N starts N processes on a gloo group, GPU = rank % GPUs (ranks may share one).
Expert outputs are randn * --scale (DeepEP's LogFMT perf case uses 0.1: most groups under 1, so cast).
Errors are over the output elements with |out_bf16| > 1e-3 * max |out_bf16| (error_stats: finite
pairs only; NaN / inf are counted and make the exit status 2); calc_diff is DeepEP's test metric
(1 - cosine-like similarity of x + 1 and y + 1). Every combine follows its own dispatch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tools.dev.ranks import rank_inputs, run_ranks  # noqa: E402 - after the path set-up above


def error_stats(ref: Any, got: Any, rel_floor: float = 1e-3) -> Dict[str, Any]:
    """LogFMT's output `got` against BF16's `ref` (same shape): the relative error over the elements with
    |ref| > rel_floor * max |ref| (finite pairs only), DeepEP's calc_diff over the finite pairs, and the
    counts behind both: `compared` elements (0 when the reference is all zero or empty: the errors are
    then None, not a crash), `nonfinite` pairs (NaN / inf in either output, left out and reported)."""
    import torch
    a, b = ref.detach().double(), got.detach().double()
    if a.shape != b.shape:
        raise ValueError(f"error_stats: shapes differ, {list(a.shape)} vs {list(b.shape)}")
    finite = torch.isfinite(a) & torch.isfinite(b)
    out: Dict[str, Any] = {"elements": a.numel(), "nonfinite": int((~finite).sum()), "compared": 0,
                           "max_rel": None, "mean_rel": None, "calc_diff": None}
    fa, fb = a[finite], b[finite]
    if fa.numel() == 0:
        return out
    keep = fa.abs() > rel_floor * fa.abs().max()
    out["compared"] = int(keep.sum())
    if out["compared"]:
        rel = (fb - fa).abs()[keep] / fa.abs()[keep]
        out["max_rel"], out["mean_rel"] = float(rel.max()), float(rel.mean())
    xa, xb = fa + 1, fb + 1
    out["calc_diff"] = float(1 - 2 * (xa * xb).sum() / (xa * xa + xb * xb).sum())
    return out


def _combine(buf: Any, x: Any, topk: Any, w: Any, y: Any, use_logfmt: bool) -> Any:
    """One dispatch + combine pair. A combine always follows its own dispatch: repeated combines on one
    handle reuse one buffer half, and a fast peer's next combine could then land in rows this rank is
    still reducing (the comparison and the timing would both be unsound)."""
    _r, _c, handle, _e, _h = buf.dispatch(x, topk)
    out, _, _ = buf.combine(y, topk, w, handle, use_logfmt=use_logfmt)
    return out


def _kernel_us(buf: Any, x: Any, topk: Any, w: Any, y: Any, use_logfmt: bool, iters: int) -> float:
    """Mean device time of the combine kernel over `iters` dispatch + combine pairs (kineto)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            _combine(buf, x, topk, w, y, use_logfmt)
        torch.cuda.synchronize()
    mine = [e for e in prof.key_averages() if "pyep::ll::" in e.key and "::combine" in e.key]
    total = sum(getattr(e, "device_time_total", None) or e.cuda_time_total for e in mine)
    calls = sum(e.count for e in mine)
    if calls == 0:
        raise RuntimeError(f"logfmt_bench: no 'pyep::ll::...::combine' kernel in the profile: "
                           f"{sorted({e.key for e in prof.key_averages()})[:20]}")
    return total / calls


def _rank_main(rank: int, dev: Any, args: argparse.Namespace) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    from pyep.ep.ll import EpBuffer
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    x, topk, w, y = rank_inputs(rank, args.ranks, dev, T, H, E, K, y_scale=args.scale)
    buf = EpBuffer(None, num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E, max_topk=K, backend="native")
    out: Dict[str, Any] = {"rank": rank, "device": torch.cuda.get_device_name(dev)}
    try:
        for lf in (False, True):     # warm-up
            for _ in range(3):
                _combine(buf, x, topk, w, y, lf)
        outs = {}
        for lf in (False, True):
            torch.cuda.synchronize()
            dist.barrier()
            outs[lf] = _combine(buf, x, topk, w, y, lf)
        torch.cuda.synchronize()
        out.update(error_stats(outs[False], outs[True]))
        for name, flag in (("bf16_us", False), ("logfmt_us", True)):
            dist.barrier()
            out[name] = _kernel_us(buf, x, topk, w, y, flag, args.iters)
        dist.barrier()
    finally:
        buf.destroy()
    return out


def _pct(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.4%}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--scale", type=float, default=0.1, help="expert outputs are randn * scale")
    ap.add_argument("--json", help="write every rank's figures here")
    args = ap.parse_args()
    if args.ranks < 1 or args.experts % args.ranks or args.hidden % 512:
        ap.error("need ranks >= 1 dividing experts, hidden % 512 == 0")
    outs = run_ranks("logfmt_bench", _rank_main, args, args.ranks, timeout_s=600)
    if outs is None:
        return 1
    print(f"T={args.tokens} H={args.hidden} E={args.experts} K={args.topk} ranks={args.ranks} "
          f"y=randn*{args.scale} on {outs[0]['device']}")
    print("rank  combine bf16 us  combine logfmt us  logfmt/bf16  max rel err  mean rel err  calc_diff  compared"
          "  nonfinite")
    for o in outs:
        cd = "n/a" if o["calc_diff"] is None else f"{o['calc_diff']:.2e}"
        print(f"{o['rank']:>4}  {o['bf16_us']:>15.1f}  {o['logfmt_us']:>17.1f}  {o['logfmt_us'] / o['bf16_us']:>11.2f}"
              f"  {_pct(o['max_rel']):>11}  {_pct(o['mean_rel']):>12}  {cd:>9}  {o['compared']:>8}  {o['nonfinite']:>9}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"config": vars(args), "ranks": outs}, fh, indent=1)
    bad = [o["rank"] for o in outs if o["nonfinite"] or not o["compared"]]
    if bad:
        print(f"logfmt_bench: rank(s) {bad}: non-finite outputs or nothing to compare (see the table)",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
