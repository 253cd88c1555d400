"""The run directory: runs/<YYYYmmdd-HHMMSS>-<name>/ holding everything one launch produced.

    config.yaml      the resolved config (what actually ran; loadable again), mode 0600
    launch.json      the exact commands, per node, mode 0600 (both hold the config's env: values)
    private/         the job secret (0700; removed when a local or ssh job ends)
    logs/            rank-NNNNN.log per rank (written by the ranks), node-I-HOST.log per node
    summary.json     exit codes, durations, result files
    events.jsonl     failures, restarts and rejoins of single ranks (launcher.restart.policy: rank)
    *.json, *.png …  whatever the workload wrote into $PYEP_RUN_DIR
    nodes/HOST/      copies of remote nodes' run directories (ssh with collect_results)
"""
from __future__ import annotations

import io
import json
import os
import tarfile
import time
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Tuple

from ..config import ClusterConfig, dump_config
from .secret import write_private

RESULT_SUFFIXES = (".json", ".png", ".svg", ".pdf", ".csv", ".txt", ".md", ".html")
_OWN_FILES = {"config.yaml", "launch.json", "summary.json", "events.jsonl"}


def run_dir_name(name: str, now: Optional[float] = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    return f"{stamp}-{name}"


def choose_run_dir(root: str, name: str, now: Optional[float] = None) -> str:
    """A run directory path under root that does not exist yet (relative if root is relative)."""
    base = os.path.join(root, run_dir_name(name, now))
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def create(path: str) -> None:
    os.makedirs(os.path.join(path, "logs"), exist_ok=False)


def write_launch_files(run_dir: str, cfg: ClusterConfig, commands: List[Dict[str, Any]], source: str) -> None:
    """config.yaml and launch.json, mode 0600: both hold the config's `env:` values (tokens, passwords)."""
    write_private(os.path.join(run_dir, "config.yaml"),
                  (f"# resolved by pyep launch from {source}\n" + dump_config(cfg)).encode("utf-8"))
    write_private(os.path.join(run_dir, "launch.json"),
                  json.dumps({"source": source, "launcher": cfg.launcher.kind, "commands": commands},
                             indent=2).encode("utf-8"))


def result_files(run_dir: str) -> List[Tuple[str, int]]:
    """Files the workload produced (relative path, size), without pyep's own bookkeeping and logs."""
    found: List[Tuple[str, int]] = []
    for dirpath, dirnames, filenames in os.walk(run_dir):
        rel_dir = os.path.relpath(dirpath, run_dir)
        dirnames[:] = sorted(d for d in dirnames if not (rel_dir == "." and d == "logs"))
        for fn in sorted(filenames):
            rel = os.path.normpath(os.path.join(rel_dir, fn))
            if rel in _OWN_FILES or not fn.lower().endswith(RESULT_SUFFIXES) or "/logs/" in f"/{rel}":
                continue
            found.append((rel, os.path.getsize(os.path.join(dirpath, fn))))
    return found


def append_event(run_dir: str, event: Dict[str, Any]) -> None:
    """One line of events.jsonl: failures, restarts and rejoins of single ranks (launcher.restart)."""
    with open(os.path.join(run_dir, "events.jsonl"), "a", encoding="utf-8") as fh:
        fh.write(json.dumps(dict(event, time=round(time.time(), 3))) + "\n")


def write_summary(run_dir: str, summary: Dict[str, Any]) -> None:
    with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))


def extract_tar(data: bytes, dest: str) -> int:
    """Unpack a node's tar stream under dest, refusing links and paths that leave dest."""
    os.makedirs(dest, exist_ok=True)
    root = os.path.realpath(dest)
    count = 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for member in tar.getmembers():
            target = os.path.realpath(os.path.join(root, member.name))
            if not (target == root or target.startswith(root + os.sep)):
                raise ValueError(f"refusing tar member {member.name!r}: outside {dest}")
            if member.isdir():
                os.makedirs(target, exist_ok=True)
            elif member.isfile():
                os.makedirs(os.path.dirname(target), exist_ok=True)
                src = tar.extractfile(member)
                assert src is not None
                with open(target, "wb") as out:
                    out.write(src.read())
                count += 1
    return count
