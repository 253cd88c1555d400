// Device helpers shared by the low-latency dispatch and combine kernels: memory accesses with explicit
// PTX semantics, the consistent per-source arrival decision with a %globaltimer timeout, the
// "last block" completion protocol, block scans, and addressing of the buffer layout
// (pyep/ep/ll/layout.py is the definition; the offsets arrive in LLStatic).
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
// Polling a signal: a relaxed (morally strong) load, and once it is seen, fence_acq_rel_sys() in the
// same thread -- the PTX "acquire pattern" -- instead of an ld.acquire.sys per poll.
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
__device__ __forceinline__ float ld_f32(const float* p) {
    float v;
    asm volatile("ld.global.L1::no_allocate.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
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
__device__ __forceinline__ float ld_f32(const float* p) {
    float v;
    __builtin_memcpy(&v, p, 4);
    return v;
}
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
__device__ __forceinline__ int expert_of(const int64_t* topk, int i, int num_experts) {
    const int64_t v = __ldg(topk + i);
    return (v >= 0 && v < num_experts) ? (int)v : -1;
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
// barrier). Off unless the backend was created with PYEP_LL_TRACE=1: one uniform branch per point.
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

// Completion protocol: every block calls this once after its part; the last block of the grid to
// arrive gets true (in all its threads). The barrier orders every thread's stores (into peers' memory
// too) before thread 0's fence and arrival: a release pattern, cumulative over what the barrier
// ordered before it (PTX memory model: causality order runs through bar.sync, as NCCL's flag stores
// after a barrier rely on). The last block's thread 0 fences again after observing every arrival, and
// the barrier then orders the block's signal stores after that fence: the signals can be relaxed
// stores. One fence per block, not per thread: fences of one SM run one after another (a release store
// per signal, 288 count signals, took 7 us on H200), and a fence in every thread kept 8 us between a
// block's last store and its arrival at T=1 on two H100s over NVLink.
// Scope: a send phase (kPeerScope) publishes its blocks' stores to other GPUs, so its fences are
// system-wide. A receive phase only needs its blocks' reads of this rank's own signal words ordered
// before the last block clears them, all on this GPU: GPU scope. Nothing outside the GPU relies on
// that order -- peers write this half again only after results of a later kernel reach them, and what
// the last block then publishes (the call record, combine acknowledgements) has its own system fence,
// which causality order chains after this one (write_call_record, send_acks).
enum ArriveScope : int { kGpuScope = 0, kPeerScope = 1 };

template <ArriveScope kScope>
__device__ __forceinline__ bool arrive_last(int* counter, int* s_flag) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (kScope == kPeerScope) __threadfence_system(); else __threadfence();
        const int prev = atomicAdd(counter, 1);
        const bool last = prev == (int)gridDim.x - 1;
        if (last) {
            if (kScope == kPeerScope) __threadfence_system(); else __threadfence();
        }
        *s_flag = last ? 1 : 0;
    }
    __syncthreads();
    return *s_flag != 0;
}

// WaitStats (ll_launch.h): the block whose CAS decided source r adds what it waited for r (stats: the
// call's wait_stats, 0 = none). An inactive source was not waited for and gets nothing.
__device__ __forceinline__ void add_wait(uint64_t stats, int r, int outcome, uint64_t waited_ns) {
    if (stats != 0 && outcome != kInactive && outcome != kUndecided)
        atomicAdd(reinterpret_cast<unsigned long long*>(stats) + r, (unsigned long long)waited_ns);
}

// Decides source rank r's word `flag` in this call identically for every block: the first block to
// find it complete (judge(value) != kUndecided), or to time out, or to find r inactive records the
// outcome with a CAS; everyone else adopts it. The timeout runs on %globaltimer (nanoseconds), never
// clock64, from the first poll that missed; the decider adds that wait to `stats` (add_wait). The first
// poll goes out with the decision word and the active flag, in one round trip (none of the three waits
// for another's value; loaded one after another they were three). `seen` (optional): whether this
// thread's own acquire load found the word complete -- if not, a caller that goes on to read what the
// word publishes must acquire it itself (another block decided). (The dispatch receive, with E_l words
// per source, uses wait_counts below.)
template <typename Judge>
__device__ __forceinline__ int resolve_signal(int* state, const int* active, int r, const int* flag, Judge judge,
                                              uint64_t timeout_ns, uint64_t stats, bool* seen = nullptr) {
    int st = ld_volatile(state + r);
    const int on = ld_volatile(active + r);
    int outcome = judge((uint32_t)ld_acquire_sys(flag));
    if (seen) *seen = outcome == kArrived;
    if (st != kUndecided) return st;
    uint64_t start = 0, waited = 0;
    if (on == 0) {
        outcome = kInactive;
    } else {
        while (outcome == kUndecided) {
            if (start == 0) start = gda::now_ns();
            LL_SPIN_HINT();
            st = ld_volatile(state + r);
            if (st != kUndecided) return st;
            waited = gda::now_ns() - start;
            if (waited > timeout_ns) {
                outcome = kTimedOut;
                break;
            }
            outcome = judge((uint32_t)ld_acquire_sys(flag));
        }
        if (seen) *seen = outcome == kArrived;
        if (start != 0 && outcome != kTimedOut) waited = gda::now_ns() - start;
    }
    const int prev = atomicCAS(state + r, kUndecided, outcome);
    if (prev != kUndecided) return prev;
    add_wait(stats, r, outcome, waited);
    return outcome;
}

// A counter that must reach `expect` (modulo 2^32: a counter may wrap, ll_ack.cuh): kArrived or not yet.
__device__ __forceinline__ int resolve_flag(int* state, const int* active, int r, const int* flag, int expect,
                                            uint64_t timeout_ns, uint64_t stats, bool* seen = nullptr) {
    return resolve_signal(state, active, r, flag, [expect](uint32_t v) {
        return (int)(v - (uint32_t)expect) >= 0 ? (int)kArrived : (int)kUndecided;
    }, timeout_ns, stats, seen);
}

// The dispatch receive's version of resolve_flag: each source sends E_l count words. Every thread
// polls its own (local expert, source) word -- together with that source's active flag and decision
// word, all in one round trip -- so all E words are awaited at once (walking them one after another
// per source was a chain of E_l dependent loads, tens of microseconds at E_l = 72). Then one thread per
// source records the block's verdict with the CAS protocol, so all blocks agree. Shared memory:
// src_state [R] (on return: the decision about source r), flags [R] (scratch), cnt [E] (on return:
// rows source r sent to local expert le at p = le * R + r, the signal's own index; 0 unless r arrived).
// Memory order: every poll is an acquire load, so each word this block uses was acquired by the thread
// that read it, and the barriers after the polls carry that to the threads that copy (causality runs
// through bar.sync). Relaxed polls with one system fence per block after them cost a fence on every
// receive (and a second one when the block adopted another block's verdict for words it had not seen);
// an acquire load is an ordinary load plus an L1 invalidation. A source decided before this block
// looked is adopted from the poll's own load of the decision word, and an undecided one goes straight
// to the CAS, which returns the verdict if another block was first: no round trip only to read it.
// With `stats` (WaitStats), waited [R] (shared) collects, per source, the latest moment a word this
// block had to wait for was seen, counted from this thread's entry; the deciding block adds it
// (add_wait). A word that is not call `seq`'s tag from its source (generation from `gens`,
// LLStatic::peer_gen, or 0), or is its abort marker, decides the source as kMismatch / kAborted (every
// one of its words counts 0); the generation is loaded in the same round trip as the first poll.
// Another call's tag stops this block's wait for that source's other words (they belong to the peer's
// own call and may never come; clean() clears them). An abort marker does not: the refusing rank writes
// it into every word, on the QP of each word's expert, in one launch, and a word on another QP can land
// after the first -- were the wait cut short, the last block would clear the half before it landed, and
// the stale marker would turn the next call on this half into a mismatch.
enum CountFlag : int { kSeenAll = 0, kUnseen = 1, kLate = 2, kInactiveSrc = 4, kAbortSeen = 8, kTagBad = 16 };

__device__ __forceinline__ void wait_counts(int* state, const int* active, const int* sig, int num_ranks,
                                            int num_pairs, int max_rows, uint64_t timeout_ns, int* src_state,
                                            int* flags, int* cnt, uint64_t stats, unsigned long long* waited,
                                            uint32_t seq, const int* gens) {
    const int R = num_ranks;
    const uint64_t entry = stats ? gda::now_ns() : 0;
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        flags[r] = 0;
        src_state[r] = kUndecided;
        if (stats) waited[r] = 0;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        const int r = p % R;
        const int gen = gens ? __ldg(gens + r) : 0;     // the host changes it between calls only
        const int on = ld_volatile(active + r);
        const int st = ld_volatile(state + r);
        int v = ld_acquire_sys(sig + p);
        // A decision is final within the call: every thread that saw one saw the same.
        if (st != kUndecided) src_state[r] = st;
        if (on == 0) {
            atomicOr(flags + r, kInactiveSrc);
            v = 0;
        } else if (v == 0 && st == kUndecided) {
            uint64_t deadline = 0;
            for (int spins = 0;; ++spins) {
                LL_SPIN_HINT();
                if ((v = ld_acquire_sys(sig + p)) != 0) break;
                if ((spins & 15) != 15) continue;
                // Someone (another block, or a thread of this one) already settled r: stop waiting. A
                // decision is only taken once a block saw all of r's words (or timed out), so stopping then
                // leaves none of them in flight.
                if (ld_volatile(state + r) != kUndecided || (*(volatile int*)(flags + r) & (kLate | kTagBad)))
                    break;
                const uint64_t now = gda::now_ns();
                if (deadline == 0) {
                    deadline = now + timeout_ns;
                } else if (now > deadline) {
                    atomicOr(flags + r, kLate);
                    break;
                }
            }
            if (stats) atomicMax(waited + r, (unsigned long long)(gda::now_ns() - entry));
        }
        cnt[p] = v;
        if (v == 0) {
            atomicOr(flags + r, kUnseen);
        } else if (on != 0) {
            const int j = judge_signal((uint32_t)v, call_tag(seq, gen), 1);
            if (j != kArrived) atomicOr(flags + r, j == kAborted ? kAbortSeen : kTagBad);
        }
    }
    __syncthreads();
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        if (src_state[r] != kUndecided) continue;
        // A source is late for this block only if one of its words stayed unseen while nobody had
        // decided (a decided state is never undecided again within the call).
        const int f = flags[r];
        const int outcome = (f & kInactiveSrc) ? kInactive : (f & kAbortSeen) ? kAborted
                            : (f & kTagBad) ? kMismatch : (f & kUnseen) ? kTimedOut : kArrived;
        const int prev = atomicCAS(state + r, kUndecided, outcome);
        src_state[r] = prev == kUndecided ? outcome : prev;
        if (prev == kUndecided) add_wait(stats, r, outcome, stats ? waited[r] : 0);
    }
    __syncthreads();
    // Another block saw every word of r and decided "arrived" first: read the words it saw (they are
    // visible to us too by now, or very soon), each with acquire like the polls.
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        if (src_state[p % R] != kArrived || cnt[p] != 0) continue;
        const uint64_t deadline = gda::now_ns() + timeout_ns;
        int v;
        while ((v = ld_acquire_sys(sig + p)) == 0 && gda::now_ns() < deadline) LL_SPIN_HINT();
        cnt[p] = v;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        const int n = src_state[p % R] == kArrived ? max(0, min((int)((uint32_t)cnt[p] & kSigValue) - 1, max_rows)) : 0;
        cnt[p] = n;
    }
    __syncthreads();
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

