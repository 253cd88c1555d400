"""`pyep bench --mode normal`: the normal (high-throughput) mode's benchmark, DeepEP tests/test_intranode.py's
setting by default (4096 tokens per rank, H=7168, K=8, E=256, uniformly random distinct experts).

Before the rows, rank 0 measures the device's copy rate (copy_rate.py) while the others wait. Per SM
count (one row each; --sweep-sms; with ranks sharing a GPU, counts whose ranks x SMs exceed its SMs are
skipped, sharing.sm_fit), after the correctness guard (normal_check) passes, every iteration times
these calls (normal_timer.py), each behind a barrier and Sync.align() and followed by a device wait:
  layout        get_dispatch_layout
  dispatch      FP8 dispatch with top-k and the layout's counts (notify + dispatch kernels)
  cached_fp8    FP8 dispatch with the handle    } what DeepEP's tuning loop times, and
  cached_bf16   BF16 dispatch with the handle   } what its "Best" GB/s lines count
  combine       BF16 combine with the handle, no top-k weights
  eager         layout + FP8 dispatch + combine (with weights) back to back, as a model calls them
Wall times are CUDA events around the call; per-kernel times come from a second, profiled pass
(kineto): kernels named "dispatch"/"combine" are the main kernels, "notify"/"layout" ones are shown
apart (aux). GB/s count the bytes as test_intranode.py counts NVLink bytes: received rows x 2H for BF16
dispatch and for combine, x (1 + 4/128)/2 of that for FP8 dispatch. Every call uses the buffer's
defaults for the row's SM count (NormalBuffer.set_num_sms), as a user's call does.

Across (virtual) nodes -- the same detection as NormalBuffer's (topology.detect_node_layout) -- the
guard checks the internode contract, and rows also count RDMA bytes as test_internode.py does: the
tokens' node fan-out (sum of num_tokens_per_rdma_rank, the own node included) x 2H, FP8 and combine
as above; its NVL bytes are the received rows, the count above. normal_internode_report.py shows them
beside the real-NIC model; on the softnic they measure the emulator, not a NIC.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import copy_rate, metrics
from .config import RoutingSpec
from .copy_rate import DEFAULT_MB as DEFAULT_COPY_MB
from .guard import CheckResult
from .normal_check import GuardInputs, run_guard
from .routing import make_batch
from .normal_timer import PHASES, SAMPLE_KINDS, PhaseTimer, gather_samples
from .sharing import Sharing, sm_fit
from .sync import Sync

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("pyep.bench")

# Issue 23's sweep: DeepEP V1 uses 24 SMs; V2 claims the same bandwidth with 4-6.
DEFAULT_SWEEP_SMS: Tuple[int, ...] = (4, 6, 8, 12, 16, 24)
NORMAL_BACKENDS = ("native", "reference")
COMBINE_INPUTS = ("fresh", "pool")
FP8_FACTOR = (1 + 4 / 128) / 2      # test_intranode.py: FP8 bytes per BF16 byte (payload + fp32 scales)


@dataclass(frozen=True)
class NormalBenchConfig:
    tokens: int = 4096
    hidden: int = 7168
    topk: int = 8
    experts: int = 256
    num_sms: Tuple[int, ...] = (24,)
    backends: Tuple[str, ...] = ("native",)
    routing: RoutingSpec = RoutingSpec("uniform")
    hot_expert: int = 0
    drop_fraction: float = 0.0                 # fraction of (token, k) entries set to -1
    iters: int = 20
    warmup: int = 5
    kineto: bool = True
    seed: int = 0
    transport: str = "auto"
    timeout_us: int = 10_000_000
    wait_timeout_s: float = 120.0
    plot: bool = True
    copy_mb: int = DEFAULT_COPY_MB             # the copy-rate measurement (copy_rate.py); 0 skips it
    # Where the combine's input lies: "fresh", a tensor of the caller's (as an expert GEMM returns it:
    # the push combine), or "pool", one from NormalBuffer.get_combine_input (the pull combine).
    combine_input: str = "fresh"

    def __post_init__(self) -> None:
        from ..ep.normal.config import MAX_TOPK
        for name, lo, hi in (("tokens", 0, 1 << 20), ("hidden", 128, 1 << 16), ("topk", 1, MAX_TOPK),
                             ("experts", 1, 1 << 16), ("iters", 1, 100_000), ("warmup", 0, 100_000),
                             ("seed", 0, 2**31 - 1), ("timeout_us", 1, 1 << 40), ("copy_mb", 0, 1 << 16)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {v!r}")
        if self.hidden % 128:
            raise ValueError(f"hidden must be a multiple of 128 (FP8 scale groups), got {self.hidden}")
        if self.topk > self.experts:
            raise ValueError(f"topk ({self.topk}) cannot exceed experts ({self.experts})")
        if not self.num_sms or len(set(self.num_sms)) != len(self.num_sms):
            raise ValueError(f"num_sms must be a non-empty list without duplicates, got {self.num_sms}")
        for n in self.num_sms:
            if isinstance(n, bool) or not isinstance(n, int) or n < 2 or n % 2 or n > 128:
                raise ValueError(f"SM counts must be even ints in [2, 128] (a sender and a receiver SM "
                                 f"per channel), got {n!r}")
        if not self.backends or any(b not in NORMAL_BACKENDS for b in self.backends):
            raise ValueError(f"backends must be drawn from {NORMAL_BACKENDS}, got {self.backends}")
        if not isinstance(self.routing, RoutingSpec):
            raise TypeError(f"routing must be a RoutingSpec, got {type(self.routing).__name__}")
        if not 0 <= self.hot_expert < self.experts:
            raise ValueError(f"hot_expert must be in [0, {self.experts}), got {self.hot_expert}")
        if not 0.0 <= float(self.drop_fraction) <= 1.0:
            raise ValueError(f"drop_fraction must be in [0, 1], got {self.drop_fraction}")
        if self.combine_input not in COMBINE_INPUTS:
            raise ValueError(f"combine_input must be one of {COMBINE_INPUTS}, got {self.combine_input!r}")
        if not 0.001 <= float(self.wait_timeout_s) <= 86400:
            raise ValueError(f"wait_timeout_s must be in [0.001, 86400], got {self.wait_timeout_s}")

    def check_world(self, world_size: int, ranks_per_node: Optional[int] = None) -> None:
        """One node (ranks_per_node None or >= world_size): 1, 2, 4 or 8 ranks. Across nodes: M nodes
        of P ranks, P in native_internode.NODE_SIZES, M <= MAX_NODES. The experts divide over the ranks."""
        from ..ep.normal.config import MAX_RANKS
        from ..ep.normal.native_internode import MAX_NODES, NODE_SIZES
        p = world_size if ranks_per_node is None else ranks_per_node
        if p >= world_size:
            if world_size > MAX_RANKS or world_size & (world_size - 1):
                raise ValueError(f"the normal mode runs on 1, 2, 4 or 8 ranks of one node, not {world_size}")
        elif p not in NODE_SIZES or world_size % p or world_size // p > MAX_NODES:
            raise ValueError(f"the internode normal mode runs {', '.join(map(str, NODE_SIZES))} ranks per node on "
                             f"2 to {MAX_NODES} nodes; {world_size} ranks in nodes of {p} is not such a layout "
                             f"(set PYEP_VIRTUAL_NODE_SIZE, or start equal nodes)")
        if self.experts % world_size:
            raise ValueError(f"experts ({self.experts}) must be divisible by the ranks ({world_size})")


def bytes_per_rank(recv_tokens: float, hidden: int) -> Dict[str, float]:
    """DeepEP's NVLink byte counts for one rank that received `recv_tokens` rows; with the tokens' node
    fan-out instead (sum of num_tokens_per_rdma_rank) they are test_internode.py's RDMA byte counts."""
    bf16 = float(recv_tokens * hidden * 2)
    fp8 = bf16 * FP8_FACTOR
    return {"dispatch": fp8, "cached_fp8": fp8, "cached_bf16": bf16, "combine": bf16, "eager": fp8 + bf16}


