// One-copy dispatch (docs/normal_mode.md, "One-copy dispatch"): when every rank's outputs of a call lie
// in its buffer's output pool, a sender stores each row straight into its final row of the receiver's
// recv_x (and recv_x_scales) over NVLink, instead of into a ring that the receiver then copies out.
// A row then crosses memory once instead of twice.
//
// The handshake: every rank's dispatch kernel publishes, per channel, a descriptor in its own buffer
// (layout.py "direct"): the call number last, after the pool offsets of its outputs, its row count and
// whether it offers them (mode 1) -- the host offers only when the previous output it handed out from
// that memory was released and no mask is set (pyep/ep/normal/direct_pool.py). Every block of every rank reads
// all R descriptors of its channel: the call goes one-copy only if all R offered, else every rank
// takes the ring path (all read the same R words, so all decide alike). A descriptor is input from a
// peer: its offsets must lie inside the pool (this rank's bounds: the pool sits at the same offsets in
// every rank's buffer), or the call records kErrDirectDesc and moves nothing.
//
// Rows of stream (channel c, me -> d) go to d's output rows rank_prefix[me - 1][d] +
// channel_prefix[d][c - 1] + position, which is where d's recv_run puts them. Their small fields (local
// top-k ids, weights, the source index) go to d's staging rows, which d copies into its own
// recv_topk_idx / recv_topk_weights / recv_src_idx once the stream's tail says they are in: those
// outputs are ordinary allocations (the handle keeps recv_src_idx for as long as it lives, which must
// not pin pool memory). The counters move as on the ring path (tail by the sender at the end, head and
// rx / tx to base + count), so the next call may take either path.
#pragma once

#include "kernels/normal_rows.cuh"
#include "kernels/normal_tma.cuh"