// The call record (ll_launch.h), by one thread, unless an earlier entry is still unreported: fields
// first, a system fence, then the code word the host reads.
__device__ __forceinline__ bool write_call_record(const LLStatic& s, int code, int kind, uint32_t seq, int peer,
                                                  uint32_t word, uint32_t expect) {
    int* rec = reinterpret_cast<int*>(s.call_err);
    if (rec == nullptr || ld_volatile(rec + kCallCode) != kCallNone) return false;
    rec[kCallKind] = kind;
    rec[kCallSeq] = (int)seq;
    rec[kCallPeer] = peer;
    rec[kCallWord] = (int)word;
    rec[kCallExpect] = (int)expect;
    __threadfence_system();
    st_relaxed_sys(rec + kCallCode, code);
    return true;
}

// Last block of a receive phase, every thread, before the decisions are cleared: whether any source's
// exchange failed in this call (one parallel pass over the decisions; `scratch`: a shared int), and if
// one did, thread 0 writes the first (by rank) into the call record. word(r): source r's offending
// signal word. A rank that refused the call itself (`refused`: its host already raised) records only
// mismatches. The caller syncs before it clears the words word(r) reads.
template <typename Word>
__device__ bool record_call(const LLStatic& s, const int* state, int* scratch, int kind, uint32_t seq, bool refused,
                            Word word) {
    if (threadIdx.x == 0) *scratch = 0;
    __syncthreads();
    for (int r = threadIdx.x; r < s.num_ranks; r += blockDim.x) {
        const int st = ld_volatile(state + r);
        if (st == kAborted || st == kMismatch) atomicOr(scratch, 1);
    }
    __syncthreads();
    const bool failed = *(volatile int*)scratch != 0;
    if (failed && threadIdx.x == 0) {     // the rare path: a serial walk is fine
        for (int r = 0; r < s.num_ranks; ++r) {
            const int st = ld_volatile(state + r);
            if ((st == kAborted && !refused) || st == kMismatch) {
                write_call_record(s, st == kAborted ? kCallPeerAborted : kCallMismatch, kind, seq, r, word(r),
                                  call_tag(seq, gen_of(s, r)));
                break;
            }
        }
    }
    return failed;
}

