// Bulk copies global -> shared -> global with the Hopper copy engine in each SM (cp.async.bulk, "TMA"
// without a tensor map), for the dispatch receiver's local copies (ring slot -> output row, own rows of
// x -> output row). One lane issues them; the engine moves the bytes, so a warp no longer needs
// thousands of bytes of registers in flight to keep HBM busy. Two stages per warp: the load of chunk
// i + 1 runs while chunk i is stored.
#pragma once

#include <stdint.h>

#include "kernels/normal_common.cuh"

namespace pyep {
namespace normal {

constexpr int kTmaStageBytes = 4096;   // per stage; 2 stages per warp, 24 warps: 192 KiB of shared memory
constexpr int kTmaStages = 2;

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

#else
// CPU simulation (tests/ll_sim): no copy engine; a bulk copy is the warp's own copy, complete on return.
__device__ __forceinline__ uint8_t* tma_shared() { return sim_smem(); }
__device__ __forceinline__ WarpTma tma_setup(uint8_t* smem_base, uint64_t* bars, int, int) {
    __syncwarp();
    return WarpTma{smem_base, bars, 0u, 0u};
}
__device__ __forceinline__ void tma_copy(WarpTma& t, uint8_t* dst, const uint8_t* src, int bytes, int lane) {
    warp_copy(dst, src, bytes, lane);
    __syncwarp();
}
__device__ __forceinline__ void tma_drain(int) { __syncwarp(); }
#endif  // !PYEP_LL_CPU_SIM

}  // namespace normal
}  // namespace pyep
