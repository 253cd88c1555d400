// LogFMT-10 combine payload (use_logfmt): encode / decode of 16-channel units and the per-group
// parameters. pyep/ep/ll/logfmt.py is THE definition (format, message layout, rounding); this file
// computes the same bits: every float step is an explicitly rounded fp32 operation (__fmul_rn /
// __fadd_rn / __fdiv_rn, never contracted into an FMA) or a table lookup, so the CPU reference and the
// kernels agree exactly (tests/test_ll_sim.py). DeepEP's approximate lg2/ex2 could not be reproduced.
#pragma once

#include <stdint.h>

namespace pyep {
namespace ll {

constexpr int kLfGroup = 128;          // channels per (amax, amin) group
constexpr int kLfCastBytes = 160;      // a cast group: 8 units x 5 words
constexpr int kLfUnitWords = 5;        // 16 channels: 16 x 9-bit codes + 16 sign bits
constexpr int kLfRound = 512;          // channels per warp round (32 lanes x 16)
constexpr int kLfStageBytes = 1024;    // per-warp shared staging of one round's output

__host__ __device__ __forceinline__ uint32_t lf_meta_bytes(int hidden) {
    return (uint32_t)((4 * (hidden / kLfGroup) + 15) / 16 * 16);
}

// fp32 bits of log2(1 + m / 128), m = 0..127 (logfmt.py LOG2_MANT).
static __device__ const uint32_t kLfLog2Mant[128] = {
    0x00000000, 0x3c37f286, 0x3cb73cb4, 0x3d08e68f, 0x3d35d69c, 0x3d626fd6, 0x3d8759c5, 0x3d9d517f,
    0x3db31fb8, 0x3dc8c50b, 0x3dde4212, 0x3df39761, 0x3e0462c4, 0x3e0ee68d, 0x3e19574f, 0x3e23b550,
    0x3e2e00d2, 0x3e383a17, 0x3e42615f, 0x3e4c76e8, 0x3e567af1, 0x3e606db6, 0x3e6a4f72, 0x3e74205f,
    0x3e7de0b6, 0x3e83c857, 0x3e88983f, 0x3e8d602e, 0x3e92203d, 0x3e96d888, 0x3e9b8926, 0x3ea03232,
    0x3ea4d3c2, 0x3ea96df0, 0x3eae00d2, 0x3eb28c7f, 0x3eb7110e, 0x3ebb8e96, 0x3ec0052b, 0x3ec474e4,
    0x3ec8ddd4, 0x3ecd4012, 0x3ed19bb0, 0x3ed5f0c4, 0x3eda3f60, 0x3ede8797, 0x3ee2c97d, 0x3ee70525,
    0x3eeb3a9f, 0x3eef69ff, 0x3ef39355, 0x3ef7b6b4, 0x3efbd42b, 0x3effebcd, 0x3f01fed4, 0x3f0404e8,
    0x3f060828, 0x3f08089e, 0x3f0a0650, 0x3f0c0146, 0x3f0df989, 0x3f0fef1f, 0x3f11e20f, 0x3f13d260,
    0x3f15c01a, 0x3f17ab44, 0x3f1993e3, 0x3f1b7a00, 0x3f1d5da0, 0x3f1f3eca, 0x3f211d84, 0x3f22f9d5,
    0x3f24d3c2, 0x3f26ab53, 0x3f28808c, 0x3f2a5374, 0x3f2c2411, 0x3f2df268, 0x3f2fbe80, 0x3f31885c,
    0x3f335004, 0x3f35157d, 0x3f36d8cb, 0x3f3899f5, 0x3f3a58ff, 0x3f3c15ee, 0x3f3dd0c8, 0x3f3f8991,
    0x3f41404f, 0x3f42f506, 0x3f44a7ba, 0x3f465872, 0x3f480731, 0x3f49b3fb, 0x3f4b5ed7, 0x3f4d07c7,
    0x3f4eaed0, 0x3f5053f7, 0x3f51f740, 0x3f5398af, 0x3f553848, 0x3f56d60f, 0x3f587209, 0x3f5a0c3a,
    0x3f5ba4a4, 0x3f5d3b4e, 0x3f5ed039, 0x3f60636a, 0x3f61f4e5, 0x3f6384ad, 0x3f6512c7, 0x3f669f35,
    0x3f6829fb, 0x3f69b31e, 0x3f6b3a9f, 0x3f6cc083, 0x3f6e44cd, 0x3f6fc781, 0x3f7148a1, 0x3f72c832,
    0x3f744636, 0x3f75c2b0, 0x3f773da4, 0x3f78b714, 0x3f7a2f04, 0x3f7ba578, 0x3f7d1a71, 0x3f7e8df2,
};

// log2 of a normal bf16 magnitude a (0x80 <= a < 0x7f80); tbl: kLfLog2Mant as floats (shared memory).
__device__ __forceinline__ float lf_log2(uint32_t a, const float* tbl) {
    return __fadd_rn((float)((int)(a >> 7) - 127), tbl[a & 127u]);
}

// 2^y for y < 0 (logfmt.py _exp2): degree-6 polynomial on the fraction, exact power-of-two scaling,
// 0 below 2^-126.
__device__ __forceinline__ float lf_exp2(float y) {
    const float n = floorf(y);
    if (n < -126.0f) return 0.0f;
    const float f = __fadd_rn(y, -n);
    float p = 0x1.cacdf6p-13f;
    p = __fadd_rn(__fmul_rn(p, f), 0x1.44bd44p-10f);
    p = __fadd_rn(__fmul_rn(p, f), 0x1.3d5826p-7f);
    p = __fadd_rn(__fmul_rn(p, f), 0x1.c67ee4p-5f);
    p = __fadd_rn(__fmul_rn(p, f), 0x1.ebfdf8p-3f);
    p = __fadd_rn(__fmul_rn(p, f), 0x1.62e428p-1f);
    p = __fadd_rn(__fmul_rn(p, f), 1.0f);
    return __fmul_rn(p, __uint_as_float((uint32_t)((int)n + 127) << 23));
}

// A group's parameters from its meta word (amax | amin << 16, flushed bf16 magnitudes).
struct LfParams {
    bool cast;
    float lb;     // log2 of the lowest level
    float step;   // log2 distance between levels
};
__device__ __forceinline__ bool lf_cast(uint32_t amax, uint32_t amin) {
    return amax >= 0x80u && amax < 0x3f80u && amin < amax;
}
__device__ __forceinline__ LfParams lf_params(uint32_t meta, const float* tbl) {
    const uint32_t amax = meta & 0xffffu, amin = meta >> 16;
    LfParams p;
    p.cast = lf_cast(amax, amin);
    p.lb = 0.0f;
    p.step = 1.0f;
    if (!p.cast) return p;
    const float la = lf_log2(amax, tbl);
    const float la32 = __fadd_rn(la, -32.0f);
    p.lb = amin == 0 ? la32 : fmaxf(lf_log2(amin, tbl), la32);
    p.step = __fdiv_rn(__fadd_rn(la, -p.lb), 510.0f);
    return p;
}

__device__ __forceinline__ uint32_t lf_umax(uint32_t a, uint32_t b) { return a > b ? a : b; }
__device__ __forceinline__ uint32_t lf_umin(uint32_t a, uint32_t b) { return a < b ? a : b; }

// Flushed bf16 magnitude of the low / high half of a word.
__device__ __forceinline__ uint32_t lf_mag(uint32_t h) {
    const uint32_t a = h & 0x7fffu;
    return a < 0x80u ? 0u : a;
}

// Encodes one lane's 16 channels (w: 8 words of bf16 pairs) of a cast group into 5 words.
__device__ __forceinline__ void lf_encode_unit(const uint32_t* w, const LfParams& p, const float* tbl,
                                               uint32_t* out) {
    const float inv = __fdiv_rn(1.0f, p.step);
    const float bias = __fadd_rn(1.5f, -__fmul_rn(p.step, 0x1.62e43p-4f));
    uint32_t code[16];
    uint32_t signs = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const uint32_t h = (i & 1) ? (w[i >> 1] >> 16) : (w[i >> 1] & 0xffffu);
        signs |= (h >> 15) << i;
        const uint32_t a = lf_mag(h);
        uint32_t c = 0;
        if (a != 0) {
            const float u = __fadd_rn(__fmul_rn(__fadd_rn(lf_log2(a, tbl), -p.lb), inv), bias);
            const float fl = floorf(fmaxf(u, 0.0f));
            c = fl >= 511.0f ? 511u : (uint32_t)fl;
        }
        code[i] = c;
    }
    out[0] = code[0] | (code[1] << 9) | (code[2] << 18) | (code[3] << 27);
    out[1] = (code[3] >> 5) | (code[4] << 4) | (code[5] << 13) | (code[6] << 22) | (code[7] << 31);
    out[2] = (code[7] >> 1) | (code[8] << 8) | (code[9] << 17) | (code[10] << 26);
    out[3] = (code[10] >> 6) | (code[11] << 3) | (code[12] << 12) | (code[13] << 21) | (code[14] << 30);
    out[4] = (code[14] >> 2) | (code[15] << 7) | (signs << 16);
}

// Channel i (0..15) of a cast unit (5 words) as fp32.
__device__ __forceinline__ float lf_decode(const uint32_t* u, int i, const LfParams& p) {
    const int pos = 9 * i, wi = pos >> 5, sh = pos & 31;
    uint32_t v = u[wi] >> sh;
    if (sh > 23) v |= u[wi + 1] << (32 - sh);
    const uint32_t c = v & 0x1ffu;
    if (c == 0) return 0.0f;
    const float mag = lf_exp2(__fadd_rn(__fmul_rn((float)(c - 1), p.step), p.lb));
    return ((u[4] >> (16 + i)) & 1u) ? -mag : mag;
}

}  // namespace ll
}  // namespace pyep
