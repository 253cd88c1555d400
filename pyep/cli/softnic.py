"""`pyep softnic selftest`: a host-memory loopback through two in-process softnics.

`Loopback` (two softnics, nodes 0 and 1, one connected RC QP pair, shared buffers) is also what the
CPU tests build on.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional

from . import CliError


@dataclass(frozen=True)
class LoopbackSpec:
    log_sq: int = 3               # 8 WQEBBs: every few posts wrap the ring
    log_cq: int = 4
    buffer_bytes: int = 1 << 16
    ack_timeout: int = 8          # retry time 4.096 us * 2^8 * (retry_cnt + 1) ~ 2 ms
    retry_cnt: int = 1
    start: bool = True
    fabric_id: Optional[int] = None


class Loopback:
    """Node 0 posts through `poster` (QP a) to node 1 (QP b); b can post back through `poster_b`."""

    def __init__(self, spec: LoopbackSpec = LoopbackSpec()) -> None:
        from ..softnic import ConnectAttr, SoftNic, SoftNicConfig, new_fabric_id
        self.spec = spec
        fabric = spec.fabric_id or new_fabric_id()
        self.a = SoftNic(SoftNicConfig(node_id=0, fabric_id=fabric, start=spec.start))
        try:
            self.b = SoftNic(SoftNicConfig(node_id=1, fabric_id=fabric, start=spec.start))
        except Exception:
            self.a.close()
            raise
        self.attr = ConnectAttr(ack_timeout=spec.ack_timeout, retry_cnt=spec.retry_cnt)
        self.cq_a = self.a.create_cq(spec.log_cq)
        self.qp_a = self.a.create_qp(self.cq_a, spec.log_sq)
        self.cq_b = self.b.create_cq(spec.log_cq)
        self.qp_b = self.b.create_qp(self.cq_b, spec.log_sq)
        self.src = self.a.alloc_host(spec.buffer_bytes)
        self.fetch = self.a.alloc_host(4096)
        self.dst = self.b.alloc_host(spec.buffer_bytes)
        self.sig = self.b.alloc_host(4096)
        self.mr_src = self.a.reg_mr(self.src)
        self.mr_fetch = self.a.reg_mr(self.fetch)
        self.mr_dst = self.b.reg_mr(self.dst)
        self.mr_sig = self.b.reg_mr(self.sig)
        self.connect()

    def connect(self) -> None:
        """(Re)connects the QP pair and makes fresh posters (after a reset)."""
        self.a.connect(self.qp_a, 1, self.qp_b.qpn, self.attr)
        self.b.connect(self.qp_b, 0, self.qp_a.qpn, self.attr)
        self.poster = self.a.host_qp(self.qp_a, self.cq_a)
        self.poster_b = self.b.host_qp(self.qp_b, self.cq_b)

    def reset(self) -> None:
        self.a.reset_qp(self.qp_a)
        self.b.reset_qp(self.qp_b)

    def close(self) -> None:
        self.a.close()
        self.b.close()

    def __enter__(self) -> "Loopback":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float = 0.0


@dataclass
class SelftestResult:
    ok: bool
    checks: List[Check] = field(default_factory=list)


def _writes(lb: Loopback, iterations: int, rng: random.Random) -> str:
    src, dst = lb.src.numpy(), lb.dst.numpy()
    src[:] = bytearray(rng.randbytes(len(src)))
    dst[:] = 0
    sig = lb.sig.numpy("uint32")
    sig[0] = 0
    slot = 512
    expected = bytearray(len(dst))
    for i in range(iterations):
        length = rng.randrange(1, slot + 1)
        soff = rng.randrange(0, len(src) - length)
        doff = (i * slot) % (len(dst) - slot)
        st = lb.poster.post_write_with_signal(lb.src.addr + soff, lb.mr_src.lkey, lb.dst.addr + doff, lb.mr_dst.rkey,
                                              length, lb.sig.addr, lb.mr_sig.rkey, 1, lb.fetch.addr,
                                              lb.mr_fetch.lkey, signaled=(i % 5 == 0))
        lb.poster.check(st, f"write {i}")
        expected[doff:doff + length] = bytes(src[soff:soff + length])
    lb.poster.check(lb.poster.quiet(), "quiet")
    if bytes(dst) != bytes(expected):
        bad = next(i for i in range(len(expected)) if dst[i] != expected[i])
        raise AssertionError(f"destination differs first at byte {bad}")
    if int(sig[0]) != iterations:
        raise AssertionError(f"signal is {int(sig[0])}, expected {iterations}")
    return f"{iterations} writes + signals landed byte-exact, signal = {int(sig[0])}"


WRAPS = 10


def _wrap(lb: Loopback) -> str:
    """The ring must have wrapped WRAPS times. A short run of writes (--iterations below about 40) does
    not get there, so signaled NOPs make up the rest: every WQEBB slot is then reused WRAPS times, which
    only works when completions free the slots (CQ-driven flow control)."""
    ring = 1 << lb.spec.log_sq
    resv = lb.poster.counters()["resv"]
    nops = max(0, WRAPS * ring - resv)
    for i in range(nops):
        # Signal every quarter ring: the poster reclaims slots only from CQEs.
        lb.poster.check(lb.poster.post_nop(signaled=i % (ring // 4 or 1) == 0 or i == nops - 1), f"nop {i}")
    lb.poster.check(lb.poster.quiet(), "quiet")
    resv = lb.poster.counters()["resv"]
    wraps = resv // ring
    if wraps < WRAPS:
        raise AssertionError(f"ring of {ring} WQEBBs wrapped only {wraps} times after {nops} NOPs")
    return (f"ring of {ring} WQEBBs wrapped {wraps} times (CQ-driven flow control"
            + (f"; {nops} NOPs after the writes)" if nops else ")"))


def _fa64(lb: Loopback, rng: random.Random) -> str:
    sig64 = lb.sig.numpy("uint64")
    fetched = lb.fetch.numpy("uint64")
    sig64[1] = start = rng.getrandbits(40)
    total = start
    for i in range(64):
        add = rng.getrandbits(32)
        lb.poster.check(lb.poster.post_fa64(lb.sig.addr + 8, lb.mr_sig.rkey, add, lb.fetch.addr + 8, lb.mr_fetch.lkey,
                                            signaled=True), f"fa64 {i}")
        lb.poster.check(lb.poster.quiet(), "quiet")
        if int(fetched[1]) != total:
            raise AssertionError(f"fa64 {i}: fetched {int(fetched[1])}, expected {total}")
        total += add
    if int(sig64[1]) != total:
        raise AssertionError(f"fa64 target {int(sig64[1])}, expected {total}")
    return "64 FA64 with correct fetched old values"


def _rkey_fault(lb: Loopback) -> str:
    from ..softnic import PostStatus, QpState, Syndrome
    lb.b.invalidate_key(lb.mr_dst)
    wr = {"opcode": "rdma_write", "laddr": lb.src.addr, "lkey": lb.mr_src.lkey, "raddr": lb.dst.addr,
          "rkey": lb.mr_dst.rkey, "length": 64}
    st = lb.poster.post_batch([wr, dict(wr, raddr=lb.dst.addr + 64), {"opcode": "nop", "signaled": True}])
    lb.poster.check(st, "post")
    st = lb.poster.quiet(timeout_s=5.0)
    err = lb.poster.error()
    if st != PostStatus.ERR_QP or err.syndrome != Syndrome.REMOTE_ACCESS_ERR:
        raise AssertionError(f"expected ERR_QP with REMOTE_ACCESS_ERR, got {st.name}: {err.describe()}")
    deadline = time.monotonic() + 5.0
    while lb.a.qp_stats(lb.qp_a).flushed < 2 and time.monotonic() < deadline:
        lb.poster.poll()
        time.sleep(0.001)
    stats = lb.a.qp_stats(lb.qp_a)
    if stats.state != QpState.ERR or stats.flushed != 2:
        raise AssertionError(f"after the error: state {stats.state.name}, flushed {stats.flushed} (expected ERR, 2)")
    if lb.poster.post_nop(signaled=True) != PostStatus.ERR_QP:
        raise AssertionError("a post after the error did not fail fast")
    lb.a.events(log_them=False)
    return "invalidated rkey -> REMOTE_ACCESS_ERR CQE, 2 WQEs flushed, later posts fail fast"


def _recover(lb: Loopback) -> str:
    from ..softnic import Access
    lb.b.dereg_mr(lb.mr_dst)
    lb.mr_dst = lb.b.reg_mr(lb.dst, access=Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    lb.reset()
    lb.connect()
    lb.src.numpy()[:64] = 7
    lb.poster.check(lb.poster.post_rdma_write(lb.src.addr, lb.mr_src.lkey, lb.dst.addr, lb.mr_dst.rkey, 64,
                                              signaled=True), "write after reset")
    lb.poster.check(lb.poster.quiet(), "quiet after reset")
    if bytes(lb.dst.numpy()[:64]) != bytes([7] * 64):
        raise AssertionError("write after reset did not land")
    return "RESET -> INIT -> RTR -> RTS again, new key, writes land"


def run_selftest(iterations: int = 300, seed: int = 1) -> SelftestResult:
    rng = random.Random(seed)
    result = SelftestResult(ok=True)
    with Loopback() as lb:
        steps: List["tuple[str, Callable[[], str]]"] = [
            ("writes+signals", lambda: _writes(lb, iterations, rng)),
            ("ring wraparound", lambda: _wrap(lb)),
            ("fa64 fetch", lambda: _fa64(lb, rng)),
            ("rkey fault", lambda: _rkey_fault(lb)),
            ("reset+reconnect", lambda: _recover(lb)),
        ]
        for name, fn in steps:
            t0 = time.monotonic()
            try:
                detail, ok = fn(), True
            except Exception as exc:  # a failed check is reported, never raised
                detail, ok = f"{type(exc).__name__}: {exc}", False
            result.checks.append(Check(name, ok, detail, round(time.monotonic() - t0, 4)))
            result.ok &= ok
    return result


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("softnic", help="the software mlx5 NIC (transport=emulated)")
    actions = p.add_subparsers(dest="softnic_action", metavar="ACTION")
    st = actions.add_parser("selftest", help="host-memory loopback through two softnics, pass/fail table")
    st.add_argument("--json", action="store_true", help="print the result as JSON")
    st.add_argument("--iterations", type=int, default=300, help="writes + signals to post (default 300)")
    st.add_argument("--seed", type=int, default=1)
    st.set_defaults(func=run)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.iterations <= 1_000_000:
        raise CliError(f"--iterations must be in 1..1000000, got {args.iterations}")
    from .._native import load
    if load() is None:
        print("pyep softnic: the native engine is not built (pip install -e . or python setup.py build_ext --inplace)")
        return 1
    result = run_selftest(args.iterations, args.seed)
    if args.json:
        print(json.dumps(asdict(result), indent=2))
        return 0 if result.ok else 1
    width = max(len(c.name) for c in result.checks)
    print(f"{'check':<{width}}  result  time(s)  detail")
    for c in result.checks:
        print(f"{c.name:<{width}}  {'PASS' if c.ok else 'FAIL':<6}  {c.seconds:7.3f}  {c.detail}")
    print(f"softnic selftest: {'PASS' if result.ok else 'FAIL'} "
          f"({sum(c.ok for c in result.checks)}/{len(result.checks)} checks)")
    return 0 if result.ok else 1
