// Low-latency combine: every expert owner sends each received row's output back into the token owner's
// combine receive area at (token, top-k slot) -- NVLink/local stores, or staged + RDMA write -- then one
// flag per destination after all data; the token owner waits (bounded) for every active source and
// reduces out[t] = sum over k ascending of w[t,k] * y[t,k] in fp32 (one multiply and one add per term,
// no FMA, so the result is bit-identical to the reference backend), rounding to bf16 once.
//
// Send work is spread evenly over all warps as (row, 4 KiB chunk) items, so a hot expert does not
// serialise on one warp group. The reduce is spread as (token, 256-channel) items.
#if !defined(PYEP_LL_CPU_SIM)
#include <cuda_runtime.h>
#endif

#include "kernels/ll_ack.cuh"
#include "kernels/ll_common.cuh"
#include "kernels/ll_logfmt.cuh"

namespace pyep {
namespace ll {
namespace {

struct CombineSmem {
    int* flag;      // [4]
    int* active;    // [R] PeerMode of each rank in this call
    int* ok;        // [R]
    int* cnt;       // [E] rows per (local expert, source rank), e-major
    int* rowstart;  // [E + 1]
    int* srcoff;    // [E + 1] source_offsets()
    int* scan;      // [scan_scratch_ints(E)]
    float* lf_tbl;  // [128] LogFMT log2 mantissa table (kLfLog2Mant)
    uint8_t* stage; // [kWarps][kLfStageBytes] LogFMT: one round of a warp's encoded row
};

__device__ CombineSmem carve_combine(uint8_t* p, int R, int E) {
    CombineSmem m;
    int* q = reinterpret_cast<int*>(p);
    m.flag = q; q += 4;
    m.active = q; q += R;
    m.ok = q; q += R;
    m.cnt = q; q += E;
    m.rowstart = q; q += E + 1;
    m.srcoff = q; q += E + 1;
    m.scan = q;
    q += scan_scratch_ints(E);
    uint8_t* b = reinterpret_cast<uint8_t*>(q);
    b = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(b) + 15) & ~uintptr_t(15));
    m.lf_tbl = reinterpret_cast<float*>(b);
    m.stage = b + 128 * 4;
    return m;
}

// NIC peers: a warp's staged row (`bytes` at `stage`) goes to `doff` in rank r's buffer as one RDMA WRITE
// on the QP of local expert e. Every lane's staging stores are made visible system-wide first: the NIC
// reads them over PCIe.
__device__ __forceinline__ void post_row(const LLStatic& s, const LLCombineCall& c, int r, int e, const uint8_t* stage,
                                         uint64_t doff, uint32_t bytes) {
    __threadfence_system();
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
        const int st = gda::post_rdma_write(peer_qp(s, r, e % s.num_qps_per_peer), (uint64_t)stage, s.lkey,
                                            remote_addr(s, r) + doff, rkey_of(s, r), bytes, false, c.timeout_ns);
        if (st != gda::kOk) note_failure(s, r);
    }
    __syncwarp();
}

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

