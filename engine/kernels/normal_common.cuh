// Device helpers of the normal-mode kernels: buffer addressing (pyep/ep/normal/layout.py is the
// definition), the error record, bounded waits on counters written by peers, group barriers, and
// row copies. The PTX memory accesses are the LL kernels' (ll_common.cuh), shared rather than copied.
#pragma once

#include <stdint.h>
#if !defined(PYEP_LL_CPU_SIM)
#include <cuda_bf16.h>
#endif

#include "kernels/ll_common.cuh"
#include "kernels/normal_launch.h"
#include "mlx5gda/portable.h"

namespace pyep {
namespace normal {

using ll::fence_acq_rel_sys;
using ll::ld_acquire_sys;
using ll::ld_relaxed_sys;
using ll::ld_v4;
using ll::ld_volatile;
using ll::st_relaxed_sys;
using ll::st_v4;

// ---- addressing --------------------------------------------------------------------------------------
__device__ __forceinline__ uint8_t* peer_buf(const NormalStatic& s, int r) {
    return reinterpret_cast<uint8_t*>(reinterpret_cast<const uint64_t*>(s.peer_base)[r]);
}
__device__ __forceinline__ int* words(uint8_t* base, uint32_t off) { return reinterpret_cast<int*>(base) + off; }
// Counters of stream (channel c, peer p), in the buffer `base` (own or a peer's).
__device__ __forceinline__ int* tail_of(const NormalStatic& s, uint8_t* base, int c, int p) {
    return words(base, s.off_tail) + c * s.num_ranks + p;
}
__device__ __forceinline__ int* head_of(const NormalStatic& s, uint8_t* base, int c, int p) {
    return words(base, s.off_head) + c * s.num_ranks + p;
}
__device__ __forceinline__ int* tx_of(const NormalStatic& s, int c, int p) {
    return words(reinterpret_cast<uint8_t*>(s.buf), s.off_tx) + c * s.num_ranks + p;
}
__device__ __forceinline__ int* rx_of(const NormalStatic& s, int c, int p) {
    return words(reinterpret_cast<uint8_t*>(s.buf), s.off_rx) + c * s.num_ranks + p;
}
// Ring (channel c, source src) inside the buffer `base`: ring_tokens slots of s.slot_bytes. The stride
// is the buffer's, never the row's: a sender of the next call may already write its stream while a
// slower receiver still reads another stream of the previous call, and with a per-row-kind stride
// (FP8 dispatch rows, then combine rows) those two streams' bytes would overlap.
__device__ __forceinline__ uint8_t* ring_of(const NormalStatic& s, uint8_t* base, int c, int src, int ring_tokens) {
    return base + s.ring_off + ((uint64_t)(c * s.num_ranks + src) * ring_tokens) * s.slot_bytes;
}
__device__ __forceinline__ uint64_t slot_offset(const NormalStatic& s, int pos, int ring_tokens) {
    return (uint64_t)(pos % ring_tokens) * s.slot_bytes;
}

// [off, off + len) inside the output pool (one-copy dispatch outputs, pull combine inputs), `align`-byte
// aligned: the check of a peer's descriptor (the pool sits at the same offsets in every rank's buffer).
__device__ __forceinline__ bool in_pool(const NormalStatic& s, uint64_t off, uint64_t len, uint64_t align) {
    return off % align == 0 && off >= s.pool_lo && off <= s.pool_hi && len <= s.pool_hi - off;
}

// Channel c's token range of a rank with n tokens and C channels (contract.py: P = ceil(n / C)).
__device__ __forceinline__ void channel_range(int n, int C, int c, int& t0, int& t1) {
    const int per = (n + C - 1) / C;
    t0 = min(per * c, n);
    t1 = min(t0 + per, n);
}

// Rows of stream (channel c, peer p): inclusive prefix matrices -> one count.
__device__ __forceinline__ int prefix_count(const int* incl, int C, int p, int c) {
    return incl[p * C + c] - (c ? incl[p * C + c - 1] : 0);
}

// The received rows of (source src, channel c) here: [start, start + count). rank_prefix_matrix gives
// where source src's rows begin; recv_channel_prefix_matrix counts from there (as DeepEP's does).
__device__ __forceinline__ void recv_run(uint64_t rank_prefix, uint64_t recv_channel_prefix, int R, int C,
                                         int me, int src, int c, int& start, int& count) {
    const int* rpm = reinterpret_cast<const int*>(rank_prefix);
    const int* rcp = reinterpret_cast<const int*>(recv_channel_prefix);
    const int src0 = src ? rpm[(src - 1) * R + me] : 0;
    const int end = c + 1 < C ? src0 + rcp[src * C + c + 1] : rpm[src * R + me];
    start = src0 + rcp[src * C + c];
    count = end - start;
}

// ---- errors ------------------------------------------------------------------------------------------
// The first error wins: the claim is an atomic on device memory (workspace word 4; atomics on mapped
// host memory are not atomic across the bus on every platform), the record itself lives in pinned host
// memory: details first, then -- after a system fence -- the code, which the host reads first.
// The host re-arms the claim with a stream-ordered memset when it has raised the error.
// The record's words by address, for every kernel family that shares it (intranode, internode, relay).
__device__ __forceinline__ void record_error_words(uint64_t err, uint64_t workspace, int code, int a, int b, int c) {
    if (atomicCAS(reinterpret_cast<int*>(workspace) + 4, 0, 1) != 0) return;
    volatile int* e = reinterpret_cast<volatile int*>(err);
    e[1] = a;
    e[2] = b;
    e[3] = c;
    __threadfence_system();
    e[0] = code;
}
__device__ __forceinline__ void record_error(const NormalStatic& s, int code, int a, int b, int c) {
    record_error_words(s.err, s.workspace, code, a, b, c);
}

// ---- the active-ranks mask (docs/elastic.md, "Normal mode") -------------------------------------------
// Bits of the buffer's mask now (all R set without one). A rank whose own entry is 0 is out of every
// call: it sends to, receives from and waits for nobody, so its bits are then 0.
__device__ __forceinline__ uint32_t mask_bits(const NormalStatic& s) {
    const uint32_t all = (1u << s.num_ranks) - 1u;
    if (!s.active) return all;
    const volatile int* m = reinterpret_cast<const volatile int*>(s.active);
    uint32_t bits = 0;
    for (int r = 0; r < s.num_ranks; ++r) bits |= (m[r] != 0 ? 1u : 0u) << r;
    return (bits >> s.rank) & 1u ? bits : 0u;
}
__device__ __forceinline__ bool in_mask(uint32_t bits, int r) { return (bits >> r) & 1u; }
// The latest call's active ranks (its gate set them; a kernel that marks a peer clears its bit).
__device__ __forceinline__ uint32_t call_mask(const NormalStatic& s) {
    return (uint32_t)ld_volatile(reinterpret_cast<const int*>(s.workspace) + kWsMask);
}
// A peer that stayed silent past the timeout, with a mask: out of the buffer's mask (every later call
// leaves it out, and the next call's tags tell the other ranks) and of this call's (the call's other
// blocks stop waiting for it). The call goes on among the others; nothing is recorded as an error.
__device__ __forceinline__ void mark_peer_failed(const NormalStatic& s, int r) {
    reinterpret_cast<volatile int*>(s.active)[r] = 0;
    atomicAnd(reinterpret_cast<int*>(s.workspace) + kWsMask, ~(1 << r));
}
__device__ __forceinline__ void add_dropped(uint64_t dropped, int r, int n) {
    if (dropped && n > 0) atomicAdd(reinterpret_cast<int*>(dropped) + r, n);
}

// ---- call tags (normal_tags.h) -----------------------------------------------------------------------
// A void call's record for the host (a seqlock, last void wins; one gate at a time per buffer, so one
// writer): the details, then the count. `peer_tag` may be null (the peer's tag was not read: its flags
// or its relay record decided); then the fields a tag would hold are given as (peer_call, status,
// origin) and the reason stays empty.
__device__ __forceinline__ void record_void(uint64_t record, int kind, int peer, uint32_t seq, uint32_t epoch,
                                            int my_kind, uint32_t peer_call, const int* peer_tag, int peer_status,
                                            int peer_origin, int peer_kind = 0) {
    volatile int* r = reinterpret_cast<volatile int*>(record);
    r[kRecKind] = kind;
    r[kRecPeer] = peer;
    r[kRecCall] = (int)seq;
    r[kRecEpoch] = (int)epoch;
    r[kRecMyKind] = my_kind;
    r[kRecPeerCall] = (int)peer_call;
    for (int i = 0; i < kTagInts; ++i) r[kRecTag + i] = peer_tag ? ld_volatile(peer_tag + i) : 0;
    if (!peer_tag) {   // a tag of the fields known (tags.py decode accepts it)
        r[kRecTag + 0] = kTagMagic;
        r[kRecTag + 1] = (int)epoch;
        r[kRecTag + 2] = (int)peer_call;
        r[kRecTag + 3] = peer_kind > 0 ? peer_kind : my_kind;   // the peer's, where its record said
        r[kRecTag + 4] = peer_status;
        r[kRecTag + 5] = peer_origin;
    }
    if (kind == kRecMismatch) r[kRecMismatches] = r[kRecMismatches] + 1;
    __threadfence_system();
    r[kRecVoids] = r[kRecVoids] + 1;
}

// ---- liveness: a waiting rank is alive -------------------------------------------------------------
// A peer may be slow to answer because it is itself waiting: a combine receiver reduces tokens in order,
// so one dead source stalls every ring it reads, and the senders of those rings then wait on a live
// rank for up to a timeout. Taking that rank for dead would split the live ranks. So a thread that has
// waited longer than a beat stores the time, in beats (2^16 ns), into its rank's heartbeat word
// (layout.py "alive") whenever the value moves, and a wait on peer r restarts its timeout whenever
// r's heartbeat moved: r is declared silent after timeout_ns with neither an answer nor a beat. A rank
// whose kernels ended (dead, or never launched the call) stops beating. kAliveCap timeouts bound any
// wait regardless, so live ranks waiting on each other in a cycle still end it (events.py bounds the
// host's wait of a call by more than that).
constexpr int kBeatShift = 16;
constexpr uint64_t kAliveCap = 2;

__device__ __forceinline__ int* alive_of(const NormalStatic& s, uint8_t* base) { return words(base, s.off_alive); }

// The clock of one wait on peer r. Nothing is read or written in the first beat of a wait, so short
// waits (the common case) cost nothing beyond the clock reads they already made.
struct PeerClock {
    uint64_t first = 0, since = 0;
    uint32_t beat = 0;   // the last value this wait stored into its rank's heartbeat
    int seen = 0;        // r's heartbeat as this wait last read it
    bool read = false;
    // True once the wait on r has run out.
    __device__ __forceinline__ bool expired(const NormalStatic& s, int r) {
        const uint64_t now = gda::now_ns();
        if (!first) {
            first = since = now;
            return false;
        }
        if ((now - first) >> kBeatShift) {
            const uint32_t b = (uint32_t)(now >> kBeatShift);
            if (b != beat) {   // at most once a beat: the heartbeat, and a look at r's
                beat = b;
                st_relaxed_sys(alive_of(s, reinterpret_cast<uint8_t*>(s.buf)), (int)b);
                const int v = ld_relaxed_sys(alive_of(s, peer_buf(s, r)));
                if (read && v != seen) since = now;
                seen = v;
                read = true;
            }
        }
        return now - since > s.timeout_ns || now - first > kAliveCap * s.timeout_ns;
    }
};

// A gate's wait for peer r's flags (its call numbers by parity, written by the peer into this rank's
// buffer): kGateArrived, kGateOther (the peer is at another call: *peer_call says which), or -1 once
// the wait ran out (PeerClock). `other` is read before `mine` (normal_tags.h gate_classify says why).
// `gone()` true ends the wait early (-1 too): the peer left the call while it was awaited.
template <typename Gone>
__device__ __forceinline__ int gate_wait(const NormalStatic& s, int r, const int* mine, const int* other, uint32_t seq,
                                         uint32_t* peer_call, Gone gone) {
    PeerClock clock;
    for (;;) {
        const uint32_t o = (uint32_t)ld_acquire_sys(other);
        const uint32_t m = (uint32_t)ld_acquire_sys(mine);
        const int st = gate_classify(m, o, seq);
        if (st != kGateWait) {
            *peer_call = st == kGateArrived ? seq : gate_peer_call(m, o);
            return st;
        }
        if (gone()) return -1;
        if (clock.expired(s, r)) return -1;
        LL_SPIN_HINT();
    }
}

// Channel c's tokens [t0, t1) towards peer d, one warp: send_head[t][d] = the token's position in the
// stream (c, -> d) or -1, one ballot per 32 tokens. Returns the stream's row count.
__device__ __forceinline__ int route_to_peer(const bool* in_rank, int* send_head, int R, int d, int t0, int t1,
                                             int lane) {
    int pos = 0;
    for (int base = t0; base < t1; base += 32) {
        const int t = base + lane;
        const bool in = t < t1 && in_rank[(int64_t)t * R + d];
        const uint32_t mask = __ballot_sync(0xffffffffu, in);
        if (t < t1) send_head[(int64_t)t * R + d] = in ? pos + __popc(mask & ((1u << lane) - 1)) : -1;
        pos += __popc(mask);
    }
    return pos;
}

// One warp checks the top-k ids of tokens [t0, t1) for values outside [-1, E) and records each with
// `bad(row, k, value)` (the record keeps the first).
template <typename Bad>
__device__ __forceinline__ void check_topk_ids(const int64_t* topk, int K, int E, int t0, int t1, int lane, Bad bad) {
    for (int i = t0 * K + lane; i < t1 * K; i += 32) {
        const int64_t v = topk[i];
        if (v < -1 || v >= E) bad(i / K, i % K, (int)v);
    }
}

// f(v) for each of token t's top-k ids in [0, E): ids outside count as -1 (check_topk_ids reports them).
template <typename F>
__device__ __forceinline__ void for_valid_ids(const int64_t* topk, int64_t t, int K, int E, F f) {
    for (int k = 0; k < K; ++k) {
        const int64_t v = topk[t * K + k];
        if (v >= 0 && v < E) f(v);
    }
}

// acc[0..7] += the 8 bf16 values of v, in fp32.
__device__ __forceinline__ void add_bf16x8(float* acc, int4 v) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        acc[2 * i] += f.x;
        acc[2 * i + 1] += f.y;
    }
}

