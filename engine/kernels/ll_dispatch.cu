// Low-latency dispatch: FP8 cast (optional), per-(destination, expert) slot assignment in (token, k)
// order, messages written straight from registers into the destination rank's receive area (NVLink /
// local) or staged and RDMA-written (NIC), count signals after the data, then the receive side packs
// the messages into recv_x / scales / src_info / layout_range.
//
// Send: block b handles a contiguous run of tokens. Every block first builds the histogram of this
// rank's valid entries per expert (so slot bases are known without any cross-block agreement) and, in
// the same pass, the count of each expert's entries before its run; then per token each top-k entry's
// rank among earlier entries of the same expert is that running count, the row is cast once and stored
// to all K destinations. The last block to finish sends every count signal (-count-1).
// Receive: every block decides each source rank's arrival (consistently, see wait_counts), builds
// the row prefix over (expert, source) pairs, and copies an even share of the messages (items of
// 32 lanes x kCopyUnroll int4), so skewed routing does not serialise on one expert.
#if !defined(PYEP_LL_CPU_SIM)
#include <cuda_runtime.h>
#endif

#include "kernels/ll_arrival.cuh"

namespace pyep {
namespace ll {
namespace {

// ---- FP8 cast (pyep/ep/fp8.py is the definition) -------------------------------------------------
__device__ __forceinline__ float fp8_scale(float amax, bool round_scale) {
    amax = fmaxf(amax, 1e-4f);
    float scale = __fdiv_rn(amax, 448.0f);
    if (round_scale) {
        const uint32_t bits = __float_as_uint(scale);
        uint32_t e = (bits >> 23) & 0xffu;
        if (bits & 0x7fffffu) e += 1;
        scale = __uint_as_float(e << 23);
    }
    return scale;
}

__device__ __forceinline__ uint32_t fp8x4(float a, float b, float c, float d, float inv) {
    const __nv_fp8x2_storage_t lo =
        __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(a, inv), __fmul_rn(b, inv)), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi =
        __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(c, inv), __fmul_rn(d, inv)), __NV_SATFINITE, __NV_E4M3);
    return (uint32_t)lo | ((uint32_t)hi << 16);
}

struct DispatchSmem {
    uint64_t* addr;     // [kMaxTopk] where the message for slot k goes (peer memory, or local staging)
    uint64_t* raddr;    // [kMaxTopk] NIC path: remote address
    unsigned long long* waited;  // [R] receive: wait_counts' per-source wait (WaitStats)
    float* scale;       // [kMaxGroups]
    int* target;        // [kMaxTopk] expert of slot k, -1 = not sent
    int* kind;          // [kMaxTopk] 0 none, 1 store, 2 NIC
    int* dst;           // [kMaxTopk]
    int* flag;          // [4]
    int* active;        // [R] PeerMode of each rank in this call
    int* hist;          // [E]
    int* base;          // [E + 1]
    int* cnt;           // [E] received count per (local expert, source) pair, e-major
    int* before;        // [E] send: valid entries of each expert before the row in hand (cnt's memory:
                        // the receive writes cnt only after a barrier that ends the send)
    int* rowstart;      // [E + 1]
    int* srcoff;        // [E + 1] plan_rows()
    int* scan;          // [plan_scratch_ints(E)]
    int* src_state;     // [R] receive: the decision about each source
    int* wflags;        // [R] receive: wait_counts scratch
};

__device__ DispatchSmem carve_dispatch(uint8_t* p, int R, int E) {
    DispatchSmem m;
    m.addr = reinterpret_cast<uint64_t*>(p); p += 8 * kMaxTopk;
    m.raddr = reinterpret_cast<uint64_t*>(p); p += 8 * kMaxTopk;
    m.waited = reinterpret_cast<unsigned long long*>(p); p += 8 * R;
    m.scale = reinterpret_cast<float*>(p); p += 4 * kMaxGroups;
    int* q = reinterpret_cast<int*>(p);
    m.target = q; q += kMaxTopk;
    m.kind = q; q += kMaxTopk;
    m.dst = q; q += kMaxTopk;
    m.flag = q; q += 4;
    m.active = q; q += R;
    m.hist = q; q += E;
    m.base = q; q += E + 1;
    m.cnt = q; q += E;
    m.before = m.cnt;
    m.rowstart = q; q += E + 1;
    m.srcoff = q; q += E + 1;
    m.scan = q; q += plan_scratch_ints(E);
    m.src_state = q; q += R;
    m.wflags = q;
    return m;
}

