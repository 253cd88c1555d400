// Per-SM copy rate of the normal mode's row-copy primitives, alone on the GPU: how many bytes per second
// (read + write) one SM moves when its 24 warps copy rows, one row a warp at a time, into scattered
// output rows, with the warps' own loads and stores (normal_common.cuh warp_copy) or the SM's bulk copy
// engine (normal_tma.cuh tma_copy), and for FP8 rows with a row's 56 column-major scales read and
// written as the dispatch does (normal_rows.cuh load_meta / store_scales), through the L2 only or the
// L1. It bounds what a block of the dispatch can reach, with no protocol around the copies.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -Iengine tools/dev/sm_copy_rate.cu -o /tmp/sm_copy_rate && /tmp/sm_copy_rate
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "kernels/normal_launch.h"
#include "kernels/normal_rows.cuh"
#include "kernels/normal_tma.cuh"
#include "median_us.h"

namespace {
using namespace pyep::normal;

enum Mode { kWarp, kTma, kScalesL2, kScalesL1, kModes };
const char* const kModeNames[kModes] = {"warp", "tma", "warp+scales(L2)", "warp+scales(L1)"};

// Warp w of the grid copies rows w, w + warps, ... into output row perm[r]; with scales, row r's scales
// are column-major (scale g of row r at scales[g * rows + r]) and go to out_scales[perm[r]] row-major.
template <Mode kMode>
__global__ void __launch_bounds__(kDispatchThreads, 1) copy_rows(uint8_t* out, const uint8_t* in, const int* perm,
                                                               int rows, int row_bytes, const float* scales,
                                                               float* out_scales) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint8_t* smem = tma_shared();
    WarpTma t = tma_setup(smem, reinterpret_cast<uint64_t*>(smem + tma_smem_data(kDispatchWarps)), warp, lane);
    const int groups = row_bytes / 128, warps = gridDim.x * kDispatchWarps;
    for (int r = blockIdx.x * kDispatchWarps + warp; r < rows; r += warps) {
        uint8_t* d = out + (size_t)perm[r] * row_bytes;
        const uint8_t* s = in + (size_t)r * row_bytes;
        RowMeta m{};
        if (kMode == kScalesL2) m = load_meta<ScaleSrc::kRing>(scales + r, rows, groups, -1, 0.f, 0, lane);
        if (kMode == kScalesL1) m = load_meta<ScaleSrc::kCaller>(scales + r, rows, groups, -1, 0.f, 0, lane);
        if (kMode == kTma) tma_copy(t, d, s, row_bytes, lane);
        else warp_copy(d, s, row_bytes, lane);
        if (kMode == kScalesL2)
            store_scales<ScaleSrc::kRing>(out_scales + (size_t)perm[r] * groups, m, scales + r, rows, groups, lane);
        if (kMode == kScalesL1)
            store_scales<ScaleSrc::kCaller>(out_scales + (size_t)perm[r] * groups, m, scales + r, rows, groups, lane);
    }
    tma_drain(lane);
}

template <Mode kMode>
float copy_us(int blocks, uint8_t* out, const uint8_t* in, const int* perm, int rows, int row_bytes,
              const float* scales, float* out_scales) {
    const int smem = tma_smem_bytes(kDispatchWarps);
    cudaFuncSetAttribute(copy_rows<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    return median_us([&] {
        copy_rows<kMode><<<blocks, kDispatchThreads, smem>>>(out, in, perm, rows, row_bytes, scales, out_scales);
    });
}

float run(Mode mode, int blocks, uint8_t* out, const uint8_t* in, const int* perm, int rows, int row_bytes,
          const float* scales, float* out_scales) {
    switch (mode) {
        case kWarp: return copy_us<kWarp>(blocks, out, in, perm, rows, row_bytes, scales, out_scales);
        case kTma: return copy_us<kTma>(blocks, out, in, perm, rows, row_bytes, scales, out_scales);
        case kScalesL2: return copy_us<kScalesL2>(blocks, out, in, perm, rows, row_bytes, scales, out_scales);
        default: return copy_us<kScalesL1>(blocks, out, in, perm, rows, row_bytes, scales, out_scales);
    }
}
}  // namespace

int main() {
    const int rows = 8192;   // about what one rank receives under DeepEP's test at 2 ranks
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    const std::vector<int> grid = {1, 6, 12, 24, 48, sms};
    std::vector<int> p(rows);
    for (int i = 0; i < rows; ++i) p[i] = i;
    for (int i = rows - 1; i > 0; --i) std::swap(p[i], p[(i * 7919u + 13) % (i + 1)]);   // scattered outputs
    int* perm;
    float *scales, *out_scales;
    cudaMalloc(&perm, rows * sizeof(int));
    cudaMemcpy(perm, p.data(), rows * sizeof(int), cudaMemcpyHostToDevice);
    cudaMalloc(&scales, (size_t)rows * 64 * sizeof(float));
    cudaMalloc(&out_scales, (size_t)rows * 64 * sizeof(float));
    cudaMemset(scales, 0, (size_t)rows * 64 * sizeof(float));
    std::printf("%d rows, %d warps a block; us per copy of all rows, and GB/s (read + write) per SM\n", rows,
                kDispatchWarps);
    std::printf("%-6s %-16s", "row", "mode");
    for (int b : grid) std::printf(" %9s SMs %3d", "", b);
    std::printf("\n");
    for (int row_bytes : {7168, 14336}) {   // an FP8 and a BF16 row at H = 7168
        uint8_t *in, *out;
        cudaMalloc(&in, (size_t)rows * row_bytes);
        cudaMalloc(&out, (size_t)rows * row_bytes);
        cudaMemset(in, 1, (size_t)rows * row_bytes);
        for (int mode = 0; mode < kModes; ++mode) {
            if (mode >= kScalesL2 && row_bytes != 7168) continue;   // FP8 rows carry scales
            std::printf("%-6d %-16s", row_bytes, kModeNames[mode]);
            for (int b : grid) {
                const float us = run(static_cast<Mode>(mode), b, out, in, perm, rows, row_bytes, scales, out_scales);
                std::printf(" %9.1f %7.1f", us, 2.0 * rows * row_bytes / (us * 1e3) / b);
            }
            std::printf("\n");
        }
        cudaFree(in);
        cudaFree(out);
    }
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
        std::printf("error: %s\n", cudaGetErrorString(e));
        return 1;
    }
    return 0;
}
