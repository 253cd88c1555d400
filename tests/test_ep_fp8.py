"""FP8 quantization (pyep.ep.fp8) against an independent numpy computation: fp32 scales, power-of-two
rounding, e4m3fn encoding with round-to-nearest-even, and UE8M0 packing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pyep.ep import fp8


def _e4m3_table() -> np.ndarray:
    """Values of the non-negative finite e4m3fn codes 0..126 (ascending with the code)."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


def _encode_e4m3(v: np.ndarray) -> np.ndarray:
    """Round float32 values (already within +-448) to e4m3fn codes, ties to the even code."""
    table = _e4m3_table()
    a = np.abs(v.astype(np.float64))
    hi = np.clip(np.searchsorted(table, a), 1, 126)
    lo = hi - 1
    d_lo, d_hi = a - table[lo], table[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a >= table[126], 126, code)
    return (code | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def _np_scales(x32: np.ndarray, round_scale: bool) -> np.ndarray:
    g = x32.reshape(x32.shape[0], -1, 128)
    amax = np.maximum(np.abs(g).max(axis=-1), np.float32(1e-4)).astype(np.float32)
    scale = (amax / np.float32(448.0)).astype(np.float32)
    if round_scale:
        mant, exp = np.frexp(scale.astype(np.float64))
        scale = np.where(mant == 0.5, scale, np.ldexp(1.0, exp)).astype(np.float32)
    return scale


def _inputs(n: int, h: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen) * torch.logspace(-6, 4, n).unsqueeze(1)
    x[0, :128] = 0.0                          # all-zero group: amax floor
    x[1, 5] = 3.0e4                           # one outlier dominates its group
    x[2, :128] = 1e-7                         # tiny group: floor again, values go subnormal/zero
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("hidden", [128, 384, 1024])
def test_quantize_matches_numpy(round_scale: bool, hidden: int) -> None:
    x = _inputs(24, hidden, seed=hidden + round_scale)
    q, scale = fp8.quantize_fp8(x, round_scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (24, hidden // 128)
    x32 = x.float().numpy()
    want_scale = _np_scales(x32, round_scale)
    np.testing.assert_array_equal(scale.numpy(), want_scale)
    inv = (np.float32(1.0) / want_scale).astype(np.float32)
    prod = (x32.reshape(24, -1, 128) * inv[..., None]).astype(np.float32)
    want_q = _encode_e4m3(np.clip(prod, -448, 448).reshape(24, hidden))
    got_q = q.view(torch.uint8).numpy()
    mism = np.argwhere(got_q != want_q)
    assert mism.size == 0, f"{len(mism)} codes differ, first at {mism[0]}: {got_q[tuple(mism[0])]:#x} " \
                           f"vs {want_q[tuple(mism[0])]:#x}"


def test_round_scale_is_power_of_two_and_not_smaller() -> None:
    x = _inputs(16, 512, seed=7)
    plain = fp8.compute_scales(x, False)
    rounded = fp8.compute_scales(x, True)
    mant, _ = np.frexp(rounded.numpy().astype(np.float64))
    assert np.all(mant == 0.5)
    assert torch.all(rounded >= plain) and torch.all(rounded < 2 * plain)
    exact = torch.tensor([0.25, 1.0, 2.0 ** -20], dtype=torch.float32)
    assert torch.equal(fp8.round_scale_pow2(exact), exact)


@pytest.mark.parametrize("hidden", [128, 512, 640, 1152])
def test_ue8m0_packing(hidden: int) -> None:
    x = _inputs(8, hidden, seed=hidden)
    scale = fp8.compute_scales(x, True)
    packed = fp8.pack_ue8m0(scale)
    groups = hidden // 128
    words = (groups + 3) // 4
    assert packed.dtype == torch.int32 and packed.shape == (8, words) == (8, fp8.num_packed_ue8m0(hidden))
    _, exp = np.frexp(scale.numpy().astype(np.float64))
    byte = (exp - 1 + 127).astype(np.uint8)           # scale = 2**(exp-1)
    padded = np.zeros((8, words * 4), dtype=np.uint8)
    padded[:, :groups] = byte
    want = padded.view("<i4")
    np.testing.assert_array_equal(packed.numpy(), want)
    assert torch.equal(fp8.unpack_ue8m0(packed, groups), scale)


def test_ue8m0_high_byte_sets_sign_bit() -> None:
    scale = torch.tensor([[2.0 ** 1, 2.0 ** 2, 2.0 ** 3, 2.0 ** 4]], dtype=torch.float32)  # bytes 128..131
    packed = fp8.pack_ue8m0(scale)
    assert int(packed[0, 0]) == int(np.array([128 | 129 << 8 | 130 << 16 | 131 << 24], dtype=np.uint32).view(np.int32)[0])
    assert torch.equal(fp8.unpack_ue8m0(packed, 4), scale)


def test_dequantize_error_bound() -> None:
    x = torch.randn(32, 768, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for rs in (False, True):
        q, scale = fp8.quantize_fp8(x, rs)
        deq = fp8.dequantize_fp8(q, scale)
        err = (deq - x.float()).abs().reshape(32, 6, 128)
        amax = x.float().abs().reshape(32, 6, 128).amax(-1, keepdim=True)
        # 3 mantissa bits: half an ulp is 1/16 of the value's binade; below that, subnormal steps.
        bound = x.float().abs().reshape(32, 6, 128) / 16 + amax * 2.0 ** -9 * (2 if rs else 1)
        assert torch.all(err <= bound)


def test_bad_hidden() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.quantize_fp8(torch.zeros(2, 100, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.num_groups(130)