// Wait until (int)(*ctr - target) >= 0, i.e. the absolute counter reached `target` (modulo 2**32).
// Returns false after timeout_ns (the caller records which peer it was).
__device__ __forceinline__ bool wait_counter(const int* ctr, uint32_t target, uint64_t timeout_ns) {
    if ((int)((uint32_t)ld_acquire_sys(ctr) - target) >= 0) return true;
    const uint64_t start = gda::now_ns();
    while ((int)((uint32_t)ld_acquire_sys(ctr) - target) < 0) {
        if (gda::now_ns() - start > timeout_ns) return false;
        LL_SPIN_HINT();
    }
    return true;
}

// wait_counter for a wait on peer `r`, timed by a PeerClock (r's heartbeat extends it). With a mask it
// also ends (false) as soon as another block of the call marked r, and when it runs out it marks r
// (mark_peer_failed); `marked` says which happened. Without a mask the caller records the timeout.
__device__ __forceinline__ bool wait_peer_counter(const NormalStatic& s, const int* ctr, uint32_t target, int r,
                                                  bool* marked) {
    *marked = false;
    if ((int)((uint32_t)ld_acquire_sys(ctr) - target) >= 0) return true;
    PeerClock clock;
    while ((int)((uint32_t)ld_acquire_sys(ctr) - target) < 0) {
        if (s.active && !in_mask(call_mask(s), r)) {
            *marked = true;
            return false;
        }
        if (clock.expired(s, r)) {
            if (!s.active) return false;
            mark_peer_failed(s, r);
            *marked = true;
            return false;
        }
        LL_SPIN_HINT();
    }
    return true;
}

