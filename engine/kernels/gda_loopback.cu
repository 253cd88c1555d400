// GPU-initiated write latency / bandwidth between two endpoints (`pyep qp loopback`), posted through
// qp.h exactly as the EP kernels post, and the bounded memory reader of the QP dump.
//
// One thread per endpoint does all the work: the point is the latency of one GPU-posted RDMA write
// through the NIC (or softnic) and back, not GPU parallelism. Every wait is bounded by timeout_ns and
// reports where it stopped (LoopResult), so a lost signal ends the kernel instead of hanging it.
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/gda_loopback.h"
#include "mlx5gda/qp.h"

namespace pyep {
namespace gda {
namespace {

void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Restores the caller's current device on scope exit (the launches may target another GPU).
struct DeviceGuard {
    int saved = -1;
    explicit DeviceGuard(int device) {
        check(cudaGetDevice(&saved), "cudaGetDevice");
        check(cudaSetDevice(device), "cudaSetDevice");
    }
    ~DeviceGuard() {
        if (saved >= 0) cudaSetDevice(saved);
    }
};

__device__ void finish(const LoopEndpoint& e, uint64_t status, uint64_t stage, uint64_t iterations, uint64_t start,
                       uint64_t end) {
    LoopResult* r = reinterpret_cast<LoopResult*>(e.result);
    r->status = status;
    r->stage = stage;
    r->iterations = iterations;
    r->start_ns = start;
    r->end_ns = end;
    r->last_signal = load_acquire_sys_u32(reinterpret_cast<const uint32_t*>(e.sig_local));
}

// Spins until the signal word reaches `target` (wrap-safe comparison). Polls the own send CQ now and
// then: if our own earlier write failed, the peer will never answer, and the error CQE says why.
__device__ int wait_signal(Qp* qp, const uint32_t* sig, uint32_t target, uint64_t timeout_ns) {
    uint64_t deadline = 0;
    uint32_t spins = 0;
    while ((int32_t)(load_acquire_sys_u32(sig) - target) < 0) {
        if ((++spins & 255) == 0) {
            poll_send_cq(qp);
            if (qp_in_error(qp)) return kErrQp;
        }
        const uint64_t t = now_ns();
        if (!deadline) deadline = t + timeout_ns;
        if (t > deadline) return kErrTimeout;
    }
    return kOk;
}

__device__ int post_one(Qp* qp, const LoopEndpoint& e, uint32_t size, bool with_signal, uint64_t timeout_ns) {
    if (with_signal)
        return post_write_with_signal(qp, e.src, e.lkey, e.dst, e.rkey, size, e.sig_remote, e.sig_rkey, 1u, e.fetch,
                                      e.fetch_lkey, /*signaled=*/false, timeout_ns);
    return post_rdma_write(qp, e.src, e.lkey, e.dst, e.rkey, size, /*signaled=*/false, timeout_ns);
}

__global__ void loop_latency_kernel(LoopLatencyArgs a) {
    if (threadIdx.x != 0 || (int)blockIdx.x >= a.num_here) return;
    const LoopEndpoint& e = a.ep[blockIdx.x];
    const bool initiator = ((a.first_role + (int)blockIdx.x) & 1) == 0;
    Qp* qp = reinterpret_cast<Qp*>(e.qp);
    const uint32_t* sig = reinterpret_cast<const uint32_t*>(e.sig_local);
    uint64_t* samples = reinterpret_cast<uint64_t*>(e.samples);
    const uint32_t total = a.warmup + a.iters;
    uint64_t start = 0;
    uint32_t i = 0;
    int st = kOk;
    uint64_t stage = kStageNone;
    for (; i < total; ++i) {
        if (i == a.warmup) start = now_ns();
        const uint64_t t0 = now_ns();
        if (!initiator) {
            st = wait_signal(qp, sig, i + 1, a.timeout_ns);
            if (st != kOk) { stage = kStageWaitSignal; break; }
        }
        st = post_one(qp, e, a.size, true, a.timeout_ns);
        if (st != kOk) { stage = kStagePost; break; }
        if (initiator) {
            st = wait_signal(qp, sig, i + 1, a.timeout_ns);
            if (st != kOk) { stage = kStageWaitSignal; break; }
            if (i >= a.warmup && samples) samples[i - a.warmup] = now_ns() - t0;
        }
    }
    const uint64_t end = now_ns();
    if (st == kOk) {
        st = quiet(qp, a.timeout_ns);
        if (st != kOk) stage = kStageQuiet;
    }
    finish(e, (uint64_t)st, stage, i, start, end);
}

__global__ void loop_bandwidth_kernel(LoopBandwidthArgs a) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const LoopEndpoint& e = a.ep;
    Qp* qp = reinterpret_cast<Qp*>(e.qp);
    int st = kOk;
    uint64_t stage = kStageNone;
    uint32_t i = 0;
    for (; i < a.warmup && st == kOk; ++i) st = post_one(qp, e, a.size, false, a.timeout_ns);
    if (st == kOk) st = quiet(qp, a.timeout_ns);
    // The clock starts with the ring drained, so the warm-up does not count towards the window.
    const uint64_t start = now_ns();
    for (uint32_t k = 0; k < a.iters && st == kOk; ++k, ++i)
        st = post_one(qp, e, a.size, k + 1 == a.iters, a.timeout_ns);
    if (st != kOk) stage = kStagePost;
    if (st == kOk) {
        st = quiet(qp, a.timeout_ns);
        if (st != kOk) stage = kStageQuiet;
    }
    finish(e, (uint64_t)st, stage, i, start, now_ns());
}

void check_endpoint(const LoopEndpoint& e, const char* which) {
    if (!e.qp || !e.src || !e.dst || !e.sig_remote || !e.sig_local || !e.fetch || !e.result)
        throw std::invalid_argument(std::string(which) + ": qp, src, dst, sig_remote, sig_local, fetch and result "
                                    "must all be non-zero addresses");
    if (e.sig_remote % 4 || e.sig_local % 4 || e.fetch % 8 || e.result % 8 || e.samples % 8)
        throw std::invalid_argument(std::string(which) + ": signal words must be 4-byte aligned, fetch, result "
                                    "and samples 8-byte aligned");
}

void check_common(uint32_t size, uint32_t iters, uint64_t timeout_ns) {
    if (size == 0 || size > (1u << 30)) throw std::invalid_argument("size must be in 1..2^30 bytes");
    if (iters == 0 || iters > (1u << 30)) throw std::invalid_argument("iters must be in 1..2^30");
    if (timeout_ns == 0) throw std::invalid_argument("timeout_ns must be > 0");
}

}  // namespace

void launch_loop_latency(const LoopLatencyArgs& a) {
    if (a.num_here != 1 && a.num_here != 2) throw std::invalid_argument("num_here must be 1 or 2");
    if (a.first_role != 0 && a.first_role != 1) throw std::invalid_argument("first_role must be 0 or 1");
    check_common(a.size, a.iters, a.timeout_ns);
    if ((uint64_t)a.warmup + a.iters >= (1ull << 31)) throw std::invalid_argument("warmup + iters must be < 2^31");
    for (int k = 0; k < a.num_here; ++k) check_endpoint(a.ep[k], k ? "endpoint 1" : "endpoint 0");
    DeviceGuard guard(a.device);
    // One block per endpoint: both must be resident at once (they wait on each other), which two
    // single-warp blocks always are.
    loop_latency_kernel<<<a.num_here, 32, 0, reinterpret_cast<cudaStream_t>(a.stream)>>>(a);
    check(cudaGetLastError(), "loop_latency_kernel launch");
}

void launch_loop_bandwidth(const LoopBandwidthArgs& a) {
    check_common(a.size, a.iters, a.timeout_ns);
    check_endpoint(a.ep, "endpoint");
    DeviceGuard guard(a.device);
    loop_bandwidth_kernel<<<1, 32, 0, reinterpret_cast<cudaStream_t>(a.stream)>>>(a);
    check(cudaGetLastError(), "loop_bandwidth_kernel launch");
}

std::string read_memory(uint64_t addr, size_t n) {
    std::string out(n, '\0');
    if (n == 0) return out;
    const void* src = reinterpret_cast<const void*>(addr);
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        cudaGetLastError();  // no usable GPU: there is no device memory, the address is host memory
        std::memcpy(&out[0], src, n);
        return out;
    }
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, src) != cudaSuccess) {
        cudaGetLastError();
        throw std::invalid_argument("read_memory: CUDA does not know address " + std::to_string(addr));
    }
    if (attr.type == cudaMemoryTypeUnregistered || attr.type == cudaMemoryTypeHost) {
        std::memcpy(&out[0], attr.hostPointer ? attr.hostPointer : src, n);
        return out;
    }
    DeviceGuard guard(attr.device);
    // A non-blocking stream never waits for the legacy default stream, so a kernel that is still
    // running (a stuck poster is what a dump is usually for) does not hold the copy back.
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    const cudaError_t e = cudaMemcpyAsync(&out[0], src, n, cudaMemcpyDeviceToHost, s);
    const cudaError_t e2 = e == cudaSuccess ? cudaStreamSynchronize(s) : e;
    cudaStreamDestroy(s);
    check(e2, "read_memory: device-to-host copy");
    return out;
}

}  // namespace gda
}  // namespace pyep