template <bool kFp8>
__device__ void dispatch_send(const LLStatic& s, const LLDispatchCall& c, DispatchSmem& sm) {
    const int R = s.num_ranks, El = s.num_local_experts, E = R * El, T = s.num_max_tokens, H = s.hidden;
    const int N = c.num_tokens, K = c.num_topk, tid = threadIdx.x, lane = tid & 31;
    const int G = H / 128;
    const int half = c.half;
    int* active = reinterpret_cast<int*>(c.active);
    const int64_t* topk = reinterpret_cast<const int64_t*>(c.topk);
    trace_point(s, kTraceDispatch, kTrSendBegin);

    // Block b sends the contiguous tokens [c0, c1), so each entry's rank among the earlier entries of
    // its expert is the count of those before c0 -- taken in the histogram pass every block makes
    // anyway -- plus the block's own entries so far (a strided split made every later token walk all
    // entries before it again: a round trip per 512 entries, per token).
    const int c0 = (int)((int64_t)blockIdx.x * N / gridDim.x), c1 = (int)((int64_t)(blockIdx.x + 1) * N / gridDim.x);
    // The first token's row does not depend on anything: start loading it before the histogram so
    // the HBM latency overlaps the routing work.
    int4 pre_a = make_int4(0, 0, 0, 0), pre_b = pre_a;
    if (c0 < c1 && tid < H / 16) {
        const uint8_t* xr = reinterpret_cast<const uint8_t*>(c.x) + (size_t)c0 * H * 2 + (size_t)tid * 32;
        pre_a = ld_nc_v4(xr);
        pre_b = ld_nc_v4(xr + 16);
    }
    // Likewise this thread's first two routing entries: all these loads are in flight together.
    // Entries are walked warp by warp (entry wb + lane), so checked_expert can compare a row's slots
    // with one warp match.
    const int NK = N * K, bd = (int)blockDim.x, wb0 = tid - lane;
    const unsigned kTopkLanes = (1u << kMaxTopk) - 1u;
    const int64_t pre_v0 = tid < NK ? __ldg(topk + tid) : -1;
    const int64_t pre_v1 = tid + bd < NK ? __ldg(topk + tid + bd) : -1;
    // And the first token's own top-k row: issued here, its load would otherwise wait behind the
    // peer-mode loads below (volatile asm: no load moves across it).
    int64_t pre_row = (c0 < c1 && tid < K) ? __ldg(topk + c0 * K + tid) : -1;
    for (int r = tid; r < R; r += blockDim.x) sm.active[r] = peer_mode(s, active, r);
    for (int e = tid; e < E; e += blockDim.x) {
        sm.hist[e] = 0;
        sm.before[e] = 0;
    }
    if (tid == 0) sm.flag[1] = 0x7fffffff;   // smallest index of a bad entry (block 0 reports it)
    __syncthreads();
    // One pass over all entries: the per-expert histogram, and the entries of each expert before this
    // block's first token. Bad entries (checked_expert) count as -1 here, so they are not sent and take
    // no slot; neither do entries for inactive ranks.
    const int first_entry = c0 * K;
    auto count_entry = [&](int i, int e, bool bad) {
        if (bad) atomicMin(&sm.flag[1], i);
        if (e < 0 || !sm.active[e / El]) return;
        atomicAdd(&sm.hist[e], 1);
        if (i < first_entry) atomicAdd(&sm.before[e], 1);
    };
    {
        bool bad;
        int e = checked_expert(topk, tid, pre_v0, K, E, 0xffffffffu, wb0, bad);
        count_entry(tid, e, bad);
        e = checked_expert(topk, tid + bd, pre_v1, K, E, 0xffffffffu, wb0 + bd, bad);
        count_entry(tid + bd, e, bad);
    }
    for (int wb = wb0 + 2 * bd; wb < NK; wb += bd) {
        const int i = wb + lane;
        bool bad;
        const int e = checked_expert(topk, i, i < NK ? __ldg(topk + i) : -1, K, E, 0xffffffffu, wb, bad);
        count_entry(i, e, bad);
    }
    __syncthreads();
    // Every block saw every entry; block 0 reports the first bad one (rare path: host-memory accesses).
    if (blockIdx.x == 0 && tid == 0 && s.err != 0 && sm.flag[1] != 0x7fffffff) record_bad_entry(s, topk, sm.flag[1], K, E);
    // At most T rows per (expert, source) fit the receiver, which a row naming each expert once
    // guarantees; the clamp keeps every slot inside its region regardless.
    block_exclusive_scan(sm.base, sm.hist, E, sm.scan, T);
    trace_point(s, kTraceDispatch, kTrSendRouted);

    const uint32_t hdr_off = hdr_offset(kFp8, H);
    const uint32_t msg_len = hdr_off + kHeaderBytes;
    const int scale_vecs = kFp8 ? (G + 3) / 4 : 0;
    for (int t = c0; t < c1; ++t) {
        if (tid < kMaxTopk) {
            // A row names each expert at most once (checked_expert routes repeats as -1), so an entry's
            // rank is the count of its expert's entries in earlier rows.
            bool bad;
            int e = checked_expert(topk, t * K + tid, pre_row, K, E, kTopkLanes, t * K, bad);
            if (e >= 0 && !sm.active[e / El]) e = -1;
            sm.target[tid] = e;
        }
        // The next row's top-k entries, in flight while this row goes out.
        pre_row = (t + 1 < c1 && tid < K) ? __ldg(topk + (t + 1) * K + tid) : -1;
        __syncthreads();
        if (tid < K) {
            const int e = sm.target[tid];
            int kind = 0;
            // Distinct experts in a row: thread k alone reads and advances its expert's count.
            const int rank = e >= 0 ? sm.before[e] : T;
            if (e >= 0) sm.before[e] = rank + 1;
            if (rank < T) {
                const int dst = e / El;
                const uint64_t slot = (uint64_t)(sm.base[e] - sm.base[dst * El] + rank);
                const uint64_t off = off_drecv(s, half, s.rank, slot);
                const uint64_t pb = peer_base(s, dst);
                sm.dst[tid] = dst;
                if (pb != 0) {
                    kind = 1;
                    sm.addr[tid] = pb + off;
                } else {
                    kind = 2;
                    sm.addr[tid] = s.buf + off_crecv(s, half, t, tid);
                    sm.raddr[tid] = remote_addr(s, dst) + off;
                }
            }
            sm.kind[tid] = kind;
        }
        __syncthreads();

        const uint8_t* xrow = reinterpret_cast<const uint8_t*>(c.x) + (size_t)t * H * 2;
        for (int ch = tid; ch < H / 16; ch += blockDim.x) {
            const bool pre = ch == tid;   // this thread's first chunk was loaded ahead
            const int4 a = pre ? pre_a : ld_nc_v4(xrow + (size_t)ch * 32);
            const int4 b = pre ? pre_b : ld_nc_v4(xrow + (size_t)ch * 32 + 16);
            if (kFp8) {
                const uint32_t w[8] = {(uint32_t)a.x, (uint32_t)a.y, (uint32_t)a.z, (uint32_t)a.w,
                                       (uint32_t)b.x, (uint32_t)b.y, (uint32_t)b.z, (uint32_t)b.w};
                float f[16];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    f[2 * j] = bf16_lo(w[j]);
                    f[2 * j + 1] = bf16_hi(w[j]);
                }
                float amax = 0.0f;
#pragma unroll
                for (int j = 0; j < 16; ++j) amax = fmaxf(amax, fabsf(f[j]));
                // The 8 chunks of one 128-channel group are 8 consecutive lanes (H/16 and the block
                // size are multiples of 8, so a group is either wholly in this iteration or not).
                const unsigned gmask = 0xffu << (lane & 24);
                amax = fmaxf(amax, __shfl_xor_sync(gmask, amax, 1));
                amax = fmaxf(amax, __shfl_xor_sync(gmask, amax, 2));
                amax = fmaxf(amax, __shfl_xor_sync(gmask, amax, 4));
                const float scale = fp8_scale(amax, c.round_scale != 0);
                const float inv = __fdiv_rn(1.0f, scale);
                int4 q;
                q.x = (int)fp8x4(f[0], f[1], f[2], f[3], inv);
                q.y = (int)fp8x4(f[4], f[5], f[6], f[7], inv);
                q.z = (int)fp8x4(f[8], f[9], f[10], f[11], inv);
                q.w = (int)fp8x4(f[12], f[13], f[14], f[15], inv);
                if ((ch & 7) == 0) sm.scale[ch >> 3] = scale;
                for (int k = 0; k < K; ++k)
                    if (sm.kind[k]) st_v4(reinterpret_cast<void*>(sm.addr[k] + (uint64_t)ch * 16), q);
            } else {
                for (int k = 0; k < K; ++k) {
                    if (!sm.kind[k]) continue;
                    uint8_t* d = reinterpret_cast<uint8_t*>(sm.addr[k] + (uint64_t)ch * 32);
                    st_v4(d, a);
                    st_v4(d + 16, b);
                }
            }
        }
        // The next row's first chunk, in flight during this row's headers and barriers.
        if (t + 1 < c1 && tid < H / 16) {
            const uint8_t* xr = xrow + (size_t)H * 2 + (size_t)tid * 32;
            pre_a = ld_nc_v4(xr);
            pre_b = ld_nc_v4(xr + 16);
        }
        __syncthreads();
        // Header (token, k, local expert) after the payload and, for FP8, the scales padded to whole int4.
        const int per_msg = 1 + scale_vecs;
        for (int j = tid; j < K * per_msg; j += blockDim.x) {
            const int k = j / per_msg, w = j - k * per_msg;
            if (!sm.kind[k]) continue;
            int4 v;
            uint64_t at;
            if (w == 0) {
                v = make_int4(t, k, sm.target[k] % El, 0);
                at = sm.addr[k] + hdr_off;
            } else {
                const int g = (w - 1) * 4;
                v.x = g < G ? __float_as_int(sm.scale[g]) : 0;
                v.y = g + 1 < G ? __float_as_int(sm.scale[g + 1]) : 0;
                v.z = g + 2 < G ? __float_as_int(sm.scale[g + 2]) : 0;
                v.w = g + 3 < G ? __float_as_int(sm.scale[g + 3]) : 0;
                at = sm.addr[k] + H + (uint64_t)(w - 1) * 16;
            }
            st_v4(reinterpret_cast<void*>(at), v);
        }
        // NIC destinations: the NIC reads the staged message over PCIe, so every writer makes its
        // stores visible system-wide first; the message then goes out on the QP of its expert, where
        // the count signal will follow it (RC executes a QP's WQEs in order).
        bool nic = false;
        for (int k = 0; k < K; ++k) nic |= sm.kind[k] == 2;
        if (nic) __threadfence_system();
        __syncthreads();
        if (tid < K && sm.kind[tid] == 2) {
            const int dst = sm.dst[tid];
            const int le = sm.target[tid] % El;
            const int st = gda::post_rdma_write(peer_qp(s, dst, le % s.num_qps_per_peer), sm.addr[tid], s.lkey,
                                                sm.raddr[tid], rkey_of(s, dst), msg_len, false, c.timeout_ns);
            if (st != gda::kOk) note_failure(s, dst);
        }
        __syncthreads();
    }
    trace_point(s, kTraceDispatch, kTrSendIssued);

    // What the last block's signal loop reads from memory (this rank's generation, the thread's first
    // destination), loaded before the arrival: the signals then follow the last fence directly, not a
    // round trip later.
    const uint32_t tag = call_tag(c.seq, gen_of(s, s.rank));
    const uint64_t first_base = tid < E ? peer_base(s, tid / El) : 0;
    const bool last_send = arrive_last<kPeerScope>(ws_counter(s, half, kDispatchSendDone), sm.flag);
    trace_point(s, kTraceDispatch, kTrSendFenced);
    if (last_send) {
        // Each count word carries this call's tag (docs/ll_kernels.md, "Call tags"); a refused call sends
        // the abort marker in every word instead (N = 0 here: no payload went out).
        auto word = [&](int i) {
            return c.abort ? sig_word(tag, kSigAbort | (uint32_t)c.abort) : sig_word(tag, (uint32_t)min(sm.hist[i], T) + 1);
        };
        for (int i = tid; i < E; i += blockDim.x) {
            const int dst = i / El, le = i - dst * El;
            if (sm.active[dst] != kPeerStore) continue;
            const uint64_t base = i == tid ? first_base : peer_base(s, dst);
            st_relaxed_sys(reinterpret_cast<int*>(base + off_dsig(s, half, le, s.rank)), (int)word(i));
        }
        __syncthreads();
        trace_point(s, kTraceDispatch, kTrSendSignaled);
        // NIC signals: one posting lane per warp (qp.h's ordering spin assumes independent posters).
        if (any_peer_of(sm.active, R, kPeerNic)) {
            const int* fail = ws_fail(s);
            for (int i = tid / 32; i < E; i += kWarps) {
                const int dst = i / El, le = i - dst * El;
                if (lane != 0 || sm.active[dst] != kPeerNic || ld_volatile(fail + dst)) continue;
                const int st = gda::post_masked_fa32(peer_qp(s, dst, le % s.num_qps_per_peer),
                                                     remote_addr(s, dst) + off_dsig(s, half, le, s.rank),
                                                     rkey_of(s, dst), word(i), s.fetch_addr, s.lkey, false,
                                                     c.timeout_ns);
                if (st != gda::kOk) note_failure(s, dst);
            }
            __syncthreads();
        }
        finish_failures(s, sm.active, active);
        if (tid == 0) *ws_counter(s, half, kDispatchSendDone) = 0;
    }
    trace_point(s, kTraceDispatch, kTrSendDone);
}

