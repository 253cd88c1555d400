// The staged normal mode across nodes (docs/normal_internode.md), the kernels around the RDMA relay
// (normal_internode_relay.cu) and the intranode kernels run on a node's forwarded rows:
//   inter_layout  get_dispatch_layout for R = M * P ranks (and num_tokens_per_rdma_rank);
//   inter_route   send_head / channel_prefix_matrix of the contract for all R ranks, each token's
//                 position in the column stream to every node (node_head), and this rank's record for
//                 the all-gather of row counts (N, rows for every rank);
//   inter_offsets where each node's run starts in the forwarded rows (F) and in the relayed rows;
//   inter_pack    a token's relay row once per node that needs it (own node's run straight into F);
//   inter_unpack  the small fields of the forwarded rows for the intranode kernels (ids node-local),
//                 which read the payloads in place;
//   inter_reduce  combine's last step at the source: 0 + bias_0 + bias_1 + the BF16 partial of every
//                 node in ascending order, in fp32, one rounding (contract.combine_order).
// None of them waits for a peer: the waits are the relay's and the intranode kernels'.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/normal_common.cuh"
#include "kernels/normal_internode.h"

namespace pyep {
namespace normal {
namespace {

constexpr int kInterThreads = 256;
constexpr int kMetaThreads = 1024;

// The node buffer's error record (normal_common.cuh record_error takes the node's NormalStatic).
__device__ void inter_error(const InterStatic& s, int code, int a, int b, int c) {
    record_error_words(s.err, s.workspace, code, a, b, c);
}

// Rank r in this call by the buffer's mask (docs/elastic.md, "Normal mode"); a rank whose own entry is 0
// takes part in nothing, as inside a node (normal_common.cuh mask_bits).
__device__ __forceinline__ bool rank_active(const InterStatic& s, int r) {
    if (!s.active) return true;
    const volatile int* act = reinterpret_cast<const volatile int*>(s.active);
    return act[s.rank] != 0 && act[r] != 0;
}
// Node m's column peer stayed in the call (the relay's kWsMask word; no word: no mask).
__device__ __forceinline__ bool column_in_call(uint64_t column_mask, int m) {
    return !column_mask || ((uint32_t)ld_volatile(reinterpret_cast<const int*>(column_mask)) >> m) & 1u;
}

// One thread per token: its ranks and nodes as bit sets (R <= kMaxNodes * kMaxRanks), the counters by
// global atomics (the host zeroed them). Ids outside [-1, E) count as -1 and are recorded.
__global__ void __launch_bounds__(kInterThreads) inter_layout_kernel(InterStatic s, InterLayoutArgs a) {
    const int E = a.num_experts, R = s.num_ranks, El = E / R, K = a.num_topk, P = contract_p(s);
    const int64_t* topk = reinterpret_cast<const int64_t*>(a.topk);
    bool* in_rank = reinterpret_cast<bool*>(a.in_rank);
    int* per_expert = reinterpret_cast<int*>(a.per_expert);
    int* per_rank = reinterpret_cast<int*>(a.per_rank);
    int* per_node = reinterpret_cast<int*>(a.per_node);
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < a.num_tokens; t += gridDim.x * blockDim.x) {
        uint32_t ranks[kMaxNodes * kMaxRanks / 32] = {};
        uint32_t nodes = 0;
        for (int k = 0; k < K; ++k) {
            const int64_t v = topk[(int64_t)t * K + k];
            if (v == -1) continue;
            if (v < -1 || v >= E) {
                inter_error(s, kErrExpertId, t, k, (int)v);
                continue;
            }
            const int r = (int)(v / El);
            if (!rank_active(s, r)) {   // left out: its column and experts stay 0, the token is dropped there
                if (a.dropped && !((ranks[r / 32] >> (r % 32)) & 1u)) atomicAdd(reinterpret_cast<int*>(a.dropped) + r, 1);
                ranks[r / 32] |= 1u << (r % 32);
                continue;
            }
            atomicAdd(per_expert + v, 1);
            ranks[r / 32] |= 1u << (r % 32);
            nodes |= 1u << (r / P);
        }
        for (int r = 0; r < R; ++r) {
            const bool in = ((ranks[r / 32] >> (r % 32)) & 1u) && rank_active(s, r);
            in_rank[(int64_t)t * R + r] = in;
            if (in) atomicAdd(per_rank + r, 1);
        }
        for (int m = 0; m < R / P; ++m)
            if ((nodes >> m) & 1u) atomicAdd(per_node + m, 1);
    }
}

// Block c, warp w: destinations d = w, w + 8, ...: positions of channel c's tokens in the (c, -> d)
// stream (send_head) and the stream's row count (channel_prefix, raw; inter_meta turns it into the
// inclusive prefix). Warp 0 checks the channel's top-k ids, as normal_route_kernel does.
__global__ void __launch_bounds__(kInterThreads) inter_route_kernel(InterStatic s, InterRouteArgs a) {
    const int c = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32, R = s.num_ranks;
    int t0, t1;
    channel_range(a.num_tokens, a.num_channels, c, t0, t1);
    const bool* in_rank = reinterpret_cast<const bool*>(a.in_rank);
    int* send_head = reinterpret_cast<int*>(a.send_head);
    for (int d = warp; d < R; d += kInterThreads / 32) {
        int pos = 0;
        if (rank_active(s, d)) {
            pos = route_to_peer(in_rank, send_head, R, d, t0, t1, lane);
        } else {   // out of the call: no stream to it (a layout made with an older mask is accepted)
            for (int t = t0 + lane; t < t1; t += 32) send_head[(int64_t)t * R + d] = -1;
        }
        if (lane == 0) reinterpret_cast<int*>(a.channel_prefix)[d * a.num_channels + c] = pos;
    }
    if (!a.topk) return;
    const int64_t* topk = reinterpret_cast<const int64_t*>(a.topk);
    const int E = a.num_experts, K = a.num_topk, El = E / R;
    if (warp == 0)
        check_topk_ids(topk, K, E, t0, t1, lane, [&](int row, int k, int v) { inter_error(s, kErrExpertId, row, k, v); });
    if (a.dropped && s.active) {
        // Tokens routed (topk_idx) to ranks out of the call, once per (token, rank): the dispatch's drops.
        for (int t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
            uint32_t ranks[kMaxNodes * kMaxRanks / 32] = {};
            for_valid_ids(topk, t, K, E, [&](int64_t v) {
                const int r = (int)(v / El);
                if (!rank_active(s, r) && !((ranks[r / 32] >> (r % 32)) & 1u))
                    atomicAdd(reinterpret_cast<int*>(a.dropped) + r, 1);
                ranks[r / 32] |= 1u << (r % 32);
            });
        }
    }
    if (!a.check_layout) return;
    // The caller's is_token_in_rank against topk_idx (a thread per token), and topk_idx's entries per
    // expert for inter_meta to compare with num_tokens_per_expert (normal_route_kernel does the same).
    for (int t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
        uint32_t ranks[kMaxNodes * kMaxRanks / 32] = {};
        for_valid_ids(topk, t, K, E, [&](int64_t v) {
            const int r = (int)(v / El);
            ranks[r / 32] |= 1u << (r % 32);
            atomicAdd(reinterpret_cast<int*>(a.layout_scratch) + v, 1);
        });
        for (int r = 0; r < R; ++r) {
            const bool said = in_rank[(int64_t)t * R + r], wants = (ranks[r / 32] >> (r % 32)) & 1u;
            // A rank out of the call: a layout made with the mask has its column 0, an older one not.
            if (said != wants && rank_active(s, r)) inter_error(s, kErrInRank, t, r, said ? 1 : 0);
        }
    }
}

// One block after inter_route: the inclusive channel prefix and rows per rank (threads d < R), and
// warp m's scan of the node stream m (node_head, node_counts). Then the count record.
__global__ void __launch_bounds__(kMetaThreads) inter_meta_kernel(InterStatic s, InterRouteArgs a) {
    const int R = s.num_ranks, M = s.num_nodes, P = s.ranks_per_node, C = a.num_channels;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int* cpm = reinterpret_cast<int*>(a.channel_prefix);
    int* meta_own = reinterpret_cast<int*>(a.meta_own);
    for (int d = threadIdx.x; d < R; d += blockDim.x) {
        int acc = 0;
        for (int c = 0; c < C; ++c) {
            acc += cpm[d * C + c];
            cpm[d * C + c] = acc;
        }
        meta_own[1 + d] = acc;
        const int* claimed = reinterpret_cast<const int*>(a.per_rank);
        // A rank out of the call: a layout made with an older mask still counts it (accepted).
        if (claimed && rank_active(s, d) && claimed[d] != acc) inter_error(s, kErrRankCount, d, claimed[d], acc);
    }
    const int* per_expert = reinterpret_cast<const int*>(a.per_expert);
    const int* counted = reinterpret_cast<const int*>(a.layout_scratch);
    for (int e = threadIdx.x; per_expert && e < a.num_experts; e += blockDim.x) {
        // An expert of a rank out of the call: a layout made with the mask counts it 0, an older one not.
        if (per_expert[e] < 0) inter_error(s, kErrExpertCount, e, per_expert[e], -1);
        else if (a.check_layout && per_expert[e] != counted[e] && rank_active(s, e / (a.num_experts / R)))
            inter_error(s, kErrExpertCount, e, per_expert[e], counted[e]);
    }
    if (threadIdx.x == 0) meta_own[0] = a.num_tokens;
    for (int i = 1 + R + threadIdx.x; i < a.meta_ints; i += blockDim.x) meta_own[i] = 0;
    const bool* in_rank = reinterpret_cast<const bool*>(a.in_rank);
    int* node_head = reinterpret_cast<int*>(a.node_head);
    for (int m = warp; m < M; m += kMetaThreads / 32) {
        int pos = 0;
        for (int base = 0; base < a.num_tokens; base += 32) {
            const int t = base + lane;
            bool in = false;
            for (int j = 0; j < P && t < a.num_tokens; ++j) in |= in_rank[(int64_t)t * R + m * P + j] && rank_active(s, m * P + j);
            const uint32_t mask = __ballot_sync(0xffffffffu, in);
            if (t < a.num_tokens) node_head[(int64_t)t * M + m] = in ? pos + __popc(mask & ((1u << lane) - 1)) : -1;
            pos += __popc(mask);
        }
        if (lane == 0) reinterpret_cast<int*>(a.node_counts)[m] = pos;
        const int* claimed = reinterpret_cast<const int*>(a.per_node);
        bool whole = true;   // a node with a rank out of the call: the caller's count may predate the mask
        for (int j = 0; j < P; ++j) whole &= rank_active(s, m * P + j);
        if (lane == 0 && claimed && whole && contract_p(s) == P && claimed[m] != pos)
            inter_error(s, kErrNodeCount, m, claimed[m], pos);
    }
    // The caller's nodes differ from the data path's: their counts checked the same way, from in_rank.
    const int Pc = contract_p(s);
    for (int n = warp; Pc != P && a.per_node && n < R / Pc; n += kMetaThreads / 32) {
        int count = 0;
        bool whole = true;
        for (int j = 0; j < Pc; ++j) whole &= rank_active(s, n * Pc + j);
        for (int base = 0; base < a.num_tokens; base += 32) {
            const int t = base + lane;
            bool in = false;
            for (int j = 0; j < Pc && t < a.num_tokens; ++j) in |= in_rank[(int64_t)t * R + n * Pc + j] != 0;
            count += __popc(__ballot_sync(0xffffffffu, in));
        }
        const int claimed = reinterpret_cast<const int*>(a.per_node)[n];
        if (lane == 0 && whole && claimed != count) inter_error(s, kErrNodeCount, n, claimed, count);
    }
    __syncthreads();
    int* meta = reinterpret_cast<int*>(a.meta);
    for (int i = threadIdx.x; i < M * a.meta_ints; i += blockDim.x) meta[i] = meta_own[i % a.meta_ints];
}

__global__ void inter_offsets_kernel(InterStatic s, InterOffsetsArgs a) {
    const int M = s.num_nodes;
    const int* nc = reinterpret_cast<const int*>(a.node_counts);
    const int* rc = reinterpret_cast<const int*>(a.recv_counts);
    int* f = reinterpret_cast<int*>(a.f_offsets);
    int* so = reinterpret_cast<int*>(a.s_offsets);
    f[0] = so[0] = 0;
    for (int m = 0; m < M; ++m) {
        f[m + 1] = f[m] + (m == s.node ? nc[m] : rc[m]);
        so[m + 1] = so[m] + (m == s.node ? 0 : nc[m]);
    }
}

// Warp per token; one relay row per node that needs the token.
__global__ void __launch_bounds__(kInterThreads) inter_pack_kernel(InterStatic s, InterPackArgs a) {
    const int M = s.num_nodes, P = s.ranks_per_node, R = s.num_ranks, K = a.num_topk;
    const RelayRow row(a.hidden, a.fp8, K, P, a.full);
    const int lane = threadIdx.x % 32, groups = a.hidden / 128;
    const int* node_head = reinterpret_cast<const int*>(a.node_head);
    const int* f_off = reinterpret_cast<const int*>(a.f_offsets);
    const int* s_off = reinterpret_cast<const int*>(a.s_offsets);
    const uint8_t* x = reinterpret_cast<const uint8_t*>(a.x);
    const float* scales = reinterpret_cast<const float*>(a.x_scales);
    const int64_t* topk = reinterpret_cast<const int64_t*>(a.topk_idx);
    const float* weights = reinterpret_cast<const float*>(a.topk_weights);
    const bool* in_rank = reinterpret_cast<const bool*>(a.in_rank);
    const int warps = gridDim.x * blockDim.x / 32;
    for (int t = (blockIdx.x * blockDim.x + threadIdx.x) / 32; t < a.num_tokens; t += warps) {
        for (int m = 0; m < M; ++m) {
            const int h = node_head[(int64_t)t * M + m];
            if (h < 0) continue;
            uint8_t* dst;
            if (m == s.node) {
                const int f = f_off[m] + h;
                if (f >= a.f_capacity) continue;   // beyond num_worst_tokens' bound: recorded by notify
                dst = reinterpret_cast<uint8_t*>(a.forward) + (uint64_t)f * row.bytes;
            } else {
                dst = reinterpret_cast<uint8_t*>(a.send) + (uint64_t)(s_off[m] + h) * row.bytes;
            }
            warp_copy(dst, x + (uint64_t)t * row.payload, row.payload, lane);
            if (a.fp8)
                for (int g = lane; g < groups; g += 32)
                    reinterpret_cast<float*>(dst + row.scales)[g] = scales[(int64_t)t * groups + g];
            if (!a.full) continue;
            if (lane < K) {
                reinterpret_cast<int64_t*>(dst + row.ids)[lane] = topk ? topk[(int64_t)t * K + lane] : -1;
                reinterpret_cast<float*>(dst + row.weights)[lane] = weights ? weights[(int64_t)t * K + lane] : 0.f;
            }
            if (lane < P) dst[row.in_rank + lane] = in_rank[(int64_t)t * R + m * P + lane] && rank_active(s, m * P + lane) ? 1 : 0;
            if (lane == 0) reinterpret_cast<int*>(dst + row.src)[0] = t;
        }
    }
}

// Warp per forwarded row: its fields out of the relay row, in one pass (see InterUnpackArgs).
__global__ void __launch_bounds__(kInterThreads) inter_unpack_kernel(InterStatic s, InterUnpackArgs a) {
    const int P = s.ranks_per_node, K = a.num_topk, groups = a.hidden / 128, lane = threadIdx.x % 32;
    const RelayRow row(a.hidden, a.fp8, K, P, 1);
    const int real = reinterpret_cast<const int*>(a.f_offsets)[s.num_nodes];
    const int64_t lo = (int64_t)s.node * P * a.num_local_experts, span = (int64_t)P * a.num_local_experts;
    const int warps = gridDim.x * blockDim.x / 32;
    const int* f_off = reinterpret_cast<const int*>(a.f_offsets);
    if (a.records) {   // records of source nodes out of the call (never relayed, or cut off) read as empty,
                       // and so do every record's rows for the ranks of such a node
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < s.num_nodes * a.record_ints; i += gridDim.x * blockDim.x) {
            const int j = i % a.record_ints - 1;
            if (!column_in_call(a.column_mask, i / a.record_ints) ||
                (j >= 0 && j < s.num_ranks && !column_in_call(a.column_mask, j / P)))
                reinterpret_cast<int*>(a.records)[i] = 0;
        }
    }
    for (int f = (blockIdx.x * blockDim.x + threadIdx.x) / 32; f < a.rows; f += warps) {
        int m = 0;   // the row's source node (f_offsets' runs)
        while (m + 1 < s.num_nodes && f >= f_off[m + 1]) ++m;
        const bool kept = column_in_call(a.column_mask, m);
        const uint8_t* r = reinterpret_cast<const uint8_t*>(a.forward) + (uint64_t)f * row.bytes;
        if (a.scales)
            for (int g = lane; g < groups; g += 32)
                reinterpret_cast<float*>(a.scales)[(int64_t)f * groups + g] = reinterpret_cast<const float*>(r + row.scales)[g];
        if (lane < K) {
            if (a.ids) {
                const int64_t v = reinterpret_cast<const int64_t*>(r + row.ids)[lane];
                reinterpret_cast<int64_t*>(a.ids)[(int64_t)f * K + lane] = v >= lo && v < lo + span ? v - lo : -1;
            }
            if (a.weights)
                reinterpret_cast<float*>(a.weights)[(int64_t)f * K + lane] = reinterpret_cast<const float*>(r + row.weights)[lane];
        }
        if (lane < P) reinterpret_cast<bool*>(a.in_rank)[(int64_t)f * P + lane] = kept && f < real && r[row.in_rank + lane] != 0;
        if (lane == 0) reinterpret_cast<int*>(a.src)[f] = reinterpret_cast<const int*>(r + row.src)[0];
    }
}

// Thread per token (InterSettleArgs); block 0 also zeroes the channel_prefix rows.
__global__ void __launch_bounds__(kInterThreads) inter_settle_kernel(InterStatic s, InterSettleArgs a) {
    const int M = s.num_nodes, P = s.ranks_per_node, R = s.num_ranks;
    int* node_head = reinterpret_cast<int*>(a.node_head);
    int* send_head = reinterpret_cast<int*>(a.send_head);
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < a.num_tokens; t += gridDim.x * blockDim.x) {
        for (int m = 0; m < M; ++m) {
            if (m == s.node || column_in_call(a.column_mask, m)) continue;
            node_head[(int64_t)t * M + m] = -1;
            for (int j = 0; j < P; ++j) {
                int* h = send_head + (int64_t)t * R + m * P + j;
                if (*h >= 0 && a.dropped) atomicAdd(reinterpret_cast<int*>(a.dropped) + m * P + j, 1);
                *h = -1;
            }
        }
    }
    if (blockIdx.x == 0)
        for (int i = threadIdx.x; i < R * a.num_channels; i += blockDim.x)
            if (!column_in_call(a.column_mask, i / a.num_channels / P) && i / a.num_channels / P != s.node)
                reinterpret_cast<int*>(a.channel_prefix)[i] = 0;
}