#if !defined(PYEP_LL_CPU_SIM)
__device__ __forceinline__ void st_release_sys(int* p, int v) {
    asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Named barrier of one warp group (id 1 + group; 0 is __syncthreads).
__device__ __forceinline__ void group_sync(int group, int warps) {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "r"(warps * 32) : "memory");
}

// The same barrier, returning whether any thread of the group passed `pred` (PTX barrier.red.or): how a
// group agrees to stop after one of its warps timed out, with no shared flag that a faster warp could
// overwrite before a slower one read it.
__device__ __forceinline__ bool group_sync_or(int group, int warps, bool pred) {
    int r;
    asm volatile(
        "{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n barrier.red.or.pred q, %2, %3, p;\n"
        " selp.s32 %0, 1, 0, q;\n}"
        : "=r"(r) : "r"((int)pred), "r"(1 + group), "r"(warps * 32) : "memory");
    return r != 0;
}

#else
// CPU simulation (tests/ll_sim): host twins of the release store and of the named barriers.
__device__ __forceinline__ void st_release_sys(int* p, int v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
__device__ __forceinline__ void group_sync(int group, int warps) { sim_named_barrier(1 + group, warps * 32, false); }
__device__ __forceinline__ bool group_sync_or(int group, int warps, bool pred) {
    return sim_named_barrier(1 + group, warps * 32, pred);
}
#endif  // !PYEP_LL_CPU_SIM

#if defined(PYEP_LL_CPU_SIM)
constexpr size_t kSimBlockScratch = 1024;   // the simulated block's block_shared() bytes (tests/ll_sim)
#endif

// Block-shared state of a kernel (one struct per kernel role): a __shared__ variable on the GPU; the
// CPU simulation has no __shared__ storage class and hands out the simulated block's scratch instead.
template <typename T>
__device__ __forceinline__ T& block_shared() {
#if !defined(PYEP_LL_CPU_SIM)
    __shared__ T v;
    return v;
#else
    static_assert(sizeof(T) <= kSimBlockScratch, "the simulated block scratch is 1 KiB");
    return *reinterpret_cast<T*>(sim_smem());
#endif
}

// ---- copies ------------------------------------------------------------------------------------------
// Every load of ring memory is ld.global.cg (L2 only, __ldcg): a slot is rewritten by a peer while this
// SM may still hold its line in L1 -- a plain load of one slot's top-k ids used to cache the first
// bytes of the next slot, and a later read of that slot returned the stale line. The L2 is the point
// of coherence for NVLink stores, so .cg loads after the acquire see the new data.
//
// One warp copies `bytes` (a multiple of 16, both 16-byte aligned): kUnroll vectors per lane in flight.
// The last round is predicated rather than a loop of single vectors: each trip of such a loop is a
// full memory round trip (the store waits for its load), and a row's tail would cost several of them
// (a 7168-byte FP8 row was 2 rounds plus 2 single trips at kUnroll 6; now it is 2 rounds).
template <int kUnroll = 8>
__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* src, int bytes, int lane) {
    const int n = bytes / 16;
    const int4* s4 = reinterpret_cast<const int4*>(src);
    int4* d4 = reinterpret_cast<int4*>(dst);
    for (int i0 = lane; i0 < n; i0 += kUnroll * 32) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i0 + u * 32 < n) v[u] = __ldcg(s4 + i0 + u * 32);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i0 + u * 32 < n) st_v4(d4 + i0 + u * 32, v[u]);
    }
}

