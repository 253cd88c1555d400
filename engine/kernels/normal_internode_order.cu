// The staged internode dispatch's bookkeeping on the device (docs/normal_internode.md, step 6-7):
//   inter_order        from the count records every rank gathered, the contract's rank_prefix_matrix,
//                      the row map from the intranode kernels' (forwarder l, source node a, token) order
//                      to the contract's (source rank a*P + l, token) order, and this rank's per-expert
//                      counts (to pinned host words when the host waits for them);
//   inter_recv_prefix  the recv_channel_prefix_matrix from the received rows' source indices.
// pyep/ep/normal/internode_order.py states the same functions in torch ops; it is the executable
// specification the CPU tests check and tests/test_normal_internode_gpu.py holds these kernels to. One
// launch each instead of ~40 small torch kernels and a device-to-host copy that waited for the dispatch.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "kernels/normal_common.cuh"
#include "kernels/normal_internode.h"

namespace pyep {
namespace normal {
namespace {

constexpr int kOrderThreads = 256;
constexpr int kMaxGroupRanks = kMaxNodes * kMaxRanks;   // R <= 256

// Word i of source rank s's record: the node's notify gathered them as [forwarder l][source node a]
// with s = a * P + l (internode_order.records_by_source).
__device__ __forceinline__ int record(const OrderArgs& a, const InterStatic& s, int src, int i) {
    const int P = s.ranks_per_node, M = s.num_nodes;
    return reinterpret_cast<const int*>(a.gathered)[(int64_t)(src % P) * M * a.meta_ints + (src / P) * a.meta_ints + i];
}

// Every block rebuilds the R-entry tables (R <= 256: cheaper than a second launch), then maps its rows.
// Kernel order q = l * M + a; `ends` is the inclusive prefix of run sizes in that order, `shift` what
// turns a row of run q into its contract row (contract start - kernel start).
__global__ void __launch_bounds__(kOrderThreads) inter_order_kernel(InterStatic s, OrderArgs a) {
    __shared__ int ends[kMaxGroupRanks], shift[kMaxGroupRanks];
    const int R = s.num_ranks, M = s.num_nodes, P = s.ranks_per_node, me = s.rank;
    if (threadIdx.x == 0) {
        int contract = 0, kernel = 0;
        int start[kMaxGroupRanks];
        for (int src = 0; src < R; ++src) {          // contract order: source ranks ascending
            start[src] = contract;
            contract += record(a, s, src, 1 + me);
        }
        for (int q = 0; q < R; ++q) {                // kernel order: forwarder, then source node
            const int src = (q % M) * P + q / M;
            const int n = record(a, s, src, 1 + me);
            shift[q] = start[src] - kernel;
            kernel += n;
            ends[q] = kernel;
        }
    }
    __syncthreads();
    const int total = ends[R - 1];
    int* row_map = reinterpret_cast<int*>(a.row_map);
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < a.rows; k += gridDim.x * blockDim.x) {
        if (k >= total) {                            // padding under num_worst_tokens maps to itself
            row_map[k] = k;
            continue;
        }
        int lo = 0, hi = R - 1;                      // the first run whose end lies past k
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (ends[mid] > k) hi = mid; else lo = mid + 1;
        }
        row_map[k] = k + shift[lo];
    }
    if (blockIdx.x != 0) return;
    int* rpm = reinterpret_cast<int*>(a.rank_prefix);
    for (int j = threadIdx.x; j < R; j += blockDim.x) {
        int acc = 0;
        for (int i = 0; i < R; ++i) {
            acc += record(a, s, i, 1 + j);
            rpm[i * R + j] = acc;
        }
    }
    if (!a.host_counts) return;
    // Per-expert counts of this rank's experts, summed over sources, aligned; then the ticket, behind a
    // system-scope fence, so the host that sees the ticket reads complete counts.
    int* host = reinterpret_cast<int*>(a.host_counts);
    const int El = a.num_experts / R, first = 1 + R + me * El;
    for (int e = threadIdx.x; e < El; e += blockDim.x) {
        int sum = 0;
        for (int src = 0; src < R; ++src) sum += record(a, s, src, first + e);
        host[1 + e] = (sum + a.alignment - 1) / a.alignment * a.alignment;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        st_release_sys(host, a.host_ticket);
    }
}

// Thread per (source s, channel c): rows of s's run whose source token lies before channel c, i.e.
// before c * ceil(N_s / C). A run holds s's tokens ascending (the contract order), so that is a lower
// bound by binary search -- no atomics, and the result does not depend on scheduling.
__global__ void __launch_bounds__(kOrderThreads) inter_recv_prefix_kernel(InterStatic s, OrderArgs a) {
    const int R = s.num_ranks, C = a.num_channels, me = s.rank;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= R * C) return;
    const int src = i / C, c = i % C;
    const int* rpm = reinterpret_cast<const int*>(a.rank_prefix);
    const int* recv_src = reinterpret_cast<const int*>(a.recv_src);
    // Clamped to the rows received: more than num_worst_tokens were dropped (and recorded by the notify).
    const int begin = min(src ? rpm[(src - 1) * R + me] : 0, a.rows), end = min(rpm[src * R + me], a.rows);
    const int per = max(1, (record(a, s, src, 0) + C - 1) / C);
    const int64_t bound = (int64_t)c * per;
    int lo = begin, hi = end;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (recv_src[mid] < bound) lo = mid + 1; else hi = mid;
    }
    reinterpret_cast<int*>(a.recv_channel_prefix)[src * C + c] = lo - begin;
}