// Warp per forwarded row of a source node out of the call: zero bytes (InterEmptyArgs).
__global__ void __launch_bounds__(kInterThreads) inter_empty_kernel(InterStatic s, InterEmptyArgs a) {
    const int* f_off = reinterpret_cast<const int*>(a.f_offsets);
    const int lane = threadIdx.x % 32, warps = gridDim.x * blockDim.x / 32;
    for (int f = (blockIdx.x * blockDim.x + threadIdx.x) / 32; f < a.rows; f += warps) {
        int m = 0;
        while (m + 1 < s.num_nodes && f >= f_off[m + 1]) ++m;
        if (m == s.node || column_in_call(a.column_mask, m)) continue;
        uint8_t* r = reinterpret_cast<uint8_t*>(a.forward) + (uint64_t)f * a.row_bytes;
        for (int i = lane * 16; i < a.row_bytes; i += 32 * 16) *reinterpret_cast<int4*>(r + i) = make_int4(0, 0, 0, 0);
    }
}

// Warp per token: acc = 0, + bias_0, + bias_1, + part_n for n ascending (fp32), one rounding.
__global__ void __launch_bounds__(kInterThreads) inter_reduce_kernel(InterStatic s, InterReduceArgs a) {
    const int M = s.num_nodes, K = a.num_topk, lane = threadIdx.x % 32, vecs = a.hidden / 8;
    const int* node_head = reinterpret_cast<const int*>(a.node_head);
    const int* f_off = reinterpret_cast<const int*>(a.f_offsets);
    const int* s_off = reinterpret_cast<const int*>(a.s_offsets);
    const int warps = gridDim.x * blockDim.x / 32;
    for (int t = (blockIdx.x * blockDim.x + threadIdx.x) / 32; t < a.num_tokens; t += warps) {
        const int4* parts[kMaxNodes];
        const float* wparts[kMaxNodes];
        int group[kMaxNodes];   // each part's node of the contract (contract.combine_order sums a BF16 partial per node)
        int n = 0;
        for (int m = 0; m < M; ++m) {
            const int h = node_head[(int64_t)t * M + m];
            if (h < 0) continue;
            if (m != s.node && !column_in_call(a.column_mask, m)) {
                // Node m left the call after the dispatch sent it this token: its part never came back.
                if (lane == 0 && a.dropped) atomicAdd(reinterpret_cast<int*>(a.dropped) + m, 1);
                continue;
            }
            if (m == s.node) {
                const int64_t f = f_off[m] + h;
                parts[n] = reinterpret_cast<const int4*>(a.own) + f * vecs;
                wparts[n] = a.own_weights ? reinterpret_cast<const float*>(a.own_weights) + f * K : nullptr;
            } else {
                const uint8_t* r = reinterpret_cast<const uint8_t*>(a.recv) + (uint64_t)(s_off[m] + h) * a.row_bytes;
                parts[n] = reinterpret_cast<const int4*>(r);
                wparts[n] = reinterpret_cast<const float*>(r + 2 * a.hidden);
            }
            group[n] = m * s.ranks_per_node / contract_p(s);
            ++n;
        }
        const int4* b0 = a.bias0 ? reinterpret_cast<const int4*>(a.bias0) + (int64_t)t * vecs : nullptr;
        const int4* b1 = a.bias1 ? reinterpret_cast<const int4*>(a.bias1) + (int64_t)t * vecs : nullptr;
        int4* out = reinterpret_cast<int4*>(a.out) + (int64_t)t * vecs;
        for (int v = lane; v < vecs; v += 32) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            if (b0) add_bf16x8(acc, b0[v]);
            if (b1) add_bf16x8(acc, b1[v]);
            for (int i = 0; i < n;) {
                // One node of the contract: its ranks' rows (one per data node here when the data path runs
                // rank to rank) summed in fp32 in rank order and rounded once; a node's single part is
                // already that partial (the node's combine computed it), and rounding a BF16 value is exact.
                float g[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                const int gi = group[i];
                for (; i < n && group[i] == gi; ++i) add_bf16x8(g, parts[i][v]);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] += __bfloat162float(__float2bfloat16_rn(g[e]));
            }
            int4 o;
            __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
            for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
            out[v] = o;
        }
        if (a.out_weights && lane < K) {
            float w = 0.f;
            for (int i = 0; i < n;) {   // the weights the same way, without rounding the partials
                float g = 0.f;
                const int gi = group[i];
                for (; i < n && group[i] == gi; ++i) g += wparts[i] ? wparts[i][lane] : 0.f;
                w += g;
            }
            reinterpret_cast<float*>(a.out_weights)[(int64_t)t * K + lane] = w;
        }
    }
}