__host__ __device__ __forceinline__ uint64_t align16(uint64_t v) { return (v + 15) / 16 * 16; }
// Slots are whole 128-byte lines (layout.py RING_ALIGN): NVLink stores of full lines, and no line holds
// the end of one slot and the start of the next.
__host__ __device__ __forceinline__ uint64_t align128(uint64_t v) { return (v + 127) / 128 * 128; }

// Dispatch row: [payload H*elem][scales align16(4*H/128), FP8 only][top-k ids int32 x K][weights fp32 x K][src idx]
struct DispatchRow {
    uint32_t payload;   // bytes of the payload (also the offset of the scales)
    uint32_t scales;    // offset of the FP8 scales
    uint32_t ids, weights, src, bytes;
    __host__ __device__ DispatchRow(int hidden, int fp8, int k) {
        payload = fp8 ? hidden : 2 * hidden;
        scales = payload;
        ids = payload + (fp8 ? (uint32_t)align16(4 * (hidden / 128)) : 0);
        weights = ids + 4 * k;
        src = weights + 4 * k;
        bytes = (uint32_t)align128(src + 4);
    }
};
// Combine row: [payload bf16 H][weights fp32 x K]
struct CombineRow {
    uint32_t payload, weights, bytes;
    __host__ __device__ CombineRow(int hidden, int k) {
        payload = 2 * hidden;
        weights = payload;
        bytes = (uint32_t)align128(payload + 4 * k);
    }
};

}  // namespace normal
}  // namespace pyep
