"""Bounded synchronisation for the benchmark: barriers between phases, waits for the device, and
gathers of results to rank 0. Every wait has a deadline and its error names what it waited for.

The group's collectives take tensors on the group's device (pyep.ep._dist.group_device): the GPU for
NCCL, host memory for gloo. Ranks that share a GPU run a gloo group (NCCL refuses two ranks on one
GPU) with their data on the GPU: every collective here then stages its tensors through host memory,
and the start of a timed call is lined up on the host clock instead of by an all-reduce on the stream
(see align)."""
from __future__ import annotations

import datetime
import time
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional, Tuple

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


# align(): 256 MB exceeds every GPU's L2; a 4096^3 bf16 GEMM runs ~0.1-0.3 ms on H100/H200, long
# enough for the host (under the profiler, too) to queue a whole dispatch or combine call.
FLUSH_BYTES = 256 << 20
GEMM_N = 4096
# ~1 ms at the 1.4-2 GHz SM clocks of H100/H200: far more than the host needs to queue one call.
ALIGN_SLEEP_CYCLES = 2_000_000
# Under torch.profiler a host occasionally stalls for more than a millisecond (a rank then starts late
# and the others' kernels count the wait: combine p99 of ~235 us against a 51 us median on 4 H200s);
# the profiled pass sleeps longer.
PROFILED_SLEEP_CYCLES = 8_000_000
# The staged start gate (align on a gloo group): the start time the ranks agree on lies this far after
# the slowest rank's proposal, more than a loopback gloo all-reduce takes to release every rank, so
# each rank reaches the gate before the agreed moment and leaves it within microseconds of the others.
GATE_LEAD_NS = 2_000_000
# A start time further ahead than this is clock skew between hosts (the gate is meant for one host):
# the rank waits this long at most and the start counts as late.
GATE_MAX_WAIT_NS = 50_000_000


