// Host stand-ins for the CUDA builtins the low-latency EP kernels use, so engine/kernels/ll_*.cu compile
// as plain C++ (PYEP_LL_CPU_SIM) and run with one OS thread per GPU thread: __syncthreads is a block
// barrier, warp shuffles exchange through per-warp slots between two barriers of the participating
// lanes, atomics are GCC atomics. Rounding helpers are exact IEEE (compile with -ffp-contract=off).
// Test-only: tests/ll_sim/ll_sim.cpp includes this before the kernel sources.
#pragma once

#include <stdint.h>

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct alignas(16) int4 { int x, y, z, w; };
inline int4 make_int4(int a, int b, int c, int d) { return int4{a, b, c, d}; }
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return float2{a, b}; }

struct SimWarp {
    uint64_t slots[32] = {};
    std::mutex m;
    std::map<uint32_t, std::unique_ptr<std::barrier<>>> bars;
    std::barrier<>& bar(uint32_t mask) {
        std::lock_guard<std::mutex> g(m);
        auto& b = bars[mask];
        if (!b) b = std::make_unique<std::barrier<>>(__builtin_popcount(mask));
        return *b;
    }
};

// A named barrier (bar.sync id, count): `count` threads, with the OR of a predicate the threads of one
// phase brought (barrier.red.or), published when the last one arrives and read back after the release.
struct SimNamedBar {
    struct Done {
        SimNamedBar* nb;
        void operator()() noexcept {
            nb->result[nb->phase & 1] = nb->acc.exchange(0);
            ++nb->phase;
        }
    };
    explicit SimNamedBar(int count) : bar(count, Done{this}) {}
    std::atomic<int> acc{0};
    int result[2] = {0, 0};
    unsigned phase = 0;
    std::barrier<Done> bar;
};

struct SimBlock {
    explicit SimBlock(int threads, size_t smem_bytes)
        : bar(threads), smem(smem_bytes + 16), warps((threads + 31) / 32) {}
    std::barrier<> bar;
    std::vector<uint8_t> smem;
    std::vector<SimWarp> warps;
    std::mutex named_m;
    std::map<int, std::unique_ptr<SimNamedBar>> named;
    SimNamedBar& named_bar(int id, int count) {
        std::lock_guard<std::mutex> g(named_m);
        auto& b = named[id];
        if (!b) b = std::make_unique<SimNamedBar>(count);
        return *b;
    }
};

struct SimDim { unsigned x; };
struct SimThread {
    SimDim tid, bid, bdim, gdim;
    SimBlock* block;
    unsigned named_uses[16] = {};   // phases of each named barrier this thread took part in
};
inline thread_local SimThread* g_sim = nullptr;

#define threadIdx (g_sim->tid)
#define blockIdx (g_sim->bid)
#define blockDim (g_sim->bdim)
#define gridDim (g_sim->gdim)

inline uint8_t* sim_smem() {
    uintptr_t p = reinterpret_cast<uintptr_t>(g_sim->block->smem.data());
    return reinterpret_cast<uint8_t*>((p + 15) & ~uintptr_t(15));
}
inline void sim_spin_hint() { std::this_thread::yield(); }
inline void __syncthreads() { g_sim->block->bar.arrive_and_wait(); }
inline void __syncwarp(uint32_t mask = 0xffffffffu) {
    g_sim->block->warps[g_sim->tid.x / 32].bar(mask).arrive_and_wait();
}

// bar.sync id, count / barrier.red.or.pred: returns whether any of the phase's threads passed pred.
inline bool sim_named_barrier(int id, int count, bool pred) {
    SimNamedBar& nb = g_sim->block->named_bar(id, count);
    const unsigned k = g_sim->named_uses[id & 15]++;
    if (pred) nb.acc.fetch_or(1);
    nb.bar.arrive_and_wait();
    return __atomic_load_n(&nb.result[k & 1], __ATOMIC_ACQUIRE) != 0;
}

template <typename T>
T sim_exchange(uint32_t mask, T v, int src_lane) {
    SimWarp& w = g_sim->block->warps[g_sim->tid.x / 32];
    const int lane = g_sim->tid.x & 31;
    uint64_t raw = 0;
    std::memcpy(&raw, &v, sizeof(T));
    __atomic_store_n(&w.slots[lane], raw, __ATOMIC_RELEASE);
    w.bar(mask).arrive_and_wait();
    const bool inside = src_lane >= 0 && src_lane < 32 && (mask >> src_lane & 1u);
    const uint64_t got = __atomic_load_n(&w.slots[inside ? src_lane : lane], __ATOMIC_ACQUIRE);
    w.bar(mask).arrive_and_wait();
    T out;
    std::memcpy(&out, &got, sizeof(T));
    return out;
}
template <typename T> T __shfl_sync(uint32_t mask, T v, int src) { return sim_exchange(mask, v, src & 31); }
template <typename T> T __shfl_xor_sync(uint32_t mask, T v, int m) {
    return sim_exchange(mask, v, (int)((g_sim->tid.x & 31) ^ (unsigned)m));
}
template <typename T> T __shfl_up_sync(uint32_t mask, T v, unsigned d) {
    const int lane = g_sim->tid.x & 31;
    return sim_exchange(mask, v, lane >= (int)d ? lane - (int)d : lane);
}

