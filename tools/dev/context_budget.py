"""How many CUDA contexts, each with its CUDA_DEVICE_MAX_CONNECTIONS, one GPU takes at once.

pyep/softnic/cuda_env.py splits a budget of hardware work queues among the processes that share a GPU.
This probe measures where that budget ends: for each case (a list of per-process settings) it starts
the processes one after another, each makes its context on cuda:0, runs a kernel and stays alive until
all have tried; then it prints, per case, how many made their context and the first error.

    python3 tools/dev/context_budget.py 32,32,24,24,24,24 16x6 32x4 8x16

A case "AxN" is N processes with A each; cases separated by spaces; under the MPS daemon the clients
share its server, so run it with the daemon on and off.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import time
from typing import List, Tuple


def _client(conns: int, started: "mp.Queue", release: "mp.Event") -> None:
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(conns)
    try:
        import torch
        x = torch.ones(1 << 20, device="cuda:0")
        torch.cuda.synchronize()
        started.put((os.getpid(), conns, None if float(x.sum()) == float(1 << 20) else "wrong sum"))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        started.put((os.getpid(), conns, f"{type(e).__name__}: {str(e).splitlines()[0]}"))
        return
    release.wait(120)


def parse_case(text: str) -> List[int]:
    if "x" in text:
        value, count = text.split("x")
        return [int(value)] * int(count)
    return [int(v) for v in text.split(",")]


def run_case(conns: List[int]) -> Tuple[int, List[str]]:
    ctx = mp.get_context("spawn")
    started, release = ctx.Queue(), ctx.Event()
    procs, errors, ok = [], [], 0
    for c in conns:                      # one after another: the order in which a test's pools start
        p = ctx.Process(target=_client, args=(c, started, release))
        p.start()
        procs.append(p)
        try:
            _, got, err = started.get(timeout=180)
        except queue.Empty:
            got, err = c, f"process {p.pid} made no context within 180 s"
        if err is None:
            ok += 1
        else:
            errors.append(f"{got}: {err}")
    release.set()
    for p in procs:
        p.join(30)
    return ok, errors


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="+")
    args = ap.parse_args(argv)
    for text in args.cases:
        conns = parse_case(text)
        t0 = time.time()
        ok, errors = run_case(conns)
        print(f"{text:>24}: {ok}/{len(conns)} contexts, total {sum(conns)} connections, "
              f"{time.time() - t0:.1f} s" + (f"; first error {errors[0]}" if errors else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
