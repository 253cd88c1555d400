// Whether a kernel's first access to a 2 MB page costs an address-translation miss every launch, or the
// GPU's TLBs keep the translations of the previous launch. The LL kernels touch a few hundred MB of buffer
// per call (docs/performance.md, "Open questions": a first reduce item that takes 3 us with no loads).
// Thread 0 of each of G blocks (one per SM) walks N pages of its own in a dependent chain of 8-byte loads
// that bypass the L1 (ld.global.cg), one load a page at a given offset in it; the median block's time per
// load is printed for:
//   L2 hit:             the same lines again in the next launch (data and translations warm);
//   new line, next launch: an offset never read before, in the pages the launch before walked (data from
//                       HBM; translations warm only if TLBs keep them across launches);
//   new line, same launch: the same kernel walks one offset and then another in the same pages, timing
//                       the second walk (data from HBM, translations certainly warm);
//   after a TLB sweep:  a new offset after a kernel that touched one line in each page of another 8 GB
//                       (data from HBM, translations evicted if the TLBs are smaller than that).
// "new line, next launch" near "same launch" means translations survive a launch; near "after a sweep"
// means each launch pays the misses again.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a tools/dev/tlb_probe.cu -o /tmp/tlb_probe && /tmp/tlb_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "probe_common.h"

namespace {
using namespace probe;

constexpr size_t kPage = 2u << 20;
constexpr int kPagesPerBlock = 8;
constexpr int kPages = 1056;   // 132 blocks x 8 pages: 2.1 GB walked
constexpr size_t kSweepBytes = size_t(8) << 30;

__device__ __forceinline__ unsigned long long ld_cg(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// One walk over the block's pages at byte offset `off` of each; every address depends on the load before
// (the words are 0), so the loads go out one at a time.
__device__ __forceinline__ unsigned long long walk(const char* buf, size_t off, unsigned long long carry) {
    for (int i = 0; i < kPagesPerBlock; ++i) {
        const size_t page = (size_t)(blockIdx.x * kPagesPerBlock + i) % kPages;
        carry = ld_cg(reinterpret_cast<const unsigned long long*>(buf + page * kPage + off + carry));
    }
    return carry;
}

// Times walk(off2); with off1 >= 0 a first walk at off1 runs before it, untimed, in the same launch.
__global__ void __launch_bounds__(32, 1) chain(const char* buf, long long off1, size_t off2, unsigned long long* ns,
                                               unsigned long long* sink) {
    if (threadIdx.x != 0) return;
    unsigned long long carry = 0;
    if (off1 >= 0) carry = walk(buf, (size_t)off1, carry);
    const unsigned long long t0 = now_ns() + carry;   // carry is 0: the clock read waits for the first walk
    carry = walk(buf, off2, carry);
    const unsigned long long t1 = now_ns() + carry;
    ns[blockIdx.x] = t1 - t0;
    if (carry == 1) sink[0] = carry;
}

// One line in each 2 MB page of `bytes`: evicts translations of other pages from the TLBs.
__global__ void sweep(const char* buf, size_t bytes, unsigned long long* sink) {
    unsigned long long acc = 0;
    for (size_t page = (size_t)blockIdx.x * blockDim.x + threadIdx.x; page < bytes / kPage;
         page += (size_t)gridDim.x * blockDim.x)
        acc += ld_cg(reinterpret_cast<const unsigned long long*>(buf + page * kPage + 4096));
    if (acc == 1) sink[0] = acc;
}

double median_ns_per_load(unsigned long long* ns_dev, int blocks) {
    std::vector<unsigned long long> ns(blocks);
    check(cudaMemcpy(ns.data(), ns_dev, blocks * sizeof(unsigned long long), cudaMemcpyDeviceToHost), "copy");
    std::sort(ns.begin(), ns.end());
    return (double)ns[blocks / 2] / kPagesPerBlock;
}

}  // namespace

int main() {
    cudaDeviceProp prop;
    check(cudaGetDeviceProperties(&prop, 0), "properties");
    char* buf = nullptr;
    char* other = nullptr;
    unsigned long long *ns = nullptr, *sink = nullptr;
    check(cudaMalloc(&buf, kPages * kPage), "malloc walk buffer");
    check(cudaMalloc(&other, kSweepBytes), "malloc sweep buffer");
    check(cudaMalloc(&ns, 1024 * sizeof(unsigned long long)), "malloc");
    check(cudaMalloc(&sink, sizeof(unsigned long long)), "malloc");
    check(cudaMemset(buf, 0, kPages * kPage), "memset");
    check(cudaMemset(other, 0, kSweepBytes), "memset");
    check(cudaDeviceSynchronize(), "sync");

    std::printf("TLB probe, %s, %d SMs: a dependent chain of %d loads a block, one per 2 MB page, ns a load "
                "(median block; least of 5)\n", prop.name, prop.multiProcessorCount, kPagesPerBlock);
    std::printf("%7s %10s %22s %22s %18s\n", "blocks", "L2 hit", "new line, next launch", "new line, same launch",
                "after a TLB sweep");
    size_t off = 8192;   // every measurement reads lines no earlier one read, 8 KB apart (75 of them fit a page)
    auto fresh = [&]() { off += 8192; return off; };
    for (int blocks : {1, 66, prop.multiProcessorCount}) {
        double hit = 1e30, next = 1e30, same = 1e30, swept = 1e30;
        for (int rep = 0; rep < 5; ++rep) {
            const size_t a = fresh();
            chain<<<blocks, 32>>>(buf, -1, a, ns, sink);          // warms translations (and line a)
            chain<<<blocks, 32>>>(buf, -1, a, ns, sink);
            check(cudaDeviceSynchronize(), "hit");
            hit = std::min(hit, median_ns_per_load(ns, blocks));
            chain<<<blocks, 32>>>(buf, -1, fresh(), ns, sink);
            check(cudaDeviceSynchronize(), "next");
            next = std::min(next, median_ns_per_load(ns, blocks));
            const size_t b = fresh();
            chain<<<blocks, 32>>>(buf, (long long)b, fresh(), ns, sink);
            check(cudaDeviceSynchronize(), "same");
            same = std::min(same, median_ns_per_load(ns, blocks));
            sweep<<<prop.multiProcessorCount, 256>>>(other, kSweepBytes, sink);
            chain<<<blocks, 32>>>(buf, -1, fresh(), ns, sink);
            check(cudaDeviceSynchronize(), "swept");
            swept = std::min(swept, median_ns_per_load(ns, blocks));
        }
        std::printf("%7d %10.0f %22.0f %22.0f %18.0f\n", blocks, hit, next, same, swept);
    }
    if (off + 8 > kPage) std::printf("(offsets ran past a page: raise the spacing)\n");
    return 0;
}