// The receive's output: the row prefix over (expert, source), layout_range / recv_count, and the copy
// of every message that arrived into recv_x, the scales, src_info and the top-k slots.
template <bool kFp8>
__device__ void dispatch_unpack(const LLStatic& s, const LLDispatchCall& c, DispatchSmem& sm) {
    const int R = s.num_ranks, El = s.num_local_experts, E = R * El, T = s.num_max_tokens, H = s.hidden;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int half = c.half;
    const int G = H / 128;
    uint8_t* hb = reinterpret_cast<uint8_t*>(s.buf);
    plan_rows(sm.cnt, sm.rowstart, sm.srcoff, sm.scan, R, El);
    const int total = sm.rowstart[E];
    trace_point(s, kTraceDispatch, kTrRecvPlanned);
    if (blockIdx.x == 0) {
        int64_t* lr = reinterpret_cast<int64_t*>(c.layout_range);
        for (int p = tid; p < E; p += blockDim.x) {
            const int e = p / R;
            const int64_t begin = sm.rowstart[p] - sm.rowstart[e * R];
            lr[p] = (begin << 32) | (int64_t)sm.cnt[p];
        }
        int* rc = reinterpret_cast<int*>(c.recv_count);
        int* cum = reinterpret_cast<int*>(c.cum_stats);
        for (int e = tid; e < El; e += blockDim.x) {
            const int n = sm.rowstart[(e + 1) * R] - sm.rowstart[e * R];
            rc[e] = n;
            if (cum) cum[e] += n;
        }
    }

    const int RT = R * T;
    const int payload_int4 = kFp8 ? H / 16 : H / 8;
    const int per_item = 32 * kCopyUnroll;
    const int chunks = (payload_int4 + per_item - 1) / per_item;
    const int64_t items = (int64_t)total * chunks;
    int* src_info = reinterpret_cast<int*>(c.src_info);
    int* recv_slot = reinterpret_cast<int*>(c.recv_slot);
    for (int64_t it = (int64_t)blockIdx.x * kWarps + warp; it < items; it += (int64_t)gridDim.x * kWarps) {
        const int q = (int)(it / chunks), ch = (int)(it - (int64_t)q * chunks);
        const int p = find_range(sm.rowstart, E, q);
        const int e = p / R, r = p - e * R;
        const int i = q - sm.rowstart[p];
        const int row = q - sm.rowstart[e * R];
        const uint8_t* msg = hb + off_drecv(s, half, r, (uint64_t)(source_slot(sm.srcoff, El, e, r) + i));
        const size_t out_row = (size_t)e * RT + row;
        const int4* src4 = reinterpret_cast<const int4*>(msg);
        int4* dst4 = reinterpret_cast<int4*>(reinterpret_cast<uint8_t*>(c.recv_x) + out_row * (size_t)(kFp8 ? H : 2 * H));
        const int j0 = ch * per_item + lane;
        // Every load of the item -- the payload chunk and, for a row's first chunk, its header and its
        // scales -- is issued before any store: one round trip per item instead of one per field (the
        // loads are volatile asm, so they issue in this order and each waits only at its first use).
        const bool head = ch == 0;
        int4 v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u)
            if (j0 + u * 32 < payload_int4) v[u] = ld_row_v4(src4 + j0 + u * 32);
        int4 hdr = make_int4(0, 0, 0, 0), sv = hdr;
        if (head && lane == 0) hdr = ld_v4(msg + hdr_offset(kFp8, H));
        // Scales: lane l reads groups 4l..4l+3 as one int4 (the sender pads them to whole int4 with
        // zeros; G <= kMaxGroups = 128, so W <= 32 lanes).
        const int W = (G + 3) / 4;
        if (kFp8 && head && lane < W) sv = ld_v4(msg + H + 16 * lane);
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u)
            if (j0 + u * 32 < payload_int4) st_v4(dst4 + j0 + u * 32, v[u]);
        if (!head) continue;
        if (lane == 0) {
            src_info[out_row] = hdr.x;
            recv_slot[out_row] = hdr.y;
        }
        if (kFp8 && lane < W) {
            const uint32_t sc[4] = {(uint32_t)sv.x, (uint32_t)sv.y, (uint32_t)sv.z, (uint32_t)sv.w};
            if (!c.use_ue8m0) {
                float* out = reinterpret_cast<float*>(c.recv_scales);
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const int g = 4 * lane + b;
                    if (g < G) out[((size_t)e * G + g) * RT + row] = __uint_as_float(sc[b]);
                }
            } else {
                uint32_t packed = 0;
#pragma unroll
                for (int b = 0; b < 4; ++b)
                    if (4 * lane + b < G) packed |= ((sc[b] >> 23) & 0xffu) << (8 * b);
                reinterpret_cast<int*>(c.recv_scales)[((size_t)e * W + lane) * RT + row] = (int)packed;
            }
        }
    }

}

