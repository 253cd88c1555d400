// The dispatch's one-copy row loops alone on the GPU, in a kernel of their own: normal_direct.cuh
// direct_send (this rank's rows into a "peer"'s outputs and staging rows; the peer's buffer is local
// memory here) and normal_dispatch.cu dispatch_self (own rows from x to the outputs), one block a
// channel, every token routed. Against the dispatch kernel's time at the same rows per block it shows
// what the kernel around the loops costs (its register allocation above all: docs/results/2026-11-27g).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -Iengine -DPYEP_WITH_CUDA=1 --expt-relaxed-constexpr \
//        tools/dev/one_copy_send_rate.cu -o /tmp/one_copy_send_rate && /tmp/one_copy_send_rate
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "kernels/normal_dispatch.cu"
#include "median_us.h"

// The launch's host checks (normal_dispatch.cu launch_dispatch, not called here) live in the engine.
namespace pyep {
namespace normal {
void check_static(const NormalStatic&) {}
void check_rings(const NormalStatic&, const char*, int, int, uint64_t, int) {}
uint64_t dispatch_row_bytes(int, int, int) { return 0; }
}  // namespace normal
}  // namespace pyep

// A named namespace: the included kernels' anonymous one would make an anonymous one here ambiguous.
namespace one_copy_send_rate {
using namespace pyep::normal;

constexpr int kRows = 8192, kTopk = 8, kRanks = 2;

// Block c: channel c of rank 0's rows, to rank 1 (own = false) or to itself (own = true).
__global__ void __launch_bounds__(kDispatchThreads, 1) loop_alone(NormalStatic s, DispatchArgs a, DirectPeer peer,
                                                                  bool own) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint8_t* smem = tma_shared();
    WarpTma t = tma_setup(smem, reinterpret_cast<uint64_t*>(smem + kTmaSmemData), warp, lane);
    const DispatchRow row(a.hidden, a.fp8, a.num_topk);
    const Group G{0, warp, kDispatchWarps, lane};
    if (own) dispatch_self(s, a, row, blockIdx.x, G, t);
    else direct_send(s, a, row, blockIdx.x, G, 1, peer, t);
    tma_drain(lane);
}

struct Case {
    const char* name;
    int hidden, fp8, colmajor, small_fields, use_tma, own;
};

template <typename T>
T* device(size_t count, int byte = 0) {
    T* p = nullptr;
    cudaMalloc(&p, count * sizeof(T));
    cudaMemset(p, byte, count * sizeof(T));
    return p;
}
}  // namespace one_copy_send_rate

