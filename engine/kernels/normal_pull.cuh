// Pull combine (docs/normal_mode.md, "Pull combine"): when every rank's combine input x lies in its
// buffer's output pool (the dispatch's recv_x handed back as it came, or a tensor the caller took from
// the pool with NormalBuffer.get_combine_input), each token's owner reads every rank's row of that token
// where it lies and sums it into its output. A peer's row then crosses memory once, read by the owner,
// instead of three times (read and stored into the owner's ring by the peer, read again by the owner's
// reduce); no ring is used, no head or tail moves, so the next call may push or pull.
//
// The handshake rides on the call gate (normal_gate.cuh): a combine's gate writes this rank's offer into
// every peer's notify slot of the call's parity, in the words a dispatch's counts use, before the flag
// that publishes its tag. After the gate every rank holds all R offers of the call, so the combine kernel
// reads them without waiting: every block of every rank reads the same R words, and the call pulls only
// if all R offered (else every rank pushes). An offer is input from a peer: its x must lie inside the pool
// (same offsets in every rank's buffer, native.py _settle_pool) with at least the rows the handle says
// that rank received, or the call records kErrDirectDesc and reads nothing.
//
// The end: a rank's x must stay as it is until every peer has read its rows, and the caller may overwrite
// or free it once the combine is done on its stream. So block b of each rank, its reads done, writes the
// call number into every peer's pulled[b][me], then waits (bounded, PeerClock) until every peer's block b
// has written its own: when a rank's kernel ends, no peer reads its x any more. Call numbers restart only
// after clean(), which zeroes pulled[] with the rest of the control area.
#pragma once

#include "kernels/normal_common.cuh"

namespace pyep {
namespace normal {

// Words of a combine gate's notify slot (layout.py NOTIFY_INTS: before the tag, where a dispatch's counts go).
constexpr int kPullOffer = 0, kPullRows = 1, kPullX = 2;   // kPullX, kPullX + 1: the byte offset, low word first
static_assert(kPullX + 2 <= kNotifyTag, "the offer fits before the tag");

__device__ __forceinline__ int* pull_offer_of(const NormalStatic& s, uint8_t* base, int parity, int src) {
    return words(base, s.off_notify) + (parity * s.num_ranks + src) * (int)s.notify_ints;
}
__device__ __forceinline__ int* pulled_of(const NormalStatic& s, uint8_t* base, int block, int src) {
    return words(base, s.off_pulled) + block * s.num_ranks + src;
}

// All threads of a combine's gate, before the block barrier that precedes the flags: this rank's offer
// into its own slot and every peer's in the call (the flag's release publishes it with the tag).
__device__ __forceinline__ void publish_pull_offer(const NormalStatic& s, const NotifyArgs& a, int parity, uint32_t mine) {
    if (!a.gate_only || a.kind != kKindCombine) return;
    for (int i = threadIdx.x; i < 4 * s.num_ranks; i += blockDim.x) {
        const int d = i / 4, j = i % 4;
        if (d != s.rank && !in_mask(mine, d)) continue;
        const int v = j == kPullOffer ? a.pull_offer
                      : j == kPullRows ? a.pull_rows
                      : j == kPullX ? (int)(uint32_t)a.pull_x : (int)(uint32_t)(a.pull_x >> 32);
        pull_offer_of(s, peer_buf(s, d), parity, s.rank)[j] = v;
    }
}

// What block (c, h) of a pull combine needs of every rank r: its x as mapped here, the row of its x
// that holds the first row of this channel this rank sent it (row0: its receive order, as the dispatch
// laid it out, normal_direct.cuh direct_send), its rows.
struct PullPlan {
    uint64_t x[kMaxRanks];
    int64_t row0[kMaxRanks];
    int rows[kMaxRanks];
    int path;   // 1 pull, 0 push, -1 a bad offer (recorded: nothing is read, the pulled[] exchange still runs)
};

// Thread 0 of every combine block, after the call's gate: the path of call `seq`, and the plan.
__device__ inline int read_pull_plan(const NormalStatic& s, const CombineArgs& a, uint32_t seq, int c, PullPlan& p) {
    // a.pull: this rank offered in the call's gate (a mask, weights, a row map or a missing pool make it
    // offer nothing: native.py pull_offer). Without an offer of its own it knows every rank pushes; with
    // one it reads everybody's.
    if (!a.pull || !s.off_pulled) return 0;
    const int R = s.num_ranks, me = s.rank, C = a.num_channels, parity = (int)(seq & 1u);
    uint8_t* own = reinterpret_cast<uint8_t*>(s.buf);
    for (int r = 0; r < R; ++r) {
        const int* w = pull_offer_of(s, own, parity, r);
        // The slot's tag says which call wrote it: a combine's gate of this call, or the offer is stale.
        if (ld_volatile(w + kNotifyTag + 2) != (int)seq || ld_volatile(w + kNotifyTag + 3) != kKindCombine ||
            ld_volatile(w + kPullOffer) != 1)
            return 0;
    }
    const int* rpm = reinterpret_cast<const int*>(a.rank_prefix_matrix);
    const int* cpm = reinterpret_cast<const int*>(a.channel_prefix_matrix);
    const uint64_t row_bytes = 2ull * (uint64_t)a.hidden;
    for (int r = 0; r < R; ++r) {
        const int* w = pull_offer_of(s, own, parity, r);
        const int rows = ld_volatile(w + kPullRows);
        const uint64_t off = (uint64_t)(uint32_t)ld_volatile(w + kPullX) | (uint64_t)(uint32_t)ld_volatile(w + kPullX + 1) << 32;
        // At least the rows rank r received in the handle's dispatch (num_worst_tokens pads them).
        const int expect = rpm[(R - 1) * R + r];
        int bad = 0;
        if (rows < 0 || rows < expect) bad = 5;
        else if (!s.pool_hi || !in_pool(s, off, (uint64_t)rows * row_bytes, 16)) bad = 6;
        if (bad) {
            record_error(s, kErrDirectDesc, r, bad, rows);
            return -1;
        }
        p.x[r] = reinterpret_cast<uint64_t>(peer_buf(s, r)) + off;
        p.row0[r] = (int64_t)(me ? rpm[(me - 1) * R + r] : 0) + (c ? cpm[r * C + c - 1] : 0);
        p.rows[r] = rows;
    }
    return 1;
}

// All threads of block `b` of a pull (or failed pull) call, after the block's reads: tell every peer
// this block is done with its x, then wait until every peer's block b is done with this rank's.
__device__ __forceinline__ void pull_done_exchange(const NormalStatic& s, int b, int c, uint32_t seq) {
    __syncthreads();                           // every warp's loads of peers' rows have returned
    const int d = threadIdx.x;
    if (d >= s.num_ranks || d == s.rank) return;
    fence_acq_rel_sys();                       // the block's reads, seen through the barrier, before the word
    st_release_sys(pulled_of(s, peer_buf(s, d), b, s.rank), (int)seq);
    const int* theirs = pulled_of(s, reinterpret_cast<uint8_t*>(s.buf), b, d);
    PeerClock clock;
    while (ld_acquire_sys(theirs) != (int)seq) {
        if (clock.expired(s, d)) {
            record_error(s, kErrPeerTimeout, d, kPhaseCombine, c);
            return;
        }
        LL_SPIN_HINT();
    }
}

}  // namespace normal
}  // namespace pyep