namespace pyep {
namespace normal {

// Descriptor words (int32) of channel c, kDescInts per channel. Words from kDescPath on are this rank's
// own: the path block h of the one-copy kernel took (kDescPath + 2h: the call number, then the path),
// which the ring kernel launched after it reads.
constexpr int kDescSeq = 0, kDescMode = 1, kDescRows = 2, kDescX = 4, kDescScales = 6, kDescStage = 8;
constexpr int kDescPath = 10;
static_assert(kDescPath + 4 <= kDescInts, "two blocks' paths fit the descriptor");

__device__ __forceinline__ int* desc_of(const NormalStatic& s, uint8_t* base, int c) {
    return words(base, s.off_direct) + c * kDescInts;
}

// Where a receiver's outputs are, as byte offsets into its buffer (validated).
struct DirectPeer {
    uint64_t x, scales, stage;
    int rows;
};

__device__ __forceinline__ uint64_t desc_u64(const int* d, int i) {
    return (uint64_t)(uint32_t)ld_volatile(d + i) | (uint64_t)(uint32_t)ld_volatile(d + i + 1) << 32;
}

// Thread 0 of a receiving block: this rank's descriptor of channel c for call `seq`.
__device__ __forceinline__ void publish_desc(const NormalStatic& s, const DispatchArgs& a, int c, uint32_t seq) {
    int* d = desc_of(s, reinterpret_cast<uint8_t*>(s.buf), c);
    auto put = [&](int i, uint64_t v) {
        d[i] = (int)(uint32_t)v;
        d[i + 1] = (int)(uint32_t)(v >> 32);
    };
    // No rows: nothing is written there, and an empty tensor's address may be anything (0 included).
    const bool any = a.direct_offer && a.num_out_rows > 0;
    const uint64_t buf = s.buf, none = s.pool_lo;
    d[kDescMode] = a.direct_offer;
    d[kDescRows] = a.num_out_rows;
    put(kDescX, any ? a.recv_x - buf : none);
    put(kDescScales, any && a.fp8 ? a.recv_x_scales - buf : none);
    put(kDescStage, !a.direct_offer || !a.direct_stage ? 0 : any ? a.direct_stage - buf : none);
    st_release_sys(d + kDescSeq, (int)seq);    // the call number last: the fields are read after it
}

// Thread 0 of every block: 1 when all R ranks offered one-copy outputs for call `seq` (their
// descriptors in `out`), 0 when one did not (the ring path), -1 when a peer stayed silent or sent a
// descriptor outside the pool (recorded: the call moves nothing, the peers time out on this rank).
__device__ int read_descs(const NormalStatic& s, const DispatchArgs& a, int c, uint32_t seq, DirectPeer* out) {
    const DispatchRow row(a.hidden, a.fp8, a.num_topk);
    const uint64_t groups = (uint64_t)(a.hidden / 128);
    const bool staged = a.recv_src_idx != 0;   // a dispatch with a handle returns no small fields
    for (int r = 0; r < s.num_ranks; ++r) {
        const int* d = desc_of(s, peer_buf(s, r), c);
        PeerClock clock;
        while (ld_acquire_sys(d + kDescSeq) != (int)seq) {
            if (clock.expired(s, r)) {
                record_error(s, kErrPeerTimeout, r, kPhaseDispatch, c);
                return -1;
            }
            LL_SPIN_HINT();
        }
        if (ld_volatile(d + kDescMode) != 1) return 0;
        DirectPeer p{desc_u64(d, kDescX), desc_u64(d, kDescScales), desc_u64(d, kDescStage),
                     ld_volatile(d + kDescRows)};
        const uint64_t n = p.rows < 0 ? 0 : (uint64_t)p.rows;
        int bad = 0;
        if (p.rows < 0) bad = 1;
        else if (!in_pool(s, p.x, n * row.payload, 16)) bad = 2;
        else if (a.fp8 && !in_pool(s, p.scales, n * groups * 4, 4)) bad = 3;
        else if (p.stage ? !in_pool(s, p.stage, n * stage_row_bytes(a.num_topk), 4) : staged) bad = 4;
        if (bad) {
            record_error(s, kErrDirectDesc, r, bad, p.rows);
            return -1;
        }
        out[r] = p;
    }
    return 1;
}

// The path of block (c, h) in call `seq`: 1 one-copy (its rows moved), 0 the ring path (the ring kernel
// moves them), -1 a failed handshake (recorded; nothing moves). The one-copy kernel's thread 0 records
// it and the ring kernel's reads it after that kernel, in stream order: plain words suffice.
__device__ __forceinline__ void record_path(const NormalStatic& s, int c, int h, uint32_t seq, int path) {
    int* d = desc_of(s, reinterpret_cast<uint8_t*>(s.buf), c) + kDescPath + 2 * h;
    d[0] = (int)seq;
    d[1] = path;
}
// Its value for this call; one left by an earlier call means the word was overwritten (recorded as
// kErrLostPath; -1: nothing moves).
__device__ __forceinline__ int recorded_path(const NormalStatic& s, int c, int h, uint32_t seq) {
    const int* d = desc_of(s, reinterpret_cast<uint8_t*>(s.buf), c) + kDescPath + 2 * h;
    if (d[0] == (int)seq) return d[1];
    record_error(s, kErrLostPath, s.rank, (int)seq, 0);
    return -1;
}

// Stream (channel c, me -> d), one-copy: rows straight into d's outputs, small fields into its staging
// rows, the tail published once after the group barrier (every row of the stream is then stored).
__device__ void direct_send(const NormalStatic& s, const DispatchArgs& a, const DispatchRow& row, int c,
                            const Group& G, int d, const DirectPeer& P, WarpTma& tma) {
    const int R = s.num_ranks, me = s.rank, C = a.num_channels, K = a.num_topk;
    int t0, t1;
    channel_range(a.num_tokens, C, c, t0, t1);
    const int* cpm = reinterpret_cast<const int*>(a.channel_prefix_matrix);
    const int* rpm = reinterpret_cast<const int*>(a.rank_prefix_matrix);
    const int count = prefix_count(cpm, C, d, c);
    const int out0 = (me ? rpm[(me - 1) * R + d] : 0) + (c ? cpm[d * C + c - 1] : 0);
    if (out0 < 0 && G.leader()) record_error(s, kErrBadHandle, c, count, out0);
    uint8_t* pb = peer_buf(s, d);
    uint8_t* xd = pb + P.x;
    float* sd = reinterpret_cast<float*>(pb + P.scales);
    uint8_t* td = P.stage ? pb + P.stage : nullptr;
    const uint32_t stage_bytes = stage_row_bytes(K);
    const bool* in_rank = reinterpret_cast<const bool*>(a.is_token_in_rank);
    const float* scales = reinterpret_cast<const float*>(a.x_scales);
    const int64_t* topk = reinterpret_cast<const int64_t*>(a.topk_idx);
    const float* weights = reinterpret_cast<const float*>(a.topk_weights);
    const int groups = a.hidden / 128, lo = d * a.num_local_experts, El = a.num_local_experts;
    const bool bulk = peer_bulk(a.use_tma, row.payload);
    const int pos = for_each_routed_row(in_rank, R, d, t0, t1, G, [&](int tok, int i) {
        const int out = out0 + i;
        // Past num_worst_tokens (notify recorded it), or before the receiver's rows: a handle's matrices
        // are the caller's tensors, and a write outside [0, rows) would land in another output (a
        // negative start is recorded above).
        if (out < 0 || out >= P.rows) return;
        const float* row_scales = a.fp8 ? scales + tok * scale_token_stride(a) : nullptr;
        const RowMeta m = load_meta<ScaleSrc::kCaller>(row_scales, scale_group_stride(a), groups,
                                    G.lane < K && topk ? topk[(int64_t)tok * K + G.lane] : -1,
                                    G.lane < K && weights ? weights[(int64_t)tok * K + G.lane] : 0.f,
                                    G.lane == 0 ? source_index(a, tok) : 0, G.lane);
        copy_row(tma, bulk, xd + (uint64_t)out * row.payload, payload_of(a, row, tok), row.payload, G.lane);
        if (a.fp8)
            store_scales<ScaleSrc::kCaller>(sd + (int64_t)out * groups, m, row_scales, scale_group_stride(a), groups,
                                            G.lane);
        if (td) {
            int* ids = reinterpret_cast<int*>(td + (uint64_t)out * stage_bytes);
            float* w = reinterpret_cast<float*>(ids + K);
            if (G.lane < K) {
                const bool local = m.id >= lo && m.id < lo + El;
                ids[G.lane] = local ? (int)(m.id - lo) : -1;
                w[G.lane] = local ? m.weight : 0.f;
            }
            if (G.lane == 0) reinterpret_cast<int*>(w + K)[0] = m.src;
        }
    });
    if (bulk) tma_drain_before_release(G.lane);
    group_sync(G.g, G.W);                       // every row of the stream is stored
    if (G.leader()) {
        const uint32_t base = (uint32_t)*tx_of(s, c, d);
        if (pos != count) record_error(s, kErrBadHandle, c, count, pos);
        st_release_sys(tail_of(s, pb, c, me), (int)(base + count));
        *tx_of(s, c, d) = (int)(base + count);
    }
}

// Stream (channel c, src -> me), one-copy: wait for its tail, copy its small fields from the staging
// rows into the outputs, then give the head back (the next call may use the ring again).
__device__ void direct_recv(const NormalStatic& s, const DispatchArgs& a, int c, const Group& G, int src) {
    const int R = s.num_ranks, me = s.rank, K = a.num_topk;
    int start, count;
    recv_run(a.rank_prefix_matrix, a.recv_channel_prefix_matrix, R, a.num_channels, me, src, c, start, count);
    uint8_t* own = reinterpret_cast<uint8_t*>(s.buf);
    const uint32_t base = (uint32_t)*rx_of(s, c, src);
    bool failed = false, marked = false;
    if (G.leader() && !wait_peer_counter(s, tail_of(s, own, c, src), base + (uint32_t)count, src, &marked)) {
        record_error(s, kErrPeerTimeout, src, kPhaseDispatch, c);
        failed = true;
    }
    if (group_sync_or(G.g, G.W, failed)) return;
    if (a.direct_stage) {
        const uint32_t stage_bytes = stage_row_bytes(K);
        for (int i = G.wi; i < count; i += G.W) {
            const int out = start + i;
            if (out >= a.num_out_rows) break;
            const int* ids = reinterpret_cast<const int*>(reinterpret_cast<const uint8_t*>(a.direct_stage) +
                                                          (uint64_t)out * stage_bytes);
            const float* w = reinterpret_cast<const float*>(ids + K);
            if (G.lane < K) {
                if (a.recv_topk_idx)
                    reinterpret_cast<int64_t*>(a.recv_topk_idx)[(int64_t)out * K + G.lane] = __ldcg(ids + G.lane);
                if (a.recv_topk_weights)
                    reinterpret_cast<float*>(a.recv_topk_weights)[(int64_t)out * K + G.lane] = __ldcg(w + G.lane);
            }
            if (G.lane == 0 && a.recv_src_idx)
                reinterpret_cast<int*>(a.recv_src_idx)[out] = __ldcg(reinterpret_cast<const int*>(w + K));
        }
    }
    group_sync(G.g, G.W);
    if (G.leader()) {
        st_release_sys(head_of(s, peer_buf(s, src), c, me), (int)(base + count));
        *rx_of(s, c, src) = (int)(base + count);
    }
}

}  // namespace normal
}  // namespace pyep
