"""FP8 (e4m3fn) quantization of dispatched tokens: THE definition. The GPU kernels implement exactly
this, so that the native and reference backends agree bit for bit.

For each token row and each group g of 128 consecutive channels (G = H / 128 groups):

1. ``amax = max(|x_f32|)`` over the group, then ``amax = max(amax, 1e-4f)`` (fmaxf; keeps all-zero
   groups from producing an infinite inverse scale).
2. ``scale = amax / 448.0f`` -- an IEEE fp32 division rounded to nearest (no fast-math reciprocal; in
   torch on CUDA that needs a tensor divisor, a Python-scalar divisor becomes ``amax * (1/448)``).
3. ``round_scale``: scale becomes the smallest power of two >= scale, computed exactly on the bits:
   ``e = (bits >> 23) & 0xff; if (bits & 0x7fffff) e += 1; scale = bits_as_float(e << 23)``.
   (scale >= 1e-4/448 is a normal fp32 number, so this is always well defined.)
4. ``inv = 1.0f / scale`` (IEEE fp32 division; exact for power-of-two scales).
5. ``q = float8_e4m3fn(clamp(x_f32 * inv, -448, 448))``: one fp32 multiply, then conversion with
   round-to-nearest-even (``__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)`` on the GPU).

Dequantization is ``q_f32 * scale``. Scales travel as fp32; with ``use_ue8m0`` (which requires
round_scale, so every scale is 2**k) the receiver stores only the exponent byte
``(bits(scale) >> 23) & 0xff`` and packs four consecutive groups into one int32, group 4j in the
least significant byte, group 4j+3 in the most significant; a trailing partial word is padded with
zero bytes. The packed tensor has ceil(G / 4) int32 per token.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

if TYPE_CHECKING:
    import torch

GROUP = 128
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def num_groups(hidden: int) -> int:
    if hidden % GROUP:
        raise ValueError(f"hidden must be a multiple of {GROUP}, got {hidden}")
    return hidden // GROUP


def num_packed_ue8m0(hidden: int) -> int:
    return (num_groups(hidden) + 3) // 4


def compute_scales(x: "torch.Tensor", round_scale: bool) -> "torch.Tensor":
    """fp32 scales [..., G] of x [..., H] (steps 1-3)."""
    import torch
    if x.shape[-1] % GROUP:
        raise ValueError(f"last dim of x must be a multiple of {GROUP}, got {tuple(x.shape)}")
    xf = x.to(torch.float32)
    groups = xf.reshape(*xf.shape[:-1], xf.shape[-1] // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    # A tensor divisor, not the Python float: torch's CUDA division by a CPU scalar multiplies by its
    # reciprocal (off by one fp32 ulp for ~half the groups), which flips FP8 roundings vs the kernels.
    scale = amax / torch.full_like(amax, FP8_MAX)
    if round_scale:
        scale = round_scale_pow2(scale)
    return scale


def round_scale_pow2(scale: "torch.Tensor") -> "torch.Tensor":
    """Smallest power of two >= scale, for positive normal fp32 scales (exact, bit arithmetic)."""
    import torch
    bits = scale.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def quantize_fp8(x: "torch.Tensor", round_scale: bool = False) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """x [..., H] (bf16 or fp32) -> (q float8_e4m3fn [..., H], scales fp32 [..., H/128])."""
    import torch
    scale = compute_scales(x, round_scale)
    inv = torch.ones_like(scale) / scale  # a true fp32 division, as the kernels do
    xf = x.to(torch.float32)
    groups = xf.reshape(*xf.shape[:-1], xf.shape[-1] // GROUP, GROUP)
    q = (groups * inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scale


def ue8m0_bytes(scale: "torch.Tensor") -> "torch.Tensor":
    """Exponent bytes (int32 values 0..255) of fp32 scales."""
    import torch
    return (scale.contiguous().view(torch.int32) >> 23) & 0xFF


def pack_ue8m0(scale: "torch.Tensor") -> "torch.Tensor":
    """fp32 power-of-two scales [..., G] -> int32 [..., ceil(G/4)] (4 exponent bytes per word)."""
    import torch
    g = scale.shape[-1]
    words = (g + 3) // 4
    b = ue8m0_bytes(scale).to(torch.int64)
    pad = words * 4 - g
    if pad:
        b = torch.nn.functional.pad(b, (0, pad))
    b = b.reshape(*b.shape[:-1], words, 4)
    packed = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    # The top byte may set bit 31: wrap to the two's-complement int32 the kernels store.
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_ue8m0(packed: "torch.Tensor", groups: int) -> "torch.Tensor":
    """int32 [..., ceil(G/4)] -> fp32 scales [..., G] (2**(byte - 127))."""
    import torch
    w = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=packed.device)
    b = (w.unsqueeze(-1) >> shifts) & 0xFF
    b = b.reshape(*packed.shape[:-1], packed.shape[-1] * 4)[..., :groups]
    return (b.to(torch.int32) << 23).view(torch.float32)


def dequantize_fp8(q: "torch.Tensor", scale: "torch.Tensor") -> "torch.Tensor":
    """q float8 [..., H] and fp32 scales [..., H/128] -> fp32 [..., H]."""
    import torch
    h = q.shape[-1]
    qf = q.to(torch.float32).reshape(*q.shape[:-1], h // GROUP, GROUP)
    return (qf * scale.to(torch.float32).unsqueeze(-1)).reshape(q.shape)
