// The softnic's DMA backends: host memory (memcpy, __atomic builtins; works across processes on shared
// memory) and CUDA memory (softnic_cuda.cu, CUDA builds only). An MR records which backend its memory
// belongs to; a WQE touching GPU memory on either side is executed on the QP's CUDA stream.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>

namespace pyep {
namespace softnic {

// Fetch-and-add with mlx5 masked-atomic field boundaries: a set bit i in `boundary` marks bit i as the
// most significant bit of a field, so the carry out of bit i is dropped and fields add independently.
// boundary == 0 is one plain add over the whole operand.
inline uint64_t field_add(uint64_t a, uint64_t b, uint64_t boundary, uint32_t bits) {
    const uint64_t mask = bits == 64 ? ~0ull : ((1ull << bits) - 1);
    if ((boundary & mask) == 0) return (a + b) & mask;
    uint64_t out = 0, carry = 0;
    for (uint32_t i = 0; i < bits; ++i) {
        const uint64_t s = ((a >> i) & 1) + ((b >> i) & 1) + carry;
        out |= (s & 1) << i;
        carry = ((boundary >> i) & 1) ? 0 : (s >> 1);
    }
    return out;
}

// Host atomic on (possibly shared) host memory; returns the old value.
inline uint64_t host_atomic_add(void* target, uint32_t size, uint64_t add, uint64_t boundary) {
    if (size == 4) {
        auto* p = static_cast<uint32_t*>(target);
        if ((boundary & 0xffffffffu) == 0) return __atomic_fetch_add(p, (uint32_t)add, __ATOMIC_SEQ_CST);
        uint32_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
        while (!__atomic_compare_exchange_n(p, &old, (uint32_t)field_add(old, add, boundary, 32), false,
                                            __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
        }
        return old;
    }
    auto* p = static_cast<uint64_t*>(target);
    if (boundary == 0) return __atomic_fetch_add(p, add, __ATOMIC_SEQ_CST);
    uint64_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(p, &old, field_add(old, add, boundary, 64), false, __ATOMIC_SEQ_CST,
                                        __ATOMIC_RELAXED)) {
    }
    return old;
}

struct CudaPointer {
    bool device = false;       // device (not host, not managed) memory
    int ordinal = -1;
    uint64_t alloc_base = 0;   // start of the allocation containing the pointer
    bool ipc_ok = false;       // an IPC handle could be made for the allocation
    uint8_t ipc[64] = {};
};

// Everything the softnic needs from CUDA. Implemented in softnic_cuda.cu; in host-only builds
// make_cuda_backend() returns nullptr and GPU memory cannot be registered. Each softnic owns one. Calls that fail return false /
// nullptr and leave the reason in last_error(). Streams and events are opaque handles.
class CudaBackend {
  public:
    virtual ~CudaBackend() = default;
    virtual bool usable() = 0;                      // a device is present and the runtime works
    virtual int current_device() = 0;
    virtual int device_count() = 0;
    virtual bool set_device(int ordinal) = 0;
    // The calling thread (the progress thread) never captures a CUDA graph; make its CUDA calls legal
    // while another thread of the process captures one (see softnic_cuda.cu).
    virtual bool isolate_from_captures() = 0;
    virtual bool query_pointer(const void* p, CudaPointer* out) = 0;
    // Pinned host memory mapped into every device's address space (rings for GPU posters).
    virtual void* alloc_host_mapped(size_t bytes, void** device_ptr) = 0;
    virtual void free_host_mapped(void* host_ptr) = 0;
    virtual void* open_ipc(const uint8_t ipc[64]) = 0;  // base of the peer's allocation
    virtual void close_ipc(void* base) = 0;
    virtual bool enable_peer(int from_device, int to_device) = 0;
    virtual void* create_stream() = 0;
    virtual void destroy_stream(void* stream) = 0;
    virtual bool copy_async(void* stream, void* dst, const void* src, size_t n) = 0;
    // *target += add (field boundaries as field_add), old value to *fetch (device-accessible), on the
    // stream, after everything queued before it.
    virtual bool atomic_async(void* stream, void* target, uint32_t size, uint64_t add, uint64_t boundary,
                              void* fetch) = 0;
    virtual void* record_event(void* stream) = 0;
    virtual int query_event(void* event) = 0;       // 1 done, 0 pending, -1 failed
    virtual void destroy_event(void* event) = 0;
    virtual bool sync_stream(void* stream, uint64_t timeout_ns) = 0;
    virtual std::string last_error() = 0;
};

std::unique_ptr<CudaBackend> make_cuda_backend();

}  // namespace softnic
}  // namespace pyep
