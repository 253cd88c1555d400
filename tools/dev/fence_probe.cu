// Whether fences on some SMs slow other SMs that only compute. On one GPU the LL kernels of the ranks
// run side by side, and every send half ends in system-scope fences; the LL combine's first reduce item
// (docs/results/2026-11-27k-h200) takes 4-6 us after the flags with no memory access in it, and every
// block ends it at the same instant. Kernel A (half the SMs) times a straight block of FMAs; kernel B
// (the other half, another stream, started first) meanwhile spins in one of these loops:
//   idle:       nothing (B not launched);
//   spin:       FMAs only;
//   fence.gpu:  __threadfence() in a loop;
//   fence.sys:  __threadfence_system() in a loop;
//   store+sys:  a 16-byte store per lane, then __threadfence_system(), in a loop.
// It prints A's median block time for each, least of 5.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a tools/dev/fence_probe.cu -o /tmp/fence_probe && /tmp/fence_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

constexpr int kFmas = 8192;

__global__ void __launch_bounds__(32, 1) timed_fmas(float* out, unsigned long long* ns, float a) {
    float x[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = threadIdx.x + j;
    __syncwarp();
    const unsigned long long t0 = now_ns();
#pragma unroll 1
    for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int i = 0; i < kFmas / 4; ++i) asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(x[i & 7]) : "f"(a));
    }
    __syncwarp();
    const unsigned long long t1 = now_ns();
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) s += x[j];
    if (threadIdx.x == 0) ns[blockIdx.x] = t1 - t0;
    if (s == 1234.5f) out[blockIdx.x] = s;
}

enum Load { kSpin = 0, kFenceGpu = 1, kFenceSys = 2, kStoreSys = 3 };
const char* const kLoadNames[] = {"spin", "fence.gpu", "fence.sys", "store+sys"};

// Runs until *stop is set (by the host after A finished), so it covers all of A; the flag lives in host
// memory and is read every 256 trips, so the loop is the load and not the PCIe read.
__global__ void __launch_bounds__(128, 1) background(int mode, volatile int* stop, int4* scratch, float a) {
    float x = threadIdx.x;
    int4* mine = scratch + (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int it = 0; (it & 255) != 0 || !*stop; ++it) {
        if (mode == kSpin) {
#pragma unroll
            for (int i = 0; i < 64; ++i) asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(x) : "f"(a));
        } else if (mode == kFenceGpu) {
            __threadfence();
        } else if (mode == kFenceSys) {
            __threadfence_system();
        } else {
            *mine = make_int4(it, it, it, it);
            __threadfence_system();
        }
    }
    if (x == 1234.5f) scratch[0].x = 1;
}

// Both kernels take this much dynamic shared memory, more than half an SM's: no SM holds a block of each,
// so A's SMs run A alone and what B does reaches them only through what the SMs share.
constexpr int kSmemBytes = 120 * 1024;

void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
        std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
        std::exit(1);
    }
}

}  // namespace

int main() {
    cudaDeviceProp prop;
    check(cudaGetDeviceProperties(&prop, 0), "props");
    const int half = prop.multiProcessorCount / 2;
    float* out;
    unsigned long long* ns;
    int* stop;   // host-mapped: the host raises it while B runs
    int4* scratch;
    check(cudaMalloc(&out, half * sizeof(float)), "malloc");
    check(cudaMalloc(&ns, half * sizeof(unsigned long long)), "malloc");
    check(cudaHostAlloc(&stop, sizeof(int), cudaHostAllocMapped), "host alloc");
    check(cudaMalloc(&scratch, (size_t)half * 128 * sizeof(int4)), "malloc");
    int* d_stop;
    check(cudaHostGetDevicePointer(&d_stop, stop, 0), "device pointer");
    check(cudaFuncSetAttribute(timed_fmas, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes), "smem A");
    check(cudaFuncSetAttribute(background, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes), "smem B");
    cudaStream_t sa, sb;
    check(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking), "stream");
    check(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking), "stream");
    std::printf("fence probe, %s: A = %d blocks x %d FMAs timed, B = %d blocks of 128 threads beside it\n", prop.name,
                half, kFmas, half);
    std::printf("%-10s %12s %12s\n", "B", "A median us", "A max us");
    for (int mode = -1; mode <= kStoreSys; ++mode) {
        double best_med = 1e30, best_max = 1e30;
        for (int rep = 0; rep < 5; ++rep) {
            *stop = 0;
            if (mode >= 0) {
                background<<<half, 128, kSmemBytes, sb>>>(mode, d_stop, scratch, 1.0f);
                check(cudaGetLastError(), "launch B");
            }
            // One A block first, so B has taken its SMs before the timed A starts.
            timed_fmas<<<1, 32, kSmemBytes, sa>>>(out, ns, 1.0f);
            check(cudaStreamSynchronize(sa), "warm-up");
            timed_fmas<<<half, 32, kSmemBytes, sa>>>(out, ns, 1.0f);
            check(cudaStreamSynchronize(sa), "A");
            *stop = 1;
            check(cudaStreamSynchronize(sb), "B");
            std::vector<unsigned long long> h(half);
            check(cudaMemcpy(h.data(), ns, half * sizeof(unsigned long long), cudaMemcpyDeviceToHost), "copy");
            std::sort(h.begin(), h.end());
            best_med = std::min(best_med, h[half / 2] / 1000.0);
            best_max = std::min(best_max, h[half - 1] / 1000.0);
        }
        std::printf("%-10s %12.2f %12.2f\n", mode < 0 ? "idle" : kLoadNames[mode], best_med, best_max);
    }
    std::printf("least of 5; A's time is its FMAs only (no memory access between its clock reads)\n");
    return 0;
}