void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

void check_inter(const InterStatic& s) {
    auto bad = [](const std::string& m) { throw std::invalid_argument("normal internode: " + m); };
    if (s.num_nodes < 2 || s.num_nodes > kMaxNodes) bad("num_nodes must be in [2, 32]");
    if (s.ranks_per_node < 1 || s.ranks_per_node > kMaxRanks) bad("ranks_per_node must be in [1, 8]");
    if (s.contract_ranks_per_node < 0 || s.contract_ranks_per_node > kMaxRanks ||
        s.num_ranks % contract_p(s) || (s.contract_ranks_per_node > 0 && s.ranks_per_node != 1))
        bad("contract_ranks_per_node must divide num_ranks, with a data path of one rank per node");
    if (s.num_ranks != s.num_nodes * s.ranks_per_node) bad("num_ranks != num_nodes * ranks_per_node");
    if (s.rank < 0 || s.rank >= s.num_ranks || s.node != s.rank / s.ranks_per_node) bad("rank / node mismatch");
    if (!s.err || !s.workspace) bad("error record pointers must be set");
}

int grid_for(int warps_needed) { return std::max(1, std::min(264, (warps_needed * 32 + kInterThreads - 1) / kInterThreads)); }

}  // namespace

void launch_inter_layout(const InterStatic& s, const InterLayoutArgs& a, uint64_t stream) {
    check_inter(s);
    if (a.num_experts < s.num_ranks || a.num_experts % s.num_ranks) throw std::invalid_argument("bad num_experts");
    if (a.num_topk < 1 || a.num_topk > kMaxTopk) throw std::invalid_argument("num_topk must be in [1, 16]");
    auto st = reinterpret_cast<cudaStream_t>(stream);
    check(cudaMemsetAsync(reinterpret_cast<void*>(a.per_rank), 0, 4ull * s.num_ranks, st), "memset");
    check(cudaMemsetAsync(reinterpret_cast<void*>(a.per_expert), 0, 4ull * a.num_experts, st), "memset");
    check(cudaMemsetAsync(reinterpret_cast<void*>(a.per_node), 0, 4ull * (s.num_ranks / contract_p(s)), st), "memset");
    if (a.num_tokens == 0) return;
    const int blocks = std::min(132, (a.num_tokens + kInterThreads - 1) / kInterThreads);
    inter_layout_kernel<<<blocks, kInterThreads, 0, st>>>(s, a);
    check(cudaGetLastError(), "inter_layout launch");
}

