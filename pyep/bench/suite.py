"""One benchmark run: for each T build the buffers (native per transport, and the reference), for each
routing generate the batch, guard correctness, time every buffer, and gather the numbers."""
from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from . import metrics
from .config import BenchConfig, RoutingSpec
from .guard import CheckResult, run_guard
from .routing import make_batch
from .runner import EAGER_METRICS, METRICS, NATIVE_KEYWORDS, CaseRunner, gather_samples
from .sharing import Sharing
from .sync import Sync

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("pyep.bench")
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class BufferSpec:
    backend: str      # "native" or "reference"
    transport: str    # requested transport (native), or the process group's backend (reference)

    @property
    def key(self) -> str:
        return f"{self.backend}/{self.transport}"


@dataclass
class CaseRow:
    backend: str
    transport: str
    routing: str
    tokens: int
    transport_detail: str = ""
    skipped: str = ""                      # why the row was not measured ("" = measured)
    check: Optional[CheckResult] = None
    num_valid: List[int] = field(default_factory=list)        # per rank
    dispatch_bytes: List[int] = field(default_factory=list)   # per rank
    combine_bytes: List[int] = field(default_factory=list)    # per rank
    wall: Dict[str, metrics.Stat] = field(default_factory=dict)
    kernel: Dict[str, metrics.Stat] = field(default_factory=dict)
    host: Dict[str, metrics.Stat] = field(default_factory=dict)     # CPU time inside the call
    # The eager pass (runner.EAGER_METRICS): back-to-back pairs, default arguments; empty if not run.
    eager: Dict[str, metrics.Stat] = field(default_factory=dict)
    samples: Dict[str, Dict[str, List[List[float]]]] = field(default_factory=dict)
    kernel_source: str = ""
    kineto: Dict[str, Any] = field(default_factory=dict)
    size_hint_bytes: Optional[int] = None

    def gbps(self, kind: str) -> Dict[str, float]:
        stats = self.wall if kind == "wall" else self.kernel
        if not stats or not self.dispatch_bytes:
            return {}
        d = sum(self.dispatch_bytes) / len(self.dispatch_bytes)
        c = sum(self.combine_bytes) / len(self.combine_bytes)
        return {"dispatch": metrics.gbps(d, stats["dispatch"].mean),
                "combine": metrics.gbps(c, stats["combine"].mean),
                "dc": metrics.gbps(d + c, stats["dc"].mean)}

    def eager_vs_kernels(self) -> float:
        """Eager pair time / (dispatch kernel + combine kernel), means; NaN where not measured. 1.0
        means the loop runs at kernel speed (the goal is <= 1.1)."""
        pair, d, c = self.eager.get("pair"), self.kernel.get("dispatch"), self.kernel.get("combine")
        if pair is None or d is None or c is None or not d.mean + c.mean > 0:
            return math.nan
        return pair.mean / (d.mean + c.mean)

    def as_dict(self) -> Dict[str, Any]:
        def num(v: float) -> Any:
            return None if v is None or math.isnan(v) else float(f"{v:.6g}")
        out: Dict[str, Any] = {
            "backend": self.backend, "transport": self.transport, "transport_detail": self.transport_detail,
            "routing": self.routing, "tokens": self.tokens, "skipped": self.skipped or None,
            "size_hint_bytes": self.size_hint_bytes}
        if self.skipped:
            return out
        assert self.check is not None
        out.update({
            "check": self.check.as_dict(), "num_valid_per_rank": self.num_valid,
            "bytes_per_rank": {"dispatch": self.dispatch_bytes, "combine": self.combine_bytes},
            "kernel_time_source": self.kernel_source,
            "wall_us": {m: s.as_dict() for m, s in self.wall.items()},
            "kernel_us": {m: s.as_dict() for m, s in self.kernel.items()},
            "host_us": {m: s.as_dict() for m, s in self.host.items()},
            "eager_us": {m: s.as_dict() for m, s in self.eager.items()},
            "eager_pair_vs_kernels": num(self.eager_vs_kernels()),
            "gbps": {k: {m: num(v) for m, v in self.gbps(k).items()} for k in ("kernel", "wall")},
            "kineto": self.kineto, "samples_us": self.samples})
        return out


