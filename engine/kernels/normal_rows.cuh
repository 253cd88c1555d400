// A dispatch row's reads from the caller's tensors: where a token's payload and FP8 scales are, its
// small fields held in registers across the payload copy, and a warp group's coordinates. Shared by the
// ring path (normal_dispatch.cu) and the one-copy path (normal_direct.cuh).
#pragma once

#include "kernels/normal_common.cuh"

namespace pyep {
namespace normal {

// Where token tok's payload starts in x (dense, or strided through relayed rows).
__device__ __forceinline__ const uint8_t* payload_of(const DispatchArgs& a, const DispatchRow& row, int tok) {
    return reinterpret_cast<const uint8_t*>(a.x) + (uint64_t)tok * (a.x_row_bytes ? a.x_row_bytes : row.payload);
}

// The source index a row reports: the token's own index, or across nodes the forwarded row's.
__device__ __forceinline__ int source_index(const DispatchArgs& a, int tok) {
    return a.src_idx ? reinterpret_cast<const int*>(a.src_idx)[tok] : tok;
}

// A row's small fields, held in registers across its payload copy: the first two FP8 scales a lane
// moves (groups lane and lane + 32; H <= 8192), its top-k entry, the source index. A row's scales are
// `gs` floats apart: 1 in a ring slot, the caller's group stride in x_scales (N for the column-major
// scales DeepGEMM and DeepEP's tests pass, read in place rather than transposed by an extra kernel).
__device__ __forceinline__ int64_t scale_token_stride(const DispatchArgs& a) {
    return a.scale_token_stride < 0 ? a.hidden / 128 : a.scale_token_stride;
}
__device__ __forceinline__ int64_t scale_group_stride(const DispatchArgs& a) {
    return a.scale_group_stride < 0 ? 1 : a.scale_group_stride;
}

struct RowMeta {
    float sc0, sc1;
    int64_t id;
    float weight;
    int src;
};

// Where a row's scales come from: the caller's x_scales, which nothing writes while the kernel runs, or
// a ring slot that a peer rewrites (L2 only, normal_common.cuh "copies"). The caller's are read through
// the L1 (ld.global.nc): with the column-major scales of DeepGEMM and DeepEP's tests a row's 56 scales
// lie in 56 sectors, each shared with the 7 next tokens, which the same block's warps copy. Alone on
// 6 SMs (docs/results/2026-11-27g-h200x1) those loads made 7 KiB row copies 26 % slower through the L2
// and 19 % through the L1; in the dispatch kernel the difference stayed within 3 %.
enum class ScaleSrc { kCaller, kRing };

template <ScaleSrc kSrc>
__device__ __forceinline__ float load_scale(const float* p) {
    return kSrc == ScaleSrc::kCaller ? __ldg(p) : __ldcg(p);
}

template <ScaleSrc kSrc>
__device__ __forceinline__ RowMeta load_meta(const float* scales, int64_t gs, int groups, int64_t id, float weight,
                                             int src, int lane) {
    RowMeta m{0.f, 0.f, id, weight, src};
    if (scales && lane < groups) m.sc0 = load_scale<kSrc>(scales + lane * gs);
    if (scales && lane + 32 < groups) m.sc1 = load_scale<kSrc>(scales + (lane + 32) * gs);
    return m;
}

// Scales past the 64th (H > 8192) are copied here directly.
template <ScaleSrc kSrc>
__device__ __forceinline__ void store_scales(float* dst, const RowMeta& m, const float* scales, int64_t gs, int groups,
                                             int lane) {
    if (lane < groups) dst[lane] = m.sc0;
    if (lane + 32 < groups) dst[lane + 32] = m.sc1;
    for (int g = lane + 64; g < groups; g += 32) dst[g] = load_scale<kSrc>(scales + g * gs);
}

struct Group {
    int g, wi, W, lane;
    __device__ bool leader() const { return wi == 0 && lane == 0; }
};

// The rows of tokens [t0, t1) routed to rank d, in stream order, one ballot per 32 tokens: the stream's
// i-th row goes to warp i mod W of the group, which calls f(token, i) for it. Counted over the stream
// and not within each window: no barrier separates windows here, and with W = 24 warps and 32 rows a
// window, warp j mod W would give warps 0-7 two rows a window and the others one (the stream would
// take 1.5x as long as its rows spread evenly).
// The next window's flags are loaded before this window's rows are copied: every warp scans every
// window and gets only a row or two of it, so a flag load waited for at each ballot would add most of
// a memory round trip to each row.
// Returns the stream's row count (every warp of the group gets the same).
template <typename F>
__device__ __forceinline__ int for_each_routed_row(const bool* in_rank, int R, int d, int t0, int t1, const Group& G,
                                                   F f) {
    auto routed = [&](int t) { return t < t1 && in_rank[(int64_t)t * R + d]; };
    int pos = 0;
    bool flag = routed(t0 + G.lane);
    for (int wbase = t0; wbase < t1; wbase += kScanWindow) {
        const uint32_t mask = __ballot_sync(0xffffffffu, flag);
        flag = routed(wbase + kScanWindow + G.lane);
        uint32_t rest = mask;
        for (int j = 0; rest; ++j) {
            const int bit = __ffs(rest) - 1;
            rest &= rest - 1;
            if ((pos + j) % G.W == G.wi) f(wbase + bit, pos + j);
        }
        pos += __popc(mask);
    }
    return pos;
}

}  // namespace normal
}  // namespace pyep
