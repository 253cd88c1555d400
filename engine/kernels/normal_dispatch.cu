// Normal-mode intranode dispatch: 2C blocks, an even block sends channel c's tokens, an odd block
// receives channel c from every source. Inside a block, warp group g (kDispatchWarps / R warps) serves peer g.
// A row travels once: the sender stores it over NVLink into the ring (channel c, source = sender) in
// the receiver's buffer and publishes the ring's tail; the receiver copies it to its final row and
// publishes its head in the sender's buffer. A call that runs the one-copy handshake launches
// dispatch_one_copy first (normal_direct.cuh), and this ring kernel then moves rows only where that one
// recorded the ring path. docs/normal_mode.md states the invariants.
#if !defined(PYEP_LL_CPU_SIM)   // tests/ll_sim/normal_sim.cpp compiles the kernels as host C++
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/normal_common.cuh"
#include "kernels/normal_direct.cuh"
#include "kernels/normal_rows.cuh"
#include "kernels/normal_tma.cuh"

namespace pyep {
namespace normal {
namespace {

// Two TMA stages per warp, then the warps' mbarriers.
constexpr int kTmaSmemData = tma_smem_data(kDispatchWarps);
constexpr int kTmaSmemBytes = tma_smem_bytes(kDispatchWarps);

// With a mask: the rows of stream (c, -> d) from position `from` on are not sent (d is out of the call,
// or was marked): counted dropped, and their tokens' send_head entries cleared, so that the combine of
// this dispatch neither waits for nor counts again rows that never went.
__device__ void drop_stream(const NormalStatic& s, const DispatchArgs& a, int c, const Group& G, int d, int from,
                            int count) {
    if (G.leader()) add_dropped(a.dropped, d, count - from);
    if (!a.send_head) return;
    int t0, t1;
    channel_range(a.num_tokens, a.num_channels, c, t0, t1);
    int* send_head = reinterpret_cast<int*>(a.send_head);
    const int R = s.num_ranks;
    for (int t = t0 + G.wi * 32 + G.lane; t < t1; t += G.W * 32)
        if (send_head[(int64_t)t * R + d] >= from) send_head[(int64_t)t * R + d] = -1;
}

// Sender of channel c to peer d. Tokens are routed 32 at a time (one ballot per window); the j-th row
// of a round goes to warp j % W, so rows of one round are written in parallel and the round is
// complete at the group barrier. The tail is published once `chunk` rows are pending, before any wait
// for ring space (else a full ring could wait on rows the receiver was never told about), and at the end.
__device__ void dispatch_send(const NormalStatic& s, const DispatchArgs& a, const DispatchRow& row, int c,
                              const Group& G, int d, WarpTma& tma) {
    const int R = s.num_ranks, me = s.rank, Q = a.ring_tokens, K = a.num_topk;
    int t0, t1;
    channel_range(a.num_tokens, a.num_channels, c, t0, t1);
    const int count = prefix_count(reinterpret_cast<const int*>(a.channel_prefix_matrix), a.num_channels, d, c);
    uint8_t* ring = ring_of(s, peer_buf(s, d), c, me, Q);
    int* tail = tail_of(s, peer_buf(s, d), c, me);
    const int* head = head_of(s, reinterpret_cast<uint8_t*>(s.buf), c, d);
    const uint32_t base = (uint32_t)*tx_of(s, c, d);
    const bool* in_rank = reinterpret_cast<const bool*>(a.is_token_in_rank);
    const float* scales = reinterpret_cast<const float*>(a.x_scales);
    const int64_t* topk = reinterpret_cast<const int64_t*>(a.topk_idx);
    const float* weights = reinterpret_cast<const float*>(a.topk_weights);
    const int groups = a.hidden / 128;
    const bool bulk = peer_bulk(a.use_tma, row.payload);

    // A peer out of the call (its gate, or marked since): nothing is sent, its rows are dropped. The
    // group decides together (another block may clear the bit while its warps read it).
    if (s.active && group_sync_or(G.g, G.W, !in_mask(call_mask(s), d))) {
        drop_stream(s, a, c, G, d, 0, count);
        return;
    }
    // Every call starts on an empty ring: the receiver consumed everything sent before.
    bool failed = false, marked = false;
    if (G.leader() && !wait_peer_counter(s, head, base, d, &marked)) {
        if (!marked) record_error(s, kErrPeerTimeout, d, kPhaseDispatch, c);
        failed = true;
    }
    if (group_sync_or(G.g, G.W, failed)) {
        if (s.active) drop_stream(s, a, c, G, d, 0, count);
        return;
    }

    // A round routes up to kMaxWindows ballots of 32 tokens, so that W warps get several rows each
    // between two barriers; all of a round's rows must fit the ring at once.
    const int windows = max(1, min(kMaxWindows, Q / kScanWindow));
    int sent = 0, published = 0;
    for (int rbase = t0; rbase < t1; rbase += windows * kScanWindow) {
        uint32_t masks[kMaxWindows];
        int n = 0;
#pragma unroll
        for (int w = 0; w < kMaxWindows; ++w) {
            const int t = rbase + w * kScanWindow + G.lane;
            masks[w] = __ballot_sync(0xffffffffu, w < windows && t < t1 && in_rank[(int64_t)t * R + d]);
            n += __popc(masks[w]);
        }
        if (n == 0) continue;                       // the same for every warp of the group
        if (sent + n > Q || sent - published >= a.chunk_tokens) {
            if (bulk && sent > published) {         // the rows' bulk stores are complete before the tail
                tma_drain_before_release(G.lane);
                group_sync(G.g, G.W);
            }
            if (G.leader() && sent > published) st_release_sys(tail, (int)(base + sent));
            published = sent;
        }
        if (sent + n > Q && G.lane == 0) {          // wait for room: head >= base + sent + n - Q
            if (!wait_peer_counter(s, head, base + (uint32_t)(sent + n - Q), d, &marked)) {
                if (!marked) record_error(s, kErrPeerTimeout, d, kPhaseDispatch, c);
                failed = true;
            }
        }
        failed = __shfl_sync(0xffffffffu, failed, 0);
        if (!failed) {
            int j = 0;
#pragma unroll
            for (int w = 0; w < kMaxWindows; ++w) {
                for (uint32_t rest = masks[w]; rest; rest &= rest - 1, ++j) {
                    if (j % G.W != G.wi) continue;
                    const int tok = rbase + w * kScanWindow + __ffs(rest) - 1;
                    uint8_t* dst = ring + slot_offset(s, sent + j, Q);
                    // The row's small fields are loaded before the payload copy, so that their loads
                    // are in flight with it instead of adding round trips after it.
                    const float* row_scales = a.fp8 ? scales + tok * scale_token_stride(a) : nullptr;
                    const RowMeta m = load_meta<ScaleSrc::kCaller>(row_scales, scale_group_stride(a), groups,
                                                G.lane < K && topk ? topk[(int64_t)tok * K + G.lane] : -1,
                                                G.lane < K && weights ? weights[(int64_t)tok * K + G.lane] : 0.f,
                                                G.lane == 0 ? source_index(a, tok) : 0, G.lane);
                    copy_row(tma, bulk, dst, payload_of(a, row, tok), row.payload, G.lane);
                    if (a.fp8)
                        store_scales<ScaleSrc::kCaller>(reinterpret_cast<float*>(dst + row.scales), m, row_scales,
                                                        scale_group_stride(a), groups, G.lane);
                    if (G.lane < K) {
                        reinterpret_cast<int*>(dst + row.ids)[G.lane] = (int)m.id;
                        reinterpret_cast<float*>(dst + row.weights)[G.lane] = m.weight;
                    }
                    if (G.lane == 0) reinterpret_cast<int*>(dst + row.src)[0] = m.src;
                }
            }
        }
        // The round's rows are written, or a warp gave up waiting and the group stops together.
        if (group_sync_or(G.g, G.W, failed)) {
            if (bulk) tma_drain(G.lane);            // the stages' stores read their shared memory
            if (s.active) drop_stream(s, a, c, G, d, sent, count);
            return;
        }
        sent += n;
    }
    if (bulk) {
        tma_drain_before_release(G.lane);
        group_sync(G.g, G.W);
    }
    if (G.leader()) {
        if (sent > published) st_release_sys(tail, (int)(base + sent));
        if (sent != count) record_error(s, kErrBadHandle, c, count, sent);
        *tx_of(s, c, d) = (int)(base + count);
    }
}

// One received row: payload (and FP8 scales) by the whole warp, local top-k ids / weights and the source
// index by a few lanes. `id(k)` and `weight(k)` read the row's top-k entry from wherever it is.
// The small fields are loaded first (load_meta), so that their latency overlaps the payload copy's.
template <ScaleSrc kSrc, typename Id, typename Weight>
__device__ __forceinline__ void emit_row(const DispatchArgs& a, const DispatchRow& row, WarpTma& tma, int out,
                                         const uint8_t* payload, const float* scales, int64_t gs, Id id,
                                         Weight weight, int src_token, int lo, int lane) {
    const int K = a.num_topk, El = a.num_local_experts, groups = a.hidden / 128;
    const bool want_k = a.recv_topk_idx && lane < K;
    const RowMeta m = load_meta<kSrc>(a.fp8 ? scales : nullptr, gs, groups, want_k ? id(lane) : -1,
                                want_k && a.recv_topk_weights ? weight(lane) : 0.f, src_token, lane);
    if (a.row_map) out = reinterpret_cast<const int*>(a.row_map)[out];   // a permutation of the real rows
    uint8_t* dst = reinterpret_cast<uint8_t*>(a.recv_x) + (uint64_t)out * row.payload;
    copy_row(tma, a.use_tma & kTmaLocal, dst, payload, row.payload, lane);
    if (a.fp8)
        store_scales<kSrc>(reinterpret_cast<float*>(a.recv_x_scales) + (int64_t)out * groups, m, scales, gs, groups,
                           lane);
    if (want_k) {
        const bool local = m.id >= lo && m.id < lo + El;
        reinterpret_cast<int64_t*>(a.recv_topk_idx)[(int64_t)out * K + lane] = local ? m.id - lo : -1;
        if (a.recv_topk_weights)
            reinterpret_cast<float*>(a.recv_topk_weights)[(int64_t)out * K + lane] = local ? m.weight : 0.f;
    }
    if (a.recv_src_idx && lane == 0) reinterpret_cast<int*>(a.recv_src_idx)[out] = m.src;
}

// Output rows [r0, r1) of a source that was marked mid-stream: zero payload and scales, top-k ids -1,
// weights 0, source index -1 (the worst-token padding's convention).
__device__ void empty_rows(const DispatchArgs& a, const DispatchRow& row, int r0, int r1, const Group& G) {
    const int K = a.num_topk, groups = a.hidden / 128;
    r1 = min(r1, a.num_out_rows);
    for (int out = r0 + G.wi; out < r1; out += G.W) {
        const int o = a.row_map ? reinterpret_cast<const int*>(a.row_map)[out] : out;
        int4* dst = reinterpret_cast<int4*>(reinterpret_cast<uint8_t*>(a.recv_x) + (uint64_t)o * row.payload);
        for (int i = G.lane; i < (int)(row.payload / 16); i += 32) dst[i] = make_int4(0, 0, 0, 0);
        if (a.fp8)
            for (int g = G.lane; g < groups; g += 32) reinterpret_cast<float*>(a.recv_x_scales)[(int64_t)o * groups + g] = 0.f;
        if (a.recv_topk_idx && G.lane < K) {
            reinterpret_cast<int64_t*>(a.recv_topk_idx)[(int64_t)o * K + G.lane] = -1;
            if (a.recv_topk_weights) reinterpret_cast<float*>(a.recv_topk_weights)[(int64_t)o * K + G.lane] = 0.f;
        }
        if (a.recv_src_idx && G.lane == 0) reinterpret_cast<int*>(a.recv_src_idx)[o] = -1;
    }
}

// This rank's own rows of channel c go from x straight to their output rows (no ring, no counters):
// the stream's i-th row goes to warp i mod W, at row recv_channel_prefix[me][c] + i.
__device__ void dispatch_self(const NormalStatic& s, const DispatchArgs& a, const DispatchRow& row, int c,
                              const Group& G, WarpTma& tma) {
    const int R = s.num_ranks, me = s.rank, K = a.num_topk;
    int t0, t1;
    channel_range(a.num_tokens, a.num_channels, c, t0, t1);
    int start, count;
    recv_run(a.rank_prefix_matrix, a.recv_channel_prefix_matrix, R, a.num_channels, me, me, c, start, count);
    const bool* in_rank = reinterpret_cast<const bool*>(a.is_token_in_rank);
    const float* scales = reinterpret_cast<const float*>(a.x_scales);
    const int64_t* topk = reinterpret_cast<const int64_t*>(a.topk_idx);
    const float* weights = reinterpret_cast<const float*>(a.topk_weights);
    const int lo = me * a.num_local_experts;
    for_each_routed_row(in_rank, R, me, t0, t1, G, [&](int tok, int i) {
        const int out = start + i;
        if (out >= a.num_out_rows) return;
        emit_row<ScaleSrc::kCaller>(
            a, row, tma, out, payload_of(a, row, tok), scales + tok * scale_token_stride(a), scale_group_stride(a),
            [&](int k) { return topk ? topk[(int64_t)tok * K + k] : (int64_t)-1; },
            [&](int k) { return weights ? weights[(int64_t)tok * K + k] : 0.f; }, source_index(a, tok), lo, G.lane);
    });
    tma_drain(G.lane);
}

// Receiver of channel c from source src: rows [start, end) of the output, contiguous in ring order.
__device__ void dispatch_recv(const NormalStatic& s, const DispatchArgs& a, const DispatchRow& row, int c,
                              const Group& G, int* sh_flag, WarpTma& tma) {
    const int R = s.num_ranks, me = s.rank, src = G.g, Q = a.ring_tokens, C = a.num_channels;
    if (src == me) {
        dispatch_self(s, a, row, c, G, tma);
        return;
    }
    int start, count;
    recv_run(a.rank_prefix_matrix, a.recv_channel_prefix_matrix, R, C, me, src, c, start, count);
    uint8_t* own = reinterpret_cast<uint8_t*>(s.buf);
    const uint8_t* ring = ring_of(s, own, c, src, Q);
    const int* tail = tail_of(s, own, c, src);
    int* head = head_of(s, peer_buf(s, src), c, me);
    const uint32_t base = (uint32_t)*rx_of(s, c, src);
    const int lo = me * a.num_local_experts;

    int done = 0;
    while (done < count) {
        if (G.leader()) {
            int avail = -1;
            bool marked = false;
            if (wait_peer_counter(s, tail, base + (uint32_t)done + 1, src, &marked)) {
                const int published = (int)((uint32_t)ld_acquire_sys(tail) - base);
                avail = min(published, count) - done;
            } else if (!marked) {
                record_error(s, kErrPeerTimeout, src, kPhaseDispatch, c);
            }
            sh_flag[G.g] = avail;
        }
        group_sync(G.g, G.W);
        const int avail = sh_flag[G.g];
        if (avail < 0) {
            // With a mask the source was marked: its rows that never came are emptied (zero payload, no
            // expert, no weight, source -1), never left holding another call's bytes.
            if (s.active) empty_rows(a, row, start + done, start + count, G);
            tma_drain(G.lane);
            return;
        }
        for (int j = G.wi; j < avail; j += G.W) {
            const int i = done + j;
            const int out = start + i;
            if (out >= a.num_out_rows) continue;    // more rows than num_worst_tokens: recorded by notify
            const uint8_t* r = ring + slot_offset(s, i, Q);
            emit_row<ScaleSrc::kRing>(a, row, tma, out, r, reinterpret_cast<const float*>(r + row.scales), 1,
                     [&](int k) { return (int64_t)__ldcg(reinterpret_cast<const int*>(r + row.ids) + k); },
                     [&](int k) { return __ldcg(reinterpret_cast<const float*>(r + row.weights) + k); },
                     __ldcg(reinterpret_cast<const int*>(r + row.src)), lo, G.lane);
        }
        group_sync(G.g, G.W);                       // every read of these slots is done (tma_copy
                                                    // returns once its loads completed)
        if (G.leader()) st_release_sys(head, (int)(base + done + avail));
        done += avail;
    }
    if (G.leader()) *rx_of(s, c, src) = (int)(base + count);
    tma_drain(G.lane);
}

struct DispatchShared {
    int flag[kMaxRanks];   // per receiving group: rows its leader found published, -1 to stop
    int path;              // one-copy call: 1, ring path: 0, a failed handshake: -1
    DirectPeer peer[kMaxRanks];
};

// The one-copy kernel (normal_direct.cuh), launched before the ring kernel when the call runs the
// handshake (a.direct). Per channel c: the descriptor handshake; then, when every rank offered, both
// blocks send, block h to the ranks d = h mod 2 -- this rank's own rows included, into its own outputs --
// a group of warps per rank, and the group of rank d then receives d's stream. No send waits on a
// receiver, so the receives after the sends cannot close a cycle of waits. Otherwise it only records
// the path, and the ring kernel moves the rows.
// Why two kernels: with the ring path's loops and dispatch_self in the same kernel, the register
// allocator (80 a thread at 768 threads) spilled, and the spills (local memory, which the TMA stages
// leave almost no L1 for) cost the one-copy loop a memory round trip per row. FP8 dispatch, 2 ranks on
// one H200, kernel us with the one-copy path alone in a kernel: 380.6 -> 302.6 at 6 SMs, 108.2 -> 91.0
// at 24; out-of-line ring code in one kernel made it slower (458 / 139), own rows through the one-copy
// send with the ring code kept did little (367 / 111; docs/results/2026-11-27g-h200x1).
__global__ void __launch_bounds__(kDispatchThreads, 1) dispatch_one_copy(NormalStatic s, DispatchArgs a) {
    // A void call (normal_gate.cuh: a rank refused it, or the ranks are at different calls) moves no
    // row and leaves every counter as it was, on every rank alike.
    if (reinterpret_cast<const int*>(s.workspace)[kWsVoid]) return;
    const int c = blockIdx.x >> 1, h = blockIdx.x & 1, R = s.num_ranks;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    DispatchShared& sh = block_shared<DispatchShared>();
    if (threadIdx.x == 0) {
        const uint32_t seq = (uint32_t)reinterpret_cast<const int*>(s.workspace)[kWsSeq];
        if (h) publish_desc(s, a, c, seq);
        sh.path = read_descs(s, a, c, seq, sh.peer);
        record_path(s, c, h, seq, sh.path);
    }
    __syncthreads();
    if (sh.path != 1) return;
    const int n = (R - h + 1) / 2;              // ranks of this block
    if (n == 0) return;
    const int W = kDispatchWarps / n, g = warp / W, d = 2 * g + h;
    if (g >= n) return;
    const Group G{g, warp % W, W, lane};
    uint8_t* tma_smem = tma_shared();
    WarpTma tma = tma_setup(tma_smem, reinterpret_cast<uint64_t*>(tma_smem + kTmaSmemData), warp, lane);
    direct_send(s, a, DispatchRow(a.hidden, a.fp8, a.num_topk), c, G, d, sh.peer[d], tma);
    direct_recv(s, a, c, G, d);
}

// The ring kernel: 2C blocks, an even block sends channel c's rows to the peers' rings, an odd block
// receives channel c from every source (its own rows straight from x). After the one-copy kernel it
// moves rows only where that kernel recorded the ring path.
__global__ void __launch_bounds__(kDispatchThreads, 1) dispatch(NormalStatic s, DispatchArgs a) {
    int* sh_flag = block_shared<DispatchShared>().flag;
    const int c = blockIdx.x >> 1;
    const bool sender = (blockIdx.x & 1) == 0;
    if (!sender && a.num_worst_tokens > 0 && a.recv_src_idx) {
        // Rows past the real count (num_worst_tokens): no expert, no weight, no source.
        const int rows = reinterpret_cast<const int*>(s.workspace)[0], K = a.num_topk;
        for (int r = rows + c * kDispatchThreads + threadIdx.x; r < a.num_out_rows; r += a.num_channels * kDispatchThreads) {
            reinterpret_cast<int*>(a.recv_src_idx)[r] = -1;
            for (int k = 0; k < K && a.recv_topk_idx; ++k) {
                reinterpret_cast<int64_t*>(a.recv_topk_idx)[(int64_t)r * K + k] = -1;
                if (a.recv_topk_weights) reinterpret_cast<float*>(a.recv_topk_weights)[(int64_t)r * K + k] = 0.f;
            }
        }
    }
    if (reinterpret_cast<const int*>(s.workspace)[kWsVoid]) return;   // a void call (dispatch_one_copy)
    if (a.direct) {
        DispatchShared& sh = block_shared<DispatchShared>();
        if (threadIdx.x == 0) {
            const uint32_t seq = (uint32_t)reinterpret_cast<const int*>(s.workspace)[kWsSeq];
            sh.path = recorded_path(s, c, blockIdx.x & 1, seq);
        }
        __syncthreads();
        if (sh.path != 0) return;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, R = s.num_ranks;
    const DispatchRow row(a.hidden, a.fp8, a.num_topk);
    if (sender) {
        // Own rows skip the ring (dispatch_self), so the sender's warps are shared by the R - 1 peers.
        if (R == 1) return;
        const int W = kDispatchWarps / (R - 1), g = warp / W;
        if (g >= R - 1) return;                     // warps left over when R - 1 does not divide kDispatchWarps
        uint8_t* tma_smem = tma_shared();
        WarpTma tma = tma_setup(tma_smem, reinterpret_cast<uint64_t*>(tma_smem + kTmaSmemData), warp, lane);
        dispatch_send(s, a, row, c, Group{g, warp % W, W, lane}, g + (g >= s.rank), tma);
    } else {
        const int W = kDispatchWarps / R, g = warp / W;
        if (g >= R) return;
        uint8_t* tma_smem = tma_shared();
        WarpTma tma = tma_setup(tma_smem, reinterpret_cast<uint64_t*>(tma_smem + kTmaSmemData), warp, lane);
        dispatch_recv(s, a, row, c, Group{g, warp % W, W, lane}, sh_flag, tma);
    }
}

}  // namespace

#if !defined(PYEP_LL_CPU_SIM)
void launch_dispatch(const NormalStatic& s, const DispatchArgs& a, uint64_t stream) {
    check_static(s);
    auto bad = [](const std::string& m) { throw std::invalid_argument("normal dispatch: " + m); };
    if (a.ring_tokens < kScanWindow) bad("the ring must hold at least 32 rows");
    if (a.chunk_tokens < 1) bad("chunk_tokens must be >= 1");
    if (a.hidden < 128 || a.hidden % 128) bad("hidden must be a positive multiple of 128");
    if (a.num_topk < 0 || a.num_topk > kMaxTopk) bad("num_topk must be in [0, 16]");
    if (a.x_row_bytes && (a.x_row_bytes % 16 || a.x_row_bytes < DispatchRow(a.hidden, a.fp8, a.num_topk).payload))
        bad("x_row_bytes must be 0 or a multiple of 16 that holds the payload");
    if (a.direct && (!s.off_direct || !s.pool_hi || s.active || a.row_map || a.src_idx))
        bad("the one-copy handshake needs a buffer with an output pool, no mask and rows of this node");
    if (a.direct_offer) {
        auto in_pool = [&](uint64_t p, uint64_t len) {
            return p >= s.buf + s.pool_lo && p <= s.buf + s.pool_hi && len <= s.buf + s.pool_hi - p;
        };
        const uint64_t n = (uint64_t)std::max(a.num_out_rows, 0);
        const uint64_t payload = DispatchRow(a.hidden, a.fp8, a.num_topk).payload;
        if (!a.direct || (n && (!in_pool(a.recv_x, n * payload) ||
                                (a.fp8 && !in_pool(a.recv_x_scales, n * (a.hidden / 128) * 4)) ||
                                (a.direct_stage && !in_pool(a.direct_stage, n * stage_row_bytes(a.num_topk))))) ||
            (!a.direct_stage && a.recv_src_idx))
            bad("a one-copy offer's outputs and staging rows must lie in the buffer's output pool");
    }
    // Pointers may be 0 for empty tensors (N = 0, nothing received); the front checked the shapes.
    check_rings(s, "normal dispatch", a.num_channels, a.ring_tokens, dispatch_row_bytes(a.hidden, a.fp8, a.num_topk),
                a.hidden);
    static std::atomic<uint64_t> smem_one_copy{0}, smem_ring{0};
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    auto launched = [](const char* what) {
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
    };
    if (a.direct) {
        reserve_stage_smem(dispatch_one_copy, kTmaSmemBytes, smem_one_copy, "normal dispatch");
        dispatch_one_copy<<<2 * a.num_channels, kDispatchThreads, kTmaSmemBytes, st>>>(s, a);
        launched("normal dispatch (one-copy kernel) launch");
    }
    reserve_stage_smem(dispatch, kTmaSmemBytes, smem_ring, "normal dispatch");
    dispatch<<<2 * a.num_channels, kDispatchThreads, kTmaSmemBytes, st>>>(s, a);
    launched("normal dispatch launch");
}
#endif  // !PYEP_LL_CPU_SIM

}  // namespace normal
}  // namespace pyep
