"""The correctness guard: one dispatch + combine per backend before any timing.

Experts are the identity, so every expert output is the dispatched token itself (after the FP8 round
trip), and the combined result of token t must be sum_k w[t, k] * y_t over its valid entries -- an
oracle each rank computes locally without communication. When the native and reference backends both
run, their dispatch outputs (counts, layout, source indices, payload and scales of every valid row)
must also be identical, and their combine outputs equal within bf16 rounding.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ..ep import fp8
from .routing import RoutedBatch

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pyep.bench")

# The combine sums up to K bf16-rounded products in fp32; a kernel that fuses multiply-add may differ
# from the oracle in the last fp32 bit, which can flip the final bf16 rounding: allow a few bf16 ulps.
RTOL = 1.0 / 64.0
ATOL_FRACTION = 1e-3


@dataclass
class CheckResult:
    passed: bool
    detail: str = ""
    max_abs_diff: float = math.nan
    exact_fraction: float = math.nan          # fraction of output elements bitwise equal to the oracle
    failed_ranks: List[int] = field(default_factory=list)

    @property
    def status(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def as_dict(self) -> Dict[str, Any]:
        return {"status": self.status, "detail": self.detail, "failed_ranks": self.failed_ranks,
                "max_abs_diff": None if math.isnan(self.max_abs_diff) else self.max_abs_diff,
                "exact_fraction": None if math.isnan(self.exact_fraction) else round(self.exact_fraction, 6)}


@dataclass
class DispatchOut:
    recv_x: "torch.Tensor"
    scales: Optional["torch.Tensor"]
    recv_count: "torch.Tensor"
    handle: Any


def expert_identity(recv_x: "torch.Tensor", scales: Optional["torch.Tensor"],
                    recv_count: "torch.Tensor") -> "torch.Tensor":
    """bf16 [E_l, R*T, H]: each received row dequantized (rows past the count are zero)."""
    import torch
    e_l, rows, h = recv_x.shape
    out = torch.zeros((e_l, rows, h), dtype=torch.bfloat16, device=recv_x.device)
    counts = recv_count.tolist()
    for e in range(e_l):   # one expert at a time: the fp32 temporary of all experts is ~1 GB at full size
        n = int(counts[e])
        if n == 0:
            continue
        if scales is None:
            out[e, :n] = recv_x[e, :n]
        else:
            out[e, :n] = fp8.dequantize_fp8(recv_x[e, :n], scales[e, :n]).to(torch.bfloat16)
    return out


def token_payload(x: "torch.Tensor", use_fp8: bool) -> "torch.Tensor":
    """What an identity expert returns for each token: bf16 [N, H]."""
    import torch
    if not use_fp8:
        return x
    q, s = fp8.quantize_fp8(x)
    return fp8.dequantize_fp8(q, s).to(torch.bfloat16)


def combine_oracle(batch: RoutedBatch, use_fp8: bool) -> "torch.Tensor":
    """bf16 [N, H]: sum over valid k ascending of w[t, k] * y_t, fp32 accumulation, one rounding."""
    import torch
    y = token_payload(batch.x, use_fp8).to(torch.float32)
    acc = torch.zeros_like(y)
    valid = batch.topk_idx >= 0
    for j in range(batch.topk_idx.shape[1]):
        acc = torch.where(valid[:, j:j + 1], acc + batch.topk_weights[:, j:j + 1] * y, acc)
    return acc.to(torch.bfloat16)


def compare_combine(out: "torch.Tensor", ref: "torch.Tensor", what: str) -> CheckResult:
    import torch
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return CheckResult(False, f"{what}: got {out.dtype} {list(out.shape)}, expected {ref.dtype} "
                                  f"{list(ref.shape)}")
    if out.numel() == 0:
        return CheckResult(True, f"{what}: no tokens", 0.0, 1.0)
    o, r = out.float(), ref.float()
    diff = (o - r).abs()
    max_diff = float(diff.max())
    exact = float((out.view(torch.int16) == ref.view(torch.int16)).float().mean())
    atol = ATOL_FRACTION * float(r.abs().max()) + 1e-6
    bad = diff > atol + RTOL * r.abs()
    if not bool(torch.isfinite(o).all()):
        return CheckResult(False, f"{what}: non-finite values in the output", max_diff, exact)
    if bool(bad.any()):
        t, c = [int(v) for v in bad.nonzero()[0].tolist()]
        return CheckResult(False, f"{what}: {int(bad.sum())} of {bad.numel()} elements differ, first at "
                                  f"token {t} channel {c}: {float(o[t, c])!r} vs {float(r[t, c])!r}",
                           max_diff, exact)
    return CheckResult(True, f"{what}: max |diff| {max_diff:.3g}, {100 * exact:.2f}% bitwise equal",
                       max_diff, exact)


def compare_dispatch(a: DispatchOut, b: DispatchOut, what: str) -> Optional[str]:
    """None if both dispatch results agree on every valid row, else what differs."""
    import torch
    if not torch.equal(a.recv_count.cpu(), b.recv_count.cpu()):
        return f"{what}: recv_count differs: {a.recv_count.tolist()} vs {b.recv_count.tolist()}"
    if not torch.equal(a.handle.layout_range.cpu(), b.handle.layout_range.cpu()):
        return f"{what}: layout_range differs"
    rows = a.recv_x.shape[1]
    mask = torch.arange(rows, device=a.recv_count.device).unsqueeze(0) < a.recv_count.unsqueeze(1).long()
    mask_b = mask.to(b.recv_x.device)
    if not torch.equal(a.handle.src_info[mask].cpu(), b.handle.src_info[mask_b].cpu()):
        return f"{what}: src_info differs on received rows"
    if a.recv_x.dtype != b.recv_x.dtype:
        return f"{what}: recv_x dtypes differ: {a.recv_x.dtype} vs {b.recv_x.dtype}"
    # Compare bytes: boolean indexing is not implemented for float8 everywhere.
    xa, xb = a.recv_x.view(torch.uint8)[mask], b.recv_x.view(torch.uint8)[mask_b]
    if not torch.equal(xa.cpu(), xb.cpu()):
        return f"{what}: received token payloads differ"
    if (a.scales is None) != (b.scales is None):
        return f"{what}: one backend returned scales, the other did not"
    if a.scales is not None and not torch.equal(a.scales[mask].cpu(), b.scales[mask_b].cpu()):
        return f"{what}: received FP8 scales differ"
    return None


def run_guard(buffers: List[Tuple[str, Any]], batch: RoutedBatch, use_fp8: bool,
              reference_key: Optional[str], sync: Any) -> Tuple[Dict[str, CheckResult], Dict[str, "torch.Tensor"]]:
    """buffers: (key, EpBuffer) in the order every rank uses. Returns per key the check (agreed over
    all ranks) and the identity expert outputs the timing loops feed to combine."""
    import torch
    oracle = combine_oracle(batch, use_fp8)
    results: Dict[str, CheckResult] = {}
    outs: Dict[str, "torch.Tensor"] = {}
    dispatched: Dict[str, DispatchOut] = {}
    combined: Dict[str, "torch.Tensor"] = {}
    for key, buf in buffers:
        recv, count, handle, _event, _hook = buf.dispatch(batch.x, batch.topk_idx, use_fp8=use_fp8)
        recv_x, scales = recv if use_fp8 else (recv, None)
        sync.device_wait(f"guard dispatch on {key}")
        d = DispatchOut(recv_x, scales, count, handle)
        expert_out = expert_identity(recv_x, scales, count)
        out, _event, _hook = buf.combine(expert_out, batch.topk_idx, batch.topk_weights, handle)
        sync.device_wait(f"guard combine on {key}")
        dispatched[key], combined[key], outs[key] = d, out, expert_out
        results[key] = compare_combine(out, oracle, f"{key} combine vs oracle")
    if reference_key is not None and reference_key in dispatched:
        ref_d, ref_out = dispatched[reference_key], combined[reference_key]
        for key in dispatched:
            if key == reference_key or not results[key].passed:
                continue
            why = compare_dispatch(dispatched[key], ref_d, f"{key} dispatch vs {reference_key}")
            if why is None:
                vs = compare_combine(combined[key], ref_out, f"{key} combine vs {reference_key}")
                why = None if vs.passed else vs.detail
            if why is not None:
                res = results[key]
                results[key] = CheckResult(False, why, res.max_abs_diff, res.exact_fraction)
    # Agree: a row passes only if it passed on every rank; name the ranks where it did not.
    flags = torch.tensor([1 if results[k].passed else 0 for k, _ in buffers], dtype=torch.int32)
    per_rank = sync.gather(flags, "correctness guard results")
    for i, (key, _) in enumerate(buffers):
        failed = [r for r, f in enumerate(per_rank) if int(f[i]) == 0]
        res = results[key]
        res.failed_ranks = failed
        if failed and res.passed:
            res.passed = False
            res.detail = f"failed on rank(s) {failed}"
        if not res.passed:
            log.error("correctness guard FAILED for %s: %s", key, res.detail)
    return results, outs