void launch_inter_route(const InterStatic& s, const InterRouteArgs& a, uint64_t stream) {
    check_inter(s);
    if (a.num_channels < 1 || a.num_channels > kMaxChannels) throw std::invalid_argument("num_channels must be in [1, 64]");
    if (a.meta_ints < 1 + s.num_ranks) throw std::invalid_argument("meta_ints must be >= 1 + num_ranks");
    if (a.check_layout && (!a.topk || !a.layout_scratch)) throw std::invalid_argument("check_layout needs topk and a scratch");
    auto st = reinterpret_cast<cudaStream_t>(stream);
    if (a.check_layout) check(cudaMemsetAsync(reinterpret_cast<void*>(a.layout_scratch), 0, 4ull * a.num_experts, st), "memset");
    inter_route_kernel<<<a.num_channels, kInterThreads, 0, st>>>(s, a);
    check(cudaGetLastError(), "inter_route launch");
    inter_meta_kernel<<<1, kMetaThreads, 0, st>>>(s, a);
    check(cudaGetLastError(), "inter_meta launch");
}

void launch_inter_offsets(const InterStatic& s, const InterOffsetsArgs& a, uint64_t stream) {
    check_inter(s);
    inter_offsets_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(s, a);
    check(cudaGetLastError(), "inter_offsets launch");
}

