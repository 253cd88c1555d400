"""LogFMT-10: the low-latency combine's optional 10-bit logarithmic payload (``use_logfmt=True``).

THE definition of the format; ``engine/kernels/ll_logfmt.cuh`` computes the same numbers bit for bit
(tests/test_ll_sim.py checks it). The idea is DeepEP's: per 128-channel group, the magnitudes are
quantized to 512 levels spaced evenly in log2 between the group's smallest and largest magnitude, plus a
sign bit -- 10 bits per channel instead of 16. DeepEP computes its logarithms with the GPU's approximate
``lg2``/``ex2`` instructions, which no host code reproduces; here every step is an IEEE fp32 operation
(one rounding each, no FMA) or a table lookup, so a reference on any machine gives the kernel's bits.

One row of H bf16 channels, G = H / 128 groups. Per group, on the bf16 bit patterns:
- ``a`` = bits & 0x7fff; subnormals and zeros (a < 0x80) count as 0 (``az``).
- ``amax`` = max(az), ``amin`` = min(az) (integer compares of bf16 magnitudes are value compares).
- The group is *cast* iff 0x80 <= amax < 0x3f80 (0 < max |x| < 1, so also no Inf/NaN) and amin < amax
  (DeepEP's condition ``log_amax < 0 and log_amin < log_amax``). Otherwise it travels as plain bf16.
- ``L(a)`` = float((a >> 7) - 127) + LOG2_MANT[a & 127], with LOG2_MANT[m] = fp32(log2(1 + m/128)):
  log2 of a normal bf16 magnitude (exact to the table's rounding; the table is the fp32 rounding of
  the double result).
- ``la`` = L(amax); ``lb`` = la - 32 if amin == 0 else max(L(amin), la - 32)  (at most 32 octaves);
  ``step`` = (la - lb) / 510; ``inv`` = 1 / step; ``bias`` = 1.5 - step * fp32(ln2 / 8).
- Channel code: 0 for az == 0, else min(511, floor(max((L(az) - lb) * inv + bias, 0))). Code c >= 1
  stands for 2^(lb + (c - 1) * step): c - 1 = round(u), u = (log2|x| - lb) / step, where the rounding
  threshold sits at u = j + 1/2 + step * ln2 / 8 -- to first order in step the midpoint between the
  two neighbouring levels in linear scale, as DeepEP's ``log2((1 + 2^step) / 2) / step`` is.
- Decode of c >= 1: y = float(c - 1) * step + lb; n = floor(y); f = y - n (exact);
  p = EXP2_POLY(f) (Horner, degree 6, |p / 2^f - 1| < 1e-7); value = p * 2^n, or 0 when n < -126
  (no subnormal results). The sign bit negates it; code 0 decodes to +0.0.

Message of one row (the combine slot of a (token, top-k slot)), everything little-endian:
- ``meta_bytes(H)`` = align16(4 G) bytes: per group a uint32, amax | amin << 16 (the bf16 patterns);
- then the groups in order: a cast group is 160 bytes (8 units of 16 channels, each unit 5 uint32 --
  codes c_0..c_15 at bits 9i..9i+8 of the 160-bit unit, signs at bits 144 + i), a bf16 group is its
  256 raw bytes. The row is ``meta + 160 * cast + 256 * (G - cast)`` bytes on the wire, at most
  ``message_bytes(H)`` = meta + 2H.

The receiver decodes to fp32 and reduces ``out = sum_k w_k * y_k`` exactly as for BF16 (k ascending,
one multiply and one add per term, one bf16 rounding). Error: a cast channel's relative error is at most
about 2^(step/2) - 1 (<= 2.2 % when the group spans the full 32 octaves, 0.27 % for 4 octaves, against
bf16's 0.39 %); see tests/test_ep_logfmt.py for the asserted bounds.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Tuple

import numpy as np

if TYPE_CHECKING:
    import torch

GROUP = 128
NUM_LEVELS = 510                      # log steps between amin and amax (codes 1..511)
MAX_CODE = 511
CLIP_OCTAVES = 32.0
CAST_GROUP_BYTES = 160                # 128 channels x 10 bits
UNIT_CHANNELS = 16                    # one 160-bit unit: 16 codes of 9 bits + 16 sign bits
UNIT_WORDS = 5

LOG2_MANT = np.array([math.log2(1.0 + m / 128.0) for m in range(128)], dtype=np.float32)
# 2^f on [0, 1): coefficients of f^0..f^6 (fp32, hex-exact; the kernel has the same literals).
EXP2_POLY_HEX = ("0x1.0p+0", "0x1.62e428p-1", "0x1.ebfdf8p-3", "0x1.c67ee4p-5", "0x1.3d5826p-7",
                 "0x1.44bd44p-10", "0x1.cacdf6p-13")
EXP2_POLY = np.array([float.fromhex(h) for h in EXP2_POLY_HEX], dtype=np.float32)
LN2_OVER_8 = np.float32(float.fromhex("0x1.62e43p-4"))

_F = np.float32


def meta_bytes(hidden: int) -> int:
    """Bytes of a message's per-group (amax, amin) words, padded to 16."""
    return (4 * (hidden // GROUP) + 15) // 16 * 16


def message_bytes(hidden: int) -> int:
    """Largest LogFMT message of a row (every group sent as bf16): what a combine slot must hold."""
    return meta_bytes(hidden) + 2 * hidden


def _check_hidden(hidden: int) -> None:
    if hidden <= 0 or hidden % (4 * GROUP):
        # The kernels give a warp 512 channels per round (32 lanes x 16); H = 128 * G with G % 4 == 0
        # keeps every round whole. layout.py requires H % 128; this stricter rule is LogFMT's.
        raise ValueError(f"LogFMT needs hidden to be a positive multiple of {4 * GROUP}, got {hidden}")


def _log2_bf16(a: np.ndarray) -> np.ndarray:
    """L(a) for normal bf16 magnitudes a (int32 array)."""
    return ((a >> 7) - 127).astype(np.float32) + LOG2_MANT[a & 127]


def _exp2(y: np.ndarray) -> np.ndarray:
    n = np.floor(y)
    f = (y - n).astype(np.float32)
    p = np.full_like(f, EXP2_POLY[6])
    for c in EXP2_POLY[5::-1]:
        p = (p * f).astype(np.float32) + c
    nn = np.clip(n, -126, 127).astype(np.int32)
    scale = ((nn + 127).astype(np.uint32) << 23).view(np.float32)
    return np.where(n < -126, _F(0), (p * scale).astype(np.float32)).astype(np.float32)


def _params(amax: np.ndarray, amin: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cast, lb, step) per group from the meta magnitudes (int32 arrays)."""
    cast = (amax >= 0x80) & (amax < 0x3F80) & (amin < amax)
    safe_max = np.where(cast, amax, 0x3F00)
    safe_min = np.where(amin >= 0x80, amin, 0x3F00)
    la = _log2_bf16(safe_max)
    la32 = (la - _F(CLIP_OCTAVES)).astype(np.float32)
    lb = np.where(amin == 0, la32, np.maximum(_log2_bf16(safe_min), la32)).astype(np.float32)
    step = ((la - lb) / _F(NUM_LEVELS)).astype(np.float32)
    step = np.where(cast, step, _F(1))
    return cast, lb, step


def encode(x: "torch.Tensor") -> Tuple[np.ndarray, np.ndarray]:
    """Encode bf16 rows [N, H]. Returns (messages uint8 [N, message_bytes(H)] -- zero past each row's
    end --, wire bytes int64 [N])."""
    import torch
    n, h = int(x.shape[0]), int(x.shape[1])
    _check_hidden(h)
    g = h // GROUP
    bits = x.detach().to("cpu").contiguous().view(torch.int16).numpy().astype(np.int32) & 0xFFFF
    bits = bits.reshape(n, g, GROUP)
    a = bits & 0x7FFF
    az = np.where(a < 0x80, 0, a)
    amax, amin = az.max(-1), az.min(-1)
    cast, lb, step = _params(amax, amin)
    inv = (_F(1) / step).astype(np.float32)
    bias = (_F(1.5) - (step * LN2_OVER_8).astype(np.float32)).astype(np.float32)
    lx = _log2_bf16(np.where(az >= 0x80, az, 0x3F00))
    with np.errstate(invalid="ignore", over="ignore"):
        u = (((lx - lb[..., None]).astype(np.float32) * inv[..., None]).astype(np.float32) + bias[..., None])
        u = np.floor(np.maximum(u.astype(np.float32), _F(0)))
    code = np.minimum(np.where(az == 0, 0, u), MAX_CODE).astype(np.uint32)
    sign = (bits >> 15).astype(np.uint32)

    # Pack: units of 16 channels, 160 bits = codes at 9i, signs at 144 + i.
    c = code.reshape(n, g, 8, UNIT_CHANNELS)
    s = sign.reshape(n, g, 8, UNIT_CHANNELS)
    words = np.zeros((n, g, 8, UNIT_WORDS), dtype=np.uint64)
    for i in range(UNIT_CHANNELS):
        pos = 9 * i
        w, sh = pos // 32, pos % 32
        words[..., w] |= c[..., i].astype(np.uint64) << np.uint64(sh)
        if sh > 23:
            words[..., w + 1] |= c[..., i].astype(np.uint64) >> np.uint64(32 - sh)
    signs = np.zeros((n, g, 8), dtype=np.uint64)
    for i in range(UNIT_CHANNELS):
        signs |= s[..., i].astype(np.uint64) << np.uint64(i)
    words[..., 4] |= signs << np.uint64(16)
    cast_bytes = (words & np.uint64(0xFFFFFFFF)).astype(np.uint32).reshape(n, g, CAST_GROUP_BYTES // 4)
    cast_bytes = cast_bytes.view(np.uint8).reshape(n, g, CAST_GROUP_BYTES)
    raw = bits.astype(np.uint16).reshape(n, g, GROUP).view(np.uint8).reshape(n, g, 2 * GROUP)

    mb = meta_bytes(h)
    out = np.zeros((n, message_bytes(h)), dtype=np.uint8)
    meta = (amax.astype(np.uint32) | (amin.astype(np.uint32) << 16)).astype(np.uint32)
    out[:, :4 * g] = meta.view(np.uint8).reshape(n, 4 * g)
    sizes = np.where(cast, CAST_GROUP_BYTES, 2 * GROUP)
    offs = mb + np.concatenate([np.zeros((n, 1), dtype=np.int64), np.cumsum(sizes, axis=1)], axis=1)
    for gi in range(g):   # group by group; rows at once
        for r_cast, src in ((True, cast_bytes), (False, raw)):
            rows = np.nonzero(cast[:, gi] == r_cast)[0]
            if rows.size == 0:
                continue
            width = src.shape[2]
            cols = offs[rows, gi][:, None] + np.arange(width)[None, :]
            out[rows[:, None], cols] = src[rows, gi]
    return out, offs[:, -1].astype(np.int64)


def decode(msgs: np.ndarray, hidden: int) -> np.ndarray:
    """Decode messages uint8 [N, >= wire bytes] to fp32 [N, H] (the values the combine reduces)."""
    _check_hidden(hidden)
    n, g = int(msgs.shape[0]), hidden // GROUP
    msgs = np.ascontiguousarray(msgs)
    meta = np.ascontiguousarray(msgs[:, :4 * g]).view(np.uint32).reshape(n, g)
    amax = (meta & 0xFFFF).astype(np.int32)
    amin = (meta >> 16).astype(np.int32)
    cast, lb, step = _params(amax, amin)
    sizes = np.where(cast, CAST_GROUP_BYTES, 2 * GROUP)
    offs = meta_bytes(hidden) + np.concatenate([np.zeros((n, 1), dtype=np.int64), np.cumsum(sizes, axis=1)], 1)
    out = np.zeros((n, g, GROUP), dtype=np.float32)
    for gi in range(g):
        for r_cast in (True, False):
            rows = np.nonzero(cast[:, gi] == r_cast)[0]
            if rows.size == 0:
                continue
            width = CAST_GROUP_BYTES if r_cast else 2 * GROUP
            cols = offs[rows, gi][:, None] + np.arange(width)[None, :]
            chunk = np.ascontiguousarray(msgs[rows[:, None], cols])
            if not r_cast:
                b = chunk.view(np.uint16).astype(np.uint32) << 16
                out[rows, gi] = b.view(np.float32)
                continue
            w = chunk.view(np.uint32).reshape(rows.size, 8, UNIT_WORDS).astype(np.uint64)
            vals = np.zeros((rows.size, 8, UNIT_CHANNELS), dtype=np.float32)
            st = step[rows, gi][:, None]
            base = lb[rows, gi][:, None]
            for i in range(UNIT_CHANNELS):
                pos = 9 * i
                wi, sh = pos // 32, pos % 32
                v = w[..., wi] >> np.uint64(sh)
                if sh > 23:
                    v |= w[..., wi + 1] << np.uint64(32 - sh)
                c = (v & np.uint64(0x1FF)).astype(np.int64)
                sgn = (w[..., 4] >> np.uint64(16 + i)) & np.uint64(1)
                y = ((np.maximum(c - 1, 0).astype(np.float32) * st).astype(np.float32) + base).astype(np.float32)
                mag = np.where(c == 0, _F(0), _exp2(y))
                vals[..., i] = np.where((sgn == 1) & (c != 0), -mag, mag)
            out[rows, gi] = vals.reshape(rows.size, GROUP)
    return out.reshape(n, hidden)


def roundtrip(x: "torch.Tensor") -> "torch.Tensor":
    """fp32 [N, H]: what a combine receiver reduces for bf16 rows x sent with use_logfmt=True."""
    import torch
    msgs, _ = encode(x)
    return torch.from_numpy(decode(msgs, int(x.shape[1]))).to(x.device)