@dataclass
class NormalRow:
    backend: str
    num_sms: int
    tokens: int
    hidden: int
    routing: str
    skipped: str = ""
    check: Optional[CheckResult] = None
    recv_tokens: List[int] = field(default_factory=list)      # per rank
    stats: Dict[str, Dict[str, metrics.Stat]] = field(default_factory=dict)   # kind -> phase -> Stat
    samples: Dict[str, Dict[str, List[List[float]]]] = field(default_factory=dict)
    kernel_source: str = ""
    kineto: Dict[str, Any] = field(default_factory=dict)
    buffer_bytes: Optional[int] = None
    configs: Dict[str, Any] = field(default_factory=dict)
    rdma_tokens: List[int] = field(default_factory=list)     # per rank, across nodes only (else empty)

    def bytes(self, phase: str, rdma: bool = False) -> List[float]:
        """Per rank: NVLink bytes (received rows), or RDMA bytes (node fan-out) with rdma=True."""
        return [bytes_per_rank(n, self.hidden).get(phase, math.nan)
                for n in (self.rdma_tokens if rdma else self.recv_tokens)]

    def gbps(self, kind: str, rdma: bool = False) -> Dict[str, float]:
        """Mean bytes per rank / the phase's time (max over ranks of each rank's mean); for "kernel"
        the time includes the aux kernels of the phase (the whole call's device work)."""
        out: Dict[str, float] = {}
        tokens = self.rdma_tokens if rdma else self.recv_tokens
        if not self.stats or not tokens:
            return out
        for p in PHASES:
            if p == "layout":
                continue
            t = self.time_us(kind, p)
            out[p] = metrics.gbps(sum(self.bytes(p, rdma)) / len(tokens), t)
        return out

    def time_us(self, kind: str, phase: str) -> float:
        """Mean time of a phase; "kernel" adds the aux kernels (main + aux: all the call's device work)."""
        st = self.stats.get(kind, {}).get(phase)
        t = st.mean if st is not None else math.nan
        if kind != "kernel":
            return t
        aux = self.stats.get("aux", {}).get(phase)
        a = aux.mean if aux is not None else math.nan
        if math.isnan(a):
            return t
        return a if math.isnan(t) else t + a

    def as_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"backend": self.backend, "num_sms": self.num_sms, "tokens": self.tokens,
                               "hidden": self.hidden, "routing": self.routing, "skipped": self.skipped or None,
                               "buffer_bytes": self.buffer_bytes, "configs": self.configs}
        if self.skipped:
            return out
        assert self.check is not None
        out.update({
            "check": self.check.as_dict(), "recv_tokens_per_rank": self.recv_tokens,
            "bytes_per_rank": {p: self.bytes(p) for p in PHASES if p != "layout"},
            "kernel_time_source": self.kernel_source,
            **{f"{k}_us": {p: s.as_dict() for p, s in self.stats.get(k, {}).items()} for k in SAMPLE_KINDS},
            "gbps": {k: self.gbps(k) for k in ("kernel", "wall")},
            "kineto": self.kineto, "samples_us": self.samples})
        if self.rdma_tokens:
            out.update({"rdma_tokens_per_rank": self.rdma_tokens,
                        "rdma_bytes_per_rank": {p: self.bytes(p, True) for p in PHASES if p != "layout"},
                        "gbps_rdma": {k: self.gbps(k, True) for k in ("kernel", "wall")}})
        return out


