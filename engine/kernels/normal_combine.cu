// Normal-mode intranode combine: the dispatch retraced (or, when every rank's x lies in its output pool,
// pulled: normal_pull.cuh). An even block sends channel c's received rows
// back to their source ranks (warp group g serves source g, rows in received order); an odd block
// reduces channel c's own tokens: token t's row from rank d sits at position send_head[t][d] of the
// ring (c, d) in this rank's buffer. Sum in fp32: bias_0, bias_1, then ranks ascending (contract.py).
#if !defined(PYEP_LL_CPU_SIM)   // tests/ll_sim/normal_sim.cpp compiles the kernels as host C++
#include <cuda_runtime.h>
#endif

#include <stdexcept>
#include <string>

#include "kernels/normal_common.cuh"
#include "kernels/normal_pull.cuh"
#include "kernels/normal_tma.cuh"
#include "kernels/normal_trace.cuh"

namespace pyep {
namespace normal {
namespace {

// Tokens a reduce round takes (up to two per warp). The receiver frees ring slots once per round, so a
// sender may run at most ring_tokens - round rows ahead of the receiver's head (see combine_send).
// Two tokens a warp between the round's barriers: a round lasts as long as its slowest warp, and a
// token's time varies with its number of sources and with when their rows arrive; over two tokens a
// warp the spread evens out, and the block waits at half as many barriers.
constexpr int kReduceTokensPerWarp = 2;
__device__ __forceinline__ int reduce_round(int ring_tokens) {
    return min(kReduceTokensPerWarp * kCombineWarps, ring_tokens / 2);
}

// Row i of the dispatch's (source, token) order in x: across nodes the rows sit in the contract's order
// and row_map says where (normal_internode.md); within one node the orders are the same.
__device__ __forceinline__ int64_t x_row(const CombineArgs& a, int i) {
    return a.row_map ? reinterpret_cast<const int*>(a.row_map)[i] : i;
}

// Group g (barrier 1 + g) sends to peer d != me; own rows are read in place by combine_recv. With a
// trace, each warp's time splits into waiting for d's head (the leader's wait and the barrier after
// it), copying its rows of a chunk, and the barrier before the chunk's tail.
template <bool kTrace>
__device__ void combine_send(const NormalStatic& s, const CombineArgs& a, const CombineRow& row, int c, int g,
                             int d, int wi, int W, int lane, WarpTma& tma, PhaseClock<kTrace>& clk) {
    const int R = s.num_ranks, me = s.rank, Q = a.ring_tokens, K = a.num_topk, C = a.num_channels;
    int start, count;
    recv_run(a.rank_prefix_matrix, a.recv_channel_prefix_matrix, R, C, me, d, c, start, count);
    uint8_t* ring = ring_of(s, peer_buf(s, d), c, me, Q);
    int* tail = tail_of(s, peer_buf(s, d), c, me);
    const int* head = head_of(s, reinterpret_cast<uint8_t*>(s.buf), c, d);
    const uint32_t base = (uint32_t)*tx_of(s, c, d);
    const uint8_t* x = reinterpret_cast<const uint8_t*>(a.x);
    const float* weights = reinterpret_cast<const float*>(a.topk_weights);
    // Room: the receiver needs up to one round of positions beyond its head before it frees any.
    const int chunk = max(1, min(max(a.chunk_tokens, 2 * W), Q - reduce_round(Q)));   // every warp busy
    const bool leader = wi == 0 && lane == 0;
    const bool bulk = peer_bulk(a.use_tma, row.payload);
    // A source out of the call gets none of its rows back; the group decides together (another block
    // may clear the bit while its warps read it).
    if (s.active && group_sync_or(g, W, !in_mask(call_mask(s), d))) return;

    bool failed = false, marked = false;
    if (leader && !wait_peer_counter(s, head, base, d, &marked)) {   // every call starts on an empty ring
        if (!marked) record_error(s, kErrPeerTimeout, d, kPhaseCombine, c);
        failed = true;
    }
    if (group_sync_or(g, W, failed)) return;
    clk.lap(kTraceWait);
    for (int sent = 0; sent < count;) {
        const int n = min(chunk, count - sent);
        if (sent + n > Q && leader && !wait_peer_counter(s, head, base + (uint32_t)(sent + n - Q), d, &marked)) {
            if (!marked) record_error(s, kErrPeerTimeout, d, kPhaseCombine, c);
            failed = true;
        }
        if (group_sync_or(g, W, failed)) {
            if (bulk) tma_drain(lane);              // the stages' stores read their shared memory
            return;
        }
        clk.lap(kTraceWait);
        for (int j = wi; j < n; j += W) {
            const int i = sent + j;
            const int64_t r = x_row(a, start + i);
            uint8_t* dst = ring + slot_offset(s, i, Q);
            const float w = lane < K && weights ? weights[r * K + lane] : 0.f;   // in flight with the copy
            copy_row(tma, bulk, dst, x + (uint64_t)r * row.payload, row.payload, lane);
            if (lane < K) reinterpret_cast<float*>(dst + row.weights)[lane] = w;
            clk.moved(1);
        }
        if (bulk) tma_drain_before_release(lane);   // the chunk's bulk stores are complete before its tail
        clk.lap(kTraceWork);
        group_sync(g, W);
        sent += n;
        if (leader) st_release_sys(tail, (int)(base + sent));
        clk.lap(kTraceSync);
    }
    if (leader) *tx_of(s, c, d) = (int)(base + count);
}

// out[v] = bf16(0 + b0[v] + b1[v] + rows[0][v] + ... + rows[nsrc-1][v]) in fp32, in that order, for the
// vectors v of 8 channels this lane owns.
template <int kSrc, int kVec>
__device__ __forceinline__ void reduce_token(const uint8_t* const* rows, int nsrc, const int4* b0, const int4* b1,
                                             int4* out, int vecs, int lane) {
    for (int v0 = lane; v0 < vecs; v0 += 32 * kVec) {
        int4 in[kSrc][kVec];
#pragma unroll
        for (int i = 0; i < kSrc; ++i)
#pragma unroll
            for (int u = 0; u < kVec; ++u)
                if (i < nsrc && v0 + 32 * u < vecs) in[i][u] = __ldcg(reinterpret_cast<const int4*>(rows[i]) + v0 + 32 * u);
#pragma unroll
        for (int u = 0; u < kVec; ++u) {
            const int v = v0 + 32 * u;
            if (v >= vecs) break;
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            if (b0) add_bf16x8(acc, __ldcg(b0 + v));
            if (b1) add_bf16x8(acc, __ldcg(b1 + v));
#pragma unroll
            for (int i = 0; i < kSrc; ++i)
                if (i < nsrc) add_bf16x8(acc, in[i][u]);
            int4 o;
            __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
            for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
            out[v] = o;
        }
    }
}

// Bytes of each source row that one stage holds for a token of nsrc (>= 1) sources: the stage split
// evenly, in whole 512-byte pieces (16 bytes a lane), at most the row.
__device__ __forceinline__ int stage_piece(int nsrc, int row_bytes) {
    return min(row_bytes, max(512, kTmaStageBytes / nsrc / 512 * 512));
}

// reduce_token's sum (same order, same rounding) with the rows brought into the warp's two stages by
// bulk loads (normal_tma.cuh): piece j + 1 of every source row loads while the lanes sum piece j from
// shared memory, so a warp keeps up to 8 KiB in flight where its lanes' registers held 4 KiB (8 vectors
// a lane, 1 or 2 of each source's at 3 to 8 sources).
__device__ void reduce_token_staged(WarpTma& t, const uint8_t* const* rows, int nsrc, const int4* b0,
                                    const int4* b1, int4* out, int row_bytes, int lane) {
    const int piece = stage_piece(nsrc, row_bytes), pieces = (row_bytes + piece - 1) / piece;
    auto issue = [&](int j) {
        const int len = min(piece, row_bytes - j * piece);
        stage_load(t, (int)((t.next + j) % kTmaStages), rows, nsrc, (uint32_t)(j * piece), len, piece);
    };
    if (lane == 0) {
        tma_reads_after_acquire();
        issue(0);
    }
    for (int j = 0; j < pieces; ++j) {
        // Stage (j + 1) % 2 was last read for piece j - 1, released at that piece's end.
        if (lane == 0 && j + 1 < pieces) issue(j + 1);
        const int st = (int)((t.next + j) % kTmaStages);
        stage_wait(t, st);
        const uint8_t* piece_rows = stage_smem(t, st);
        const int vecs = min(piece, row_bytes - j * piece) / 16, v0 = j * piece / 16;
        for (int v = lane; v < vecs; v += 32) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            if (b0) add_bf16x8(acc, __ldcg(b0 + v0 + v));
            if (b1) add_bf16x8(acc, __ldcg(b1 + v0 + v));
            for (int i = 0; i < nsrc; ++i)
                add_bf16x8(acc, *reinterpret_cast<const int4*>(piece_rows + i * piece + v * 16));
            int4 o;
            __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
            for (int q = 0; q < 4; ++q) h[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
            out[v0 + v] = o;
        }
        __syncwarp();                       // every lane read the stage
        if (lane == 0) stage_release();     // before the async proxy writes it again
    }
    t.next += (uint32_t)pieces;
}

struct CombineRecvShared {
    uint32_t base[kMaxRanks];   // rx position of each source's stream at the call's start
    int max[kMaxRanks];         // the round's highest position read per source
    int failed;
};

// With a trace, each warp's time splits into waiting for the sources' tails (from the token's routing
// load to the warp's agreement that every row is there), reducing, and the round's block barriers.
template <bool kTrace>
__device__ void combine_recv(const NormalStatic& s, const CombineArgs& a, const CombineRow& row, int c,
                             WarpTma& tma, PhaseClock<kTrace>& clk) {
    const int R = s.num_ranks, me = s.rank, Q = a.ring_tokens, K = a.num_topk, C = a.num_channels;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, round = reduce_round(Q);
    CombineRecvShared& sh = block_shared<CombineRecvShared>();
    uint32_t* sh_base = sh.base;
    int* sh_max = sh.max;
    int& sh_failed = sh.failed;
    uint8_t* own = reinterpret_cast<uint8_t*>(s.buf);
    if (threadIdx.x < R) {
        sh_base[threadIdx.x] = (uint32_t)*rx_of(s, c, threadIdx.x);
        sh_max[threadIdx.x] = -1;
    }
    if (threadIdx.x == 0) sh_failed = 0;
    __syncthreads();
    int t0, t1;
    channel_range(a.num_tokens, C, c, t0, t1);
    const int* send_head = reinterpret_cast<const int*>(a.send_head);
    int self_row0, self_rows;
    recv_run(a.rank_prefix_matrix, a.recv_channel_prefix_matrix, R, C, me, me, c, self_row0, self_rows);
    const int vecs = a.hidden / 8;   // int4 of 8 bf16
    const int4* bias0 = reinterpret_cast<const int4*>(a.bias0);
    const int4* bias1 = reinterpret_cast<const int4*>(a.bias1);
    int4* out = reinterpret_cast<int4*>(a.out);
    float* out_w = reinterpret_cast<float*>(a.out_weights);

    for (int rs = t0; rs < t1; rs += round) {
        for (int t = rs + warp; t < min(rs + round, t1); t += kCombineWarps) {
            int pos = lane < R ? send_head[(int64_t)t * R + lane] : -1;
            bool ok = true;
            if (s.active && pos >= 0 && lane != me && !in_mask(call_mask(s), lane)) {
                // With a mask: the rank is out of the call (or was marked): its row of this token does
                // not come back; the sum goes on without it and the token counts as dropped for it.
                add_dropped(a.dropped, lane, 1);
                pos = -1;
            }
            bool marked = false;
            if (pos >= 0 && lane != me &&
                !wait_peer_counter(s, tail_of(s, own, c, lane), sh_base[lane] + (uint32_t)pos + 1, lane, &marked)) {
                if (marked) {
                    add_dropped(a.dropped, lane, 1);
                    pos = -1;
                } else {
                    record_error(s, kErrPeerTimeout, lane, kPhaseCombine, c);
                    ok = false;
                }
            }
            if (__all_sync(0xffffffffu, ok)) {
                clk.lap(kTraceWait);
                fence_acq_rel_sys();   // the other lanes' acquires cover the rows this lane reads
                // Rank d's row of token t: in the ring (c, d), or for this rank itself the row of x it
                // received at recv_channel_prefix[me][c] + position (never copied into a ring).
                const uint8_t* rows[kMaxRanks];
                const float* wrow[kMaxRanks];
                int nsrc = 0;
                for (int d = 0; d < R; ++d) {
                    const int p = __shfl_sync(0xffffffffu, pos, d);
                    if (p < 0) continue;
                    if (d == me) {
                        const int64_t r = x_row(a, self_row0 + p);
                        rows[nsrc] = reinterpret_cast<const uint8_t*>(a.x) + (uint64_t)r * row.payload;
                        wrow[nsrc] = a.topk_weights ? reinterpret_cast<const float*>(a.topk_weights) + (int64_t)r * K : nullptr;
                    } else {
                        rows[nsrc] = ring_of(s, own, c, d, Q) + slot_offset(s, p, Q);
                        wrow[nsrc] = reinterpret_cast<const float*>(rows[nsrc] + row.weights);
                    }
                    ++nsrc;
                }
                // Loads in flight per lane: kSrc sources x kVec vectors, 8 in every instantiation (a
                // reduce is latency-bound otherwise: one round trip per 16 bytes of output).
                const int4* b0 = bias0 ? bias0 + (int64_t)t * vecs : nullptr;
                const int4* b1 = bias1 ? bias1 + (int64_t)t * vecs : nullptr;
                int4* o = out + (int64_t)t * vecs;
                // Staged for 3 or more sources, where the registers hold 2 vectors a source or fewer: with
                // 1 or 2 (4 vectors each) the register path was faster (6 SMs, 2 ranks: 1092 against
                // 1218 us; docs/results/2026-11-27-h100x1).
                if ((a.use_tma & kTmaLocal) && nsrc > 2)
                    reduce_token_staged(tma, rows, nsrc, b0, b1, o, (int)row.payload, lane);
                else if (nsrc <= 2) reduce_token<2, 4>(rows, nsrc, b0, b1, o, vecs, lane);
                else if (nsrc <= 4) reduce_token<4, 2>(rows, nsrc, b0, b1, o, vecs, lane);
                else reduce_token<kMaxRanks, 1>(rows, nsrc, b0, b1, o, vecs, lane);
                if (out_w && lane < K) {
                    float w = 0.f;
                    for (int i = 0; i < nsrc; ++i) w += __ldcg(wrow[i] + lane);
                    out_w[(int64_t)t * K + lane] = w;
                }
                if (pos >= 0) atomicMax(&sh_max[lane], pos);
                clk.lap(kTraceWork);
                clk.moved(1);
            } else {
                if (lane == 0) sh_failed = 1;
                break;
            }
        }
        __syncthreads();                       // the round's rows are read
        if (sh_failed) return;
        int consumed = -1;
        if (threadIdx.x < R) consumed = sh_max[threadIdx.x];
        __syncthreads();                       // read before the next round raises it again
        if (consumed >= 0 && threadIdx.x != me && (!s.active || in_mask(call_mask(s), threadIdx.x)))
            st_release_sys(head_of(s, peer_buf(s, threadIdx.x), c, me), (int)(sh_base[threadIdx.x] + consumed + 1));
        clk.lap(kTraceSync);
    }
    if (threadIdx.x < R && threadIdx.x != me) {
        const int n = prefix_count(reinterpret_cast<const int*>(a.channel_prefix_matrix), C, threadIdx.x, c);
        *rx_of(s, c, threadIdx.x) = (int)(sh_base[threadIdx.x] + n);
    }
}

// A pull call (normal_pull.cuh): block b = 2c + h reduces every other token of channel c (h, h + 2, ...),
// reading rank d's row of token t at d's x row p.row0[d] + send_head[t][d], in the same order and with
// the same rounding as combine_recv. Then the pulled[] exchange: no peer reads this rank's x once the
// kernel ends. A failed handshake (path -1) reads nothing but still takes part in the exchange.
template <bool kTrace>
__device__ void combine_pull(const NormalStatic& s, const CombineArgs& a, const CombineRow& row, const PullPlan& p,
                             uint32_t seq, PhaseClock<kTrace>& clk) {
    const int R = s.num_ranks, C = a.num_channels, b = blockIdx.x, c = b >> 1;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, vecs = a.hidden / 8;
    int t0, t1;
    channel_range(a.num_tokens, C, c, t0, t1);
    const int* send_head = reinterpret_cast<const int*>(a.send_head);
    const int4* bias0 = reinterpret_cast<const int4*>(a.bias0);
    const int4* bias1 = reinterpret_cast<const int4*>(a.bias1);
    int4* out = reinterpret_cast<int4*>(a.out);
    for (int t = t0 + (b & 1) + 2 * warp; p.path == 1 && t < t1; t += 2 * kCombineWarps) {
        int pos = lane < R ? send_head[(int64_t)t * R + lane] : -1;
        const int64_t at = pos >= 0 ? p.row0[lane] + pos : 0;
        if (pos >= 0 && (at < 0 || at >= p.rows[lane])) {
            // A handle that does not describe this call (its matrices are the caller's tensors): never a
            // read outside the peer's x, past its end or (negative prefix entries) before its start.
            // Recorded as the rows left in that peer's x from this channel's first, against the rows
            // send_head needs.
            record_error(s, kErrBadHandle, c, (int)(p.rows[lane] - p.row0[lane]), pos + 1);
            pos = -1;
        }
        const uint8_t* rows[kMaxRanks];
        int nsrc = 0;
        for (int d = 0; d < R; ++d) {
            const int q = __shfl_sync(0xffffffffu, pos, d);
            if (q >= 0) rows[nsrc++] = reinterpret_cast<const uint8_t*>(p.x[d]) + (uint64_t)(p.row0[d] + q) * row.payload;
        }
        const int4* b0 = bias0 ? bias0 + (int64_t)t * vecs : nullptr;
        const int4* b1 = bias1 ? bias1 + (int64_t)t * vecs : nullptr;
        int4* o = out + (int64_t)t * vecs;
        // The register path only: combine_recv's bulk loads (twice the bytes in flight) gained nothing here
        // (8 ranks on one H200, 16 SMs: 193 against 192 GB/s; docs/results/2026-11-28c-h200x1).
        if (nsrc <= 2) reduce_token<2, 4>(rows, nsrc, b0, b1, o, vecs, lane);
        else if (nsrc <= 4) reduce_token<4, 2>(rows, nsrc, b0, b1, o, vecs, lane);
        else reduce_token<kMaxRanks, 1>(rows, nsrc, b0, b1, o, vecs, lane);
        clk.lap(kTraceWork);
        clk.moved(1);
    }
    pull_done_exchange(s, b, c, seq);
    clk.lap(kTraceSync);
}

// kPull: built with the pull path, launched when this rank offered (a.pull); a rank that did not offer
// knows the call pushes (every rank reads its 0), and its kernel keeps the push path's registers (the pull
// path in the same kernel raised the push path's spills from 20 to 112 bytes a thread).
template <bool kTrace, bool kPull>
__global__ void __launch_bounds__(kCombineThreads, 1) combine(NormalStatic s, CombineArgs a) {
    // A void call (normal_gate.cuh) moves no row and leaves every counter as it was, on every rank alike.
    if (reinterpret_cast<const int*>(s.workspace)[kWsVoid]) return;
    PhaseClock<kTrace> clk(s, blockIdx.x);
    const int c = blockIdx.x >> 1;
    const CombineRow row(a.hidden, a.num_topk);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint8_t* tma_smem = tma_shared();
    WarpTma tma = tma_setup(tma_smem, reinterpret_cast<uint64_t*>(tma_smem + tma_smem_data(kCombineWarps)), warp, lane);
    if (kPull) {
        PullPlan& p = block_shared<PullPlan>();
        const uint32_t seq = (uint32_t)reinterpret_cast<const int*>(s.workspace)[kWsSeq];   // set by the gate
        if (threadIdx.x == 0) p.path = read_pull_plan(s, a, seq, c, p);
        __syncthreads();
        const int path = p.path;
        if (path) {
            combine_pull(s, a, row, p, seq, clk);
            clk.finish(s, blockIdx.x, kTraceRoleReduce);
            return;
        }
        __syncthreads();   // the simulation's block scratch is combine_recv's too: read before it is reused
    }
    if (blockIdx.x & 1) {
        combine_recv(s, a, row, c, tma, clk);
        clk.finish(s, blockIdx.x, kTraceRoleReduce);
        return;
    }
    if (s.num_ranks == 1) return;
    const int W = kCombineWarps / (s.num_ranks - 1), g = warp / W;
    if (g >= s.num_ranks - 1) return;
    combine_send(s, a, row, c, g, g + (g >= s.rank), warp % W, W, lane, tma, clk);
    clk.finish(s, blockIdx.x, kTraceRoleSend);
}

}  // namespace

#if !defined(PYEP_LL_CPU_SIM)
void launch_combine(const NormalStatic& s, const CombineArgs& a, uint64_t stream) {
    check_static(s);
    auto bad = [](const std::string& m) { throw std::invalid_argument("normal combine: " + m); };
    if (a.ring_tokens < 2) bad("the ring must hold at least 2 rows");
    if (a.hidden < 128 || a.hidden % 128) bad("hidden must be a positive multiple of 128");
    if (a.num_topk < 0 || a.num_topk > kMaxTopk) bad("num_topk must be in [0, 16]");
    check_rings(s, "normal combine", a.num_channels, a.ring_tokens, combine_row_bytes(a.hidden, a.num_topk), a.hidden);
    // Two bulk-copy stages per warp (normal_tma.cuh): the senders' stores, the reduce's loads.
    constexpr int smem = tma_smem_bytes(kCombineWarps);
    const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    if (s.trace) {   // the traced build (normal_trace.cuh), on words zeroed for this call (all of them:
                     // a reader tells the call's blocks by their role, whatever its channel count)
        const cudaError_t z = cudaMemsetAsync(reinterpret_cast<void*>(s.trace), 0,
                                              (size_t)2 * kMaxChannels * kTraceWords * 8, st);
        if (z != cudaSuccess) throw std::runtime_error(std::string("normal combine trace: ") + cudaGetErrorString(z));
    }
    // One flag word per build: each reserves its shared memory once per device.
    static std::atomic<uint64_t> smem_devices[4];
    auto run = [&](auto kernel, int which, const char* what) {
        reserve_stage_smem(kernel, smem, smem_devices[which], what);
        kernel<<<2 * a.num_channels, kCombineThreads, smem, st>>>(s, a);
    };
    if (s.trace && a.pull) run(combine<true, true>, 3, "normal combine (traced, pull)");
    else if (s.trace) run(combine<true, false>, 2, "normal combine (traced)");
    else if (a.pull) run(combine<false, true>, 1, "normal combine (pull)");
    else run(combine<false, false>, 0, "normal combine");
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw std::runtime_error(std::string("normal combine launch: ") + cudaGetErrorString(e));
}
#endif  // !PYEP_LL_CPU_SIM

}  // namespace normal
}  // namespace pyep