def _transport_detail(buf: Any) -> str:
    kinds = Counter(p.kind for p in buf.transport_table())
    return ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))


class Suite:
    def __init__(self, cfg: BenchConfig, group: "dist.ProcessGroup", device: "torch.device",
                 progress: Optional[Progress] = None) -> None:
        import torch.distributed as dist
        self.cfg = cfg
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.dist_backend = str(dist.get_backend(group)).lower()
        self.sync = Sync(group, device, cfg.wait_timeout_s)
        self.progress = progress
        self.notes: List[str] = []
        self.specs: Optional[List[BufferSpec]] = None   # decided when the first buffer is built
        cfg.check_world(self.world_size)
        if self.sync.staged and cfg.backend in ("reference", "both"):
            raise ValueError(f"--backend {cfg.backend}: on a gloo group the reference backend works on host "
                             "tensors, and this run keeps its data on the GPU (ranks sharing a GPU measure the "
                             "native backend); add --device cpu to measure the reference")
        self.sharing = Sharing.gather(self.sync, device)

    # ------------------------------------------------------------------ buffers
    def _new_buffer(self, backend: str, transport: str, tokens: int) -> Any:
        from ..ep.ll import EpBuffer
        c = self.cfg
        return EpBuffer(self.group, num_max_dispatch_tokens_per_rank=tokens, hidden=c.hidden,
                        num_experts=c.experts, transport=transport, timeout_us=c.timeout_us,
                        backend=backend, max_topk=c.topk, ranks_per_node=c.ranks_per_node)

    def _build(self, spec: BufferSpec, tokens: int, backend_arg: Optional[str] = None) -> Tuple[Any, str]:
        """(buffer or None, why not). Agreed over ranks: a buffer that failed anywhere is dropped."""
        buf, why = None, ""
        transport = spec.transport if spec.backend == "native" else "auto"
        try:
            buf = self._new_buffer(backend_arg or spec.backend, transport, tokens)
        except Exception as exc:  # noqa: BLE001 - reported in the row; the run goes on
            why = f"{type(exc).__name__}: {exc}"
            log.warning("cannot build %s buffer for T=%d: %s", spec.key, tokens, why)
        ok = self.sync.all_min(1 if buf is not None else 0, f"building the {spec.key} buffer for T={tokens}")
        if not ok and buf is not None:
            buf.destroy()
            buf, why = None, "failed on another rank"
        return buf, why

    def _buffers(self, tokens: int) -> List[Tuple[BufferSpec, Any, str]]:
        c = self.cfg
        ref = BufferSpec("reference", self.dist_backend)
        natives = [BufferSpec("native", t) for t in c.transports]
        built: List[Tuple[BufferSpec, Any, str]] = []
        if self.specs is None and c.backend == "auto" and self.sync.staged:
            self.specs = natives
            self.notes.append("the reference backend is not measured: on a gloo group it works on host tensors "
                              "(--device cpu measures it)")
        if self.specs is None and c.backend == "auto":
            first, why = self._build(natives[0], tokens, backend_arg="auto")
            if first is not None and first.backend_name == "native":
                self.specs = natives + [ref]
                built.append((natives[0], first, ""))
            else:
                note = ("native backend not available here (EpBuffer backend='auto' "
                        + (f"failed: {why}" if first is None else "chose the reference")
                        + "): measuring the reference backend only")
                if self.rank == 0:
                    log.warning(note)
                self.notes.append(note)
                self.specs = [ref]
                if first is not None:
                    built.append((ref, first, ""))
        elif self.specs is None:
            self.specs = {"native": natives, "reference": [ref], "both": natives + [ref]}[c.backend]
        have = {s.key for s, _, _ in built}
        for spec in self.specs:
            if spec.key not in have:
                buf, why = self._build(spec, tokens)
                built.append((spec, buf, why))
        order = {s.key: i for i, s in enumerate(self.specs)}
        return sorted(built, key=lambda b: order[b[0].key])

    def size_hint(self, tokens: int) -> Optional[int]:
        from ..ep.ll import EpBuffer
        try:
            return int(EpBuffer.size_hint(tokens, self.cfg.hidden, self.cfg.experts, self.world_size,
                                          self.cfg.topk))
        except (ImportError, NotImplementedError) as exc:
            log.warning("buffer size hint unavailable: %s", exc)
            return None

    # ------------------------------------------------------------------ run
    def run(self) -> List[CaseRow]:
        c = self.cfg
        rows: List[CaseRow] = []
        done = 0
        total: Optional[int] = None
        for tokens in c.tokens:
            buffers = self._buffers(tokens)
            if total is None:
                total = len(c.tokens) * len(c.routings) * len(buffers)
            hint = self.size_hint(tokens)
            try:
                for routing in c.routings:
                    for spec, buf, why in buffers:
                        if buf is None:
                            rows.append(CaseRow(spec.backend, spec.transport, routing.label, tokens,
                                                skipped=why or "not built", size_hint_bytes=hint))
                    live = [(spec, buf) for spec, buf, _ in buffers if buf is not None]
                    for row in self._run_routing(tokens, routing, live, hint):
                        rows.append(row)
                        done += 1
                        self._report(done, total, f"{row.backend}/{row.transport} {row.routing} T={tokens}")
                    done += len(buffers) - len(live)
            finally:
                for _spec, buf, _why in buffers:
                    if buf is not None:
                        buf.destroy()
        if total is not None:
            self._report(total, total, "done")
        return rows

    def _report(self, done: int, total: int, label: str) -> None:
        if self.progress is not None:
            self.progress(min(done, total), total, label)

    def _run_routing(self, tokens: int, routing: RoutingSpec, live: List[Tuple[BufferSpec, Any]],
                     hint: Optional[int]) -> List[CaseRow]:
        import torch
        c = self.cfg
        batch = make_batch(routing, tokens, c.hidden, c.experts, c.topk, seed=c.seed, rank=self.rank,
                           hot_expert=c.hot_expert, drop_fraction=c.drop_fraction).to(self.device)
        ref_key = next((s.key for s, _ in live if s.backend == "reference"), None)
        checks, expert_outs = run_guard([(s.key, b) for s, b in live], batch, c.use_fp8, ref_key, self.sync)
        nv = batch.num_valid()
        per_rank_valid = [int(t[0]) for t in self.sync.gather(torch.tensor([nv], dtype=torch.int64),
                                                              "valid top-k entries")]
        rows = []
        for spec, buf in live:
            label = f"{spec.key} {routing.label} T={tokens}"
            runner = CaseRunner(buf, batch, expert_outs[spec.key], use_fp8=c.use_fp8, hook=c.hook,
                                sync=self.sync, keywords=NATIVE_KEYWORDS if spec.backend == "native" else {},
                                label=label, eager=c.eager)
            samples = runner.run(c.warmup, c.iters, c.kineto)
            gathered = gather_samples(samples, c.iters, self.sync)
            row = CaseRow(spec.backend, spec.transport, routing.label, tokens,
                          transport_detail=_transport_detail(buf), check=checks[spec.key],
                          num_valid=per_rank_valid,
                          dispatch_bytes=[metrics.dispatch_bytes(n, c.hidden, c.use_fp8) for n in per_rank_valid],
                          combine_bytes=[metrics.combine_bytes(n, c.hidden) for n in per_rank_valid],
                          wall={m: metrics.summarize(gathered["wall"][m]) for m in METRICS},
                          kernel={m: metrics.summarize(gathered["kernel"][m]) for m in METRICS},
                          host={m: metrics.summarize(gathered["host"][m]) for m in METRICS},
                          eager={m: metrics.summarize(gathered["eager"][m]) for m in EAGER_METRICS
                                 if "eager" in gathered},
                          samples=gathered, kernel_source=samples.kernel_source, kineto=samples.kineto,
                          size_hint_bytes=hint)
            rows.append(row)
            del expert_outs[spec.key]
        return rows
