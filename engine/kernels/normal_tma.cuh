// Bulk copies global -> shared -> global with the Hopper copy engine in each SM (cp.async.bulk, "TMA"
// without a tensor map): the dispatch receiver's local copies (ring slot -> output row, own rows of x ->
// output row) and, with kTmaPeer, the row stores into peers' memory (one-copy dispatch into a peer's
// output row, combine into a peer's ring). One lane issues them; the engine moves the bytes, so a warp no
// longer needs thousands of bytes of registers in flight to keep HBM busy. Two stages per warp: the load
// of chunk i + 1 runs while chunk i is stored.
#pragma once

#include <stdint.h>
#include <string.h>

#include <atomic>
#include <stdexcept>
#include <string>

#include "kernels/normal_common.cuh"

namespace pyep {
namespace normal {

constexpr int kTmaStageBytes = 4096;   // per stage; 2 stages per warp, 24 warps: 192 KiB of shared memory
constexpr int kTmaStages = 2;
// DispatchArgs / CombineArgs use_tma bits: which copies go by bulk copy (the others by warp loads/stores).
constexpr int kTmaLocal = 1;   // the dispatch receiver's copies into this rank's outputs, the combine's reduce loads
constexpr int kTmaPeer = 2;    // stores into a peer's buffer: one-copy dispatch rows, combine rows

// Whether a row of `bytes` goes to a peer by bulk copy: only rows longer than a warp's stages. Rows that
// fit them (FP8 at H = 7168, 7 KiB) lost 7 % that way under DeepEP's test at 4 ranks; BF16 rows (14 KiB)
// gained 9 % at 2 ranks, one H100 (docs/results/2026-11-27-h100x1).
__host__ __device__ constexpr bool peer_bulk(int flags, uint32_t bytes) {
    return (flags & kTmaPeer) && bytes > (uint32_t)(kTmaStages * kTmaStageBytes);
}

// Dynamic shared memory of a block whose `warps` warps each own their stages and mbarriers.
__host__ __device__ constexpr int tma_smem_data(int warps) { return warps * kTmaStages * kTmaStageBytes; }
__host__ __device__ constexpr int tma_smem_bytes(int warps) { return tma_smem_data(warps) + warps * kTmaStages * 8; }

struct WarpTma {
    uint8_t* smem;       // kTmaStages * kTmaStageBytes, this warp's
    uint64_t* bar;       // kTmaStages mbarriers
    uint32_t phases;     // bit s: the parity the next wait on stage s expects
    uint32_t next;       // chunks issued so far (selects the stage)
};

#if !defined(PYEP_LL_CPU_SIM)
// The block's dynamic shared memory (the launch reserves the stages and barriers).
__device__ __forceinline__ uint8_t* tma_shared() {
    extern __shared__ __align__(128) uint8_t tma_smem[];
    return tma_smem;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Lane 0 of the warp initialises its barriers (once per kernel).
__device__ __forceinline__ WarpTma tma_setup(uint8_t* smem_base, uint64_t* bars, int warp, int lane) {
    WarpTma t{smem_base + (size_t)warp * kTmaStages * kTmaStageBytes, bars + warp * kTmaStages, 0u, 0u};
    if (lane == 0) {
        for (int s = 0; s < kTmaStages; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(t.bar + s)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
    return t;
}

__device__ __forceinline__ void tma_load(WarpTma& t, int stage, const void* src, int bytes) {
    const uint32_t bar = smem_addr(t.bar + stage);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(t.smem + stage * kTmaStageBytes)), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ void tma_wait(WarpTma& t, int stage) {
    const uint32_t bar = smem_addr(t.bar + stage), parity = (t.phases >> stage) & 1u;
    uint32_t done = 0;
    while (!done) {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
    t.phases ^= 1u << stage;
}

// Copy `bytes` (a multiple of 16, both ends 16-byte aligned) from global src to global dst. Called by
// the whole warp; lane 0 issues everything. Loads of src are complete when this returns (the caller may
// then let the source be overwritten); stores to dst may still be in flight until tma_drain().
__device__ __forceinline__ void tma_copy(WarpTma& t, uint8_t* dst, const uint8_t* src, int bytes, int lane) {
    if (lane == 0) {
        // Reads of a source that peers wrote (generic proxy, ordered by the caller's acquire) by the
        // async proxy: order them explicitly.
        asm volatile("fence.proxy.async;" ::: "memory");
        const int chunks = (bytes + kTmaStageBytes - 1) / kTmaStageBytes;
        auto issue = [&](int i) {
            const int stage = (t.next + i) % kTmaStages;
            // The stage's previous store must have finished reading it.
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            tma_load(t, stage, src + (size_t)i * kTmaStageBytes, min(kTmaStageBytes, bytes - i * kTmaStageBytes));
        };
        issue(0);
        for (int i = 0; i < chunks; ++i) {
            if (i + 1 < chunks) issue(i + 1);
            const int stage = (t.next + i) % kTmaStages;
            tma_wait(t, stage);
            uint8_t* d = dst + (size_t)i * kTmaStageBytes;
            const uint32_t from = smem_addr(t.smem + stage * kTmaStageBytes);
            const int n = min(kTmaStageBytes, bytes - i * kTmaStageBytes);
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                         ::"l"(d), "r"(from), "r"(n) : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
        t.next += chunks;
    }
    __syncwarp();
}

// Wait until this warp's bulk stores are complete (before the kernel ends).
__device__ __forceinline__ void tma_drain(int lane) {
    if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    __syncwarp();
}

// Wait until this warp's bulk stores are complete, then order them (async proxy) before the generic-proxy
// release that tells a peer they are there: the caller's group barrier and a leader's st_release_sys of
// the tail follow, and the peer acquires the tail before it reads the rows.
__device__ __forceinline__ void tma_drain_before_release(int lane) {
    if (lane == 0) {
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        asm volatile("fence.proxy.async.global;" ::: "memory");
    }
    __syncwarp();
}

// ---- a warp's own loads into its stages (the combine's reduce): every lane tracks the same state ----
// Stage s of warp state t: its shared memory and its mbarrier.
__device__ __forceinline__ uint8_t* stage_smem(const WarpTma& t, int s) { return t.smem + s * kTmaStageBytes; }

// Lane 0: arm stage s's barrier for `bytes`, then bulk-load each of n pieces (src[i], `len` bytes) to
// stage offset i * stride. Pieces read rows that peers wrote (generic proxy, ordered by the caller's
// acquire) through the async proxy: the caller fenced with tma_reads_after_acquire() first.
__device__ __forceinline__ void stage_load(WarpTma& t, int s, const uint8_t* const* src, int n, uint32_t off, int len,
                                          int stride) {
    const uint32_t bar = smem_addr(t.bar + s);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(n * len) : "memory");
    for (int i = 0; i < n; ++i)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(smem_addr(stage_smem(t, s) + i * stride)), "l"(src[i] + off), "r"(len), "r"(bar)
                     : "memory");
}

__device__ __forceinline__ void tma_reads_after_acquire() { asm volatile("fence.proxy.async;" ::: "memory"); }

// Every lane: wait until stage s's loads landed (each lane flips its own copy of the parity alike).
__device__ __forceinline__ void stage_wait(WarpTma& t, int s) { tma_wait(t, s); }

// After the lanes' reads of a stage (generic proxy) and a __syncwarp, before lane 0 loads into it again
// (async proxy).
__device__ __forceinline__ void stage_release() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

#else
// CPU simulation (tests/ll_sim): no copy engine; a bulk copy is the warp's own copy, complete on return.
// The stages sit past the block_shared() scratch (normal_common.cuh), which the simulated block's
// memory starts with; tests/ll_sim/normal_sim.cpp reserves both.
__device__ __forceinline__ uint8_t* tma_shared() { return sim_smem() + kSimBlockScratch; }
__device__ __forceinline__ WarpTma tma_setup(uint8_t* smem_base, uint64_t* bars, int warp, int) {
    __syncwarp();
    return WarpTma{smem_base + (size_t)warp * kTmaStages * kTmaStageBytes, bars + warp * kTmaStages, 0u, 0u};
}
__device__ __forceinline__ void tma_copy(WarpTma& t, uint8_t* dst, const uint8_t* src, int bytes, int lane) {
    warp_copy(dst, src, bytes, lane);
    __syncwarp();
}
__device__ __forceinline__ void tma_drain(int) { __syncwarp(); }
__device__ __forceinline__ void tma_drain_before_release(int) { __syncwarp(); }
__device__ __forceinline__ uint8_t* stage_smem(const WarpTma& t, int s) { return t.smem + s * kTmaStageBytes; }
// The simulation's loads complete at once (plain copies into the stage).
__device__ __forceinline__ void stage_load(WarpTma& t, int s, const uint8_t* const* src, int n, uint32_t off, int len,
                                          int stride) {
    for (int i = 0; i < n; ++i) memcpy(stage_smem(t, s) + i * stride, src[i] + off, (size_t)len);
}
__device__ __forceinline__ void tma_reads_after_acquire() {}
__device__ __forceinline__ void stage_wait(WarpTma&, int) { __syncwarp(); }   // lane 0's copies are done
__device__ __forceinline__ void stage_release() {}
#endif  // !PYEP_LL_CPU_SIM

#if !defined(PYEP_LL_CPU_SIM)
// The dynamic shared memory a kernel's stages need past the 48 KiB default. cudaFuncSetAttribute acts
// on the current device only, so it is made once per device (bit d of `devices`), not once per process:
// a process that drives two GPUs would otherwise launch on the second without it.
template <typename Kernel>
inline void reserve_stage_smem(Kernel* kernel, int bytes, std::atomic<uint64_t>& devices, const char* what) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) throw std::runtime_error(std::string(what) + ": no current CUDA device");
    const uint64_t bit = dev < 64 ? (uint64_t{1} << dev) : 0;
    if (bit && (devices.load(std::memory_order_acquire) & bit)) return;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess)
        throw std::runtime_error(std::string(what) + ": cannot reserve " + std::to_string(bytes) +
                                 " bytes of shared memory per block on device " + std::to_string(dev));
    devices.fetch_or(bit, std::memory_order_release);
}
#endif  // !PYEP_LL_CPU_SIM

// A row copy: by bulk copy when `bulk`, else by the warp's own loads and stores.
__device__ __forceinline__ void copy_row(WarpTma& t, bool bulk, uint8_t* dst, const uint8_t* src, int bytes, int lane) {
    if (bulk) tma_copy(t, dst, src, bytes, lane);
    else warp_copy(dst, src, bytes, lane);
}

}  // namespace normal
}  // namespace pyep
