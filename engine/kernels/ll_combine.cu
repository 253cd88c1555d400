// Low-latency combine: every expert owner sends each received row's output back into the token owner's
// combine receive area at (token, top-k slot) -- NVLink/local stores, or staged + RDMA write -- then one
// flag per destination after all data; the token owner waits (bounded) for every active source and
// reduces out[t] = sum over k ascending of w[t,k] * y[t,k] in fp32 (one multiply and one add per term,
// no FMA, so the result is bit-identical to the reference backend), rounding to bf16 once.
//
// Send work is spread evenly over all warps as (row, 8 KiB chunk) items, so a hot expert does not
// serialise on one warp group. The reduce is spread as (token, 256-channel) items. A fused BF16 combine
// reads the rows of this rank's own tokens straight from x (ws_selfrow, ll_combine_common.cuh). With
// use_logfmt the send and the reduce are ll_combine_logfmt.cuh's instead.
#if !defined(PYEP_LL_CPU_SIM)
#include <cuda_runtime.h>
#endif

#include "kernels/ll_ack.cuh"
#include "kernels/ll_arrival.cuh"
#include "kernels/ll_combine_common.cuh"
#include "kernels/ll_combine_logfmt.cuh"
#include "kernels/ll_logfmt.cuh"

namespace pyep {
namespace ll {
namespace {

template <bool kLogfmt>
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
    plan_rows(sm.cnt, sm.rowstart, sm.srcoff, sm.scan, R, El);
    const int total = sm.rowstart[E];
    // A handle combined again: no row before each destination acknowledged our earlier combines on
    // this half (ll_ack.cuh). After the routing scans, so they overlap the wait.
    if (c.repeat) wait_acks(s, c, sm.active);
    trace_point(s, kTraceCombine, kTrSendRouted);

