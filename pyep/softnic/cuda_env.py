"""The one CUDA setting the softnic needs from a process that posts to it from GPU kernels.

The softnic executes a WQE that touches GPU memory as a copy or a one-thread atomic kernel on a CUDA
stream of its own, while the kernels that posted it spin on the device until the data lands. CUDA
multiplexes a context's streams onto a few hardware work queues (`CUDA_DEVICE_MAX_CONNECTIONS`, 8 by
default; under the MPS daemon the clients of a GPU share one pool of them), and work on one queue runs
in order: a softnic copy that lands in the queue of a spinning kernel waits for that kernel, which waits
for the copy, until the kernel's timeout marks a live peer dead. Seen on an H200 with two ranks sharing
it under MPS: 3 of 8 softnic drills marked a live rank; with 32 connections, 10 of 10 passed. The value
is read when the CUDA context is created, so it has to be in the environment before any CUDA call:
`pyep launch`, `pyep drill` and the test workers set it for ranks that use the softnic; a program of
your own sets it before it imports torch (or before its first CUDA call).

The queues are a resource of the GPU that every context on it draws from: 16 processes on one H200 with
32 each failed to create their contexts ("out of memory" in cudaSetDevice), with CUDA's 8 each they ran;
on one H100 under the MPS daemon 4 test workers with 32 each (beside their parent's context) failed the
same way (one context in four), with 16 each they ran. On one H200 under the daemon
(tools/dev/context_budget.py, docs/results/2026-11-28d-h200x2): 6 processes with 16 each (96) all made
their contexts; 4 with 32 (128) lost one ("out of memory"); 2 with 32 and then 4 with 24 (160) lost two
("CUDA-capable device(s) is/are busy or unavailable"). So processes that share a GPU split a budget of
QUEUE_BUDGET (never below CUDA's default)."""
from __future__ import annotations

import os
from typing import MutableMapping, Optional

VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"
RECOMMENDED = 32
CUDA_DEFAULT = 8
QUEUE_BUDGET = 96       # per GPU, split among the processes that share it (and a parent's context)


def connections_for(processes_on_gpu: int) -> int:
    """The setting for each of `processes_on_gpu` processes sharing one GPU."""
    return max(CUDA_DEFAULT, min(RECOMMENDED, QUEUE_BUDGET // max(1, processes_on_gpu)))


def softnic_cuda_env(env: MutableMapping[str, str], processes_on_gpu: int = 1) -> None:
    """Give a process that will use the softnic from GPU kernels enough hardware queues, unless the
    caller chose a value."""
    env.setdefault(VARIABLE, str(connections_for(processes_on_gpu)))


def cuda_connections_warning(environ: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """A sentence when this process's setting can put softnic work behind a spinning kernel, else None."""
    env = os.environ if environ is None else environ
    raw = env.get(VARIABLE)
    try:
        value = int(raw) if raw is not None else None
    except ValueError:
        value = None
    if value is not None and value > CUDA_DEFAULT:
        return None
    have = "unset (CUDA's default, 8)" if raw is None else repr(raw)
    return (f"{VARIABLE} is {have}: the softnic's copies can queue behind a kernel that waits for them "
            f"(a live peer then times out; likely when ranks share a GPU under MPS). Set "
            f"{VARIABLE}={RECOMMENDED} before CUDA starts (docs/softnic.md)")
