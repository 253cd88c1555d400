#!/usr/bin/env python3
"""DeepEP V1's own figures, measured on this machine in the same job as ours: runs
`bash .anchors/deepep_v1.sh {intranode|ll} N [args]` (DeepEP built from .anchors/deepep on first use),
parses what its test prints and writes the figures as JSON. `--on pyep` runs the same unchanged test
file on pyep's DeepEP shim instead (DEEPEP_ON=pyep): one harness, both libraries.

  python tools/deepep_baseline.py intranode 2 --out DIR [-- --num-tokens 4096 --hidden 7168 ...]
  python tools/deepep_baseline.py intranode 2 --on pyep --out DIR
  python tools/deepep_baseline.py ll 2 --out DIR [-- --num-tokens 128]

More ranks than GPUs: the script lets the ranks share the GPUs (its .anchors/onegpu: cuda:<rank> ->
rank % GPUs, a gloo group with CUDA tensors staged through host memory) and starts the CUDA MPS daemon
when none runs; the document says so ("mps_started"). DeepEP's LL test cannot share a GPU (NVSHMEM).

intranode (tests/test_intranode.py): the "[tuning] Best dispatch (FP8|BF16)" and "Best combine" lines
(SMs, NVL chunk, GB/s counted as NVLink bytes received/sent by rank 0, time per call in us), the
default-config line of each sweep, the whole chunk sweep, the layout kernel time, and how many
correctness checks printed "passed". ll (tests/test_low_latency.py): rank 0's dispatch+combine
bandwidth and times, per-kernel dispatch/combine (kineto) and the hook halves.
`pyep bench --deepep` imports this file (by path) and shows these figures beside its own.
Exit status: 0 parsed, 1 DeepEP ran but printed no figures, 2 DeepEP is not available here.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

log = logging.getLogger("pyep.deepep_baseline")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(".anchors", "deepep_v1.sh")
SCHEMA = "pyep-deepep-baseline/1"
MODES = ("intranode", "ll")
ON = ("deepep", "pyep")
# What deepep_v1.sh prints when it starts the MPS daemon for ranks that share GPUs.
_MPS_STARTED = re.compile(r"ranks share \d+ GPU\(s\); MPS daemon started")
# torchrun's variables: DeepEP's init_dist reads WORLD_SIZE/RANK as the *node* count/rank, so a
# baseline started from inside a torchrun job must not inherit them.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


class DeepEpUnavailable(RuntimeError):
    """No DeepEP checkout / script here, or it could not be built."""


_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_BEST_DISPATCH = re.compile(r"\[tuning\] Best dispatch \((FP8|BF16)\): SMs (\d+), NVL chunk (\d+), " + _NUM
                            + r" GB/s \(NVL\), t: " + _NUM + r" us")
_BEST_COMBINE = re.compile(r"\[tuning\] Best combine: SMs (\d+), NVL chunk (\d+): " + _NUM
                           + r" GB/s \(NVL\), t: " + _NUM + r" us")
_TUNING = re.compile(r"\[tuning\] SMs (\d+), NVL chunk (\d+|default): " + _NUM + r" GB/s \(NVL\), " + _NUM + r" us")
_LAYOUT = re.compile(r"\[layout\] Kernel performance: " + _NUM + r" ms")
_CONFIG = re.compile(r"\[config\] num_tokens=(\d+), hidden=(\d+), num_topk=(\d+)")
_LL_DC = re.compile(r"\[rank (\d+)\] Dispatch \+ combine bandwidth: " + _NUM + r" GB/s, avg_t=" + _NUM
                    + r" us, min_t=" + _NUM + r" us, max_t=" + _NUM + r" us")
_LL_KERNEL = re.compile(r"\[rank (\d+)\] Dispatch bandwidth: " + _NUM + r" GB/s, avg_t=" + _NUM
                        + r" us \| Combine bandwidth: " + _NUM + r" GB/s, avg_t=" + _NUM + r" us")
_LL_HOOK = re.compile(r"\[rank (\d+)\] Dispatch send/recv time: " + _NUM + r" \+ " + _NUM
                      + r" us \| Combine send/recv time: " + _NUM + r" \+ " + _NUM + r" us")


def parse_intranode(text: str) -> Dict[str, Any]:
    """Figures of a test_intranode.py log (rank 0 prints them). The sweep lines before each "Best"
    line belong to that section: dispatch FP8, dispatch BF16, combine, in the order the test runs."""
    out: Dict[str, Any] = {"checks_passed": len(re.findall(r"\bpassed\b", text)), "sweeps": {}, "default": {}}
    pending: List[Dict[str, Any]] = []
    for line in text.splitlines():
        m = _CONFIG.search(line)
        if m:
            out["shape"] = {"num_tokens": int(m[1]), "hidden": int(m[2]), "num_topk": int(m[3])}
        m = _LAYOUT.search(line)
        if m:
            out["layout_us"] = float(m[1]) * 1000.0
        m = _TUNING.search(line)
        if m:
            pending.append({"num_sms": int(m[1]), "nvl_chunk": None if m[2] == "default" else int(m[2]),
                            "gbps": float(m[3]), "t_us": float(m[4])})
            continue
        m = _BEST_DISPATCH.search(line)
        key = None
        if m:
            key = "dispatch_fp8" if m[1] == "FP8" else "dispatch_bf16"
            best = {"num_sms": int(m[2]), "nvl_chunk": int(m[3]), "gbps": float(m[4]), "t_us": float(m[5])}
        else:
            m = _BEST_COMBINE.search(line)
            if m:
                key = "combine"
                best = {"num_sms": int(m[1]), "nvl_chunk": int(m[2]), "gbps": float(m[3]), "t_us": float(m[4])}
        if key is not None:
            out[key] = best
            if pending:
                out["sweeps"][key] = pending
                default = [p for p in pending if p["nvl_chunk"] is None]
                if default:
                    out["default"][key] = default[-1]
            pending = []
    return out


def parse_ll(text: str, rank: int = 0) -> Dict[str, Any]:
    """test_low_latency.py's figures for one rank; each kind keeps every run (the test may run more
    than once) and the headline is the last one."""
    runs: Dict[str, List[Dict[str, float]]] = {"dispatch_combine": [], "kernels": [], "hooks": []}
    # Ranks print without a lock: two ranks' lines can share one line of the log (finditer, not search).
    for line in text.splitlines():
        for m in _LL_DC.finditer(line):
            if int(m[1]) == rank:
                runs["dispatch_combine"].append({"gbps": float(m[2]), "avg_us": float(m[3]),
                                                 "min_us": float(m[4]), "max_us": float(m[5])})
        for m in _LL_KERNEL.finditer(line):
            if int(m[1]) == rank:
                runs["kernels"].append({"dispatch_gbps": float(m[2]), "dispatch_us": float(m[3]),
                                        "combine_gbps": float(m[4]), "combine_us": float(m[5])})
        for m in _LL_HOOK.finditer(line):
            if int(m[1]) == rank:
                runs["hooks"].append({"dispatch_send_us": float(m[2]), "dispatch_recv_us": float(m[3]),
                                      "combine_send_us": float(m[4]), "combine_recv_us": float(m[5])})
    out: Dict[str, Any] = {"rank": rank, "runs": runs}
    for kind, vals in runs.items():
        if vals:
            out[kind] = vals[-1]
    return out


def has_figures(mode: str, parsed: Dict[str, Any]) -> bool:
    if mode == "intranode":
        return all(k in parsed for k in ("dispatch_fp8", "dispatch_bf16", "combine"))
    return "kernels" in parsed or "dispatch_combine" in parsed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_available(root: str = ROOT) -> None:
    script = os.path.join(root, SCRIPT)
    src = os.path.join(root, ".anchors", "deepep", "csrc")
    if not os.path.isfile(script):
        raise DeepEpUnavailable(f"{script} is missing: DeepEP's runner script is not in this checkout "
                                "(copy shared/anchors/deepep_v1.sh to .anchors/, and carry .anchors to the GPU machine)")
    if not os.path.isdir(src):
        raise DeepEpUnavailable(f"no DeepEP checkout at {os.path.dirname(src)} (see the preparation steps in "
                                f"{SCRIPT}; on the GPU machine, carry .anchors)")


def check_visible_gpus(num_ranks: int, env: Dict[str, str], root: str = ROOT) -> None:
    """CUDA_VISIBLE_DEVICES that leaves fewer GPUs than the ranks, on a machine with more: the ranks
    must share the visible ones, which the runner does only when it counts them (a runner that counts
    `nvidia-smi -L` gives each rank a GPU of its own, and DeepEP's ranks past the visible ones fail to
    start). DeepEpUnavailable says so before anything runs."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return
    visible = [p for p in raw.split(",") if p.strip()]
    if num_ranks <= len(visible):
        return
    with open(os.path.join(root, SCRIPT), encoding="utf-8", errors="replace") as fh:
        if "CUDA_VISIBLE_DEVICES" in fh.read():
            return
    from pyep.config.host import count_gpus
    physical = count_gpus()
    if physical > len(visible):
        raise DeepEpUnavailable(
            f"CUDA_VISIBLE_DEVICES={raw} leaves {len(visible)} of this machine's {physical} GPUs for "
            f"{num_ranks} ranks, but {SCRIPT} counts the machine's GPUs (nvidia-smi), so its ranks would not "
            "share the visible ones: give it a GPU count that follows CUDA_VISIBLE_DEVICES "
            "(docs/performance.md, 'Ranks sharing one GPU'), or unset the variable")


