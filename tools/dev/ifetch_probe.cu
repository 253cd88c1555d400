// How long an SM takes to run code that is not in its instruction caches, against the same code run again
// right away. A kernel's code is fetched in 128-byte lines as the warps reach it; between two calls of an
// LL kernel other kernels run, so every call starts cold. This probe runs one straight block of N
// independent FMAs (16 bytes of code each, no memory access between the two clock reads) on G blocks, one
// per SM:
//   warm:  the same kernel run just before, on the same grid;
//   cold:  another kernel's code (256 KB of it, kEvictFmas) run on every SM in between;
//   cold+L2: also 256 MB written in between, meant to push the code out of the L2 too.
// It prints the median block's time and the time per 128-byte line of code. A second kernel runs the
// same amount of code as 32 pieces of 1 KB entered in a runtime order (a switch: a tree of branches
// to each piece), so every piece starts at a cold jump target: its cold - warm, against the straight
// code's for the same bytes, is what cold jump targets add. A third kernel reads 16 lines of its
// parameters in a dependent chain, twice: what a launch's first touch of each parameter line costs.
// docs/performance.md ("Open questions", the first reduce item) uses them.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a tools/dev/ifetch_probe.cu -o /tmp/ifetch_probe && /tmp/ifetch_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "probe_common.h"

namespace {
using namespace probe;

// kSalt makes each instance another piece of code: the eviction kernel shares no line with the probe.
template <int kFmas, int kSalt>
__global__ void __launch_bounds__(32, 1) straight(float* out, unsigned long long* ns, float a) {
    float x[8];
    const unsigned long long t0 = start_chains(x, kSalt);
#pragma unroll
    for (int i = 0; i < kFmas; ++i) asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(x[i & 7]) : "f"(a));
    finish_chains(x, t0, out, ns);
}

// The same FMAs as straight<kPieces * kPerPiece>, in kPieces pieces entered in the order
// (i * stride + first) % kPieces: a jump to a piece the warp has not run before at every step.
template <int kPieces, int kPerPiece>
__global__ void __launch_bounds__(32, 1) jumps(float* out, unsigned long long* ns, float a, int first, int stride) {
    float x[8];
    const unsigned long long t0 = start_chains(x, 0);
#pragma unroll 1
    for (int i = 0; i < kPieces; ++i) {
        // A switch needs its cases written out: the macro writes the 32 (the measured build used it).
        switch ((i * stride + first) % kPieces) {
#define PYEP_PIECE(n)                                                                                 \
    case n:                                                                                           \
        _Pragma("unroll") for (int f = 0; f < kPerPiece; ++f)                                         \
            asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(x[f & 7]) : "f"(a + (float)n));          \
        break;
            PYEP_PIECE(0) PYEP_PIECE(1) PYEP_PIECE(2) PYEP_PIECE(3) PYEP_PIECE(4) PYEP_PIECE(5) PYEP_PIECE(6)
            PYEP_PIECE(7) PYEP_PIECE(8) PYEP_PIECE(9) PYEP_PIECE(10) PYEP_PIECE(11) PYEP_PIECE(12)
            PYEP_PIECE(13) PYEP_PIECE(14) PYEP_PIECE(15) PYEP_PIECE(16) PYEP_PIECE(17) PYEP_PIECE(18)
            PYEP_PIECE(19) PYEP_PIECE(20) PYEP_PIECE(21) PYEP_PIECE(22) PYEP_PIECE(23) PYEP_PIECE(24)
            PYEP_PIECE(25) PYEP_PIECE(26) PYEP_PIECE(27) PYEP_PIECE(28) PYEP_PIECE(29) PYEP_PIECE(30)
            PYEP_PIECE(31)
#undef PYEP_PIECE
        }
    }
    finish_chains(x, t0, out, ns);
}

// Kernel parameters are a fresh constant buffer at every launch, so each SM's first read of each line
// of them misses. params_chain reads one word from each of kLines 64-byte lines in a dependent chain
// (every index depends on the word read before: the host fills the words with 0), then the same chain
// again: ns[3 * block] is the first pass, ns[3 * block + 1] the second.
struct BigParams {
    unsigned long long w[128];   // 1 KB: 16 lines of 64 bytes
};
template <int kLines>
__global__ void __launch_bounds__(32, 1) params_chain(const BigParams p, unsigned long long* ns) {
    unsigned long long idx = 0;
    __syncwarp();
    const unsigned long long t0 = now_ns();
#pragma unroll 1
    for (int i = 0; i < kLines; ++i) idx = p.w[(i * 8 + (int)idx) & 127];
    const unsigned long long t1 = now_ns();
#pragma unroll 1
    for (int i = 0; i < kLines; ++i) idx = p.w[(i * 8 + (int)idx) & 127];
    const unsigned long long t2 = now_ns();
    if (threadIdx.x == 0) {
        ns[3 * blockIdx.x] = t1 - t0;
        ns[3 * blockIdx.x + 1] = t2 - t1;
        ns[3 * blockIdx.x + 2] = idx;
    }
}

constexpr int kProbeFmas = 2048;    // 32 KB of code
constexpr int kEvictFmas = 16384;   // 256 KB of code

double median_block_us(unsigned long long* d_ns, int blocks) {
    std::vector<unsigned long long> h(blocks);
    check(cudaMemcpy(h.data(), d_ns, blocks * sizeof(unsigned long long), cudaMemcpyDeviceToHost), "copy");
    std::sort(h.begin(), h.end());
    return h[blocks / 2] / 1000.0;
}

}  // namespace