class Sync:
    """Barriers and device waits on one process group. On NCCL the barrier is an all-reduce on the
    current stream followed by a polled event, so the host wait is bounded and every rank leaves the
    barrier as soon as its GPU has seen all peers (a few microseconds apart). On gloo it is a host
    all-reduce with a bounded wait; `staged` says the data lives on a GPU the group cannot reach."""

    def __init__(self, group: "dist.ProcessGroup", device: "torch.device", timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        from ..ep._dist import group_device
        self.group = group
        self.device = device
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group)).lower()
        self.cuda = device.type == "cuda"
        self.comm = group_device(group)
        self.staged = self.cuda and self.comm.type != "cuda"
        self.gates = 0          # staged start gates passed, and how many of them this rank reached late
        self.late_starts = 0
        self._token = torch.ones(1, dtype=torch.int32, device=self.comm)
        if self.cuda:
            self._flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
            self._lhs = torch.randn(GEMM_N, GEMM_N, device=device).to(torch.bfloat16)
            self._rhs = torch.randn(GEMM_N, GEMM_N, device=device).to(torch.bfloat16)
            self._prod = torch.empty(GEMM_N, GEMM_N, dtype=torch.bfloat16, device=device)

    def _ranks(self) -> List[int]:
        return list(range(self.world_size))

    def wait_work(self, work: "dist.Work", what: str) -> None:
        if self.comm.type == "cuda":
            # NCCL: wait() only orders the current stream after the collective; the bounded host wait
            # is the spinning device_wait. (A wait(timeout=...) would poll with millisecond sleeps
            # and let the ranks leave the barrier milliseconds apart.)
            work.wait()
            self.device_wait(what)
            return
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise TimeoutError(f"{what}: ranks {self._ranks()} did not all take part within "
                               f"{self.timeout_s:g} s ({exc})") from exc
        if ok is False:
            raise TimeoutError(f"{what}: ranks {self._ranks()} did not all take part within "
                               f"{self.timeout_s:g} s")

    def device_wait(self, what: str) -> None:
        """Wait until the current stream has finished everything queued so far."""
        if not self.cuda:
            return
        import torch
        ev = torch.cuda.Event()
        ev.record()
        deadline = time.monotonic() + self.timeout_s
        # Spinning (not sleeping) keeps the ranks' exits from a barrier microseconds apart.
        while not ev.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: the GPU (rank {self.rank}, {self.device}) did not finish "
                                   f"within {self.timeout_s:g} s")

    def barrier(self, what: str) -> None:
        import torch.distributed as dist
        work = dist.all_reduce(self._token, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
        self.wait_work(work, f"barrier ({what})")

    def align(self, sleep_cycles: int = 0) -> None:
        """GPU only, after a barrier: line up the start of the next call on all GPUs, the way DeepEP's
        benchmark does. The stream first overwrites a buffer larger than L2 (no timed call finds the
        previous one's data cached), runs a GEMM and then sleeps on the device for about a millisecond
        -- time for the host to queue the whole timed call behind it, profiler overhead included --
        then an all-reduce, which ends on every GPU at nearly the same moment; the timed call starts
        right after. Without it each rank would start when its host got there, tens of microseconds
        apart, and the first rank's kernels would count the wait for the others. (The sleep sits
        before the all-reduce, so differences between the GPUs' clocks do not skew the start.) These
        are torch operators, so kineto links their kernels to launches outside the timed ranges. The
        host does not wait here: the device_wait after the timed call bounds it."""
        if not self.cuda:
            return
        import torch
        import torch.distributed as dist
        with torch.profiler.record_function("pyep_bench::align"):
            self._flush.zero_()
            torch.mm(self._lhs, self._rhs, out=self._prod)
            if self.staged:
                # gloo cannot order the stream, so the host lines the ranks up: flush and GEMM done,
                # every rank leaves the gate at one agreed host-clock moment (ranks sharing a GPU share
                # the host's clock), then the device sleep holds the stream while the host queues the
                # whole timed call behind it. The starts differ by the launch of one sleep kernel.
                self.device_wait("the alignment's L2 flush and GEMM")
                self.gate("start gate")
                torch.cuda._sleep(sleep_cycles or ALIGN_SLEEP_CYCLES)
                return
            torch.cuda._sleep(sleep_cycles or ALIGN_SLEEP_CYCLES)
            dist.all_reduce(self._token, op=dist.ReduceOp.MIN, group=self.group)

    def gate(self, what: str, clock: "Callable[[], int]" = time.time_ns) -> None:
        """Host-side start gate (bounded): the ranks agree on a moment GATE_LEAD_NS after the latest of
        their proposals and spin until it. CLOCK_REALTIME is one clock for every process of a host;
        across hosts it is only NTP-close, and a wait past GATE_MAX_WAIT_NS is cut short."""
        import torch
        import torch.distributed as dist
        t = torch.tensor([clock() + GATE_LEAD_NS], dtype=torch.int64)
        self.wait_work(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
                       f"barrier ({what})")
        start = int(t.item())
        now = clock()
        self.gates += 1
        if now >= start or start - now > GATE_MAX_WAIT_NS:
            self.late_starts += 1
            if now >= start:
                return
            start = now + GATE_MAX_WAIT_NS
        while clock() < start:
            pass

    def gate_note(self) -> Optional[str]:
        """Collective: how often a rank reached the staged start gate after the agreed moment (its call
        then started late and the others' kernels counted the wait); None when never, or no gate ran."""
        import torch
        counts = self.gather(torch.tensor([self.late_starts, self.gates], dtype=torch.int64), "start-gate counts")
        late = {r: int(c[0]) for r, c in enumerate(counts) if int(c[0])}
        gates = max(int(c[1]) for c in counts)
        if not late or not gates:
            return None
        return (f"start gate: rank(s) {', '.join(f'{r} ({n})' for r, n in late.items())} of {gates} timed calls "
                f"reached it late; their calls started up to a host hiccup behind the others")

    def all_min(self, value: int, what: str) -> int:
        import torch
        import torch.distributed as dist
        t = torch.tensor([value], dtype=torch.int64, device=self.comm)
        self.wait_work(dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group, async_op=True), what)
        return int(t.item())

    def _gather(self, t: "torch.Tensor", what: str) -> List["torch.Tensor"]:
        import torch
        import torch.distributed as dist
        src = t.to(self.comm).contiguous()
        outs = [torch.empty_like(src) for _ in range(self.world_size)]
        self.wait_work(dist.all_gather(outs, src, group=self.group, async_op=True), what)
        return outs

    def gather(self, t: "torch.Tensor", what: str) -> List["torch.Tensor"]:
        """Every rank's copy of a same-shaped tensor (returned on all ranks, as CPU tensors)."""
        return [o.cpu() for o in self._gather(t, what)]

    def gather_on_device(self, t: "torch.Tensor", what: str) -> List["torch.Tensor"]:
        """gather(), the copies on this rank's device (staged through host memory on a gloo group)."""
        return [o.to(self.device) for o in self._gather(t, what)]

    def gather_strings(self, text: str, what: str, width: int = 256) -> List[str]:
        import torch
        raw = text.encode("utf-8")[:width]
        buf = torch.zeros(width + 1, dtype=torch.uint8)
        buf[0] = len(raw)
        if raw:
            buf[1:1 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        out = []
        for row in self.gather(buf, what):
            n = int(row[0])
            out.append(bytes(row[1:1 + n].tolist()).decode("utf-8", errors="replace"))
        return out


def timed_call(sync: Sync, phase: str, it: int, label: str, fn: Callable[[], Any],
               ranged: bool) -> Tuple[Any, float, float]:
    """One timed call as both modes' timing loops take it: barrier, align, the call (inside the kineto
    range of (phase, it) when `ranged`), bounded device wait. (result, wall us, host us in the call)."""
    import torch

    from . import kineto
    sync.barrier(f"before {phase} of {label}, iteration {it}")
    sync.align(PROFILED_SLEEP_CYCLES if ranged else 0)
    timer = WallTimer(sync.cuda)
    ctx = torch.profiler.record_function(kineto.range_name(phase, it)) if ranged else nullcontext()
    with ctx, timer.measure():
        t0 = time.perf_counter()
        result = fn()
        t1 = time.perf_counter()
    sync.device_wait(f"{phase} of {label}, iteration {it}")
    return result, timer.elapsed_us(), (t1 - t0) * 1e6


class WallTimer:
    """Wall time of one call: CUDA events on the current stream on GPU (what the stream spent from the
    call's first launch to its last, host stalls included), perf_counter on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._start: Optional[object] = None
        self._end: Optional[object] = None
        self._t0 = 0.0
        self._t1 = 0.0

    @contextmanager
    def measure(self) -> Iterator[None]:
        if self.cuda:
            import torch
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
            yield
            self._end.record()
        else:
            self._t0 = time.perf_counter()
            yield
            self._t1 = time.perf_counter()

    def elapsed_us(self) -> float:
        """Valid once the device finished the measured work (after Sync.device_wait on GPU)."""
        if self.cuda:
            assert self._start is not None and self._end is not None
            return float(self._start.elapsed_time(self._end)) * 1000.0   # type: ignore[attr-defined]
        return (self._t1 - self._t0) * 1e6