// At the end of a receive phase (last block only): a source that timed out is marked inactive in the
// caller's active_ranks, and the decisions are cleared for the next call on this half. Marks are
// applied only here, after every block of the launch has read active_ranks, so that all blocks of a
// launch see one membership.
__device__ __forceinline__ void finish_decisions(int* state, int* active, int num_ranks) {
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
        if (ld_volatile(state + r) == kTimedOut) atomicExch(active + r, 0);
        state[r] = kUndecided;
    }
}

// Send failures on the NIC path (a post that returned an error) are collected in the workspace and
// applied by the last block of the send phase, for the same reason.
// Only NIC posts fail: with no NIC peer (peer_modes: this call's PeerMode per rank, shared memory)
// there is nothing to collect, and no reason to make threads that just stored signals wait on loads.
__device__ __forceinline__ void finish_failures(const LLStatic& s, const int* peer_modes, int* active) {
    if (!any_peer_of(peer_modes, s.num_ranks, kPeerNic)) return;
    int* fail = ws_fail(s);
    for (int r = threadIdx.x; r < s.num_ranks; r += blockDim.x) {
        if (ld_volatile(fail + r)) {
            atomicExch(active + r, 0);
            fail[r] = 0;
        }
    }
}

// ---- bf16 halves of a 32-bit word (little-endian: channel 2i in the low half) ---------------------
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// ---- NIC posting -----------------------------------------------------------------------------------
__device__ __forceinline__ void note_failure(const LLStatic& s, int r) { atomicExch(ws_fail(s) + r, 1); }

}  // namespace ll
}  // namespace pyep
