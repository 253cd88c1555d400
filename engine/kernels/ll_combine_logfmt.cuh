// The LogFMT halves of the low-latency combine (use_logfmt): the send that encodes each row into the
// packed wire format, and the reduce that decodes and sums it. ll_logfmt.cuh is the codec and
// pyep/ep/ll/logfmt.py the definition; ll_combine.cu calls these in place of its BF16 loops and is the
// only file that includes this one, so its contents keep that file's internal linkage.
#pragma once

#include "kernels/ll_combine_common.cuh"
#include "kernels/ll_common.cuh"
#include "kernels/ll_logfmt.cuh"

namespace pyep {
namespace ll {
namespace {

// LogFMT send (pyep/ep/ll/logfmt.py is the format): one warp per row, rounds of 512 channels, lane l
// holding channels 16l..16l+15 of the round. A round's four groups are encoded into the warp's shared
// staging (a cast group: 160 bytes, else its 256 raw bytes), then copied out as int4 at the row's
// running offset: groups are packed, so the wire size depends on how many groups cast.
__device__ void combine_send_logfmt(const LLStatic& s, const LLCombineCall& c, CombineSmem& sm, int total) {
    const int R = s.num_ranks, El = s.num_local_experts, T = s.num_max_tokens, H = s.hidden;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint8_t* hb = reinterpret_cast<uint8_t*>(s.buf);
    const int* src_info = reinterpret_cast<const int*>(c.src_info);
    const int* recv_slot = reinterpret_cast<const int*>(c.recv_slot);
    const uint32_t meta = lf_meta_bytes(H);
    uint8_t* wst = sm.stage + warp * kLfStageBytes;
    const int RT = R * T;
    for (int q = blockIdx.x * kWarps + warp; q < total; q += gridDim.x * kWarps) {
        const int p = find_range(sm.rowstart, s.num_ranks * El, q);
        const int e = p / R, r = p - e * R;
        if (!sm.active[r]) continue;
        const int i = q - sm.rowstart[p];
        const int row = q - sm.rowstart[e * R];
        const size_t in_row = (size_t)e * RT + row;
        const uint8_t* src = reinterpret_cast<const uint8_t*>(c.x) + in_row * 2 * (size_t)H;
        const int t = __ldg(src_info + in_row), k = __ldg(recv_slot + in_row);
        if (t < 0 || t >= T || k < 0 || k >= s.max_topk) continue;
        const uint64_t doff = off_crecv(s, c.half, t, k);
        const bool store_peer = sm.active[r] == kPeerStore;
        uint8_t* dst = store_peer ? reinterpret_cast<uint8_t*>(peer_base(s, r) + doff)
                                  : hb + off_drecv(s, c.half, r, (uint64_t)(source_slot(sm.srcoff, El, e, r) + i));
        uint32_t carry = 0;
        for (int ch0 = 0; ch0 < H; ch0 += kLfRound) {
            const int ch = ch0 + lane * 16;
            const bool live = ch < H;
            uint32_t w[8];
            if (live) {
                const int4 a = ld_nc_v4(src + 2 * (size_t)ch), b = ld_nc_v4(src + 2 * (size_t)ch + 16);
                w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) w[j] = 0;
            }
            uint32_t amax = 0, amin = 0xffffu;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const uint32_t lo = lf_mag(w[j] & 0xffffu), hi = lf_mag(w[j] >> 16);
                amax = lf_umax(amax, lf_umax(lo, hi));
                amin = lf_umin(amin, lf_umin(lo, hi));
            }
#pragma unroll
            for (int m = 1; m < 8; m <<= 1) {
                amax = lf_umax(amax, (uint32_t)__shfl_xor_sync(0xffffffffu, (int)amax, m));
                amin = lf_umin(amin, (uint32_t)__shfl_xor_sync(0xffffffffu, (int)amin, m));
            }
            const bool cast = live && lf_cast(amax, amin);
            const int bytes = live ? (cast ? kLfCastBytes : 2 * kLfGroup) : 0;
            // Offsets of the round's four groups (leaders: lanes 0, 8, 16, 24).
            int off = 0, round_bytes = 0;
            const int gj = lane >> 3;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int bj = __shfl_sync(0xffffffffu, bytes, 8 * j);
                if (j < gj) off += bj;
                round_bytes += bj;
            }
            if (live) {
                const int u = lane & 7;
                if (u == 0)
                    *reinterpret_cast<uint32_t*>(dst + 4 * (ch / kLfGroup)) = amax | (amin << 16);
                if (cast) {
                    uint32_t enc[kLfUnitWords];
                    lf_encode_unit(w, lf_params(amax | (amin << 16), sm.lf_tbl), sm.lf_tbl, enc);
                    uint32_t* o = reinterpret_cast<uint32_t*>(wst + off + 20 * u);
#pragma unroll
                    for (int j = 0; j < kLfUnitWords; ++j) o[j] = enc[j];
                } else {
                    int4* o = reinterpret_cast<int4*>(wst + off + 32 * u);
                    o[0] = make_int4((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
                    o[1] = make_int4((int)w[4], (int)w[5], (int)w[6], (int)w[7]);
                }
            }
            __syncwarp();
            int4* d4 = reinterpret_cast<int4*>(dst + meta + carry);
            for (int j = lane; j < round_bytes / 16; j += 32) st_v4(d4 + j, *reinterpret_cast<const int4*>(wst + 16 * j));
            __syncwarp();
            carry += (uint32_t)round_bytes;
        }
        if (!store_peer) post_row(s, c, r, e, dst, doff, meta + carry);
    }
}

// LogFMT reduce (pyep/ep/ll/logfmt.py): items (token t, 512-channel chunk); lane l owns channels
// 16l..16l+15, i.e. unit l & 7 of group 4 * chunk + l / 8. A group's place in the message depends on
// how many earlier groups were cast: every lane loads meta words of the groups before the chunk's end
// (one coalesced load per 32 groups, cached for the items of the same row), and a ballot counts them.
// Then each slot's 5 code words or 32 raw bytes are loaded, decoded to fp32 and reduced exactly like
// the BF16 path (k ascending, one multiply and one add per term), rounded to bf16 once.
constexpr int kLfBatch = 4;   // slots in flight per item (registers: codes/raw words + 16 accumulators)

__device__ void combine_reduce_logfmt(const LLStatic& s, const LLCombineCall& c, CombineSmem& sm, int64_t first_it,
                                      int64_t items, int col_chunks, int64_t pre_v, float pre_w) {
    const int El = s.num_local_experts, E = s.num_ranks * El, H = s.hidden, K = c.num_topk;
    const int lane = threadIdx.x & 31;
    const uint8_t* hb = reinterpret_cast<const uint8_t*>(s.buf);
    const uint32_t meta_bytes = lf_meta_bytes(H);
    for (int64_t it = first_it; it < items; it += (int64_t)gridDim.x * kWarps) {
        const int t = (int)(it / col_chunks);
        const int chunk = (int)(it - (int64_t)t * col_chunks);
        const int g = chunk * 4 + (lane >> 3);          // this lane's group
        const int ng = chunk * 4 + 4;                   // groups whose meta this item needs
        float my_w;
        const int my_e = slot_expert(c, sm, El, E, t, pre_v, pre_w, my_w);
        load_item_routing(c, it + (int64_t)gridDim.x * kWarps, items, col_chunks, pre_v, pre_w);
        float acc[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) acc[j] = 0.0f;
        for (int k0 = 0; k0 < K; k0 += kLfBatch) {
            bool use[kLfBatch];
            float w[kLfBatch];
            uint32_t mine[kLfBatch];
            uint32_t before[kLfBatch];   // cast groups before g
            const uint8_t* row[kLfBatch];
#pragma unroll
            for (int j = 0; j < kLfBatch; ++j) {
                const int k = k0 + j;
                use[j] = __shfl_sync(0xffffffffu, my_e, k & 31) >= 0 && k < K;
                w[j] = __shfl_sync(0xffffffffu, my_w, k & 31);
                row[j] = hb + off_crecv(s, c.half, t, k < K ? k : 0);
                mine[j] = 0;
                before[j] = 0;
                if (!use[j]) continue;   // uniform over the warp
                mine[j] = ld_u32(row[j] + 4 * g);
                for (int b = 0; b < ng; b += 32) {
                    const int gi = b + lane;
                    const uint32_t mw = gi < ng ? ld_u32(row[j] + 4 * gi) : 0u;
                    const unsigned m = __ballot_sync(0xffffffffu, gi < ng && lf_cast(mw & 0xffffu, mw >> 16));
                    if (g >= b + 32) before[j] += __popc(m);
                    else if (g >= b) before[j] += __popc(m & ((1u << (g - b)) - 1u));
                }
            }
            uint32_t d[kLfBatch][8];
#pragma unroll
            for (int j = 0; j < kLfBatch; ++j) {
                if (!use[j]) continue;
                const bool cast = lf_cast(mine[j] & 0xffffu, mine[j] >> 16);
                const uint8_t* gp = row[j] + meta_bytes + 256u * (uint32_t)g - 96u * before[j];
                if (cast) {
#pragma unroll
                    for (int q = 0; q < kLfUnitWords; ++q) d[j][q] = ld_u32(gp + 20 * (lane & 7) + 4 * q);
                } else {
                    const int4 a = ld_v4(gp + 32 * (lane & 7)), b = ld_v4(gp + 32 * (lane & 7) + 16);
                    d[j][0] = a.x; d[j][1] = a.y; d[j][2] = a.z; d[j][3] = a.w;
                    d[j][4] = b.x; d[j][5] = b.y; d[j][6] = b.z; d[j][7] = b.w;
                }
            }
#pragma unroll
            for (int j = 0; j < kLfBatch; ++j) {
                if (!use[j]) continue;
                const LfParams p = lf_params(mine[j], sm.lf_tbl);
                if (p.cast) {
#pragma unroll
                    for (int q = 0; q < 16; ++q) acc[q] = __fadd_rn(acc[q], __fmul_rn(w[j], lf_decode(d[j], q, p)));
                } else {
#pragma unroll
                    for (int q = 0; q < 8; ++q) {
                        acc[2 * q] = __fadd_rn(acc[2 * q], __fmul_rn(w[j], bf16_lo(d[j][q])));
                        acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __fmul_rn(w[j], bf16_hi(d[j][q])));
                    }
                }
            }
        }
        uint32_t o[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const __nv_bfloat162 b = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
            o[j] = *reinterpret_cast<const uint32_t*>(&b);
        }
        int4* dst = reinterpret_cast<int4*>(reinterpret_cast<uint8_t*>(c.out) + ((size_t)t * H + chunk * kLfRound + lane * 16) * 2);
        st_v4(dst, make_int4((int)o[0], (int)o[1], (int)o[2], (int)o[3]));
        st_v4(dst + 1, make_int4((int)o[4], (int)o[5], (int)o[6], (int)o[7]));
    }
}

}  // namespace
}  // namespace ll
}  // namespace pyep