def log_name(on: str, mode: str, num_ranks: int) -> str:
    """The full log deepep_v1.sh writes into $OUT (its tag: library, mode, ranks)."""
    return f"{on}_{mode}_{num_ranks}.log"


def run(mode: str, num_ranks: int, extra: Sequence[str] = (), out_dir: Optional[str] = None,
        timeout_s: float = 900.0, root: str = ROOT, on: str = "deepep") -> Dict[str, Any]:
    """Runs DeepEP's test (on DeepEP, or with on="pyep" on pyep's shim) and returns the JSON document
    (figures under "figures")."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if on not in ON:
        raise ValueError(f"on must be one of {ON}, got {on!r}")
    if num_ranks < 1:
        raise ValueError(f"number of ranks must be >= 1, got {num_ranks}")
    check_available(root)
    check_visible_gpus(num_ranks, dict(os.environ), root)
    out_dir = out_dir or os.path.join(root, "runs", "deepep-" + time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    env["OUT"] = os.path.abspath(out_dir)            # the script's full logs land here
    env["MASTER_PORT"] = str(_free_port())            # DeepEP's rendezvous, away from ours
    env["DEEPEP_ON"] = on
    cmd = ["bash", SCRIPT, mode, str(num_ranks), *extra]
    log.info("running %s (logs in %s)", " ".join(cmd), out_dir)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stdout, stderr = 124, _text(exc.stdout), _text(exc.stderr) + f"\ntimed out after {timeout_s:g} s"
    # The script greps its stdout down to a few lines; the figures of the tuning sweeps are in its log.
    full_log = os.path.join(out_dir, log_name(on, mode, num_ranks))
    text = stdout
    if os.path.isfile(full_log):
        with open(full_log, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    if rc == 2 and "no DeepEP checkout" in stdout:
        raise DeepEpUnavailable(stdout.strip())
    figures = parse_intranode(text) if mode == "intranode" else parse_ll(text)
    test = "tests/test_intranode.py" if mode == "intranode" else "tests/test_low_latency.py"
    doc = {"schema": SCHEMA, "mode": mode, "num_ranks": num_ranks, "on": on, "command": cmd, "rc": rc,
           "out_dir": out_dir, "seconds": round(time.monotonic() - t0, 1),
           "log": full_log if os.path.isfile(full_log) else None,
           "mps_started": bool(_MPS_STARTED.search(stdout)),
           "source": (f"DeepEP V1 (.anchors/deepep), {test}" if on == "deepep"
                      else f"pyep's DeepEP shim under DeepEP V1's {test} (DEEPEP_ON=pyep)"),
           "ok": rc == 0 and has_figures(mode, figures), "figures": figures,
           "output_tail": (stdout + stderr)[-4000:]}
    return doc


PROBE = os.path.join("tools", "dev", "normal_b2b_probe.py")
_B2B_KEYS = (("fp8_colmajor", "dispatch_fp8"), ("bf16", "dispatch_bf16"), ("combine", "combine"))


def figures_from_probe(doc: Dict[str, Any], sms: int, chunk: int) -> Dict[str, Any]:
    """test_intranode.py-shaped figures from tools/dev/normal_b2b_probe.py's JSON: per call kind, rank 0's
    GB/s (the probe counts them as DeepEP's test does) and mean event time of its back-to-back calls
    (DeepEP's bench())."""
    args, ranks = doc["args"], doc["ranks"]
    r0 = next(r for r in ranks if r["rank"] == 0)
    out: Dict[str, Any] = {"shape": {"num_tokens": args["num_tokens"], "hidden": args["hidden"],
                                     "num_topk": args["num_topk"]}}
    for variant, key in _B2B_KEYS:
        v = r0["variants"].get(variant, {}).get("b2b")
        if v:
            out[key] = {"num_sms": sms, "nvl_chunk": chunk, "gbps": float(v["gbps"]), "t_us": float(v["event_us_mean"])}
    return out


def run_b2b(num_ranks: int, sms: int, shape: Sequence[str] = (), out_dir: Optional[str] = None,
            timeout_s: float = 600.0, root: str = ROOT, on: str = "deepep", chunk: int = 8,
            ring: int = 256) -> Dict[str, Any]:
    """DeepEP's bench() loop (tools/dev/normal_b2b_probe.py) on DeepEP or on pyep's shim at `sms` SMs:
    where DeepEP's own test cannot run (its 24 SMs per rank do not fit the ranks sharing one GPU), the
    same calls, inputs and byte counts at an SM count that fits both. `shape`: --num-tokens N --hidden H
    --num-topk K --num-experts E. Ranks share the GPUs as deepep_v1.sh lets them (.anchors/onegpu)."""
    if on not in ON:
        raise ValueError(f"on must be one of {ON}, got {on!r}")
    check_available(root)
    out_dir = out_dir or os.path.join(root, "runs", "deepep-" + time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    anchors = os.path.join(root, ".anchors")
    t0 = time.monotonic()
    if on == "deepep":    # built once by its runner script (DEEPEP_BUILD_ONLY=1)
        built = subprocess.run(["bash", SCRIPT, "intranode", "2"], cwd=root, capture_output=True, text=True,
                               env={**env, "DEEPEP_BUILD_ONLY": "1", "OUT": os.path.abspath(out_dir)},
                               timeout=timeout_s)
        if built.returncode != 0:
            raise DeepEpUnavailable(f"DeepEP did not build: {(built.stdout + built.stderr).strip()[-400:]}")
        lib = os.path.join(anchors, "deepep")
    else:
        lib = os.path.join(out_dir, "shim")
        os.makedirs(os.path.join(lib, "deep_ep"), exist_ok=True)
        with open(os.path.join(lib, "deep_ep", "__init__.py"), "w", encoding="utf-8") as fh:
            fh.write("from pyep.compat.deep_ep import *  # noqa\nimport pyep.compat.deep_ep as _m\nBuffer = _m.Buffer\n")
        lib = lib + os.pathsep + root
    env.update(ONEGPU="1", PYTHONPATH=os.pathsep.join([os.path.join(anchors, "onegpu"), lib]))
    js = os.path.join(out_dir, f"b2b_{on}_{num_ranks}.json")
    cmd = [sys.executable, os.path.join(root, PROBE), "--ranks", str(num_ranks), "--sms", str(sms), "--chunk", str(chunk),
           "--ring", str(ring), *shape, "--variants", "fp8_colmajor", "bf16", "combine", "--modes", "b2b",
           "--json", js, "--trace-dir", os.path.join(out_dir, f"b2b_traces_{on}")]
    log.info("running %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = 124, _text(exc.stdout) + _text(exc.stderr) + f"\ntimed out after {timeout_s:g} s"
    log_path = os.path.join(out_dir, f"b2b_{on}_{num_ranks}.log")
    with open(log_path, "w", encoding="utf-8") as fh:
        fh.write(text)
    figures: Dict[str, Any] = {}
    if rc == 0 and os.path.isfile(js):
        with open(js, encoding="utf-8") as fh:
            figures = figures_from_probe(json.load(fh), sms, chunk)
    who = "DeepEP V1 (.anchors/deepep)" if on == "deepep" else "pyep's DeepEP shim"
    return {"schema": SCHEMA, "mode": "intranode", "harness": "b2b", "num_ranks": num_ranks, "on": on,
            "command": cmd, "rc": rc, "out_dir": out_dir, "seconds": round(time.monotonic() - t0, 1), "log": log_path,
            "mps_started": False, "source": f"{who}, DeepEP's bench() loop at {sms} SMs ({PROBE})",
            "label": ("DeepEP (its bench() loop)" if on == "deepep" else "pyep shim (DeepEP's bench() loop)"),
            "ok": rc == 0 and has_figures("intranode", figures), "figures": figures, "output_tail": text[-4000:]}


def _text(v: Any) -> str:
    if v is None:
        return ""
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)


def write(path: str, doc: Dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    os.replace(tmp, path)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=MODES)
    p.add_argument("num_ranks", type=int)
    p.add_argument("--on", choices=ON, default="deepep", help="whose library runs the test (default deepep)")
    p.add_argument("--out", help="directory for DeepEP's logs and deepep_<mode>.json (default runs/deepep-<time>)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="bound of the whole DeepEP run (build included)")
    p.add_argument("--parse", metavar="LOG", help="only parse an existing DeepEP log and print the JSON")
    p.add_argument("extra", nargs="*", help="arguments for DeepEP's test script (after --)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.parse:
        with open(args.parse, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        figures = parse_intranode(text) if args.mode == "intranode" else parse_ll(text)
        print(json.dumps(figures, indent=1))
        return 0 if has_figures(args.mode, figures) else 1
    try:
        doc = run(args.mode, args.num_ranks, args.extra, args.out, args.timeout_s, on=args.on)
    except DeepEpUnavailable as exc:
        print(f"deepep_baseline: DeepEP not available: {exc}", file=sys.stderr)
        return 2
    path = os.path.join(doc["out_dir"], f"deepep_{args.mode}_on_{args.on}.json")
    write(path, doc)
    print(json.dumps(doc["figures"], indent=1))
    print(f"DeepEP {args.mode}: rc={doc['rc']}, {'figures parsed' if doc['ok'] else 'NO FIGURES'}; {path}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