void launch_inter_pack(const InterStatic& s, const InterPackArgs& a, uint64_t stream) {
    check_inter(s);
    if (a.hidden < 128 || a.hidden % 128) throw std::invalid_argument("hidden must be a positive multiple of 128");
    if (a.num_topk < 0 || a.num_topk > kMaxTopk) throw std::invalid_argument("num_topk must be in [0, 16]");
    if (a.num_tokens == 0) return;
    inter_pack_kernel<<<grid_for(a.num_tokens), kInterThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(s, a);
    check(cudaGetLastError(), "inter_pack launch");
}

void launch_inter_unpack(const InterStatic& s, const InterUnpackArgs& a, uint64_t stream) {
    check_inter(s);
    if (a.hidden < 128 || a.hidden % 128) throw std::invalid_argument("hidden must be a positive multiple of 128");
    if (a.num_topk < 0 || a.num_topk > kMaxTopk) throw std::invalid_argument("num_topk must be in [0, 16]");
    if (a.records && (!a.column_mask || a.record_ints < 1))
        throw std::invalid_argument("inter_unpack: records need the column mask word and record_ints");
    if (a.rows == 0 && !a.records) return;   // nothing forwarded: the outputs are empty tensors (null pointers)
    if (a.rows > 0 && (!a.forward || !a.src || !a.in_rank || !a.f_offsets || (a.ids && a.num_local_experts < 1)))
        throw std::invalid_argument("inter_unpack: forward, src, in_rank, f_offsets (and num_local_experts with ids) must be set");
    inter_unpack_kernel<<<grid_for(std::max(a.rows, 1)), kInterThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(s, a);
    check(cudaGetLastError(), "inter_unpack launch");
}