template <bool kFp8>
__device__ void dispatch_recv(const LLStatic& s, const LLDispatchCall& c, DispatchSmem& sm) {
    const int R = s.num_ranks, El = s.num_local_experts, E = R * El, T = s.num_max_tokens;
    const int tid = threadIdx.x;
    const int half = c.half;
    int* state = ws_dstate(s, half);
    int* active = reinterpret_cast<int*>(c.active);
    uint8_t* hb = reinterpret_cast<uint8_t*>(s.buf);
    trace_point(s, kTraceDispatch, kTrRecvBegin);
    const int* sig = reinterpret_cast<const int*>(hb + off_dsig(s, half, 0, 0));

    wait_counts(state, active, sig, R, E, T, c.timeout_ns, sm.src_state, sm.wflags, sm.cnt, c.wait_stats, sm.waited,
                c.seq, reinterpret_cast<const int*>(s.peer_gen));
    trace_point(s, kTraceDispatch, kTrRecvReady);
    // A call this rank refused: the peers' words are awaited and cleared below, nothing is written out.
    if (!c.abort) dispatch_unpack<kFp8>(s, c, sm);
    const bool last_recv = arrive_last<kGpuScope>(ws_counter(s, half, kDispatchRecvDone), sm.flag);
    trace_point(s, kTraceDispatch, kTrRecvCopied);
    if (last_recv) {
        // The first failed source into the call record, and whether this call's combine is skipped.
        const bool failed = record_call(s, sm.src_state, sm.flag + 2, kKindDispatch, c.seq, c.abort != 0, [&](int r) {
            const uint32_t tag = call_tag(c.seq, gen_of(s, r));
            for (int le = 0; le < El; ++le) {
                const uint32_t v = (uint32_t)ld_relaxed_sys(sig + le * R + r);
                if (v != 0 && judge_signal(v, tag, 1) != kArrived) return v;
            }
            return 0u;
        });
        if (tid == 0) *ws_dfail(s, half) = (failed || c.abort) ? 1 : 0;
        __syncthreads();
        // Every block has read this half's counts: clear them for the call after next, which peers
        // can only start after they have this call's results from us.
        int* words = reinterpret_cast<int*>(hb + off_dsig(s, half, 0, 0));
        for (int i = tid; i < E; i += blockDim.x) words[i] = 0;
        finish_decisions(state, sm.src_state, active, R);
        if (tid == 0) *ws_counter(s, half, kDispatchRecvDone) = 0;
    }
    trace_point(s, kTraceDispatch, kTrRecvDone);
}

