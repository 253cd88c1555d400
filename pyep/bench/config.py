"""Settings of one `pyep bench` run, checked before any process group or GPU is touched."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

from ..ep.config import FP8_GROUP, MAX_HIDDEN, MAX_TOPK, TRANSPORTS, _check_int

ROUTING_KINDS = ("uniform", "zipf", "hot")
BENCH_BACKENDS = ("auto", "native", "reference", "both")
DISPATCH_DTYPES = ("fp8", "bf16")
# The DeepEP low-latency sweep: powers of two up to 256 tokens per rank.
SWEEP_TOKENS: Tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _float(name: str, value: object, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    if not lo <= float(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return float(value)


@dataclass(frozen=True)
class RoutingSpec:
    """How tokens pick experts. uniform: K distinct experts uniformly at random. zipf: K distinct
    experts drawn without replacement with P(expert of popularity rank i) ~ 1 / i**param (param = s).
    hot: a fraction param of each rank's tokens all include one hot expert; the other tokens avoid
    it, so the measured fraction is exact."""

    kind: str = "uniform"
    param: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ROUTING_KINDS:
            raise ValueError(f"routing must be one of {ROUTING_KINDS}, got {self.kind!r}")
        if self.kind == "zipf":
            _float("zipf exponent", self.param, 0.0, 10.0)
        elif self.kind == "hot":
            _float("hot-expert fraction", self.param, 0.0, 1.0)

    @property
    def label(self) -> str:
        return "uniform" if self.kind == "uniform" else f"{self.kind}:{self.param:g}"

    @staticmethod
    def parse(text: str, zipf_s: float = 1.0, hot_fraction: float = 0.25) -> "RoutingSpec":
        """'uniform', 'zipf', 'zipf:1.5', 'hot', 'hot:0.3' (defaults from --zipf-s / --hot-fraction)."""
        kind, sep, raw = text.strip().partition(":")
        if kind not in ROUTING_KINDS:
            raise ValueError(f"unknown routing {text!r}: use uniform, zipf[:S] or hot[:FRACTION]")
        if kind == "uniform":
            if sep:
                raise ValueError(f"routing 'uniform' takes no parameter, got {text!r}")
            return RoutingSpec("uniform")
        if sep:
            try:
                param = float(raw)
            except ValueError:
                raise ValueError(f"routing {text!r}: {raw!r} is not a number") from None
        else:
            param = zipf_s if kind == "zipf" else hot_fraction
        return RoutingSpec(kind, param)


@dataclass(frozen=True)
class BenchConfig:
    tokens: Tuple[int, ...] = (128,)           # T values; the buffer is rebuilt for each
    hidden: int = 7168
    topk: int = 8
    experts: int = 288
    routings: Tuple[RoutingSpec, ...] = (RoutingSpec("uniform"),)
    hot_expert: int = 0
    drop_fraction: float = 0.0                 # fraction of (token, k) entries set to -1
    dispatch_dtype: str = "fp8"
    transports: Tuple[str, ...] = ("auto",)    # native backend only; the reference has one path
    backend: str = "auto"
    iters: int = 50
    warmup: int = 10
    hook: bool = True                          # also time the send/receive halves (recv hook)
    kineto: bool = True                        # per-kernel times from torch.profiler on GPU
    seed: int = 0
    timeout_us: int = 10_000_000               # EpBuffer's per-call timeout
    wait_timeout_s: float = 120.0              # every barrier / device wait of the benchmark
    ranks_per_node: Optional[int] = None
    plot: bool = True
    eager: bool = True                         # the eager pass: back-to-back pairs, default arguments
    extra: dict = field(default_factory=dict, compare=False)   # free-form notes copied into the JSON

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, tuple) or not self.tokens:
            raise ValueError(f"tokens must be a non-empty tuple of ints, got {self.tokens!r}")
        for t in self.tokens:
            _check_int("tokens", t, 1, 1 << 16)
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError(f"tokens has duplicates: {self.tokens}")
        h = _check_int("hidden", self.hidden, FP8_GROUP, MAX_HIDDEN)
        if h % FP8_GROUP:
            raise ValueError(f"hidden must be a multiple of {FP8_GROUP}, got {h}")
        _check_int("experts", self.experts, 1)
        _check_int("topk", self.topk, 1, MAX_TOPK)
        if self.topk > self.experts:
            raise ValueError(f"topk ({self.topk}) cannot exceed experts ({self.experts}): each token "
                             "picks distinct experts")
        if not self.routings:
            raise ValueError("at least one routing is needed")
        for r in self.routings:
            if not isinstance(r, RoutingSpec):
                raise TypeError(f"routings must hold RoutingSpec, got {type(r).__name__}")
            if r.kind == "hot" and r.param < 1.0 and self.topk > self.experts - 1:
                raise ValueError(f"hot routing: tokens that avoid the hot expert need topk ({self.topk}) "
                                 f"<= experts - 1 ({self.experts - 1})")
        if len({r.label for r in self.routings}) != len(self.routings):
            raise ValueError(f"routings has duplicates: {[r.label for r in self.routings]}")
        _check_int("hot_expert", self.hot_expert, 0, self.experts - 1)
        _float("drop_fraction", self.drop_fraction, 0.0, 1.0)
        if self.dispatch_dtype not in DISPATCH_DTYPES:
            raise ValueError(f"dispatch_dtype must be one of {DISPATCH_DTYPES}, got {self.dispatch_dtype!r}")
        if not self.transports:
            raise ValueError("at least one transport is needed")
        for t in self.transports:
            if t not in TRANSPORTS:
                raise ValueError(f"transport must be one of {TRANSPORTS}, got {t!r}")
        if len(set(self.transports)) != len(self.transports):
            raise ValueError(f"transports has duplicates: {self.transports}")
        if self.backend not in BENCH_BACKENDS:
            raise ValueError(f"backend must be one of {BENCH_BACKENDS}, got {self.backend!r}")
        _check_int("iters", self.iters, 1, 100_000)
        _check_int("warmup", self.warmup, 0, 100_000)
        _check_int("seed", self.seed, 0, 2**31 - 1)
        _check_int("timeout_us", self.timeout_us, 1)
        _float("wait_timeout_s", self.wait_timeout_s, 0.001, 86400.0)
        if self.ranks_per_node is not None:
            _check_int("ranks_per_node", self.ranks_per_node, 1)
        for flag in ("hook", "kineto", "plot", "eager"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {type(getattr(self, flag)).__name__}")

    @property
    def use_fp8(self) -> bool:
        return self.dispatch_dtype == "fp8"

    def check_world(self, world_size: int) -> None:
        """Checks that need the group size (run on every rank before any buffer is built)."""
        if self.experts % world_size:
            raise ValueError(f"experts ({self.experts}) must be divisible by the number of ranks "
                             f"({world_size})")
        if self.ranks_per_node is not None and world_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node ({self.ranks_per_node}) must divide the number of ranks "
                             f"({world_size})")