int main() {
    using namespace one_copy_send_rate;
    const Case cases[] = {
        {"send fp8 col-major", 7168, 1, 1, 1, 3, 0}, {"send fp8 dense", 7168, 1, 0, 1, 3, 0},
        {"send fp8 bare", 7168, 1, 0, 0, 3, 0},      {"send bf16 H3584", 3584, 0, 0, 1, 3, 0},
        {"send bf16", 7168, 0, 0, 1, 3, 0},          {"send bf16 warp", 7168, 0, 0, 1, 0, 0},
        {"own fp8 col-major", 7168, 1, 1, 1, 3, 1},  {"own fp8 dense", 7168, 1, 0, 1, 3, 1},
        {"own fp8 warp", 7168, 1, 0, 1, 0, 1},       {"own bf16", 7168, 0, 0, 1, 3, 1}};
    const size_t x_bytes = (size_t)kRows * 14336, scale_bytes = (size_t)kRows * 64 * 4;
    const size_t stage_bytes = (size_t)kRows * stage_row_bytes(kTopk);
    uint8_t* own_buf = device<uint8_t>(1 << 20);
    uint8_t* peer_buf = device<uint8_t>(4096 + x_bytes + scale_bytes + stage_bytes);
    uint8_t* outs = device<uint8_t>(x_bytes + scale_bytes + (size_t)kRows * kTopk * 12 + kRows * 4);
    uint8_t* x = device<uint8_t>(x_bytes, 1);
    float* scales = device<float>((size_t)kRows * 64);
    float* weights = device<float>((size_t)kRows * kTopk);
    bool* in_rank = device<bool>((size_t)kRows * kRanks, 1);
    int* err = device<int>(8);
    int* workspace = device<int>(16);
    int* prefix = device<int>(64 * kRanks);        // channel_prefix_matrix (inclusive)
    int* recv_prefix = device<int>(64 * kRanks);   // recv_channel_prefix_matrix (exclusive)
    int* rank_prefix = device<int>(kRanks * kRanks);
    int64_t* topk = device<int64_t>((size_t)kRows * kTopk);
    std::vector<int64_t> ids((size_t)kRows * kTopk);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = (int64_t)((i * 37) % 256);
    cudaMemcpy(topk, ids.data(), ids.size() * sizeof(int64_t), cudaMemcpyHostToDevice);
    uint64_t* bases = device<uint64_t>(kRanks);
    const uint64_t host_bases[kRanks] = {(uint64_t)own_buf, (uint64_t)peer_buf};
    cudaMemcpy(bases, host_bases, sizeof(host_bases), cudaMemcpyHostToDevice);

    NormalStatic s;
    s.rank = 0;
    s.num_ranks = kRanks;
    s.buf = (uint64_t)own_buf;
    s.peer_base = (uint64_t)bases;
    s.off_tail = 0, s.off_head = 1024, s.off_tx = 2048, s.off_rx = 3072;
    s.err = (uint64_t)err;
    s.workspace = (uint64_t)workspace;
    s.timeout_ns = 1000000000ull;
    cudaFuncSetAttribute(loop_alone, cudaFuncAttributeMaxDynamicSharedMemorySize, kTmaSmemBytes);

    const int grid[] = {6, 12, 24};
    std::printf("%d rows of rank 0, one block a channel: us, and payload GB/s (read + write) per SM\n%-20s", kRows,
                "case");
    for (int b : grid) std::printf(" %8s blocks %2d", "", b);
    std::printf("\n");
    for (const Case& k : cases) {
        std::printf("%-20s", k.name);
        for (int C : grid) {
            std::vector<int> incl(64 * kRanks, 0), excl(64 * kRanks, 0), ranks(kRanks * kRanks, 0);
            for (int c = 0; c < C; ++c) {
                const int per = (kRows + C - 1) / C, t0 = std::min(per * c, kRows), t1 = std::min(t0 + per, kRows);
                incl[c] = incl[C + c] = t1;
                excl[c] = t0;
            }
            ranks[0] = kRows;
            cudaMemcpy(prefix, incl.data(), incl.size() * sizeof(int), cudaMemcpyHostToDevice);
            cudaMemcpy(recv_prefix, excl.data(), excl.size() * sizeof(int), cudaMemcpyHostToDevice);
            cudaMemcpy(rank_prefix, ranks.data(), ranks.size() * sizeof(int), cudaMemcpyHostToDevice);
            DispatchArgs a;
            a.x = (uint64_t)x;
            a.fp8 = k.fp8;
            a.hidden = k.hidden;
            a.num_topk = kTopk;
            a.num_local_experts = 128;
            a.x_scales = k.fp8 ? (uint64_t)scales : 0;
            if (k.colmajor) a.scale_token_stride = 1, a.scale_group_stride = kRows;
            a.topk_idx = k.small_fields ? (uint64_t)topk : 0;
            a.topk_weights = k.small_fields ? (uint64_t)weights : 0;
            a.is_token_in_rank = (uint64_t)in_rank;
            a.channel_prefix_matrix = (uint64_t)prefix;
            a.recv_channel_prefix_matrix = (uint64_t)recv_prefix;
            a.rank_prefix_matrix = (uint64_t)rank_prefix;
            a.num_tokens = kRows;
            a.num_channels = C;
            a.use_tma = k.use_tma;
            a.num_out_rows = kRows;
            a.recv_x = (uint64_t)outs;
            a.recv_x_scales = (uint64_t)(outs + x_bytes);
            if (k.small_fields) {
                a.recv_topk_idx = (uint64_t)(outs + x_bytes + scale_bytes);
                a.recv_topk_weights = a.recv_topk_idx + (uint64_t)kRows * kTopk * 8;
                a.recv_src_idx = a.recv_topk_weights + (uint64_t)kRows * kTopk * 4;
            }
            const DirectPeer peer{4096, 4096 + x_bytes, k.small_fields ? 4096 + x_bytes + scale_bytes : 0, kRows};
            const float t =
                median_us([&] { loop_alone<<<C, kDispatchThreads, kTmaSmemBytes>>>(s, a, peer, k.own != 0); });
            int rec[4];
            cudaMemcpy(rec, err, sizeof(rec), cudaMemcpyDeviceToHost);
            const cudaError_t e = cudaGetLastError();
            if (e != cudaSuccess || rec[0]) {
                std::printf("\nerror: %s, device record %d %d %d %d\n", cudaGetErrorString(e), rec[0], rec[1], rec[2],
                            rec[3]);
                return 1;
            }
            const double payload = DispatchRow(k.hidden, k.fp8, kTopk).payload;
            std::printf(" %8.1f %9.1f", t, 2.0 * kRows * payload / (t * 1e3) / C);
        }
        std::printf("\n");
    }
    return 0;
}
