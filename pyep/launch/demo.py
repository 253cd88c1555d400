"""The "reference-demo" workload: a small, self-checking EP run that `pyep launch` can start anywhere.

    torchrun ... -m pyep.launch.demo [--iters 4] [--tokens N] [--seed 0] [--ep auto|require|off]

Every rank checks an all_reduce, then (when pyep.ep is importable, or always with --ep require) runs
`iters` dispatch/combine rounds through `EpBuffer(backend=PYEP_EP_BACKEND)` with the shape from the
PYEP_EP_* variables. Inputs are generated from (seed, rank, iteration), so each receiver rebuilds
every sender's tokens and checks recv_count, layout_range, src_info and every received row exactly;
with identity experts, combine must return x * (sum of the valid top-k weights). Rank 0 writes
demo-result.json into $PYEP_RUN_DIR. Any mismatch exits non-zero.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from ..config.env import ep_from_env, virtual_node_size
from .progress import report

log = logging.getLogger("pyep.demo")


def _inputs(seed: int, rank: int, it: int, n: int, hidden: int, experts: int, topk: int) -> Tuple[Any, Any, Any]:
    import torch
    g = torch.Generator().manual_seed(seed * 1_000_003 + it * 7919 + rank)
    x = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
    idx = torch.rand(n, experts, generator=g).argsort(dim=1)[:, :topk].to(torch.int64).contiguous()
    idx[torch.rand(n, topk, generator=g) < 0.1] = -1      # some tokens skip some of their slots
    w = torch.rand(n, topk, generator=g, dtype=torch.float32)
    return x, idx, w


def _check_dispatch(recv_x: Any, recv_count: Any, handle: Any, world: int, rank: int, it: int,
                    args: argparse.Namespace, ep: Any) -> None:
    import torch
    e_local = ep.num_experts // world
    senders = [_inputs(args.seed, r, it, args.tokens, ep.hidden, ep.num_experts, ep.num_topk) for r in range(world)]
    layout = handle.layout_range.cpu()
    src_info = handle.src_info.cpu()
    counts = recv_count.cpu()
    recv = recv_x.cpu()
    for e in range(e_local):
        expert = rank * e_local + e
        total = 0
        for r, (x, idx, _) in enumerate(senders):
            tokens = sorted({t for t in range(idx.shape[0]) if bool((idx[t] == expert).any())})
            begin, count = int(layout[e, r]) >> 32, int(layout[e, r]) & 0xFFFFFFFF
            if count != len(tokens) or begin != total:
                raise AssertionError(f"iteration {it}: expert {expert} from rank {r}: layout (begin {begin}, "
                                     f"count {count}), expected ({total}, {len(tokens)})")
            got = [int(v) for v in src_info[e, begin:begin + count]]
            if got != tokens:
                raise AssertionError(f"iteration {it}: expert {expert} from rank {r}: src_info {got}, expected {tokens}")
            if count and not torch.equal(recv[e, begin:begin + count], x[tokens]):
                raise AssertionError(f"iteration {it}: expert {expert} from rank {r}: received rows differ")
            total += count
        if int(counts[e]) != total:
            raise AssertionError(f"iteration {it}: recv_count[{e}] = {int(counts[e])}, expected {total}")


def run_ep(args: argparse.Namespace, rank: int, world: int, steps: int, step0: int) -> Dict[str, Any]:
    import torch
    from ..ep.ll.buffer import EpBuffer
    ep = ep_from_env()
    backend = ep.backend
    kwargs: Dict[str, Any] = dict(num_max_dispatch_tokens_per_rank=ep.num_max_dispatch_tokens_per_rank,
                                  hidden=ep.hidden, num_experts=ep.num_experts, transport=ep.transport,
                                  timeout_us=ep.timeout_us, backend=backend)
    vsize = virtual_node_size()
    if vsize is not None:
        kwargs["ranks_per_node"] = vsize
    if args.tokens > ep.num_max_dispatch_tokens_per_rank:
        raise ValueError(f"--tokens {args.tokens} exceeds num_max_dispatch_tokens_per_rank "
                         f"{ep.num_max_dispatch_tokens_per_rank}")
    times: List[float] = []
    with EpBuffer(None, **kwargs) as buf:
        for it in range(args.iters):
            x, idx, w = _inputs(args.seed, rank, it, args.tokens, ep.hidden, ep.num_experts, ep.num_topk)
            x, idx, w = x.to(buf.device), idx.to(buf.device), w.to(buf.device)
            t0 = time.perf_counter()
            recv_x, recv_count, handle, _, _ = buf.dispatch(x, idx, use_fp8=False)
            out, _, _ = buf.combine(recv_x, idx, w, handle)    # identity experts
            times.append(time.perf_counter() - t0)
            _check_dispatch(recv_x, recv_count, handle, world, rank, it, args, ep)
            expect = (x.float() * (w * (idx >= 0)).sum(dim=1, keepdim=True)).to(torch.bfloat16)
            if not torch.allclose(out.float().cpu(), expect.float().cpu(), rtol=2e-2, atol=2e-2):
                err = (out.float() - expect.float()).abs().max().item()
                raise AssertionError(f"iteration {it}: combine differs from x * sum(weights) by up to {err}")
            report(step0 + it + 1, steps, f"dispatch/combine {it + 1}/{args.iters}")
        name = buf.backend_name
    return {"backend": name, "transport": ep.transport, "num_experts": ep.num_experts, "hidden": ep.hidden,
            "num_topk": ep.num_topk, "tokens": args.tokens, "iters": args.iters,
            "virtual_node_size": vsize, "seconds_per_iter": times}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pyep.launch.demo", description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16, help="tokens per rank per iteration (<= T)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ep", choices=["auto", "require", "off"], default="auto",
                   help="run the EP part: when pyep.ep imports (auto), always, or never")
    p.add_argument("--timeout-s", type=float, default=120.0, help="bound on every collective")
    args = p.parse_args(argv)
    if args.iters < 1 or args.tokens < 0 or args.timeout_s <= 0:
        p.error("--iters must be >= 1, --tokens >= 0 and --timeout-s > 0")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import torch
    import torch.distributed as dist
    ep_settings = ep_from_env()
    backend = ep_settings.dist_backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES", "") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    run_ep_part = args.ep == "require"
    if args.ep == "auto":
        import importlib.util
        try:
            run_ep_part = importlib.util.find_spec("pyep.ep.ll.buffer") is not None
            if not run_ep_part:
                log.warning("pyep.ep is not installed; running the collective check only")
        except ImportError as exc:
            log.warning("pyep.ep is not importable (%s); running the collective check only", exc)
    steps = 1 + (args.iters if run_ep_part else 0)
    result: Dict[str, Any] = {"world_size": world, "dist_backend": backend}
    try:
        t = torch.tensor([rank + 1], dtype=torch.int64, device=device)
        dist.all_reduce(t)
        if int(t.item()) != world * (world + 1) // 2:
            raise AssertionError(f"all_reduce gave {int(t.item())}, expected {world * (world + 1) // 2}")
        report(1, steps, "all_reduce")
        if run_ep_part:
            result["ep"] = run_ep(args, rank, world, steps, 1)
        dist.barrier()
    except (AssertionError, ValueError, TypeError, RuntimeError) as exc:
        print(f"rank {rank}: demo FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    timing = ""
    if "ep" in result:
        per_iter = sorted(result["ep"]["seconds_per_iter"])
        timing = (f"; dispatch + combine {1e3 * per_iter[len(per_iter) // 2]:.1f} ms per iteration "
                  f"(median of {len(per_iter)}, checks excluded)")
    print(f"rank {rank}: demo passed ({world} ranks, {backend}"
          + (f", EP backend {result['ep']['backend']}" if "ep" in result else ", no EP part") + ")" + timing,
          flush=True)
    run_dir = os.environ.get("PYEP_RUN_DIR")
    if rank == 0 and run_dir:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "demo-result.json"), "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
