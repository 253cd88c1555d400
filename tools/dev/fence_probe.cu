// Whether what some SMs do slows other SMs that compute or read the L2. On one GPU the LL kernels of the
// ranks run side by side: every block of a phase ends in a fence and an atomic on one counter, and the
// receive polls a few flag words from every block; the LL combine's first reduce item
// (docs/results/2026-11-27k-h200, 2026-11-27l-onegpu) takes 4-6 us after the flags, also with no loads,
// and every block of both ranks ends it at the same instant. Kernel A (half the SMs) times either a
// straight block of FMAs or a dependent chain of L2-resident loads (ld.global.cg, one 128-byte line
// apart); kernel B (the other half, another stream, started first) meanwhile loops on one of:
//   idle:       nothing (B not launched);
//   spin:       FMAs only;
//   fence.gpu:  __threadfence() in a loop;
//   fence.sys:  __threadfence_system() in a loop;
//   acqrel.gpu, acqrel.sys: fence.acq_rel at that scope in a loop (the fence.sc above are MEMBAR.SC);
//   store+sys:  a 16-byte store per lane, then __threadfence_system(), in a loop;
//   poll:       threads 0 and 1 of each block read one word with ld.acquire.sys, as the LL receive polls;
//   atomic:     thread 0 of each block adds to one word, as blocks arrive on a phase's counter.
// It prints A's median and slowest block for each, least of 5: the FMAs' time, and ns per load.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a tools/dev/fence_probe.cu -o /tmp/fence_probe && /tmp/fence_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_common.h"

namespace {
using namespace probe;

constexpr int kFmas = 8192;

__global__ void __launch_bounds__(32, 1) timed_fmas(float* out, unsigned long long* ns, float a) {
    float x[8];
    const unsigned long long t0 = start_chains(x, 0);
#pragma unroll 1
    for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int i = 0; i < kFmas / 4; ++i) asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(x[i & 7]) : "f"(a));
    }
    finish_chains(x, t0, out, ns);
}

constexpr int kChainWords = 1 << 18;   // 1 MB: stays in the L2
constexpr int kChainLoads = 512;

// Thread 0 follows the chain (each word holds the next index), every load a round trip to the L2.
__global__ void __launch_bounds__(32, 1) timed_chase(const unsigned* chain, unsigned long long* ns, unsigned* sink) {
    if (threadIdx.x != 0) return;
    unsigned i = (blockIdx.x * 4099u * 32u) % kChainWords;
    const unsigned long long t0 = now_ns();
    for (int k = 0; k < kChainLoads; ++k) {
        unsigned v;
        asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(chain + i) : "memory");
        i = v;
    }
    const unsigned long long t1 = now_ns() + (i == 0xffffffffu);
    ns[blockIdx.x] = t1 - t0;
    if (i == 0xffffffffu) sink[0] = i;
}

enum Load { kSpin = 0, kFenceGpu = 1, kFenceSys = 2, kAcqRelGpu = 3, kAcqRelSys = 4, kStoreSys = 5, kPoll = 6,
            kAtomic = 7 };
const char* const kLoadNames[] = {"spin", "fence.gpu", "fence.sys", "acqrel.gpu", "acqrel.sys", "store+sys", "poll",
                                  "atomic"};

// Runs until *stop is set, so it covers all of A. The flag is device memory, raised by a copy on a third
// stream after A finished, and read every 256 trips. The first form read a host-mapped flag, which put
// B's threads on PCIe reads in the short-loop modes; in those modes one block of A's loads slowed to
// 7-8 us each (docs/results/2026-11-28-x2, run 1; the cause is open).
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
        } else if (mode == kAcqRelGpu) {
            asm volatile("fence.acq_rel.gpu;" ::: "memory");
        } else if (mode == kAcqRelSys) {
            asm volatile("fence.acq_rel.sys;" ::: "memory");
        } else if (mode == kStoreSys) {
            *mine = make_int4(it, it, it, it);
            __threadfence_system();
        } else if (mode == kPoll) {
            if (threadIdx.x < 2) {
                int v;
                asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(&scratch[0].y) : "memory");
                x += v;
            }
        } else if (threadIdx.x == 0) {
            atomicAdd(&scratch[0].z, 1);
        }
    }
    if (x == 1234.5f) scratch[0].x = 1;
}

// Both kernels take this much dynamic shared memory, more than half an SM's: no SM holds a block of each,
// so A's SMs run A alone and what B does reaches them only through what the SMs share.
constexpr int kSmemBytes = 120 * 1024;

}  // namespace