    const int RT = R * T;
    if (c.abort) {
        // A combine this rank refused: no rows, only the abort-tagged flags below.
    } else if (kLogfmt) {
        combine_send_logfmt(s, c, sm, total);
    } else {
    const int row_int4 = H / 8;
    const int per_item = 32 * kCombineSendUnroll;
    const int chunks = (row_int4 + per_item - 1) / per_item;
    const int64_t items = (int64_t)total * chunks;
    const int* src_info = reinterpret_cast<const int*>(c.src_info);
    const int* recv_slot = reinterpret_cast<const int*>(c.recv_slot);
    const bool own = reads_own_rows(s, c, sm.active);
    int* selfrow = ws_selfrow(s, half);
    for (int64_t it = (int64_t)blockIdx.x * kWarps + warp; it < items; it += (int64_t)gridDim.x * kWarps) {
        const int q = (int)(it / chunks), ch = (int)(it - (int64_t)q * chunks);
        const int p = find_range(sm.rowstart, E, q);
        const int e = p / R, r = p - e * R;
        if (!sm.active[r]) continue;
        const int i = q - sm.rowstart[p];
        const int row = q - sm.rowstart[e * R];
        const size_t in_row = (size_t)e * RT + row;
        const int4* src4 = reinterpret_cast<const int4*>(reinterpret_cast<const uint8_t*>(c.x) + in_row * 2 * (size_t)H);
        const bool own_row = own && r == s.rank;   // ws_selfrow: its index, not its data
        const bool store_peer = !own_row && sm.active[r] == kPeerStore;
        // An own row (its index) and a NIC row (staged whole) are one item's work: the row's other items
        // leave before any global load, so a warp's next copy is not queued behind their latency.
        if (!store_peer && ch != 0) continue;
        // The row's data does not depend on where it goes: its loads are issued together with the
        // loads of its destination (token, slot), not after them.
        const int j0 = ch * per_item + lane;
        int4 v[kCombineSendUnroll];
        if (store_peer) {
#pragma unroll
            for (int u = 0; u < kCombineSendUnroll; ++u)
                if (j0 + u * 32 < row_int4) v[u] = ld_nc_v4(src4 + j0 + u * 32);
        }
        const int t = __ldg(src_info + in_row), k = __ldg(recv_slot + in_row);
        if (t < 0 || t >= T || k < 0 || k >= s.max_topk) continue;  // never write outside the slot area
        const uint64_t doff = off_crecv(s, half, t, k);
        if (own_row) {
            if (ch == 0 && lane == 0) selfrow[t * s.max_topk + k] = (int)in_row;
        } else if (store_peer) {
            int4* dst4 = reinterpret_cast<int4*>(peer_base(s, r) + doff);
#pragma unroll
            for (int u = 0; u < kCombineSendUnroll; ++u)
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
    // What the last block's flag stores read from memory (this rank's generation, the thread's first
    // destination) is loaded before the arrival, so the flags follow its fence directly.
    const uint32_t tag = call_tag(c.seq, gen_of(s, s.rank));
    const uint64_t first_base = tid < R ? peer_base(s, tid) : 0;
    const bool last_send = arrive_last<kPeerScope>(ws_counter(s, half, kCombineSendDone), sm.flag);
    trace_point(s, kTraceCombine, kTrSendFenced);
    if (last_send) {
        // The flag carries this call's tag (docs/ll_kernels.md, "Call tags"), or the abort marker.
        const uint32_t first = c.abort ? sig_word(tag, kSigAbort | (uint32_t)c.abort) : sig_word(tag, 1);
        for (int r = tid; r < R; r += blockDim.x) {
            if (sm.active[r] != kPeerStore) continue;
            const uint64_t base = r == tid ? first_base : peer_base(s, r);
            st_relaxed_sys(reinterpret_cast<int*>(base + off_csig(s, half, s.rank)), (int)first);
        }
        // NIC: a +1 on every QP of the peer, so the flag completes only after the data of all of them; the
        // add on QP 0 also brings the tag (or, alone, the abort marker).
        if (any_peer_of(sm.active, R, kPeerNic)) {
            const int* fail = ws_fail(s);
            for (int i = warp; i < R * s.num_qps_per_peer; i += kWarps) {
                const int r = i / s.num_qps_per_peer, j = i - r * s.num_qps_per_peer;
                if (lane != 0 || sm.active[r] != kPeerNic || ld_volatile(fail + r) || (j != 0 && c.abort)) continue;
                const int st = gda::post_masked_fa32(peer_qp(s, r, j), remote_addr(s, r) + off_csig(s, half, s.rank),
                                                     rkey_of(s, r), j == 0 ? first : 1u, s.fetch_addr, s.lkey, false,
                                                     c.timeout_ns);
                if (st != gda::kOk) note_failure(s, r);
            }
        }
        __syncthreads();
        finish_failures(s, sm.active, active);
        finish_acks(s, c, sm.active, active);
        if (tid == 0) *ws_counter(s, half, kCombineSendDone) = 0;
    }
    trace_point(s, kTraceCombine, kTrSendDone);
}

// The BF16 reduce of the receive half. kOwnRows (reads_own_rows: a fused combine) takes this rank's own
// rows from x (ws_selfrow), their index loaded one item ahead like the routing; a split combine's reduce
// is compiled without it: as a runtime branch, the own-row loads, shuffles and the select between x and the
// slot made a split receive half 10 % slower at T = 256 (docs/results/2026-11-27j-onegpu).
template <bool kOwnRows>
__device__ void combine_reduce(const LLStatic& s, const LLCombineCall& c, CombineSmem& sm, int64_t first_it,
                               int64_t items, int col_chunks, int64_t pre_v, float pre_w) {
    const int R = s.num_ranks, El = s.num_local_experts, E = R * El, H = s.hidden;
    const int K = c.num_topk, lane = threadIdx.x & 31, half = c.half, cols = H / 8;
    const uint8_t* hb = reinterpret_cast<const uint8_t*>(s.buf);
    const uint8_t* xb = reinterpret_cast<const uint8_t*>(c.x);
    const int own_lo = s.rank * El, x_rows = El * R * s.num_max_tokens;
    int pre_row = kOwnRows ? load_item_selfrow(s, c, true, first_it, items, col_chunks) : -1;
    for (int64_t it = first_it; it < items; it += (int64_t)gridDim.x * kWarps) {
        const int t = (int)(it / col_chunks);
        const int col = (int)(it - (int64_t)t * col_chunks) * 32 + lane;
        float my_w;
        int my_e = slot_expert(c, sm, El, E, t, pre_v, pre_w, my_w);
        // The slot's row in x when its expert is this rank's. An index outside x (a combine whose routing
        // is not its dispatch's) reads nothing: the slot counts as unused.
        int my_row = -1;
        if (kOwnRows && my_e >= own_lo && my_e < own_lo + El) {
            if (pre_row >= 0 && pre_row < x_rows) my_row = pre_row;
            else my_e = -1;
        }
        const int64_t nit = it + (int64_t)gridDim.x * kWarps;
        load_item_routing(c, nit, items, col_chunks, pre_v, pre_w);
        if (kOwnRows) pre_row = load_item_selfrow(s, c, true, nit, items, col_chunks);
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
                const int row = kOwnRows ? __shfl_sync(0xffffffffu, my_row, k & 31) : -1;
                if (use[j] && live)
                    y[j] = row >= 0 ? ld_nc_v4(xb + (uint64_t)row * 2 * H + (uint64_t)col * 16)
                                    : ld_row_v4(hb + off_crecv(s, half, t, k) + (uint64_t)col * 16);
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
}

template <bool kLogfmt>
__device__ void combine_recv(const LLStatic& s, const LLCombineCall& c, CombineSmem& sm) {
    const int R = s.num_ranks, H = s.hidden, N = c.num_tokens;
    const int tid = threadIdx.x, warp = tid >> 5;
    const int half = c.half;
    int* state = ws_cstate(s, half);
    int* active = reinterpret_cast<int*>(c.active);
    uint8_t* hb = reinterpret_cast<uint8_t*>(s.buf);
    const int* expect = reinterpret_cast<const int*>(s.flag_expect);
    trace_point(s, kTraceCombine, kTrRecvBegin);

    // Routing of this warp's first reduce item depends on nothing the peers send: load it before the
    // wait, so the wait's end is followed by the data loads only.
    const int cols = H / 8;               // int4 columns of a row
    // LogFMT items are (token, 512 channels): lane l reduces channels 16l..16l+15.
    const int col_chunks = kLogfmt ? H / kLfRound : (cols + 31) / 32;
    const int64_t items = (int64_t)N * col_chunks;
    const int64_t first_it = (int64_t)blockIdx.x * kWarps + warp;
    int64_t pre_v;
    float pre_w;
    load_item_routing(c, first_it, items, col_chunks, pre_v, pre_w);

    for (int r = tid; r < R; r += blockDim.x) {
        const int* sig = reinterpret_cast<const int*>(hb + off_csig(s, half, r));
        const uint32_t tag = call_tag(c.seq, gen_of(s, r)), need = (uint32_t)max(1, expect[r]);
        bool seen = false;
        const int st = resolve_signal(state, active, r, sig,
                                      [tag, need](uint32_t v) { return judge_signal(v, tag, need); }, c.timeout_ns,
                                      c.wait_stats, &seen);
        // When another block decided and this thread's own load did not find the flag complete, re-read
        // it with acquire: this block needs its own edge to the data the flag publishes.
        sm.ok[r] = st == kArrived && (seen || ld_acquire_sys(sig) != 0);
        sm.dec[r] = st;
    }
    __syncthreads();
    trace_point(s, kTraceCombine, kTrRecvReady);

    if (kLogfmt)
        combine_reduce_logfmt(s, c, sm, first_it, items, col_chunks, pre_v, pre_w);
    else if (reads_own_rows(s, c, sm.active) && sm.ok[s.rank])
        combine_reduce<true>(s, c, sm, first_it, items, col_chunks, pre_v, pre_w);
    else
        combine_reduce<false>(s, c, sm, first_it, items, col_chunks, pre_v, pre_w);
    trace_point(s, kTraceCombine, kTrRecvReduced);

    const bool last_recv = arrive_last<kGpuScope>(ws_counter(s, half, kCombineRecvDone), sm.flag);
    trace_point(s, kTraceCombine, kTrRecvCopied);
    if (last_recv) {
        int* sig = reinterpret_cast<int*>(hb + off_csig(s, half, 0));
        record_call(s, sm.dec, sm.flag + 2, kKindCombine, c.seq, c.abort != 0,
                    [&](int r) { return (uint32_t)ld_relaxed_sys(sig + r); });
        __syncthreads();
        for (int r = tid; r < R; r += blockDim.x) sig[r] = 0;
        finish_decisions(state, sm.dec, active, R);
        if (tid == 0) *ws_counter(s, half, kCombineRecvDone) = 0;
        send_acks(s, c, sm.ok);
    }
    trace_point(s, kTraceCombine, kTrRecvDone);
}

// The combine of a dispatch whose exchange failed: every rank of the call saw the failure (an abort marker
// or another call's tag reaches all of them), so every rank skips it -- no rows, no flags, no wait, no
// acknowledgement -- and no rank waits for a combine the others do not make. The output is NaN, never
// numbers that look right, and the call record says why (unless it still holds the dispatch's error).
__device__ void combine_skipped(const LLStatic& s, const LLCombineCall& c) {
    if (!(c.phases & kPhaseRecv) || c.abort) return;
    const int64_t n = (int64_t)c.num_tokens * s.hidden / 8;   // int4 of bf16 NaN (0x7fc0) pairs
    const int nan2 = 0x7fc07fc0;
    int4* out = reinterpret_cast<int4*>(c.out);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        st_v4(out + i, make_int4(nan2, nan2, nan2, nan2));
    if (blockIdx.x == 0 && threadIdx.x == 0) write_call_record(s, kCallSkipped, kKindCombine, c.seq, -1, 0, 0);
}

// One instance per payload format (c.use_logfmt == kLogfmt): each is register-allocated for its own loops.
template <bool kLogfmt>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) combine(LLStatic s, LLCombineCall c) {
    if (ld_volatile(ws_dfail(s, c.half)) != 0) {
        combine_skipped(s, c);
        return;
    }
    uint8_t* smem = dynamic_smem();
    CombineSmem sm = carve_combine(smem, s.num_ranks, s.num_ranks * s.num_local_experts);
    if (kLogfmt)
        for (int j = threadIdx.x; j < 128; j += blockDim.x) sm.lf_tbl[j] = __uint_as_float(kLfLog2Mant[j]);
    if (c.phases & kPhaseSend) combine_send<kLogfmt>(s, c, sm);
    if (c.phases & kPhaseRecv) {
        __syncthreads();
        combine_recv<kLogfmt>(s, c, sm);
    }
}

}  // namespace

int combine_smem_bytes(const LLStatic& s) {
    const int R = s.num_ranks, E = s.num_ranks * s.num_local_experts;
    // + 16 alignment slack, the LogFMT log2 table and the per-warp LogFMT staging.
    return 4 * (4 + 3 * R + 3 * E + 2 + plan_scratch_ints(E)) + 16 + 128 * 4 + kWarps * kLfStageBytes;
}

#if !defined(PYEP_LL_CPU_SIM)
void check_cuda(cudaError_t e, const char* what);  // ll_runtime.cu

void load_combine_kernels(const LLStatic& s) {
    for (auto* kernel : {combine<false>, combine<true>}) {
        cudaFuncAttributes attr;
        check_cuda(cudaFuncGetAttributes(&attr, kernel), "ll combine module load");
        const int smem = combine_smem_bytes(s);
        if (smem > 48 * 1024)
            check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                       "ll combine smem attribute");
    }
}

void launch_combine(const LLStatic& s, const LLCombineCall& c, uint64_t stream) {
    check_call(s, c);
    auto* kernel = c.use_logfmt ? combine<true> : combine<false>;
    const int smem = combine_smem_bytes(s);
    if (smem > 48 * 1024)
        check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                   "ll combine smem attribute");
    kernel<<<s.num_blocks, kThreadsPerBlock, smem, reinterpret_cast<cudaStream_t>(stream)>>>(s, c);
    check_cuda(cudaGetLastError(), "ll combine launch");
}

#endif  // !PYEP_LL_CPU_SIM

}  // namespace ll
}  // namespace pyep
