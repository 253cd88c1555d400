// The softnic's CUDA backend (CUDA builds only): GPU memory registration (IPC handles), host-mapped
// control memory, and the per-QP stream on which WQEs touching GPU memory execute.
//
// Ordering: an RDMA write is a cudaMemcpyAsync and an atomic a one-thread kernel, both on the QP's
// non-blocking stream, so a signal atomic runs only after the data copies queued before it. The engine
// writes the CQEs for them only once an event recorded after them has completed.
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "mlx5gda/softnic_mem.h"

namespace pyep {
namespace softnic {

namespace {

__device__ __forceinline__ unsigned long long dev_field_add(unsigned long long a, unsigned long long b,
                                                            unsigned long long boundary, unsigned bits) {
    unsigned long long out = 0, carry = 0;
    for (unsigned i = 0; i < bits; ++i) {
        const unsigned long long s = ((a >> i) & 1ull) + ((b >> i) & 1ull) + carry;
        out |= (s & 1ull) << i;
        carry = ((boundary >> i) & 1ull) ? 0ull : (s >> 1);
    }
    return out;
}

// System-scope atomics: the target may be another GPU's memory (IPC) polled by kernels there.
__global__ void softnic_atomic_kernel(void* target, unsigned size, unsigned long long add,
                                      unsigned long long boundary, void* fetch) {
    if (size == 4) {
        unsigned* p = static_cast<unsigned*>(target);
        unsigned old;
        if ((unsigned)boundary == 0) {
            old = atomicAdd_system(p, (unsigned)add);
        } else {
            old = *reinterpret_cast<volatile unsigned*>(p);
            for (;;) {
                const unsigned next = (unsigned)dev_field_add(old, add, boundary, 32);
                const unsigned prev = atomicCAS_system(p, old, next);
                if (prev == old) break;
                old = prev;
            }
        }
        if (fetch) *static_cast<unsigned*>(fetch) = old;
    } else {
        unsigned long long* p = static_cast<unsigned long long*>(target);
        unsigned long long old;
        if (boundary == 0) {
            old = atomicAdd_system(p, add);
        } else {
            old = *reinterpret_cast<volatile unsigned long long*>(p);
            for (;;) {
                const unsigned long long next = dev_field_add(old, add, boundary, 64);
                const unsigned long long prev = atomicCAS_system(p, old, next);
                if (prev == old) break;
                old = prev;
            }
        }
        if (fetch) *static_cast<unsigned long long*>(fetch) = old;
    }
    __threadfence_system();
}

class CudaBackendImpl final : public CudaBackend {
  public:
    bool usable() override {
        int n = 0;
        return ok(cudaGetDeviceCount(&n), "cudaGetDeviceCount") && n > 0;
    }
    int current_device() override {
        int d = 0;
        return ok(cudaGetDevice(&d), "cudaGetDevice") ? d : 0;
    }
    int device_count() override {
        int n = 0;
        return ok(cudaGetDeviceCount(&n), "cudaGetDeviceCount") ? n : 0;
    }
    bool set_device(int ordinal) override { return ok(cudaSetDevice(ordinal), "cudaSetDevice"); }
    bool isolate_from_captures() override {
        // In the default (global) capture interaction mode, a stream capture on any thread of the
        // process forbids "potentially unsafe" calls on every other thread -- cudaEventQuery among
        // them -- and such a call invalidates the capture (torch.cuda.graph captures in that mode). This
        // thread only touches its own QP streams and events, which no capture involves, so thread-local
        // mode is exact: it restricts this thread only while it captures itself, which it never does.
        // The WQEs of a replayed graph's kernels are then executed like any others.
        cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
        return ok(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
    }

    bool query_pointer(const void* p, CudaPointer* out) override {
        cudaPointerAttributes a{};
        if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
            cudaGetLastError();  // plain host memory on old runtimes: not an error for us
            return false;
        }
        *out = CudaPointer{};
        if (a.type != cudaMemoryTypeDevice) return true;
        out->device = true;
        out->ordinal = a.device;
        CUdeviceptr base = 0;
        size_t size = 0;
        if (cuMemGetAddressRange(&base, &size, (CUdeviceptr)(uintptr_t)p) != CUDA_SUCCESS) base = (CUdeviceptr)(uintptr_t)p;
        out->alloc_base = (uint64_t)base;
        cudaIpcMemHandle_t h;
        if (cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)) == cudaSuccess) {
            static_assert(sizeof(h) == sizeof(out->ipc), "cudaIpcMemHandle_t is 64 bytes");
            std::memcpy(out->ipc, &h, sizeof(h));
            out->ipc_ok = true;
        } else {
            cudaGetLastError();  // e.g. VMM allocations: usable in this process only
        }
        return true;
    }