__device__ void combine_send(const LLStatic& s, const LLCombineCall& c, CombineSmem& sm) {
    const int R = s.num_ranks, El = s.num_local_experts, E = R * El, T = s.num_max_tokens, H = s.hidden;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int half = c.half;
    int* active = reinterpret_cast<int*>(c.active);
    uint8_t* hb = reinterpret_cast<uint8_t*>(s.buf);
    const int64_t* lr = reinterpret_cast<const int64_t*>(c.layout_range);
    trace_point(s, kTraceCombine, kTrSendBegin);

    for (int r = tid; r < R; r += blockDim.x) sm.active[r] = peer_mode(s, active, r);
    for (int p = tid; p < E; p += blockDim.x) {
        const int n = (int)(__ldg(lr + p) & 0xffffffffll);
        sm.cnt[p] = n;
    }
    __syncthreads();
    source_offsets(sm.cnt, sm.srcoff, sm.scan, R, El);
    block_exclusive_scan(sm.rowstart, sm.cnt, E, sm.scan);
    const int total = sm.rowstart[E];
    // A handle combined again: no row before each destination acknowledged our earlier combines on
    // this half (ll_ack.cuh). After the routing scans, so they overlap the wait.
    if (c.repeat) wait_acks(s, c, sm.active);
    trace_point(s, kTraceCombine, kTrSendRouted);

    const int RT = R * T;
    if (c.use_logfmt) {
        combine_send_logfmt(s, c, sm, total);
    } else {
    const int row_int4 = H / 8;
    const int per_item = 32 * kCopyUnroll;
    const int chunks = (row_int4 + per_item - 1) / per_item;
    const int64_t items = (int64_t)total * chunks;
    const int* src_info = reinterpret_cast<const int*>(c.src_info);
    const int* recv_slot = reinterpret_cast<const int*>(c.recv_slot);
    for (int64_t it = (int64_t)blockIdx.x * kWarps + warp; it < items; it += (int64_t)gridDim.x * kWarps) {
        const int q = (int)(it / chunks), ch = (int)(it - (int64_t)q * chunks);
        const int p = find_range(sm.rowstart, E, q);
        const int e = p / R, r = p - e * R;
        if (!sm.active[r]) continue;
        const int i = q - sm.rowstart[p];
        const int row = q - sm.rowstart[e * R];
        const size_t in_row = (size_t)e * RT + row;
        const int4* src4 = reinterpret_cast<const int4*>(reinterpret_cast<const uint8_t*>(c.x) + in_row * 2 * (size_t)H);
        const bool store_peer = sm.active[r] == kPeerStore;
        // The row's data does not depend on where it goes: its loads are issued together with the
        // loads of its destination (token, slot), not after them.
        const int j0 = ch * per_item + lane;
        int4 v[kCopyUnroll];
        if (store_peer) {
#pragma unroll
            for (int u = 0; u < kCopyUnroll; ++u)
                if (j0 + u * 32 < row_int4) v[u] = ld_nc_v4(src4 + j0 + u * 32);
        }
        const int t = __ldg(src_info + in_row), k = __ldg(recv_slot + in_row);
        if (t < 0 || t >= T || k < 0 || k >= s.max_topk) continue;  // never write outside the slot area
        const uint64_t doff = off_crecv(s, half, t, k);
        if (store_peer) {
            int4* dst4 = reinterpret_cast<int4*>(peer_base(s, r) + doff);
#pragma unroll
            for (int u = 0; u < kCopyUnroll; ++u)
                if (j0 + u * 32 < row_int4) st_v4(dst4 + j0 + u * 32, v[u]);
        } else if (ch == 0) {
            // NIC: stage the whole row in the slot its input arrived in (layout.py explains why that
            // slot is free), then one RDMA write on the expert's QP.
            uint8_t* stage = hb + off_drecv(s, half, r, (uint64_t)(source_slot(sm.srcoff, El, e, r) + i));
            int4* st4 = reinterpret_cast<int4*>(stage);
            for (int j = lane; j < row_int4; j += 32) st_v4(st4 + j, ld_nc_v4(src4 + j));
            post_row(s, c, r, e, stage, doff, (uint32_t)(2 * H));
        }
    }
    }   // !use_logfmt

    __syncthreads();
    trace_point(s, kTraceCombine, kTrSendIssued);
    const bool last_send = arrive_last(ws_counter(s, half, kCombineSendDone), sm.flag, true);
    trace_point(s, kTraceCombine, kTrSendFenced);
    if (last_send) {
        const int* fail = ws_fail(s);
        for (int r = tid; r < R; r += blockDim.x)
            if (sm.active[r] == kPeerStore) st_relaxed_sys(reinterpret_cast<int*>(peer_base(s, r) + off_csig(s, half, s.rank)), 1);
        // NIC: a +1 on every QP of the peer, so the flag completes only after the data of all of them.
        for (int i = warp; i < R * s.num_qps_per_peer; i += kWarps) {
            const int r = i / s.num_qps_per_peer, j = i - r * s.num_qps_per_peer;
            if (lane != 0 || sm.active[r] != kPeerNic || ld_volatile(fail + r)) continue;
            const int st = gda::post_masked_fa32(peer_qp(s, r, j), remote_addr(s, r) + off_csig(s, half, s.rank),
                                                 rkey_of(s, r), 1u, s.fetch_addr, s.lkey, false, c.timeout_ns);
            if (st != gda::kOk) note_failure(s, r);
        }
        __syncthreads();
        finish_failures(s, sm.active, active);
        finish_acks(s, c, sm.active, active);
        if (tid == 0) *ws_counter(s, half, kCombineSendDone) = 0;
    }
    trace_point(s, kTraceCombine, kTrSendDone);
}

