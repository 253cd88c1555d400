// Per-SM copy rate of the normal mode's row-copy primitives, alone on the GPU: how many bytes per second
// one SM moves when its warps copy rows (gathered from a source table into a dense output), with warp
// loads/stores (warp_copy, 6 x 16 bytes per lane in flight) or with the SM's bulk copy engine
// (tma_copy, two 4 KiB stages per warp). It bounds what a sender or receiver block of the dispatch can
// reach, with no protocol around the copies.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -Iengine tools/dev/sm_copy_rate.cu -o /tmp/sm_copy_rate && /tmp/sm_copy_rate
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "kernels/normal_launch.h"
#include "kernels/normal_tma.cuh"

namespace {
using namespace pyep::normal;

constexpr int kUnroll = 6;

__device__ __forceinline__ void reg_copy(uint8_t* dst, const uint8_t* src, int bytes, int lane) {
    const int n = bytes / 16;
    const int4* s4 = reinterpret_cast<const int4*>(src);
    int4* d4 = reinterpret_cast<int4*>(dst);
    int i = lane;
    for (; i + (kUnroll - 1) * 32 < n; i += kUnroll * 32) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = __ldcg(s4 + i + u * 32);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) d4[i + u * 32] = v[u];
    }
    for (; i < n; i += 32) d4[i] = __ldcg(s4 + i);
}

// Row r of the output takes source row perm[r]; block b copies rows b, b + gridDim.x, ... one per warp.
__global__ void __launch_bounds__(768, 1) copy_rows(uint8_t* out, const uint8_t* in, const int* perm, int rows,
                                                   int row_bytes, int use_tma, int warps) {
    extern __shared__ __align__(128) uint8_t smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp >= warps) return;
    WarpTma t = tma_setup(smem, reinterpret_cast<uint64_t*>(smem + kDispatchWarps * kTmaStages * kTmaStageBytes), warp, lane);
    for (int r = blockIdx.x * warps + warp; r < rows; r += gridDim.x * warps) {
        uint8_t* d = out + (size_t)r * row_bytes;
        const uint8_t* s = in + (size_t)perm[r] * row_bytes;
        if (use_tma) tma_copy(t, d, s, row_bytes, lane);
        else reg_copy(d, s, row_bytes, lane);
    }
    tma_drain(lane);
}
}  // namespace

int main() {
    const int rows = 65536, smem = kDispatchWarps * kTmaStages * (kTmaStageBytes + 8);
    cudaFuncSetAttribute(copy_rows, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    std::printf("%-6s %-6s %-9s %-6s %10s %14s\n", "row", "mode", "warps", "SMs", "us", "GB/s per SM");
    for (int row_bytes : {7168 + 256, 14336}) {
        uint8_t *in, *out;
        int* perm;
        cudaMalloc(&in, (size_t)rows * row_bytes);
        cudaMalloc(&out, (size_t)rows * row_bytes);
        cudaMalloc(&perm, rows * sizeof(int));
        std::vector<int> p(rows);
        for (int i = 0; i < rows; ++i) p[i] = (int)((i * 2654435761u) % rows);   // a scattered gather
        cudaMemcpy(perm, p.data(), rows * sizeof(int), cudaMemcpyHostToDevice);
        for (int use_tma : {0, 1})
            for (int warps : {kDispatchWarps / 2, kDispatchWarps})
                for (int blocks : {1, 3, 6, 12, 24, 48, sms}) {
                    cudaEvent_t a, b;
                    cudaEventCreate(&a);
                    cudaEventCreate(&b);
                    const int n = std::min(rows, blocks * 2048);   // about the same time per SM count
                    copy_rows<<<blocks, 768, smem>>>(out, in, perm, n, row_bytes, use_tma, warps);
                    cudaEventRecord(a);
                    for (int it = 0; it < 5; ++it) copy_rows<<<blocks, 768, smem>>>(out, in, perm, n, row_bytes, use_tma, warps);
                    cudaEventRecord(b);
                    cudaEventSynchronize(b);
                    float ms = 0;
                    cudaEventElapsedTime(&ms, a, b);
                    const double us = ms * 1e3 / 5, gbps = (double)n * row_bytes / (us * 1e3);
                    std::printf("%-6d %-6s %-9d %-6d %10.1f %14.1f\n", row_bytes, use_tma ? "tma" : "reg", warps, blocks, us,
                                gbps / blocks);
                }
        cudaFree(in);
        cudaFree(out);
        cudaFree(perm);
    }
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) { std::printf("error: %s\n", cudaGetErrorString(e)); return 1; }
    return 0;
}