template <bool kFp8>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) dispatch(LLStatic s, LLDispatchCall c) {
    uint8_t* smem = dynamic_smem();
    DispatchSmem sm = carve_dispatch(smem, s.num_ranks, s.num_ranks * s.num_local_experts);
    if (c.phases & kPhaseSend) dispatch_send<kFp8>(s, c, sm);
    if (c.phases & kPhaseRecv) {
        __syncthreads();
        dispatch_recv<kFp8>(s, c, sm);
    }
}

}  // namespace

int dispatch_smem_bytes(const LLStatic& s) {
    const int R = s.num_ranks, E = s.num_ranks * s.num_local_experts;
    return 16 * kMaxTopk + 8 * R + 4 * kMaxGroups + 4 * (3 * kMaxTopk + 4 + 3 * R + 5 * E + 3 + plan_scratch_ints(E));
}

#if !defined(PYEP_LL_CPU_SIM)
void check_cuda(cudaError_t e, const char* what);  // ll_runtime.cu

void load_dispatch_kernels(const LLStatic& s) {
    const int smem = dispatch_smem_bytes(s);
    for (auto kern : {dispatch<true>, dispatch<false>}) {
        cudaFuncAttributes attr;
        check_cuda(cudaFuncGetAttributes(&attr, kern), "ll dispatch module load");
        if (smem > 48 * 1024)
            check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                       "ll dispatch smem attribute");
    }
}

void launch_dispatch(const LLStatic& s, const LLDispatchCall& c, uint64_t stream) {
    check_call(s, c);
    const int smem = dispatch_smem_bytes(s);
    auto kern = c.use_fp8 ? dispatch<true> : dispatch<false>;
    if (smem > 48 * 1024)
        check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "ll dispatch smem attribute");
    kern<<<s.num_blocks, kThreadsPerBlock, smem, reinterpret_cast<cudaStream_t>(stream)>>>(s, c);
    check_cuda(cudaGetLastError(), "ll dispatch launch");
}

#endif  // !PYEP_LL_CPU_SIM

}  // namespace ll
}  // namespace pyep