// A reduce item's lanes 0..K-1 hold row t's top-k slots: returns the lane's expert and sets its weight.
// An id dispatch routed as -1 (out of range, or a repeat of an earlier slot's expert) is -1 here too --
// nothing was sent for it, and dispatch reports it -- and so is an expert whose owner did not arrive.
// The warp's first item takes the values it loaded before the wait (pre_v, pre_w).
__device__ __forceinline__ int slot_expert(const LLCombineCall& c, const CombineSmem& sm, int El, int E, int t,
                                           bool first, int64_t pre_v, float pre_w, float& my_w) {
    const int K = c.num_topk, lane = threadIdx.x & 31;
    const int64_t* topk = reinterpret_cast<const int64_t*>(c.topk);
    int64_t my_v = -1;
    my_w = 0.0f;
    if (lane < K) {
        my_v = first ? pre_v : __ldg(topk + t * K + lane);
        my_w = first ? pre_w : __ldg(reinterpret_cast<const float*>(c.weights) + t * K + lane);
    }
    bool bad;
    const int my_e = checked_expert(topk, t * K + lane, my_v, K, E, 0xffffffffu, t * K, bad);
    return my_e >= 0 && !sm.ok[my_e / El] ? -1 : my_e;
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
        const int my_e = slot_expert(c, sm, El, E, t, it == first_it, pre_v, pre_w, my_w);
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

__device__ void combine_recv(const LLStatic& s, const LLCombineCall& c, CombineSmem& sm) {
    const int R = s.num_ranks, El = s.num_local_experts, E = R * El, H = s.hidden;
    const int N = c.num_tokens, K = c.num_topk;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int half = c.half;
    int* state = ws_cstate(s, half);
    int* active = reinterpret_cast<int*>(c.active);
    uint8_t* hb = reinterpret_cast<uint8_t*>(s.buf);
    const int* expect = reinterpret_cast<const int*>(s.flag_expect);
    trace_point(s, kTraceCombine, kTrRecvBegin);

    // Routing of this warp's first reduce item depends on nothing the peers send: load it before the
    // wait, so the wait's end is followed by the data loads only.
    const int64_t* topk = reinterpret_cast<const int64_t*>(c.topk);
    const float* weights = reinterpret_cast<const float*>(c.weights);
    const int cols = H / 8;               // int4 columns of a row
    // LogFMT items are (token, 512 channels): lane l reduces channels 16l..16l+15.
    const int col_chunks = c.use_logfmt ? H / kLfRound : (cols + 31) / 32;
    const int64_t items = (int64_t)N * col_chunks;
    const int64_t first_it = (int64_t)blockIdx.x * kWarps + warp;
    int64_t pre_v = -1;
    float pre_w = 0.0f;
    if (first_it < items && lane < K) {
        const int t = (int)(first_it / col_chunks);
        pre_v = __ldg(topk + t * K + lane);
        pre_w = __ldg(weights + t * K + lane);
    }

    for (int r = tid; r < R; r += blockDim.x) {
        const int* sig = reinterpret_cast<const int*>(hb + off_csig(s, half, r));
        const int st = resolve_flag(state, active, r, sig, max(1, expect[r]), c.timeout_ns, c.wait_stats);
        // Re-read with acquire: when another block decided, this block still needs its own edge to
        // the data the flag publishes.
        sm.ok[r] = st == kArrived && ld_acquire_sys(sig) != 0;
    }
    __syncthreads();
    trace_point(s, kTraceCombine, kTrRecvReady);

    if (c.use_logfmt) {
        combine_reduce_logfmt(s, c, sm, first_it, items, col_chunks, pre_v, pre_w);
    } else {
    for (int64_t it = first_it; it < items; it += (int64_t)gridDim.x * kWarps) {
        const int t = (int)(it / col_chunks);
        const int col = (int)(it - (int64_t)t * col_chunks) * 32 + lane;
        float my_w;
        const int my_e = slot_expert(c, sm, El, E, t, it == first_it, pre_v, pre_w, my_w);
        const bool live = col < cols;
        // k ascending, kReduceBatch loads in flight at a time (all of them for K <= 8): the order of the
        // fp32 additions is fixed, and registers stay low enough for a full block of 512 threads.
        float acc[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
        for (int k0 = 0; k0 < K; k0 += kReduceBatch) {
            int4 y[kReduceBatch];
            bool use[kReduceBatch];
            float w[kReduceBatch];
#pragma unroll
            for (int j = 0; j < kReduceBatch; ++j) {
                const int k = k0 + j;
                use[j] = __shfl_sync(0xffffffffu, my_e, k & 31) >= 0 && k < K;
                w[j] = __shfl_sync(0xffffffffu, my_w, k & 31);
                if (use[j] && live) y[j] = ld_v4(hb + off_crecv(s, half, t, k) + (uint64_t)col * 16);
            }
#pragma unroll
            for (int j = 0; j < kReduceBatch; ++j) {
                if (!use[j] || !live) continue;
                const uint32_t v[4] = {(uint32_t)y[j].x, (uint32_t)y[j].y, (uint32_t)y[j].z, (uint32_t)y[j].w};
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    acc[2 * q] = __fadd_rn(acc[2 * q], __fmul_rn(w[j], bf16_lo(v[q])));
                    acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __fmul_rn(w[j], bf16_hi(v[q])));
                }
            }
        }
        if (!live) continue;
        int4 o;
        uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const __nv_bfloat162 b = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
            ow[j] = *reinterpret_cast<const uint32_t*>(&b);
        }
        st_v4(reinterpret_cast<uint8_t*>(c.out) + ((size_t)t * cols + col) * 16, o);
    }
    }   // !use_logfmt

    const bool last_recv = arrive_last(ws_counter(s, half, kCombineRecvDone), sm.flag, false);
    trace_point(s, kTraceCombine, kTrRecvCopied);
    if (last_recv) {
        int* sig = reinterpret_cast<int*>(hb + off_csig(s, half, 0));
        for (int r = tid; r < R; r += blockDim.x) sig[r] = 0;
        finish_decisions(state, active, R);
        if (tid == 0) *ws_counter(s, half, kCombineRecvDone) = 0;
        send_acks(s, c, sm.ok);
    }
    trace_point(s, kTraceCombine, kTrRecvDone);
}

