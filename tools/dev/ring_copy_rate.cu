// What a ring costs in HBM traffic, alone on the GPU: rows moved x -> ring -> out by producer/consumer
// block pairs (the normal mode's two copies: sender to the peer's ring, receiver to its output rows,
// with a tail/head handshake every `chunk` rows), against the same rows moved x -> out once by as many
// blocks (what senders writing the final rows would do). The gap is what a design with one copy per
// row could win when both ends share one memory (docs/results/2026-11-26g-h100x1/).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -Iengine tools/dev/ring_copy_rate.cu -o /tmp/ring_copy_rate && /tmp/ring_copy_rate
// Prints one line per (row size, block pairs, mode): microseconds and payload GB/s (rows x row bytes
// over the kernel time, each row counted once).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "kernels/normal_common.cuh"
#include "median_us.h"
#include "probe_common.h"

namespace {
using namespace pyep::normal;
using probe::check;

constexpr int kThreads = 768;   // the dispatch's blocks
constexpr int kWarps = kThreads / 32;

// Block pair p moves rows [p*per, (p+1)*per): block 2p copies x -> ring (Q slots), block 2p + 1 ring -> out.
// ctl[p] = {tail, head}: rows published / consumed (release / acquire, as the kernels' counters).
__global__ void __launch_bounds__(kThreads, 1) ring_pipeline(const uint8_t* x, uint8_t* ring, uint8_t* out, int* ctl,
                                                            int per, int row_bytes, int slot_bytes, int Q, int chunk) {
    const int p = blockIdx.x / 2, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int* tail = ctl + 2 * p;
    int* head = ctl + 2 * p + 1;
    uint8_t* slots = ring + (size_t)p * Q * slot_bytes;
    const size_t first = (size_t)p * per;
    __shared__ int avail;
    if (blockIdx.x % 2 == 0) {
        for (int i0 = 0; i0 < per; i0 += chunk) {
            const int n = min(chunk, per - i0);
            if (threadIdx.x == 0)
                while (ld_acquire_sys(head) < i0 + n - Q) LL_SPIN_HINT();
            __syncthreads();
            for (int j = warp; j < n; j += kWarps)
                warp_copy(slots + (size_t)((i0 + j) % Q) * slot_bytes, x + (first + i0 + j) * row_bytes, row_bytes, lane);
            __syncthreads();
            if (threadIdx.x == 0) st_release_sys(tail, i0 + n);
        }
    } else {
        for (int done = 0; done < per;) {
            if (threadIdx.x == 0) {
                int t;
                while ((t = ld_acquire_sys(tail)) <= done) LL_SPIN_HINT();
                avail = t - done;
            }
            __syncthreads();
            const int n = avail;
            for (int j = warp; j < n; j += kWarps) {
                const uint8_t* slot = slots + (size_t)((done + j) % Q) * slot_bytes;
                warp_copy(out + (first + done + j) * row_bytes, slot, row_bytes, lane);
            }
            __syncthreads();
            done += n;
            if (threadIdx.x == 0) st_release_sys(head, done);
        }
    }
}

// The same rows once: block b copies rows b, b + gridDim.x, ... x -> out, one per warp.
__global__ void __launch_bounds__(kThreads, 1) one_copy(const uint8_t* x, uint8_t* out, int rows, int row_bytes) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = blockIdx.x * kWarps + warp; r < rows; r += gridDim.x * kWarps)
        warp_copy(out + (size_t)r * row_bytes, x + (size_t)r * row_bytes, row_bytes, lane);
}

}  // namespace

int main() {
    const int rows = 49152, Q = 256, chunk = 8, reps = 10;
    int sms = 0;
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "attribute");
    std::printf("%-6s %-6s %-30s %10s %10s\n", "row", "pairs", "mode", "us", "GB/s");
    for (int row_bytes : {7168 + 256, 14336}) {
        const int slot_bytes = (int)align128(row_bytes + 8 * 16 + 4);
        uint8_t *x, *out, *ring;
        int* ctl;
        check(cudaMalloc(&x, (size_t)rows * row_bytes), "malloc");
        check(cudaMalloc(&out, (size_t)rows * row_bytes), "malloc");
        check(cudaMemset(x, 1, (size_t)rows * row_bytes), "memset");
        for (int pairs : {6, 12, 24, 48, sms / 2}) {
            if (pairs > sms / 2) continue;
            check(cudaMalloc(&ring, (size_t)pairs * Q * slot_bytes), "malloc");
            check(cudaMalloc(&ctl, 2 * sizeof(int) * pairs), "malloc");
            const int per = rows / pairs;
            struct Mode { const char* name; bool two; };
            const Mode modes[] = {{"two copies", true}, {"one copy (2 x pairs blocks)", false}};
            for (const Mode& m : modes) {
                const float us = median_us([&] {
                    if (m.two) {
                        cudaMemsetAsync(ctl, 0, 2 * sizeof(int) * pairs);
                        ring_pipeline<<<2 * pairs, kThreads>>>(x, ring, out, ctl, per, row_bytes, slot_bytes, Q, chunk);
                    } else {
                        one_copy<<<2 * pairs, kThreads>>>(x, out, per * pairs, row_bytes);
                    }
                    check(cudaGetLastError(), "launch");
                }, reps, 1);
                std::printf("%-6d %-6d %-30s %10.1f %10.1f\n", row_bytes, pairs, m.name, us,
                            (double)per * pairs * row_bytes / us / 1e3);
            }
            cudaFree(ring);
            cudaFree(ctl);
        }
        cudaFree(x);
        cudaFree(out);
    }
    return 0;
}