int main() {
    cudaDeviceProp prop;
    check(cudaGetDeviceProperties(&prop, 0), "props");
    const int sms = prop.multiProcessorCount;
    float* out;
    unsigned long long* ns;
    void* flush;
    const size_t flush_bytes = 256u << 20;
    check(cudaMalloc(&out, sms * sizeof(float)), "malloc");
    check(cudaMalloc(&ns, sms * sizeof(unsigned long long)), "malloc");
    check(cudaMalloc(&flush, flush_bytes), "malloc");
    const double lines = kProbeFmas * 16.0 / 128.0;
    std::printf("instruction fetch probe, %s, %d SMs: %d FMAs (%.0f KB of code, %.0f lines of 128 B) per block\n",
                prop.name, sms, kProbeFmas, kProbeFmas * 16.0 / 1024, lines);
    std::printf("%7s %10s %12s %12s %14s %14s\n", "blocks", "warm us", "cold us", "cold+L2 us", "cold ns/line",
                "cold+L2 ns/ln");
    const int grids[] = {1, 66, sms};
    for (int g : grids) {
        double warm = 1e30, cold = 1e30, cold_l2 = 1e30;
        for (int rep = 0; rep < 5; ++rep) {
            straight<kProbeFmas, 0><<<g, 32>>>(out, ns, 1.0f);
            straight<kProbeFmas, 0><<<g, 32>>>(out, ns, 1.0f);
            check(cudaDeviceSynchronize(), "warm");
            warm = std::min(warm, median_block_us(ns, g));
            straight<kEvictFmas, 1><<<sms, 32>>>(out, ns, 1.0f);
            straight<kProbeFmas, 0><<<g, 32>>>(out, ns, 1.0f);
            check(cudaDeviceSynchronize(), "cold");
            cold = std::min(cold, median_block_us(ns, g));
            straight<kEvictFmas, 1><<<sms, 32>>>(out, ns, 1.0f);
            check(cudaMemsetAsync(flush, rep, flush_bytes), "flush");
            straight<kProbeFmas, 0><<<g, 32>>>(out, ns, 1.0f);
            check(cudaDeviceSynchronize(), "cold+L2");
            cold_l2 = std::min(cold_l2, median_block_us(ns, g));
        }
        std::printf("%7d %10.2f %12.2f %12.2f %14.0f %14.0f\n", g, warm, cold, cold_l2, (cold - warm) * 1000 / lines,
                    (cold_l2 - warm) * 1000 / lines);
    }
    std::printf("least of 5 of the median block; ns/line = (cold - warm) / lines\n");
    // The same 32 KB in 32 pieces of 64 FMAs, entered in a scrambled order (stride 13 of 32).
    std::printf("\n32 pieces of 1 KB entered by indirect jumps, in the order (13 i + 5) %% 32\n");
    std::printf("%7s %10s %12s %12s %16s\n", "blocks", "warm us", "cold us", "cold+L2 us", "cold-warm ns/jump");
    for (int g : grids) {
        double warm = 1e30, cold = 1e30, cold_l2 = 1e30;
        for (int rep = 0; rep < 5; ++rep) {
            jumps<32, 64><<<g, 32>>>(out, ns, 1.0f, 5, 13);
            jumps<32, 64><<<g, 32>>>(out, ns, 1.0f, 5, 13);
            check(cudaDeviceSynchronize(), "warm");
            warm = std::min(warm, median_block_us(ns, g));
            straight<kEvictFmas, 1><<<sms, 32>>>(out, ns, 1.0f);
            jumps<32, 64><<<g, 32>>>(out, ns, 1.0f, 5, 13);
            check(cudaDeviceSynchronize(), "cold");
            cold = std::min(cold, median_block_us(ns, g));
            straight<kEvictFmas, 1><<<sms, 32>>>(out, ns, 1.0f);
            check(cudaMemsetAsync(flush, rep, flush_bytes), "flush");
            jumps<32, 64><<<g, 32>>>(out, ns, 1.0f, 5, 13);
            check(cudaDeviceSynchronize(), "cold+L2");
            cold_l2 = std::min(cold_l2, median_block_us(ns, g));
        }
        std::printf("%7d %10.2f %12.2f %12.2f %16.0f\n", g, warm, cold, cold_l2, (cold - warm) * 1000 / 32);
    }
    std::printf("cold-warm ns/jump = (cold - warm) / 32: a piece's code fetch included, compare with the straight\n"
                "table's cold - warm for the same 32 KB\n");

    // Parameter lines: first read of each of 16 lines in a launch, against the same reads again.
    BigParams bp{};
    unsigned long long* pns;
    check(cudaMalloc(&pns, 3 * sms * sizeof(unsigned long long)), "malloc");
    std::printf("\nkernel parameters: 16 lines of 64 B read in a dependent chain, first pass and again\n");
    std::printf("%7s %14s %14s %16s\n", "blocks", "first pass us", "again us", "first ns/line");
    for (int g : grids) {
        double first = 1e30, again = 1e30;
        for (int rep = 0; rep < 5; ++rep) {
            params_chain<16><<<g, 32>>>(bp, pns);
            check(cudaDeviceSynchronize(), "params");
            std::vector<unsigned long long> h(3 * g);
            check(cudaMemcpy(h.data(), pns, h.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost), "copy");
            std::vector<unsigned long long> a(g), b(g);
            for (int i = 0; i < g; ++i) a[i] = h[3 * i], b[i] = h[3 * i + 1];
            std::sort(a.begin(), a.end());
            std::sort(b.begin(), b.end());
            first = std::min(first, a[g / 2] / 1000.0);
            again = std::min(again, b[g / 2] / 1000.0);
        }
        std::printf("%7d %14.2f %14.2f %16.0f\n", g, first, again, first * 1000 / 16);
    }
    return 0;
}
