"""Killing a rank on a GPU shared through the CUDA MPS daemon, as a drill does.

MPS does not contain the death of a client whose kernels are still running: a client SIGKILLed in the
middle of a kernel leaves the MPS server to tear that work down, and every other client of the GPU then
gets cudaErrorIllegalAddress (NVIDIA's MPS guide, "client early termination"; seen on an H200 with a
kernel spinning on device memory only: 2 of 2 survivors faulted, 0 of 3 after terminate_client). A
survivor on another GPU never sees this, so a drill that shares one GPU among its ranks first asks the
MPS control daemon to terminate the victim's GPU work (`terminate_client`), which stops its kernels at
whatever point they reached, as a crash would, and only then kills the process."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
from typing import List

log = logging.getLogger("pyep.ep.elastic.mps")
CONTROL = "nvidia-cuda-mps-control"
TIMEOUT_S = 10.0


def _control(command: str) -> str:
    exe = shutil.which(CONTROL)
    if exe is None:
        return ""
    try:
        done = subprocess.run([exe], input=command + "\n", capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("%s %r failed: %s", CONTROL, command, exc)
        return ""
    return done.stdout.strip()


def mps_servers() -> List[int]:
    """PIDs of the running MPS servers; empty when no daemon runs (or its answer is not a PID list)."""
    out = _control("get_server_list")
    return [int(tok) for tok in out.split() if tok.isascii() and tok.isdigit()]


def terminate_own_gpu_work() -> bool:
    """Ask every MPS server to terminate this process's GPU work (a no-op without MPS). True if a server
    took the request."""
    pid = os.getpid()
    took = False
    for server in mps_servers():
        if _control(f"terminate_client {server} {pid}") == "0":
            took = True
    return took