// Lanes of `mask` whose value equals this lane's (match.any.sync.b64).
inline unsigned __match_any_sync(uint32_t mask, unsigned long long v) {
    SimWarp& w = g_sim->block->warps[g_sim->tid.x / 32];
    const int lane = g_sim->tid.x & 31;
    __atomic_store_n(&w.slots[lane], (uint64_t)v, __ATOMIC_RELEASE);
    w.bar(mask).arrive_and_wait();
    unsigned out = 0;
    for (int l = 0; l < 32; ++l)
        if ((mask >> l & 1u) && __atomic_load_n(&w.slots[l], __ATOMIC_ACQUIRE) == (uint64_t)v) out |= 1u << l;
    w.bar(mask).arrive_and_wait();
    return out;
}

// Lanes of `mask` whose predicate is true (vote.ballot.sync), and a population count.
inline unsigned __ballot_sync(uint32_t mask, bool pred) {
    SimWarp& w = g_sim->block->warps[g_sim->tid.x / 32];
    const int lane = g_sim->tid.x & 31;
    __atomic_store_n(&w.slots[lane], (uint64_t)(pred ? 1 : 0), __ATOMIC_RELEASE);
    w.bar(mask).arrive_and_wait();
    unsigned out = 0;
    for (int l = 0; l < 32; ++l)
        if ((mask >> l & 1u) && __atomic_load_n(&w.slots[l], __ATOMIC_ACQUIRE) != 0) out |= 1u << l;
    w.bar(mask).arrive_and_wait();
    return out;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }
inline bool __all_sync(uint32_t mask, bool pred) { return __ballot_sync(mask, pred) == mask; }

inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <typename T> T __ldg(const T* p) { return *p; }
template <typename T> T __ldcg(const T* p) { return *p; }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline int atomicOr(int* p, int v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
inline int atomicAnd(int* p, int v) { return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicAnd(unsigned int* p, unsigned int v) { return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); }
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline int atomicMin(int* p, int v) {
    int cur = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v < cur && !__atomic_compare_exchange_n(p, &cur, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return cur;
}
inline int atomicMax(int* p, int v) {
    int cur = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v > cur && !__atomic_compare_exchange_n(p, &cur, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return cur;
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
    unsigned long long cur = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v > cur && !__atomic_compare_exchange_n(p, &cur, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return cur;
}
inline int atomicCAS(int* p, int expected, int desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }

inline int4 sim_ld_v4(const void* p) { int4 v; std::memcpy(&v, p, 16); return v; }
inline void sim_st_v4(void* p, int4 v) { std::memcpy(p, &v, 16); }

// float -> e4m3fn, round to nearest even, saturating to +-448 (cvt.rn.satfinite.e4m3x2.f32).
inline uint8_t sim_e4m3(float f) {
    if (std::isnan(f)) return 0x7f;
    const uint8_t sign = std::signbit(f) ? 0x80 : 0;
    double a = std::fabs((double)f);
    if (a >= 448.0) return sign | 0x7e;
    if (a < 0.015625) {                                  // below 2^-6: subnormal steps of 2^-9
        const double q = std::nearbyint(a * 512.0);      // q == 8 is the smallest normal, bits 0x08
        return sign | (uint8_t)q;
    }
    int e;
    const double m = std::frexp(a, &e);                  // a = m * 2^e, m in [0.5, 1)
    int exp = e - 1;
    double q = std::nearbyint((m * 2.0 - 1.0) * 8.0);
    if (q == 8.0) { q = 0; ++exp; }
    if (exp > 8 || (exp == 8 && q > 6)) return sign | 0x7e;
    return sign | (uint8_t)(((exp + 7) << 3) | (int)q);
}
typedef unsigned short __nv_fp8x2_storage_t;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
inline __nv_fp8x2_storage_t __nv_cvt_float2_to_fp8x2(float2 v, __nv_saturation_t, __nv_fp8_interpretation_t) {
    return (unsigned short)(sim_e4m3(v.x) | (sim_e4m3(v.y) << 8));
}
struct __nv_bfloat162 { uint16_t x, y; };
inline uint16_t sim_bf16(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    if (std::isnan(f)) return 0x7fc0;
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
inline float2 __bfloat1622float2(__nv_bfloat162 v) {
    const uint32_t a = (uint32_t)v.x << 16, b = (uint32_t)v.y << 16;
    float2 f;
    std::memcpy(&f.x, &a, 4);
    std::memcpy(&f.y, &b, 4);
    return f;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162{sim_bf16(a), sim_bf16(b)}; }

// Launches grids together, as the ranks of a simulated world run at once: grid() starts `blocks` x
// `threads` OS threads that each run body() with their own threadIdx/blockIdx; join() (or the
// destructor) returns when every simulated thread has finished.
class SimLaunch {
  public:
    template <typename Body>
    void grid(int blocks, int threads, size_t smem_bytes, Body body) {
        for (int b = 0; b < blocks; ++b) {
            blocks_.push_back(std::make_unique<SimBlock>(threads, smem_bytes));
            SimBlock* blk = blocks_.back().get();
            for (int t = 0; t < threads; ++t) {
                threads_.emplace_back([=] {
                    SimThread st{{(unsigned)t}, {(unsigned)b}, {(unsigned)threads}, {(unsigned)blocks}, blk};
                    g_sim = &st;
                    body();
                });
            }
        }
    }
    void join() {
        for (auto& th : threads_) th.join();
        threads_.clear();
    }
    ~SimLaunch() { join(); }

  private:
    std::vector<std::unique_ptr<SimBlock>> blocks_;
    std::vector<std::thread> threads_;
};
