// What the single-process dev probes share (ifetch_probe, fence_probe, tlb_probe, ring_copy_rate): the
// GPU's nanosecond clock, eight FMA chains that time code with no memory access, and a CUDA check that
// ends the process.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace probe {

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Eight independent FMA chains a lane, so the warp issues about one FMA a cycle once its code is there.
__device__ __forceinline__ unsigned long long start_chains(float (&x)[8], int salt) {
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = threadIdx.x + j + salt;
    __syncwarp();
    return now_ns();
}
// The block's time since t0 to ns[block]; the chains stay live (the sum never equals the test value).
__device__ __forceinline__ void finish_chains(const float (&x)[8], unsigned long long t0, float* out,
                                              unsigned long long* ns) {
    __syncwarp();
    const unsigned long long t1 = now_ns();
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) s += x[j];
    if (threadIdx.x == 0) ns[blockIdx.x] = t1 - t0;
    if (s == 1234.5f) out[blockIdx.x] = s;
}

inline void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
        std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
        std::exit(1);
    }
}

}  // namespace probe