    void* alloc_host_mapped(size_t bytes, void** device_ptr) override {
        void* p = nullptr;
        if (!ok(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc")) return nullptr;
        void* d = nullptr;
        if (!ok(cudaHostGetDevicePointer(&d, p, 0), "cudaHostGetDevicePointer")) {
            cudaFreeHost(p);
            return nullptr;
        }
        // Host posters (tests, tools) use the same QpInfo addresses as GPU posters; with unified
        // addressing (every 64-bit platform CUDA supports) the two are equal.
        if (d != p) {
            err_ = "cudaHostGetDevicePointer returned a pointer != the host pointer (no unified addressing)";
            cudaFreeHost(p);
            return nullptr;
        }
        *device_ptr = d;
        return p;
    }
    void free_host_mapped(void* host_ptr) override { cudaFreeHost(host_ptr); }

    void* open_ipc(const uint8_t ipc[64]) override {
        cudaIpcMemHandle_t h;
        std::memcpy(&h, ipc, sizeof(h));
        void* p = nullptr;
        if (!ok(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle")) return nullptr;
        return p;
    }
    void close_ipc(void* base) override { cudaIpcCloseMemHandle(base); }

    bool enable_peer(int from_device, int to_device) override {
        if (from_device == to_device) return true;
        int can = 0;
        if (!ok(cudaDeviceCanAccessPeer(&can, from_device, to_device), "cudaDeviceCanAccessPeer") || !can) return false;
        const cudaError_t e = cudaDeviceEnablePeerAccess(to_device, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) {
            cudaGetLastError();
            return true;
        }
        return ok(e, "cudaDeviceEnablePeerAccess");
    }

    void* create_stream() override {
        // Load the atomic kernel now. With CUDA's lazy module loading (the default) its first launch
        // would load it then, and loading may wait for kernels already running on the device: the
        // posting kernels that are waiting for this very atomic. Streams are created by control calls
        // (QP creation), before any poster runs.
        cudaFuncAttributes attr;
        if (!ok(cudaFuncGetAttributes(&attr, softnic_atomic_kernel), "loading the softnic atomic kernel")) return nullptr;
        cudaStream_t s = nullptr;
        if (!ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags")) return nullptr;
        return s;
    }
    void destroy_stream(void* stream) override { cudaStreamDestroy(static_cast<cudaStream_t>(stream)); }

    bool copy_async(void* stream, void* dst, const void* src, size_t n) override {
        return ok(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)), "cudaMemcpyAsync");
    }

    bool atomic_async(void* stream, void* target, uint32_t size, uint64_t add, uint64_t boundary, void* fetch) override {
        softnic_atomic_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(target, size, add, boundary, fetch);
        return ok(cudaGetLastError(), "softnic atomic kernel launch");
    }

    void* record_event(void* stream) override {
        cudaEvent_t ev = nullptr;
        if (!ok(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate")) return nullptr;
        if (!ok(cudaEventRecord(ev, static_cast<cudaStream_t>(stream)), "cudaEventRecord")) {
            cudaEventDestroy(ev);
            return nullptr;
        }
        return ev;
    }
    int query_event(void* event) override {
        const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
        if (e == cudaSuccess) return 1;
        if (e == cudaErrorNotReady) {
            cudaGetLastError();
            return 0;
        }
        ok(e, "cudaEventQuery");
        return -1;
    }
    void destroy_event(void* event) override { cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

    bool sync_stream(void* stream, uint64_t timeout_ns) override {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns);
        for (;;) {
            const cudaError_t e = cudaStreamQuery(static_cast<cudaStream_t>(stream));
            if (e == cudaSuccess) return true;
            if (e != cudaErrorNotReady) return ok(e, "cudaStreamQuery");
            cudaGetLastError();
            if (std::chrono::steady_clock::now() > deadline) {
                err_ = "stream still busy after " + std::to_string(timeout_ns / 1000000) + " ms";
                return false;
            }
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
    }

    std::string last_error() override { return err_; }

  private:
    bool ok(cudaError_t e, const char* what) {
        if (e == cudaSuccess) return true;
        err_ = std::string(what) + ": " + cudaGetErrorString(e);
        cudaGetLastError();
        return false;
    }
    std::string err_;
};

}  // namespace

std::unique_ptr<CudaBackend> make_cuda_backend() { return std::make_unique<CudaBackendImpl>(); }

}  // namespace softnic
}  // namespace pyep