__global__ void __launch_bounds__(kThreadsPerBlock, 1) combine(LLStatic s, LLCombineCall c) {
    uint8_t* smem = dynamic_smem();
    CombineSmem sm = carve_combine(smem, s.num_ranks, s.num_ranks * s.num_local_experts);
    if (c.use_logfmt)
        for (int j = threadIdx.x; j < 128; j += blockDim.x) sm.lf_tbl[j] = __uint_as_float(kLfLog2Mant[j]);
    if (c.phases & kPhaseSend) combine_send(s, c, sm);
    if (c.phases & kPhaseRecv) {
        __syncthreads();
        combine_recv(s, c, sm);
    }
}

}  // namespace

int combine_smem_bytes(const LLStatic& s) {
    const int R = s.num_ranks, E = s.num_ranks * s.num_local_experts;
    // + 16 alignment slack, the LogFMT log2 table and the per-warp LogFMT staging.
    return 4 * (4 + 2 * R + 3 * E + 2 + scan_scratch_ints(E)) + 16 + 128 * 4 + kWarps * kLfStageBytes;
}

#if !defined(PYEP_LL_CPU_SIM)
void check_cuda(cudaError_t e, const char* what);  // ll_runtime.cu

void load_combine_kernels(const LLStatic& s) {
    cudaFuncAttributes attr;
    check_cuda(cudaFuncGetAttributes(&attr, combine), "ll combine module load");
    const int smem = combine_smem_bytes(s);
    if (smem > 48 * 1024)
        check_cuda(cudaFuncSetAttribute(combine, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                   "ll combine smem attribute");
}

void launch_combine(const LLStatic& s, const LLCombineCall& c, uint64_t stream) {
    check_call(s, c);
    const int smem = combine_smem_bytes(s);
    if (smem > 48 * 1024)
        check_cuda(cudaFuncSetAttribute(combine, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
              "ll combine smem attribute");
    combine<<<s.num_blocks, kThreadsPerBlock, smem, reinterpret_cast<cudaStream_t>(stream)>>>(s, c);
    check_cuda(cudaGetLastError(), "ll combine launch");
}

#endif  // !PYEP_LL_CPU_SIM

}  // namespace ll
}  // namespace pyep