void launch_inter_settle(const InterStatic& s, const InterSettleArgs& a, uint64_t stream) {
    check_inter(s);
    if (!a.column_mask || !a.node_head || !a.send_head || !a.channel_prefix || a.num_channels < 1)
        throw std::invalid_argument("inter_settle: the column mask, node_head, send_head and channel_prefix");
    const int blocks = std::max(1, std::min(132, (a.num_tokens + kInterThreads - 1) / kInterThreads));
    inter_settle_kernel<<<blocks, kInterThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(s, a);
    check(cudaGetLastError(), "inter_settle launch");
}

void launch_inter_empty(const InterStatic& s, const InterEmptyArgs& a, uint64_t stream) {
    check_inter(s);
    if (a.row_bytes <= 0 || a.row_bytes % 16 || !a.column_mask || !a.f_offsets)
        throw std::invalid_argument("inter_empty: row_bytes a positive multiple of 16, the column mask and f_offsets");
    if (a.rows == 0) return;
    inter_empty_kernel<<<grid_for(a.rows), kInterThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(s, a);
    check(cudaGetLastError(), "inter_empty launch");
}

void launch_inter_reduce(const InterStatic& s, const InterReduceArgs& a, uint64_t stream) {
    check_inter(s);
    if (a.hidden < 128 || a.hidden % 128) throw std::invalid_argument("hidden must be a positive multiple of 128");
    if (a.row_bytes % 16 || (uint64_t)a.row_bytes < 2ull * a.hidden + 4ull * a.num_topk)
        throw std::invalid_argument("combine relay rows must hold bf16[H] + fp32[K], 16-byte aligned");
    if (a.num_tokens == 0) return;
    inter_reduce_kernel<<<grid_for(a.num_tokens), kInterThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(s, a);
    check(cudaGetLastError(), "inter_reduce launch");
}

}  // namespace normal
}  // namespace pyep
