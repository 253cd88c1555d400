"""GPU-posted RDMA write loopback (what `pyep qp loopback` runs): two endpoints joined by one RC QP each
way, on the softnic or a real mlx5 NIC (DevX), connected through pyep.transport.connect (the setup every
pyep job uses), and the measurement loops: GPU threads posting through qp.h (the loopback kernels), or
CPU threads posting through the same qp.h code (`poster="cpu"`, softnic only: a baseline, and what CI
can run). The settings and the host checks made before any of this is set up: loopback_config.py.

Each endpoint owns one registered arena: [receive buffer | source buffer | signal word | fetch scratch].
Latency: endpoint 0 writes `size` bytes + a +1 signal into endpoint 1, which answers the same way when
its signal arrives; half the round trip is the one-way latency (as ib_write_lat reports it).
Bandwidth: endpoint 0 streams writes of `size` bytes with at most a send ring of them outstanding (the
window), the last one followed by a signal; bytes / time from first post to last completion.
After every case the received bytes are compared with what the peer sent.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List

from .loopback_config import LoopbackConfig

log = logging.getLogger("pyep.transport.loopback")

SIG_OFF, FETCH_OFF, CTRL_BYTES = 0, 64, 128     # within the control block after the two buffers
ALIGN = 64                                      # buffers start 64-byte aligned (the signal word must be)
ACCESS = 1 | 2 | 8                              # local write, remote write, remote atomic
STAGES = {0: "-", 1: "posting", 2: "waiting for the peer's signal", 3: "quiet (waiting for completions)"}
STATUS = {0: "ok", 1: "QP in error", 2: "timed out", 3: "invalid request"}


class LoopbackError(RuntimeError):
    """A loopback run failed (error completion, timeout, wrong data); the message says where."""


@dataclass
class Endpoint:
    index: int
    gpu: int
    provider: Any
    arena: Any                    # torch tensor (GPU poster) or pyep.softnic HostBuffer (CPU poster)
    addr: int
    length: int
    lkey: int = 0
    rkey: int = 0
    conn: Any = None              # pyep.transport.connect.Connections
    host_qp: Any = None           # engine HostQp (its context bytes; the CPU poster posts through it)
    qp_ctx: Any = None            # GPU poster: the context in this endpoint's GPU memory
    stream: Any = None
    extra: Dict[str, Any] = field(default_factory=dict)

    def recv(self) -> int:
        return self.addr

    def src(self, span: int) -> int:
        return self.addr + span

    def ctrl(self, span: int) -> int:
        return self.addr + 2 * span


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def pattern(index: int, n: int) -> bytes:
    """The bytes endpoint `index` sends (distinct per endpoint, so a write that lands in the wrong
    place or comes from the wrong side is caught)."""
    return bytes((i * 7 + 31 * index + (i >> 8)) % 251 for i in range(min(n, 4096))) * (n // 4096 + 1)


class Loopback:
    """Two connected endpoints; use as a context manager (close() releases QPs, MRs and NICs)."""

    def __init__(self, cfg: LoopbackConfig) -> None:
        self.cfg = cfg
        self.span = _round_up(cfg.max_size, ALIGN)   # arena: [receive | source | control], each span apart
        self.eps: List[Endpoint] = []
        self._nics: List[Any] = []
        self._torch: Any = None
        self._eng: Any = None
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ setup
    def _open(self) -> None:
        from .._native import engine
        from .connect import ConnectConfig, Connections
        from .connect_info import Region
        self._eng = engine()
        cfg = self.cfg
        gpu = cfg.poster == "gpu"
        if gpu:
            import torch
            self._torch = torch
        placement = "host_mapped" if gpu else "host"
        fabric = 0
        for k in range(2):
            dev = cfg.gpus[k]
            if cfg.nic == "softnic":
                from ..softnic import SoftNicConfig, SoftNic, new_fabric_id
                fabric = fabric or new_fabric_id()
                nic = SoftNic(SoftNicConfig(node_id=k, fabric_id=fabric, cuda_device=dev if gpu else -1))
                self._nics.append(nic)
                if gpu and not nic.has_cuda:
                    raise LoopbackError("this softnic cannot reach GPU memory (host-only build or no usable GPU)")
            else:
                name = cfg.devices[min(k, len(cfg.devices) - 1)]
                nic = self._eng.devx.DevxProvider(name)
                self._nics.append(nic)
                placement = "device" if "device" in list(nic.placements()) else "host_mapped"
            size = _round_up(2 * self.span + CTRL_BYTES, 4096)
            if gpu:
                arena = self._torch.zeros(size, dtype=self._torch.uint8, device=f"cuda:{dev}")
                self._torch.cuda.synchronize(dev)
                addr = int(arena.data_ptr())
            else:
                arena = nic.alloc_host(size)
                addr = arena.addr
            ep = Endpoint(k, dev, nic, arena, addr, size)
            if cfg.nic == "softnic":
                mr = nic.reg_mr(arena)
                ep.lkey, ep.rkey = mr.lkey, mr.rkey
                ep.extra["mr"] = mr
            else:
                mr = dict(nic.reg_mr(addr, size, ACCESS))
                ep.lkey, ep.rkey = int(mr["lkey"]), int(mr["rkey"])
                ep.extra["mr_lkey"] = ep.lkey
            ep.conn = Connections(nic, k, 2, ConnectConfig(qps_per_peer=1, log_sq=cfg.log_sq, placement=placement),
                                  regions=(Region("arena", addr, size, ep.rkey),))
            self.eps.append(ep)
        blobs = [ep.conn.local_info().to_bytes() for ep in self.eps]
        for ep in self.eps:
            ep.conn.connect(blobs)
            q = ep.conn.qps(1 - ep.index)[0]
            qp, cq = q.qp, q.cq
            # cq_ci=0: a fresh CQ, and the doorbell record may be device memory the host cannot read.
            ep.host_qp = self._eng.HostQp(qp["qpn"], qp["log_sq"], qp["sq"], qp["dbrec"], qp["bf"], qp["bf_size"],
                                          cq["cqes"], cq["dbrec"], cq["log_size"], 0)
            if gpu:
                t = self._torch
                ctx = t.frombuffer(bytearray(ep.host_qp.context_bytes()), dtype=t.uint8)
                ep.qp_ctx = ctx.to(f"cuda:{ep.gpu}")
                ep.stream = t.cuda.Stream(device=ep.gpu)
            self._fill(ep)
        log.info("loopback: %s, QPs %#x <-> %#x, ring %d WQEBBs, %s posters", self.describe_nic(),
                 self.eps[0].host_qp.qpn, self.eps[1].host_qp.qpn, 1 << cfg.log_sq, cfg.poster.upper())

    def describe_nic(self) -> str:
        if self.cfg.nic == "softnic":
            return "softnic (software mlx5 NIC)"
        return "DevX " + ",".join(self.cfg.devices)

    def _fill(self, ep: Endpoint) -> None:
        ms, span = self.cfg.max_size, self.span
        data = pattern(ep.index, ms)[:ms]
        if self._torch is not None:
            t = self._torch
            src = t.frombuffer(bytearray(data), dtype=t.uint8).to(f"cuda:{ep.gpu}")
            ep.arena[span:span + ms].copy_(src)
            t.cuda.synchronize(ep.gpu)
        else:
            ep.arena.view[span:span + ms] = data

    def close(self) -> None:
        for ep in self.eps:
            if ep.conn is not None:
                try:
                    ep.conn.close()
                except Exception as exc:  # noqa: BLE001 - keep releasing the rest
                    log.warning("loopback: closing endpoint %d's QPs: %s", ep.index, exc)
                ep.conn = None
        for ep in self.eps:
            try:
                if "mr" in ep.extra:
                    ep.provider.dereg_mr(ep.extra.pop("mr"))
                elif "mr_lkey" in ep.extra:
                    ep.provider.dereg_mr(ep.extra.pop("mr_lkey"))
            except Exception as exc:  # noqa: BLE001
                log.warning("loopback: deregistering endpoint %d's memory: %s", ep.index, exc)
        for nic in self._nics:
            if hasattr(nic, "close"):
                nic.close()
        self._nics = []
        self.eps = []

    def __enter__(self) -> "Loopback":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ memory helpers
    def _reset(self, size: int) -> None:
        """Zeroes the signal words and the part of the receive buffers a case writes, so a write that
        never lands cannot be hidden by an earlier case's data."""
        c = 2 * self.span
        for ep in self.eps:
            if self._torch is not None:
                ep.arena[c:c + CTRL_BYTES].zero_()
                ep.arena[:size].zero_()
                self._torch.cuda.synchronize(ep.gpu)
            else:
                ep.arena.view[c:c + CTRL_BYTES] = bytes(CTRL_BYTES)
                ep.arena.view[:size] = bytes(size)

    def _signal(self, ep: Endpoint) -> int:
        c = 2 * self.span
        if self._torch is not None:
            return int(ep.arena[c:c + 4].view(self._torch.int32).item()) & 0xFFFFFFFF
        return int(ep.arena.numpy("uint32")[c // 4])

    def _received(self, ep: Endpoint, size: int) -> bytes:
        if self._torch is not None:
            return bytes(ep.arena[:size].cpu().numpy().tobytes())
        return bytes(ep.arena.view[:size])

    def verify(self, receiver: Endpoint, size: int, what: str) -> None:
        got = self._received(receiver, size)
        want = pattern(1 - receiver.index, size)[:size]
        if got != want:
            bad = next(i for i in range(size) if got[i] != want[i])
            raise LoopbackError(f"{what}: endpoint {receiver.index} received wrong data at byte {bad} of {size} "
                                f"(got {got[bad]:#04x}, expected {want[bad]:#04x})")

    def _failure(self, ep: Endpoint, status: int, stage: int, iterations: int, what: str) -> LoopbackError:
        from ..softnic.types import QpError
        err = ""
        try:
            raw = self._eng.read_memory(int(ep.qp_ctx.data_ptr()), int(self._eng.qp_context_size)) \
                if ep.qp_ctx is not None else ep.host_qp.context_bytes()
            e = dict(self._eng.decode_qp_context(raw)["err"])
            err = "; QP error slot: " + QpError(**{k: e[k] for k in ("valid", "kind", "cqe_opcode", "syndrome",
                                                                     "vendor_syndrome", "wqe_opcode", "wqe_counter",
                                                                     "when_ns")}).describe()
        except Exception as exc:  # noqa: BLE001 - the failure itself is what matters
            err = f"; (QP error slot unreadable: {exc})"
        return LoopbackError(f"{what}: endpoint {ep.index} stopped while {STAGES.get(stage, stage)} after "
                             f"{iterations} iterations: {STATUS.get(status, status)}{err}")

    # ------------------------------------------------------------------ GPU posters
    def _endpoint_args(self, ep: Endpoint, samples: Any, result: Any) -> Any:
        ms, peer = self.span, self.eps[1 - ep.index]
        e = self._eng.LoopEndpoint()
        e.qp = int(ep.qp_ctx.data_ptr())
        e.src, e.lkey = ep.src(ms), ep.lkey
        e.dst, e.rkey = peer.recv(), peer.rkey
        e.sig_remote, e.sig_rkey = peer.ctrl(ms) + SIG_OFF, peer.rkey
        e.sig_local = ep.ctrl(ms) + SIG_OFF
        e.fetch, e.fetch_lkey = ep.ctrl(ms) + FETCH_OFF, ep.lkey
        e.samples = int(samples.data_ptr()) if samples is not None else 0
        e.result = int(result.data_ptr())
        return e

    def _wait(self, ep: Endpoint, bound_s: float, what: str) -> None:
        ev = self._torch.cuda.Event()
        ev.record(ep.stream)
        deadline = time.monotonic() + bound_s
        pause = 50e-6
        while not ev.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: the kernel on GPU {ep.gpu} did not finish within {bound_s:.0f} s "
                                   f"(each of its waits is bounded by {self.cfg.timeout_s} s)")
            time.sleep(pause)
            pause = min(2 * pause, 5e-3)

    def _host_bound(self, iters: int, size: int) -> float:
        # Generous: assumes at least 0.05 GB/s and 5 ms per round, plus one full timeout per poster.
        return 2 * self.cfg.timeout_s + 10 + (iters + self.cfg.warmup) * (5e-3 + size / 5e7)

    def _gpu_latency(self, size: int, iters: int) -> List[int]:
        t, cfg = self._torch, self.cfg
        what = f"latency, {size} B"
        res = [t.zeros(8, dtype=t.int64, device=f"cuda:{ep.gpu}") for ep in self.eps]
        samples = t.zeros(iters, dtype=t.int64, device=f"cuda:{self.eps[0].gpu}")
        args = [self._endpoint_args(ep, samples if ep.index == 0 else None, r) for ep, r in zip(self.eps, res)]
        for ep in self.eps:
            ep.stream.wait_stream(t.cuda.current_stream(ep.gpu))
        if self.eps[0].gpu == self.eps[1].gpu:
            self._eng.launch_loop_latency(args[0], args[1], 0, self.eps[0].gpu, size, iters, cfg.warmup,
                                          cfg.timeout_s, self.eps[0].stream.cuda_stream)
            waits = [self.eps[0]]
        else:
            for k in (1, 0):   # responder first: it must be running when the first ping arrives
                self._eng.launch_loop_latency(args[k], None, k, self.eps[k].gpu, size, iters, cfg.warmup,
                                              cfg.timeout_s, self.eps[k].stream.cuda_stream)
            waits = list(self.eps)
        for ep in waits:
            self._wait(ep, self._host_bound(iters, size), what)
        for ep, r in zip(self.eps, res):
            status, stage, done = (int(x) for x in r[:3].cpu().tolist())
            if status:
                raise self._failure(ep, status, stage, done, what)
        return [int(x) for x in samples.cpu().tolist()]

    def _gpu_bandwidth(self, size: int, iters: int) -> float:
        t, cfg = self._torch, self.cfg
        what = f"bandwidth, {size} B"
        ep = self.eps[0]
        res = t.zeros(8, dtype=t.int64, device=f"cuda:{ep.gpu}")
        ep.stream.wait_stream(t.cuda.current_stream(ep.gpu))
        self._eng.launch_loop_bandwidth(self._endpoint_args(ep, None, res), ep.gpu, size, iters, cfg.warmup,
                                        cfg.timeout_s, ep.stream.cuda_stream)
        self._wait(ep, self._host_bound(iters, size), what)
        status, stage, done, start, end = (int(x) for x in res[:5].cpu().tolist())
        if status:
            raise self._failure(ep, status, stage, done, what)
        return max(end - start, 1) / 1e9

    # ------------------------------------------------------------------ CPU posters
    def _post(self, ep: Endpoint, size: int, with_signal: bool) -> int:
        ms, peer = self.span, self.eps[1 - ep.index]
        if with_signal:
            return ep.host_qp.post_write_with_signal(ep.src(ms), ep.lkey, peer.recv(), peer.rkey, size,
                                                     peer.ctrl(ms) + SIG_OFF, peer.rkey, 1, ep.ctrl(ms) + FETCH_OFF,
                                                     ep.lkey, False, self.cfg.timeout_s)
        return ep.host_qp.post_rdma_write(ep.src(ms), ep.lkey, peer.recv(), peer.rkey, size, False,
                                          self.cfg.timeout_s)

    def _cpu_wait_signal(self, ep: Endpoint, target: int) -> int:
        deadline = time.monotonic() + self.cfg.timeout_s
        spins = 0
        while ((self._signal(ep) - target) & 0xFFFFFFFF) >= 0x80000000:
            spins += 1
            if spins % 64 == 0:
                ep.host_qp.poll()
                if ep.host_qp.error()["valid"]:
                    return 1
            if time.monotonic() > deadline:
                return 2
            time.sleep(0)   # let the peer's thread (and the softnic) have the GIL
        return 0

    def _cpu_side(self, ep: Endpoint, size: int, iters: int, out: Dict[str, Any]) -> None:
        initiator, total, samples = ep.index == 0, self.cfg.warmup + iters, []
        stage, status, i = 0, 0, 0
        for i in range(total):
            t0 = time.perf_counter_ns()
            if not initiator:
                status = self._cpu_wait_signal(ep, i + 1)
                if status:
                    stage = 2
                    break
            status = self._post(ep, size, True)
            if status:
                stage = 1
                break
            if initiator:
                status = self._cpu_wait_signal(ep, i + 1)
                if status:
                    stage = 2
                    break
                if i >= self.cfg.warmup:
                    samples.append(time.perf_counter_ns() - t0)
        else:
            i = total
        if not status:
            status = ep.host_qp.quiet(self.cfg.timeout_s)
            stage = 3 if status else 0
        out[ep.index] = (status, stage, i, samples)

    def _cpu_latency(self, size: int, iters: int) -> List[int]:
        out: Dict[int, Any] = {}
        threads = [threading.Thread(target=self._cpu_side, args=(ep, size, iters, out), daemon=True)
                   for ep in reversed(self.eps)]
        for th in threads:
            th.start()
        bound = self._host_bound(iters, size)
        for th in threads:
            th.join(bound)
            if th.is_alive():
                raise TimeoutError(f"latency, {size} B: a CPU poster did not finish within {bound:.0f} s")
        for ep in self.eps:
            status, stage, done, _ = out[ep.index]
            if status:
                raise self._failure(ep, status, stage, done, f"latency, {size} B")
        return out[0][3]

    def _cpu_bandwidth(self, size: int, iters: int) -> float:
        ep = self.eps[0]
        status, stage = 0, 1
        for _ in range(self.cfg.warmup):
            status = status or self._post(ep, size, False)
        status = status or ep.host_qp.quiet(self.cfg.timeout_s)
        t0 = time.perf_counter_ns()
        for k in range(iters):
            if status:
                break
            status = self._post(ep, size, k + 1 == iters)
        if not status:
            status, stage = ep.host_qp.quiet(self.cfg.timeout_s), 3
        elapsed = time.perf_counter_ns() - t0
        if status:
            raise self._failure(ep, status, stage, iters, f"bandwidth, {size} B")
        return max(elapsed, 1) / 1e9

    # ------------------------------------------------------------------ the cases
    def latency(self, size: int) -> Dict[str, Any]:
        iters = self.cfg.lat_iters
        self._reset(size)
        samples = self._gpu_latency(size, iters) if self._torch is not None else self._cpu_latency(size, iters)
        total = self.cfg.warmup + iters
        for ep in self.eps:
            if self._signal(ep) != total:
                raise LoopbackError(f"latency, {size} B: endpoint {ep.index}'s signal is {self._signal(ep)}, "
                                    f"expected {total}")
            self.verify(ep, size, f"latency, {size} B")
        half = sorted(s / 2e3 for s in samples)   # one-way latency in microseconds
        pick = (lambda q: half[min(len(half) - 1, int(q * len(half)))])
        return {"size": size, "iterations": iters, "t_min_us": half[0], "t_median_us": pick(0.5),
                "t_avg_us": sum(half) / len(half), "t_p99_us": pick(0.99), "t_max_us": half[-1]}

    def bandwidth(self, size: int) -> Dict[str, Any]:
        iters = self.cfg.bw_iters
        self._reset(size)
        seconds = self._gpu_bandwidth(size, iters) if self._torch is not None else self._cpu_bandwidth(size, iters)
        receiver = self.eps[1]
        if self._signal(receiver) != 1:
            raise LoopbackError(f"bandwidth, {size} B: the receiver's signal is {self._signal(receiver)}, expected 1")
        self.verify(receiver, size, f"bandwidth, {size} B")
        return {"size": size, "iterations": iters, "seconds": seconds, "gb_s": iters * size / seconds / 1e9,
                "mmsg_s": iters / seconds / 1e6}


def run_loopback(cfg: LoopbackConfig) -> Dict[str, Any]:
    """Every case of `cfg`; raises LoopbackError on the first failure. Returns the report."""
    report: Dict[str, Any] = {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
                              "latency": [], "bandwidth": []}
    with Loopback(cfg) as lb:
        report["nic"] = lb.describe_nic()
        report["window"] = 1 << cfg.log_sq
        for size in cfg.sizes:
            if "lat" in cfg.tests:
                report["latency"].append(lb.latency(size))
            if "bw" in cfg.tests:
                report["bandwidth"].append(lb.bandwidth(size))
    return report


__all__ = ["Loopback", "LoopbackConfig", "LoopbackError", "pattern", "run_loopback"]
