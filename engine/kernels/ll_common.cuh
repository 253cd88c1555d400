// Device helpers shared by the low-latency dispatch and combine kernels (and the normal mode's memory
// accesses): memory accesses with explicit PTX semantics, top-k entry checks, the timeline trace, block
// scans and the receive plan, and addressing of the buffer layout (pyep/ep/ll/layout.py is the
// definition; the offsets arrive in LLStatic). The arrival protocol -- who decides a source, the
// last-block completion, the call record -- is ll_arrival.cuh.
//
// PYEP_LL_CPU_SIM: the same source compiles as host C++ against tests/ll_sim/cuda_shim.h, where every
// block thread is an OS thread; only the few raw PTX accesses below have host twins there.
#pragma once

#include <stdint.h>
#if !defined(PYEP_LL_CPU_SIM)
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#endif

#include "kernels/ll_launch.h"
#include "mlx5gda/qp.h"

namespace pyep {
namespace ll {

constexpr int kWarps = kThreadsPerBlock / 32;
constexpr int kMaxTopk = 16;
constexpr int kMaxGroups = 128;        // H <= 16384 -> at most 128 FP8 groups of 128 channels
constexpr int kCopyUnroll = 8;         // int4 per lane in flight per copy item (4 KiB per warp)
constexpr int kCombineSendUnroll = 16; // the combine send's items: 8 KiB per warp (a 14 KiB row in 2 items)
constexpr int kReduceBatch = 8;        // combine rows loaded at once per reduce item
constexpr int kHeaderBytes = 16;
constexpr int kMsgAlign = 128;         // layout.py MSG_ALIGN: slots are whole cache lines

// A dispatch message is [payload][FP8 scales][16-byte header] (layout.py: header_offset); its
// payload starts at the slot's first byte, which is 128-byte aligned.
__host__ __device__ __forceinline__ uint32_t hdr_offset(bool fp8, int hidden) {
    return fp8 ? (uint32_t)(hidden + ((4 * (hidden / 128) + 15) / 16) * 16) : (uint32_t)(2 * hidden);
}

// Workspace words (layout.py: ws_words). Done counters per half, then per-source decision words.
enum WsCounter : int { kDispatchSendDone = 0, kDispatchRecvDone = 1, kCombineSendDone = 2, kCombineRecvDone = 3 };
__device__ __forceinline__ int* ws_counter(const LLStatic& s, int half, int which) {
    return reinterpret_cast<int*>(s.workspace) + half * 4 + which;
}
__device__ __forceinline__ int* ws_dstate(const LLStatic& s, int half) {
    return reinterpret_cast<int*>(s.workspace) + 16 + half * s.num_ranks;
}
__device__ __forceinline__ int* ws_cstate(const LLStatic& s, int half) {
    return reinterpret_cast<int*>(s.workspace) + 16 + 2 * s.num_ranks + half * s.num_ranks;
}
__device__ __forceinline__ int* ws_fail(const LLStatic& s) {
    return reinterpret_cast<int*>(s.workspace) + 16 + 4 * s.num_ranks;
}
// Per half: whether the latest dispatch on it failed (a peer refused it, or met this rank at another
// call). Written by the last block of that dispatch's receive; its combine then does nothing on any
// rank (every rank of the call saw the failure), so no rank waits for a combine the others skip.
__device__ __forceinline__ int* ws_dfail(const LLStatic& s, int half) {
    return reinterpret_cast<int*>(s.workspace) + 8 + half;
}

// Decision about one source rank in one call, shared by all blocks through the workspace. kAborted: the
// source refused the call (abort marker); kMismatch: its signal carries another call's tag.
enum SrcState : int { kUndecided = 0, kArrived = 1, kTimedOut = 2, kInactive = 3, kAborted = 4, kMismatch = 5 };

// ---- call tags (docs/ll_kernels.md, "Call tags") ---------------------------------------------------
// Every signal word a peer writes -- a dispatch count word, a combine flag -- is [31:16] the call tag,
// [15] abort, [14:0] the value (dispatch: count + 1; combine: adds so far; abort: the refusal reason).
// The tag is the call number modulo 4096 and the sender's membership generation modulo 16. A word
// that arrived is never 0 (value >= 1 or the abort bit), so 0 still means "not yet".
constexpr uint32_t kSigAbort = 0x8000u;
constexpr uint32_t kSigValue = 0x7fffu;
__host__ __device__ __forceinline__ uint32_t call_tag(uint32_t seq, int gen) {
    return ((seq & 0xfffu) << 4) | ((uint32_t)gen & 0xfu);
}
__host__ __device__ __forceinline__ uint32_t sig_word(uint32_t tag, uint32_t value) { return (tag << 16) | value; }
__device__ __forceinline__ int gen_of(const LLStatic& s, int r) {
    return s.peer_gen ? reinterpret_cast<const int*>(s.peer_gen)[r] : 0;
}
// What signal word v from a source says, once its value reached `need` (kUndecided before): arrived
// for this call, aborted (this call's abort marker), or another call's word.
__device__ __forceinline__ int judge_signal(uint32_t v, uint32_t tag, uint32_t need) {
    if (v & kSigAbort) return (v >> 16) == tag ? kAborted : kMismatch;
    if ((v & kSigValue) < need) return kUndecided;
    return (v >> 16) == tag ? kArrived : kMismatch;
}

// ---- addressing (byte offsets from a buffer base) ---------------------------------------------------
__device__ __forceinline__ uint64_t off_dsig(const LLStatic& s, int half, int le, int src) {
    return half * s.half_bytes + s.off_dsig + 4ull * ((uint64_t)le * s.num_ranks + src);
}
__device__ __forceinline__ uint64_t off_csig(const LLStatic& s, int half, int src) {
    return half * s.half_bytes + s.off_csig + 4ull * src;
}
__device__ __forceinline__ uint64_t off_drecv(const LLStatic& s, int half, int src, uint64_t slot) {
    return half * s.half_bytes + s.off_drecv + ((uint64_t)src * s.slots_per_src + slot) * s.msg_bytes;
}
__device__ __forceinline__ uint64_t off_crecv(const LLStatic& s, int half, int token, int k) {
    return half * s.half_bytes + s.off_crecv + ((uint64_t)token * s.max_topk + k) * s.msg_bytes;
}
__device__ __forceinline__ uint64_t peer_base(const LLStatic& s, int r) {
    return reinterpret_cast<const uint64_t*>(s.peer_base)[r];
}
__device__ __forceinline__ gda::Qp* peer_qp(const LLStatic& s, int r, int j) {
    return reinterpret_cast<gda::Qp*>(s.qps) + (r * s.num_qps_per_peer + j);
}
__device__ __forceinline__ uint64_t remote_addr(const LLStatic& s, int r) {
    return reinterpret_cast<const uint64_t*>(s.remote_addr)[r];
}
__device__ __forceinline__ uint32_t rkey_of(const LLStatic& s, int r) {
    return reinterpret_cast<const uint32_t*>(s.rkeys)[r];
}

// How this call reaches rank r: not at all (inactive), by stores (self / NVLink IPC), or by the NIC.
// Decided once per block from active_ranks and the peer table, so the signal loops of the last block
// do not walk the global tables rank by rank (18 dependent loads per warp cost ~5 us at E = 288).
enum PeerMode : int { kPeerInactive = 0, kPeerStore = 1, kPeerNic = 2 };

// ---- memory accesses --------------------------------------------------------------------------------
#if !defined(PYEP_LL_CPU_SIM)
#define LL_SPIN_HINT() ((void)0)
__device__ __forceinline__ uint8_t* dynamic_smem() {
    extern __shared__ __align__(16) uint8_t ll_dynamic_smem[];
    return ll_dynamic_smem;
}
// Read-only inputs (x, topk, weights, the handle): the non-coherent path, no L1 allocation. Rows are
// read whole, 16 bytes a lane: L2::256B lets a miss fetch 256 contiguous bytes from HBM in one request
// (a prefetch-size hint only; a warp's 512 bytes use all of it).
__device__ __forceinline__ int4 ld_nc_v4(const void* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
// Data other GPUs / the NIC wrote during this kernel (after an acquire): coherent loads.
__device__ __forceinline__ int4 ld_v4(const void* p) {
    int4 v;
    asm volatile("ld.global.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
// The same for rows that are read whole (the dispatch receive's copy, the combine's reduce), with
// ld_nc_v4's prefetch-size hint.
__device__ __forceinline__ int4 ld_row_v4(const void* p) {
    int4 v;
    asm volatile("ld.global.L1::no_allocate.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_v4(void* p, int4 v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1,%2,%3,%4};"
                 ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ int ld_acquire_sys(const int* p) {
    int v;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int ld_volatile(const int* p) {
    int v;
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// A relaxed (morally strong) load. Polling with it and, once the value is seen, fence_acq_rel_sys() in
// the same thread is the PTX "acquire pattern" (the normal mode's waits); the LL receive polls with
// ld_acquire_sys instead, which spares its blocks a system fence (ll_arrival.cuh, wait_counts).
__device__ __forceinline__ int ld_relaxed_sys(const int* p) {
    int v;
    asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
// Signal stores of the last block (see arrive_last): ordered by the fence that block already ran.
__device__ __forceinline__ void st_relaxed_sys(int* p, int v) {
    asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_u32(const uint8_t* p) {
    uint32_t v;
    asm volatile("ld.global.L1::no_allocate.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
#else
#define LL_SPIN_HINT() sim_spin_hint()
__device__ __forceinline__ uint8_t* dynamic_smem() { return sim_smem(); }
__device__ __forceinline__ int4 ld_nc_v4(const void* p) { return sim_ld_v4(p); }
__device__ __forceinline__ int4 ld_v4(const void* p) { return sim_ld_v4(p); }
__device__ __forceinline__ int4 ld_row_v4(const void* p) { return sim_ld_v4(p); }
__device__ __forceinline__ void st_v4(void* p, int4 v) { sim_st_v4(p, v); }
__device__ __forceinline__ int ld_acquire_sys(const int* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
__device__ __forceinline__ int ld_volatile(const int* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
__device__ __forceinline__ int ld_relaxed_sys(const int* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
__device__ __forceinline__ void fence_acq_rel_sys() { __atomic_thread_fence(__ATOMIC_ACQ_REL); }
__device__ __forceinline__ void st_relaxed_sys(int* p, int v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
__device__ __forceinline__ uint32_t ld_u32(const uint8_t* p) {
    uint32_t v;
    __builtin_memcpy(&v, p, 4);
    return v;
}
#endif
// Both loads in one round trip: the table load is written first, since nothing moves a load across the
// volatile asm of the other (a branch on `active` first made them two dependent round trips).
__device__ __forceinline__ int peer_mode(const LLStatic& s, const int* active, int r) {
    const uint64_t pb = peer_base(s, r);
    if (ld_volatile(active + r) == 0) return kPeerInactive;
    return pb != 0 ? kPeerStore : kPeerNic;
}
// Whether any rank has PeerMode `mode` in this call (peer_modes: shared memory, the block's copy); the
// same answer in every thread, so it can guard a barrier.
__device__ __forceinline__ bool any_peer_of(const int* peer_modes, int num_ranks, int mode) {
    bool any = false;
    for (int r = 0; r < num_ranks; ++r) any |= peer_modes[r] == mode;
    return any;
}

// ---- top-k entry checks (docs/ll_kernels.md: "Where values are checked") ----------------------------
// The expert of top-k entry i (raw id v) of a routing with K columns: -1 for an unused slot, for an id
// outside [0, E), and for an expert an earlier slot of the same row already names (a token goes to an
// expert once, so an expert gets at most T rows per source); `bad` is set for the last two.
// Warp-collective: every lane in `mask` calls it, and lane l holds entry first + (l - lowest lane of
// mask), consecutive entries (lanes past the end pass v = -1). The repeat test is one match over the
// warp; only lanes whose row began before `first` load those earlier entries (at most K - 1, just
// loaded by the previous warp; none when K divides 32).
__device__ __forceinline__ int checked_expert(const int64_t* topk, int i, int64_t v, int K, int E, unsigned mask,
                                             int first, bool& bad) {
    int e = (v >= 0 && v < E) ? (int)v : -1;
    bad = v < -1 || v >= E;
    const int t = i / K;
    const unsigned lane = threadIdx.x & 31u;
    const unsigned same = __match_any_sync(mask, ((unsigned long long)(unsigned)t << 32) | (unsigned)e);
    if (e >= 0) {
        bool dup = (same & mask & ((1u << lane) - 1u)) != 0;
        for (int j = t * K; !dup && j < first; ++j) dup = __ldg(topk + j) == v;
        if (dup) {
            e = -1;
            bad = true;
        }
    }
    return e;
}

// Block 0, thread 0 of the dispatch, when its routing pass saw a bad entry (pos: the smallest index):
// fills the host-mapped error record unless an earlier error is still unreported (ll_launch.h).
// Only this thread of a buffer's kernels writes the record, and a buffer's kernels run one after
// another, so a plain check-then-write suffices (no atomics on host memory, which PCIe may not have).
__device__ __forceinline__ void record_bad_entry(const LLStatic& s, const int64_t* topk, int pos, int K, int E) {
    int* rec = reinterpret_cast<int*>(s.err);
    if (ld_volatile(rec + kErrCode) != kErrNone) return;
    const int t = pos / K, k = pos - t * K;
    const int64_t v = __ldg(topk + pos);
    int first_k = -1;
    if (v >= 0 && v < E)
        for (int j = 0; j < k && first_k < 0; ++j)
            if (__ldg(topk + (int64_t)t * K + j) == v) first_k = j;
    rec[kErrRow] = t;
    rec[kErrK] = k;
    rec[kErrValueLo] = (int)(uint32_t)((uint64_t)v & 0xffffffffu);
    rec[kErrValueHi] = (int)(uint32_t)((uint64_t)v >> 32);
    rec[kErrFirstK] = first_k;
    __threadfence_system();   // the fields before the code word that tells the host they are there
    st_relaxed_sys(rec + kErrCode, first_k >= 0 ? kErrExpertDuplicate : kErrExpertRange);
}

// ---- timeline trace (diagnostics: LLStatic::trace) ---------------------------------------------------
// Thread 0 stamps %globaltimer at a point the whole block has reached (callers stamp right after a
// barrier; recv_reduced is warp 0's own point). Off unless the backend was created with
// PYEP_LL_TRACE=1: one uniform branch per point.
// (The normal combine's trace sums each warp's time per activity instead, normal_trace.cuh: its senders
// and reducers run at once.)
__device__ __forceinline__ void trace_point(const LLStatic& s, int kernel, int point) {
    if (s.trace != 0 && threadIdx.x == 0)
        reinterpret_cast<uint64_t*>(s.trace)[((size_t)kernel * s.num_blocks + blockIdx.x) * kTraceSlots + point] =
            gda::now_ns();
}

// ---- block-level building blocks --------------------------------------------------------------------
// Exclusive prefix sum of min(in[i], clamp) over in[0..n) into out (may be in), out[n] = total. Run
// by every thread; the caller syncs before and this function syncs after. Two levels: every warp scans
// 32-entry chunks, warp 0 scans the chunk totals (`tot`: scan_scratch_ints(n) ints of shared memory),
// then everyone adds the chunk offsets -- a single warp walking E = 288 entries took about a
// microsecond on the critical path of every dispatch.
__host__ __device__ __forceinline__ int scan_scratch_ints(int n) { return (n + 31) / 32 + 1; }

__device__ __forceinline__ int warp_inclusive_scan(int v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
    }
    return v;
}

// One warp: tot[0..chunks) (chunk totals) becomes their exclusive scan, tot[chunks] the grand total.
__device__ __forceinline__ void scan_chunk_totals(int* tot, int chunks) {
    const int lane = threadIdx.x & 31;
    int carry = 0;
    for (int base = 0; base < chunks; base += 32) {
        const int i = base + lane;
        const int v = i < chunks ? tot[i] : 0;
        const int incl = warp_inclusive_scan(v);
        if (i < chunks) tot[i] = carry + incl - v;
        carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) tot[chunks] = carry;
}

__device__ __forceinline__ void block_exclusive_scan(int* out, const int* in, int n, int* tot,
                                                     int clamp = 0x7fffffff) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (int)blockDim.x >> 5;
    const int chunks = (n + 31) / 32;
    for (int c = warp; c < chunks; c += nwarps) {
        const int i = c * 32 + lane;
        const int v = i < n ? min(in[i], clamp) : 0;
        const int incl = warp_inclusive_scan(v);
        if (i < n) out[i] = incl - v;
        if (lane == 31) tot[c] = incl;
    }
    __syncthreads();
    if (warp == 0) scan_chunk_totals(tot, chunks);
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] += tot[i >> 5];
    if (threadIdx.x == 0) out[n] = tot[chunks];
    __syncthreads();
}

// Largest p in [0, n) with a[p] <= q, for a non-decreasing a with a[0] <= q < a[n]: the pair whose
// row range [a[p], a[p+1]) holds q (empty pairs are skipped because their successor starts at q too).
__device__ __forceinline__ int find_range(const int* a, int n, int q) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (a[mid] <= q) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// The plan of rows that the dispatch receive and the combine send share, from cnt [E] (rows of (local
// expert e, source r) at p = e * R + r, the count word's own index): rowstart [E + 1], the exclusive
// scan of cnt in that order (output rows by expert, then source), and offs [E + 1], the exclusive scan
// of cnt transposed to source-major order -- offs[r * E_l + e] holds the rows of all sources before r
// plus those of (r, e' < e), so source_slot() says where source r's messages for e start among its
// slots (the sender packs them by expert). Both scans share three barriers: run one after the other,
// with the transpose, they took seven, about 2 us of a dispatch receive at E = 288. Run by every
// thread after a barrier; scan: plan_scratch_ints(E) ints of shared memory.
__host__ __device__ __forceinline__ int plan_scratch_ints(int n) { return 2 * scan_scratch_ints(n); }

__device__ __forceinline__ void plan_rows(const int* cnt, int* rowstart, int* offs, int* scan, int R, int El) {
    const int E = R * El, chunks = (E + 31) / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (int)blockDim.x >> 5;
    int* const tot_rows = scan;               // chunk totals of rowstart, then of offs
    int* const tot_offs = scan + chunks + 1;
    for (int c = warp; c < 2 * chunks; c += nwarps) {
        const bool src_major = c >= chunks;
        const int i = (src_major ? c - chunks : c) * 32 + lane;
        int v = 0;
        if (i < E) {
            const int r = i / El;
            v = src_major ? cnt[(i - r * El) * R + r] : cnt[i];
        }
        const int incl = warp_inclusive_scan(v);
        if (i < E) (src_major ? offs : rowstart)[i] = incl - v;
        if (lane == 31) (src_major ? tot_offs : tot_rows)[src_major ? c - chunks : c] = incl;
    }
    __syncthreads();
    for (int w = warp; w < 2; w += nwarps) scan_chunk_totals(w ? tot_offs : tot_rows, chunks);
    __syncthreads();
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        rowstart[i] += tot_rows[i >> 5];
        offs[i] += tot_offs[i >> 5];
    }
    if (threadIdx.x == 0) {
        rowstart[E] = tot_rows[chunks];
        offs[E] = tot_offs[chunks];
    }
    __syncthreads();
}
__device__ __forceinline__ int source_slot(const int* offs, int El, int e, int r) {
    return offs[r * El + e] - offs[r * El];
}

// ---- bf16 halves of a 32-bit word (little-endian: channel 2i in the low half) ---------------------
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

}  // namespace ll
}  // namespace pyep