void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

void check_order(const InterStatic& s, const OrderArgs& a) {
    auto bad = [](const std::string& m) { throw std::invalid_argument("normal internode order: " + m); };
    if (s.num_nodes < 2 || s.num_nodes > kMaxNodes || s.ranks_per_node < 1 || s.ranks_per_node > kMaxRanks ||
        s.num_ranks != s.num_nodes * s.ranks_per_node || s.rank < 0 || s.rank >= s.num_ranks)
        bad("bad group");
    if (!a.gathered || a.meta_ints < 1 + s.num_ranks) bad("the gathered records need meta_ints >= 1 + num_ranks");
}

}  // namespace

void launch_inter_order(const InterStatic& s, const OrderArgs& a, uint64_t stream) {
    check_order(s, a);
    if (a.rows < 0 || !a.row_map || !a.rank_prefix) throw std::invalid_argument("inter_order: outputs must be set");
    if (a.host_counts && (a.num_experts % s.num_ranks || a.alignment < 1 || a.host_ticket == 0 ||
                          1 + s.num_ranks + a.num_experts > a.meta_ints))
        throw std::invalid_argument("inter_order: host counts need E % R == 0, alignment >= 1, a ticket, E in the record");
    const int blocks = std::max(1, std::min(132, (a.rows + kOrderThreads - 1) / kOrderThreads));
    inter_order_kernel<<<blocks, kOrderThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(s, a);
    check(cudaGetLastError(), "inter_order launch");
}

void launch_inter_recv_prefix(const InterStatic& s, const OrderArgs& a, uint64_t stream) {
    check_order(s, a);
    if (a.num_channels < 1 || a.num_channels > kMaxChannels || !a.rank_prefix || !a.recv_channel_prefix)
        throw std::invalid_argument("inter_recv_prefix: num_channels in [1, 64] and the matrices must be set");
    const int threads = s.num_ranks * a.num_channels;
    inter_recv_prefix_kernel<<<(threads + kOrderThreads - 1) / kOrderThreads, kOrderThreads, 0,
                               reinterpret_cast<cudaStream_t>(stream)>>>(s, a);
    check(cudaGetLastError(), "inter_recv_prefix launch");
}

}  // namespace normal
}  // namespace pyep
