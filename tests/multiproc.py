"""Run test functions in N torch.distributed processes (gloo on 127.0.0.1) with hard timeouts.

`DistPool(n)` starts n spawned workers once, joins them into one process group (rendezvous through a
TCPStore that the parent hosts on an ephemeral port), then runs any number of module-level functions
on every rank: `pool.run(fn, *args)` returns the per-rank results, raises `RankFailure` with every
failing rank's traceback, or `TimeoutError` naming the ranks that did not answer (the pool is then
torn down and restarts on the next run). `run_distributed(fn, n, *args)` is the one-shot form.
Functions run as fn(*args, **kwargs); inside them torch.distributed is initialised.
"""
from __future__ import annotations

import datetime
import faulthandler
import logging
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable, List, Optional

log = logging.getLogger("tests.multiproc")
FAILURE_GRACE_S = 5.0


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


def _worker(rank: int, world: int, port: int, backend: str, pg_timeout_s: float,
            tasks: "mp.Queue", results: "mp.Queue", processes_on_gpu: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # keep gloo's own sockets on 127.0.0.1
    from pyep.softnic.cuda_env import softnic_cuda_env
    # Before CUDA starts: GPU cases post to the softnic, and the workers may all share one GPU.
    softnic_cuda_env(os.environ, processes_on_gpu=processes_on_gpu)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)   # n workers share a few cores; oversubscription only slows them down
    stall_s = float(os.environ.get("PYEP_TEST_STALL_DUMP_S", "0"))
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                              timeout=datetime.timedelta(seconds=pg_timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        results.put((-1, rank, True, None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((-1, rank, False, traceback.format_exc()))
        return
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, fn, args, kwargs = item
        if stall_s > 0:
            # Diagnostics: a task that runs this long dumps every thread's stack to stderr (the test
            # log), so a case that hits its time bound on a GPU machine says where each rank was.
            faulthandler.dump_traceback_later(stall_s, repeat=True)
        try:
            results.put((task_id, rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001
            results.put((task_id, rank, False, traceback.format_exc()))
        finally:
            faulthandler.cancel_dump_traceback_later()
    # Every result was collected before close() sent None. Exit hard: tearing down gloo (and its
    # threads) at interpreter exit can block for seconds, or forever after a timed-out collective.
    os._exit(0)


class DistPool:
    def __init__(self, world_size: int, backend: str = "gloo", start_timeout_s: float = 120.0,
                 pg_timeout_s: float = 60.0, processes_on_gpu: Optional[int] = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        # How many processes may share a GPU with these workers (their CUDA work-queue share,
        # pyep/softnic/cuda_env.py); default: the pool's own.
        self.processes_on_gpu = max(world_size, processes_on_gpu or 0)
        self.backend = backend
        self.start_timeout_s = start_timeout_s
        self.pg_timeout_s = pg_timeout_s
        self._procs: List[mp.process.BaseProcess] = []
        self._tasks: List[Any] = []
        self._results: Optional[Any] = None
        self._store: Any = None
        self._next_id = 0

    # -------------------------------------------------------------- lifetime
    def _start(self) -> None:
        import torch.distributed as dist
        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True,
                                    wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.pg_timeout_s))
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_worker, name=f"dist-rank{r}", daemon=True,
                                   args=(r, self.world_size, self._store.port, self.backend,
                                         self.pg_timeout_s, self._tasks[r], self._results,
                                         self.processes_on_gpu))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self._collect(-1, self.start_timeout_s, "process-group start")

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001 - queue of a dead worker
                pass
        deadline = time.monotonic() + 10.0
        for p in self._procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for p in self._procs:
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join(5.0)
        self._procs, self._tasks, self._results, self._store = [], [], None, None

    def running(self) -> bool:
        """Whether the workers are up (a pool starts them at its first run, again after a close)."""
        return bool(self._procs)

    def __enter__(self) -> "DistPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -------------------------------------------------------------- running
    def _collect(self, task_id: int, timeout_s: float, what: str) -> List[Any]:
        assert self._results is not None
        got: dict = {}
        failures: dict = {}
        deadline = time.monotonic() + timeout_s
        while len(got) + len(failures) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world_size)) - set(got) - set(failures))
                self._kill()
                if failures:
                    raise RankFailure(f"{what} failed (ranks {missing} then hung and were killed)"
                                      + self._format_failures(failures))
                raise TimeoutError(f"{what}: ranks {missing} did not finish within {timeout_s:.0f} s"
                                   + self._format_failures(failures))
            try:
                tid, rank, ok, payload = self._results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()
                        and r not in got and r not in failures]
                if dead:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    self._kill()
                    raise RankFailure(f"{what}: rank process(es) died: exit codes {codes}"
                                      + self._format_failures(failures))
                continue
            if tid != task_id:
                continue   # late answer of a task that already failed elsewhere
            (got if ok else failures)[rank] = payload
            if not ok:
                # The others may be blocked in a collective with the failed rank: give them a
                # moment to fail too, then tear down instead of waiting out the whole timeout.
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if failures:
            raise RankFailure(f"{what} failed" + self._format_failures(failures))
        return [got[r] for r in range(self.world_size)]

    @staticmethod
    def _format_failures(failures: dict) -> str:
        return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> List[Any]:
        """fn(*args, **kwargs) on every rank; returns the results in rank order."""
        if not self._procs:
            self._start()
        self._next_id += 1
        for q in self._tasks:
            q.put((self._next_id, fn, args, kwargs))
        return self._collect(self._next_id, timeout_s, f"{getattr(fn, '__name__', fn)}")


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0,
                    backend: str = "gloo", **kwargs: Any) -> List[Any]:
    """One-shot: start world_size processes, run fn on every rank, tear down."""
    with DistPool(world_size, backend=backend) as pool:
        return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)


class LazyPools(dict):
    """{world size: DistPool}, each pool started on first use (GPU tests use the sizes the machine
    has, and a pool per size costs a start-up). close() ends every pool it started.

    The pools' workers live side by side on the GPU(s) and share its hardware work queues
    (pyep/softnic/cuda_env.py): with the 2- and 4-rank pools of a module up at once, 2 x 32 + 4 x 24
    queues made every context of the 4-rank pool fail under the MPS daemon ("CUDA-capable device(s)
    is/are busy or unavailable"). So every worker's share is taken as if `planned` processes shared
    the GPU, and a pool that would take the live workers past that closes the others first."""

    def __init__(self, planned: int = 6, **pool_kwargs: Any) -> None:
        super().__init__()
        self._planned = planned
        self._kwargs = pool_kwargs

    def __missing__(self, world: int) -> DistPool:
        if sum(p.world_size for p in self.values()) + world > self._planned:
            self.close()
            self.clear()
        pool = DistPool(world, processes_on_gpu=max(self._planned, world), **self._kwargs)
        self[world] = pool
        return pool

    def close(self) -> None:
        for pool in self.values():
            pool.close()


def usable_gpus(part: str = "ep") -> int:
    """CUDA devices a GPU test can use: 0 without CUDA or without a CUDA build of pyep._engine that has
    `part` (its submodule: "ep", "normal", ...). Any failure here means "no usable GPU build"."""
    try:
        import torch
        if not torch.cuda.is_available():
            return 0
        from pyep._native import load
        mod = load()
        if mod is None or not getattr(mod, "has_cuda", False) or not hasattr(mod, part):
            return 0
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0