int main() {
    cudaDeviceProp prop;
    check(cudaGetDeviceProperties(&prop, 0), "props");
    const int half = prop.multiProcessorCount / 2;
    float* out;
    unsigned long long* ns;
    int* stop;   // device memory: raised by a copy on stream sc while B runs
    int* one;    // pinned host word holding 1, the copy's source
    int4* scratch;
    unsigned *chain, *sink;
    check(cudaMalloc(&out, half * sizeof(float)), "malloc");
    check(cudaMalloc(&ns, half * sizeof(unsigned long long)), "malloc");
    check(cudaMalloc(&stop, sizeof(int)), "malloc");
    check(cudaHostAlloc(&one, sizeof(int), cudaHostAllocDefault), "host alloc");
    *one = 1;
    check(cudaMalloc(&scratch, (size_t)half * 128 * sizeof(int4)), "malloc");
    check(cudaMemset(scratch, 0, (size_t)half * 128 * sizeof(int4)), "memset");
    check(cudaMalloc(&chain, kChainWords * sizeof(unsigned)), "malloc");
    check(cudaMalloc(&sink, sizeof(unsigned)), "malloc");
    {
        // Word i points 37 lines on: every load of a chain is another 128-byte line.
        std::vector<unsigned> h(kChainWords);
        for (int i = 0; i < kChainWords; ++i) h[i] = (unsigned)((i + 37 * 32) % kChainWords);
        check(cudaMemcpy(chain, h.data(), h.size() * sizeof(unsigned), cudaMemcpyHostToDevice), "chain");
    }
    check(cudaFuncSetAttribute(timed_fmas, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes), "smem A");
    check(cudaFuncSetAttribute(timed_chase, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes), "smem A");
    check(cudaFuncSetAttribute(background, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes), "smem B");
    cudaStream_t sa, sb, sc;
    check(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking), "stream");
    check(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking), "stream");
    check(cudaStreamCreateWithFlags(&sc, cudaStreamNonBlocking), "stream");
    std::printf("fence probe, %s: A = %d blocks (%d FMAs, or a chain of %d L2 loads), B = %d blocks of 128 "
                "threads beside it\n", prop.name, half, kFmas, kChainLoads, half);
    std::printf("%-10s %14s %12s %16s %14s\n", "B", "FMA median us", "FMA max us", "load median ns", "load max ns");
    for (int mode = -1; mode <= kAtomic; ++mode) {
        double best[2][2] = {{1e30, 1e30}, {1e30, 1e30}};   // [fmas, chase][median, max]
        for (int rep = 0; rep < 5; ++rep) {
            for (int kind = 0; kind < 2; ++kind) {
                // On B's own stream: the streams are non-blocking, so a legacy-stream memset could land
                // after B started and B would see the last rep's 1.
                check(cudaMemsetAsync(stop, 0, sizeof(int), sb), "stop = 0");
                if (mode >= 0) {
                    background<<<half, 128, kSmemBytes, sb>>>(mode, stop, scratch, 1.0f);
                    check(cudaGetLastError(), "launch B");
                }
                // One A block first, so B has taken its SMs before the timed A starts (and the chain is
                // in the L2).
                if (kind == 0) timed_fmas<<<1, 32, kSmemBytes, sa>>>(out, ns, 1.0f);
                else timed_chase<<<1, 32, kSmemBytes, sa>>>(chain, ns, sink);
                check(cudaStreamSynchronize(sa), "warm-up");
                if (kind == 0) timed_fmas<<<half, 32, kSmemBytes, sa>>>(out, ns, 1.0f);
                else timed_chase<<<half, 32, kSmemBytes, sa>>>(chain, ns, sink);
                check(cudaStreamSynchronize(sa), "A");
                check(cudaMemcpyAsync(stop, one, sizeof(int), cudaMemcpyHostToDevice, sc), "stop = 1");
                check(cudaStreamSynchronize(sb), "B");
                std::vector<unsigned long long> h(half);
                check(cudaMemcpy(h.data(), ns, half * sizeof(unsigned long long), cudaMemcpyDeviceToHost), "copy");
                std::sort(h.begin(), h.end());
                const double unit = kind == 0 ? 1000.0 : (double)kChainLoads;   // us, or ns per load
                best[kind][0] = std::min(best[kind][0], h[half / 2] / unit);
                best[kind][1] = std::min(best[kind][1], h[half - 1] / unit);
            }
        }
        std::printf("%-10s %14.2f %12.2f %16.0f %14.0f\n", mode < 0 ? "idle" : kLoadNames[mode], best[0][0],
                    best[0][1], best[1][0], best[1][1]);
    }
    std::printf("least of 5; A's FMA time has no memory access between its clock reads\n");
    return 0;
}
