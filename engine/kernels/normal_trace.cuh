// Normal-mode kernel trace (PYEP_NORMAL_TRACE, docs/normal_mode.md "Kernel trace"): where each block of
// a combine spends its time. A combine's senders and reducers are coupled through the rings (a sender
// waits for the reducer's head, a reducer for the sender's tail), so its kernel time alone cannot say
// which side paces the other; the trace splits every warp's time into waiting on a peer counter,
// moving rows, and block or group barriers, summed per block. (The LL kernels' trace is a timeline of
// fixed points instead, ll_common.cuh trace_point: their phases follow one another.)
//
// Only the kTrace instantiation of a kernel reads the clock (the traced build may allocate registers
// differently; the figures it reports are its own), and only when NormalStatic::trace is set.
#pragma once

#include "kernels/normal_launch.h"
#include "mlx5gda/portable.h"

namespace pyep {
namespace normal {

// PhaseClock<true>: one warp's running split; lap(bucket) adds the time since the previous lap to it.
// PhaseClock<false>: nothing, and no register.
template <bool kOn>
struct PhaseClock;

template <>
struct PhaseClock<false> {
    __device__ __forceinline__ PhaseClock(const NormalStatic&, int) {}
    __device__ __forceinline__ void lap(int) {}
    __device__ __forceinline__ void moved(int) {}
    __device__ __forceinline__ void finish(const NormalStatic&, int, int) {}
};

// 32-bit times: a lap is far shorter than the 4.3 s at which the low word wraps, and unsigned
// differences survive the wrap; five registers a thread where 64-bit ones made the traced build spill
// 136 bytes a thread.
template <>
struct PhaseClock<true> {
    uint32_t last;
    uint32_t spent[3] = {0, 0, 0};   // kTraceWait, kTraceWork, kTraceSync, as bucket - kTraceWait
    uint32_t items = 0;
    // The block's start is the earliest first reading of its warps (words zeroed by the launch hold the
    // complement, raised by atomicMax), so every warp's laps fall between the block's start and end.
    __device__ __forceinline__ PhaseClock(const NormalStatic& s, int blk) {
        const uint64_t now = gda::now_ns();
        last = (uint32_t)now;
        if (s.trace && threadIdx.x % 32 == 0)
            atomicMax(reinterpret_cast<unsigned long long*>(s.trace) + (int64_t)blk * kTraceWords + kTraceStart,
                      ~(unsigned long long)now);
    }
    __device__ __forceinline__ void moved(int n) { items += (uint32_t)n; }
    __device__ __forceinline__ void lap(int bucket) {
        const uint32_t now = (uint32_t)gda::now_ns();
        spent[bucket - kTraceWait] += now - last;
        last = now;
    }
    // Lane 0 of each warp adds its split to block `blk`'s words (zeroed by the launch), raises the
    // block's end time, and counts itself and the rows (senders) or tokens (reducers) it moved.
    __device__ __forceinline__ void finish(const NormalStatic& s, int blk, int role) {
        if (!s.trace || threadIdx.x % 32) return;
        unsigned long long* w = reinterpret_cast<unsigned long long*>(s.trace) + (int64_t)blk * kTraceWords;
        for (int i = 0; i < 3; ++i) atomicAdd(w + kTraceWait + i, (unsigned long long)spent[i]);
        atomicMax(w + kTraceEnd, (unsigned long long)gda::now_ns());
        atomicAdd(w + kTraceItems, (unsigned long long)items);
        atomicAdd(w + kTraceWarps, 1ull);
        if (threadIdx.x == 0) w[kTraceRole] = (unsigned long long)role;
    }
};

}  // namespace normal
}  // namespace pyep