def _buffer_class() -> Any:
    from ..ep.normal import NormalBuffer
    return NormalBuffer


class NormalSuite:
    """The whole run on one rank. `buffer_factory(group, num_nvl_bytes, hidden, backend, transport,
    timeout_us)` builds a buffer; NormalBuffer by default (tests pass a stand-in)."""

    def __init__(self, cfg: NormalBenchConfig, group: "dist.ProcessGroup", device: "torch.device",
                 buffer_class: Optional[Any] = None,
                 progress: Optional[Callable[[int, int, str], None]] = None) -> None:
        import torch.distributed as dist
        self.cfg = cfg
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.dist_backend = str(dist.get_backend(group)).lower()
        from ..ep.normal.topology import detect_node_layout
        # The buffer detects its nodes the same way (ranks_per_node not given): one answer for both.
        self.nodes = detect_node_layout(group, None, cfg.timeout_us)
        cfg.check_world(self.world_size, self.nodes.ranks_per_node)
        self.sync = Sync(group, device, cfg.wait_timeout_s)
        if self.sync.staged and "reference" in cfg.backends:
            raise ValueError("--backend reference: on a gloo group the reference backend works on host tensors, "
                             "and this run keeps its data on the GPU (ranks sharing a GPU measure the native "
                             "backend); add --device cpu to measure the reference")
        self.sharing = Sharing.gather(self.sync, device)
        self.cls = buffer_class if buffer_class is not None else _buffer_class()
        self.progress = progress
        self.notes: List[str] = []
        self.copy: Optional[copy_rate.CopyRate] = None

    @property
    def ranks_per_node(self) -> Optional[int]:
        """The node size across nodes; None on one node."""
        return self.nodes.ranks_per_node if self.nodes.internode else None

    def transport(self, backend: str) -> str:
        """What carries the rows between nodes: "emulated" (the softnic: figures measure the emulator),
        "nic" (IBGDA on a real NIC), "reference" (torch.distributed collectives, no NIC at all)."""
        if backend != "native":
            return "reference"
        from ..ep.normal.native_internode import relay_transport
        return "emulated" if relay_transport(self.cfg.transport) == "emulated" else "nic"

    def _nvl_bytes(self) -> int:
        """Enough buffer for the largest SM count of the run (rings grow with the channel count)."""
        cls, r = self.cls, self.world_size
        saved = cls.num_sms
        need = 0
        try:
            for n in self.cfg.num_sms:
                cls.set_num_sms(n)
                for c in (cls.get_dispatch_config(r), cls.get_combine_config(r)):
                    need = max(need, int(c.get_nvl_buffer_size_hint(self.cfg.hidden * 2, r)))
        finally:
            cls.set_num_sms(saved)
        return need

    def _build(self, backend: str) -> Tuple[Any, str]:
        buf, why = None, ""
        try:
            if self.nodes.internode:
                # The node buffer's control area also holds the count records of every node, which
                # the NVLink size hint leaves out: the backend sizes itself for the sweep's largest SMs.
                buf = self.cls(self.group, None, hidden=self.cfg.hidden, backend=backend,
                               transport=self.cfg.transport, timeout_us=self.cfg.timeout_us,
                               num_sms=max(self.cfg.num_sms))
                got = getattr(buf, "ranks_per_node", self.nodes.ranks_per_node)
                if got != self.nodes.ranks_per_node:
                    raise ValueError(f"the buffer runs nodes of {got} ranks, the benchmark detected "
                                     f"{self.nodes.ranks_per_node}")
            else:
                # Unless PYEP_NORMAL_DIRECT=0, room past the rings for one-copy dispatch outputs of this
                # run's calls (direct_pool.py).
                from ..ep.normal.direct_pool import one_copy_enabled, pooled_buffer_bytes
                nvl = self._nvl_bytes()
                if one_copy_enabled():
                    nvl = max(nvl, pooled_buffer_bytes(self.world_size, max(self.cfg.num_sms), self.cfg.hidden,
                                                       self.cfg.tokens))
                buf = self.cls(self.group, nvl, hidden=self.cfg.hidden, backend=backend,
                               transport=self.cfg.transport, timeout_us=self.cfg.timeout_us)
        except Exception as exc:  # noqa: BLE001 - reported in the row; the run goes on
            why = f"{type(exc).__name__}: {exc}"
            log.warning("cannot build the %s normal-mode buffer: %s", backend, why)
        if not self.sync.all_min(1 if buf is not None else 0, f"building the {backend} buffer"):
            if buf is not None:
                buf.destroy()
            buf, why = None, why or "failed on another rank"
        return buf, why

    def inputs(self) -> GuardInputs:
        import torch
        from ..ep import fp8
        c = self.cfg
        # test_intranode.py draws |randn| + 1 scores and takes the top K: K distinct experts, every
        # K-subset equally likely, which is what the "uniform" generator draws (CPU, seeded per rank).
        b = make_batch(c.routing, c.tokens, c.hidden, c.experts, c.topk, seed=c.seed, rank=self.rank,
                       hot_expert=c.hot_expert, drop_fraction=c.drop_fraction).to(self.device)
        q, s = fp8.quantize_fp8(b.x)
        return GuardInputs(b.x, (q.contiguous(), s.contiguous()), b.topk_idx.contiguous(),
                           b.topk_weights.to(torch.float32).contiguous(), c.experts)

    def measure_copy_rate(self) -> Optional[copy_rate.CopyRate]:
        """Rank 0 copies while the other ranks wait (the device is otherwise idle); None elsewhere."""
        if not self.cfg.copy_mb:
            return None
        self.sync.barrier("before the copy-rate measurement")
        rate = copy_rate.measure(self.device, self.cfg.copy_mb, self.sync.device_wait) if self.rank == 0 else None
        self.sync.barrier("after rank 0's copy-rate measurement")
        return rate

    def run(self) -> List[NormalRow]:
        rows: List[NormalRow] = []
        self.copy = self.measure_copy_rate()
        inp = self.inputs()
        total = len(self.cfg.backends) * len(self.cfg.num_sms)
        share = self.sharing
        for backend in self.cfg.backends:
            buf, why = self._build(backend)
            try:
                for n in self.cfg.num_sms:
                    too_many = sm_fit(n, share.ranks_per_device, share.sms) if share.shared_gpu and backend == "native" else ""
                    if buf is None or too_many:
                        rows.append(NormalRow(backend, n, self.cfg.tokens, self.cfg.hidden,
                                              self.cfg.routing.label, skipped=too_many or why or "not built"))
                    else:
                        rows.append(self._row(buf, backend, n, inp))
                    if self.progress is not None:
                        self.progress(len(rows), total, f"{backend} {n} SMs")
            finally:
                if buf is not None:
                    buf.destroy()
        return rows

    def _row(self, buf: Any, backend: str, num_sms: int, inp: GuardInputs) -> NormalRow:
        import torch
        c = self.cfg
        cls = type(buf) if hasattr(type(buf), "set_num_sms") else self.cls
        saved = cls.num_sms
        cls.set_num_sms(num_sms)
        try:
            configs = {k: _cfg_dict(v) for k, v in _default_configs(cls, self.world_size).items()}
            row = NormalRow(backend, num_sms, c.tokens, c.hidden, c.routing.label, configs=configs,
                            buffer_bytes=_buffer_bytes(buf))
            check, reuse = run_guard(buf, inp, self.rank, self.sync, self.ranks_per_node,
                                     pool_input=c.combine_input == "pool")
            flags = self.sync.gather(torch.tensor([1 if check.passed else 0], dtype=torch.int32), "guard results")
            check.failed_ranks = [r for r, f in enumerate(flags) if int(f[0]) == 0]
            if check.failed_ranks and check.passed:
                check.passed, check.detail = False, f"failed on rank(s) {check.failed_ranks}"
            row.check = check
            recv = self.sync.gather(torch.tensor([reuse["num_recv_tokens"]], dtype=torch.int64), "received rows")
            row.recv_tokens = [int(t[0]) for t in recv]
            if self.nodes.internode:
                rdma = self.sync.gather(torch.tensor([reuse["num_rdma_tokens"]], dtype=torch.int64), "RDMA tokens")
                row.rdma_tokens = [int(t[0]) for t in rdma]
            if not check.passed:
                log.error("%s, %d SMs: correctness guard FAILED (%s): not timed", backend, num_sms, check.detail)
                row.kernel_source = "not timed (guard failed)"
                return row
            timer = PhaseTimer(buf, inp, reuse, self.sync, backend, f"{backend} {num_sms} SMs",
                               internode=self.nodes.internode)
            samples, source, info = timer.run(c.warmup, c.iters, c.kineto)
            gathered = gather_samples(samples, c.iters, self.sync)
            row.samples, row.kernel_source, row.kineto = gathered, source, info
            row.stats = {k: {p: metrics.summarize(gathered[k][p]) for p in PHASES} for k in SAMPLE_KINDS}
            return row
        finally:
            cls.set_num_sms(saved)


def _default_configs(cls: Any, num_ranks: int) -> Dict[str, Any]:
    """The configs a call without `config` gets: the tuned table's, or Config(num_sms) for rank
    counts beyond it (more than one node's worth), as NormalBuffer's dispatch and combine choose."""
    try:
        return {"dispatch": cls.get_dispatch_config(num_ranks), "combine": cls.get_combine_config(num_ranks)}
    except ValueError:
        from ..ep.normal.config import Config
        return {"dispatch": Config(cls.num_sms), "combine": Config(cls.num_sms)}


def _buffer_bytes(buf: Any) -> Optional[int]:
    v = getattr(buf, "buffer_bytes", None)
    v = v() if callable(v) else v
    return None if v is None else int(v)


def _cfg_dict(cfg: Any) -> Dict[str, Any]:
    import dataclasses
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else {"repr": repr(cfg)}


def exit_code(rows: Sequence[NormalRow]) -> int:
    measured = [r for r in rows if not r.skipped]
    if not measured:
        log.error("no benchmark row could be measured")
        return 1
    return 1 if any(r.check is None or not r.check.passed for r in measured) else 0
