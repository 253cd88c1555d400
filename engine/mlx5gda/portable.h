// Host/device portability for the GDA primitives: byte order, atomics, fences, the nanosecond timer.
//
// One source serves nvcc (device code: GPU threads posting WQEs) and g++ (host code: the same posting
// path driven by CPU threads in CI, and the softnic). Memory-model notes:
//  - Rings, doorbell records and CQEs are shared with an agent outside the GPU (the NIC, or the softnic
//    thread on the host), so ordering edges towards them use system scope (fence.sc.sys /
//    __threadfence_system on the GPU, seq_cst fences on the host).
//  - QP bookkeeping (reservation counters, locks) is only shared among posting threads of one device,
//    so it uses device-scope atomics, which are much cheaper than system scope.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define PYEP_HD __host__ __device__ __forceinline__
#define PYEP_DEV __device__ __forceinline__
#else
#define PYEP_HD inline
#define PYEP_DEV inline
#endif

#if !defined(__CUDA_ARCH__)
#include <chrono>
#include <thread>
#endif

namespace pyep {
namespace gda {

PYEP_HD uint16_t bswap16(uint16_t v) { return (uint16_t)((v >> 8) | (v << 8)); }
PYEP_HD uint32_t bswap32(uint32_t v) {
#if defined(__CUDA_ARCH__)
    return __byte_perm(v, 0, 0x0123);
#else
    return __builtin_bswap32(v);
#endif
}
PYEP_HD uint64_t bswap64(uint64_t v) {
    return ((uint64_t)bswap32((uint32_t)v) << 32) | bswap32((uint32_t)(v >> 32));
}
// The PRM is big-endian; both hosts we build for (x86-64, aarch64) and the GPU are little-endian.
PYEP_HD uint16_t htobe16_(uint16_t v) { return bswap16(v); }
PYEP_HD uint32_t htobe32_(uint32_t v) { return bswap32(v); }
PYEP_HD uint64_t htobe64_(uint64_t v) { return bswap64(v); }
PYEP_HD uint16_t be16toh_(uint16_t v) { return bswap16(v); }
PYEP_HD uint32_t be32toh_(uint32_t v) { return bswap32(v); }
PYEP_HD uint64_t be64toh_(uint64_t v) { return bswap64(v); }

// Nanoseconds from a monotonic clock. On the GPU this is %globaltimer (wall-clock nanoseconds, the
// same on every SM), not clock64(), whose rate is the SM clock and changes with boost/throttling.
PYEP_HD uint64_t now_ns() {
#if defined(__CUDA_ARCH__)
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#else
    return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
#endif
}

PYEP_HD void spin_pause() {
#if defined(__CUDA_ARCH__)
    __nanosleep(32);
#else
    // Host posters and the softnic may share few cores with the thread they wait for (CI has two):
    // yield so that thread can run. No sleeping: a timed sleep costs ~200 us here (timer slack), far
    // longer than any handoff. Host posting is for tests and tools; keep posters <= cores for speed.
    std::this_thread::yield();
#endif
}

// --- device-scope atomics on QP bookkeeping ---------------------------------------------------------
PYEP_HD uint64_t atomic_fetch_add_u64(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
    return (uint64_t)atomicAdd((unsigned long long*)p, (unsigned long long)v);
#else
    return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
#endif
}
PYEP_HD uint32_t atomic_cas_u32(uint32_t* p, uint32_t expected, uint32_t desired) {
#if defined(__CUDA_ARCH__)
    return atomicCAS((unsigned int*)p, expected, desired);
#else
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    return expected;
#endif
}
PYEP_HD uint64_t load_acquire_u64(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}
PYEP_HD uint32_t load_acquire_u32(const uint32_t* p) {
#if defined(__CUDA_ARCH__)
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}
PYEP_HD void store_release_u64(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}
PYEP_HD void store_release_u32(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

// --- system-scope accesses to memory the NIC / softnic reads or writes -------------------------------
// Orders this thread's earlier stores (WQEs) before later stores (DBR, BF) as seen by any agent.
PYEP_HD void fence_system() {
#if defined(__CUDA_ARCH__)
    __threadfence_system();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}
// A load of NIC-written memory (CQE bytes, softnic-visible counters) that must not be cached or hoisted.
PYEP_HD uint8_t load_volatile_u8(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
    uint16_t v;
    asm volatile("ld.volatile.global.u8 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return (uint8_t)v;
#else
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}
PYEP_HD uint32_t load_acquire_sys_u32(const uint32_t* p) {
#if defined(__CUDA_ARCH__)
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}
PYEP_HD void store_relaxed_sys_u32(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
    __atomic_store_n(p, v, __ATOMIC_RELAXED);
#endif
}
// The BlueFlame/UAR doorbell: one 8-byte store that must not be split or merged (MMIO on real HW).
PYEP_HD void store_mmio_u64(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.mmio.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
    __atomic_store_n(p, v, __ATOMIC_RELAXED);
#endif
}

}  // namespace gda
}  // namespace pyep
