// Host side of the low-latency EP kernels: argument checks shared by the launchers, and the CUDA
// runtime calls the transports need (device buffers, IPC handles, peer-access queries).
#if !defined(PYEP_LL_CPU_SIM)
#include <cuda_runtime.h>
#endif

#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/ll_common.cuh"
#include "kernels/ll_logfmt.cuh"

namespace pyep {
namespace ll {
void check_static(const LLStatic& s) {
    auto bad = [](const std::string& m) { throw std::invalid_argument("ll buffer: " + m); };
    if (s.num_ranks < 1) bad("num_ranks must be >= 1");
    if (s.rank < 0 || s.rank >= s.num_ranks) bad("rank outside [0, num_ranks)");
    if (s.num_local_experts < 1) bad("num_local_experts must be >= 1");
    if (s.num_max_tokens < 1 || s.num_max_tokens > kMaxTokensPerRank)
        bad("num_max_tokens must be in [1, " + std::to_string(kMaxTokensPerRank) + "] (a count word holds count + 1 in 15 bits)");
    if (s.hidden < 128 || s.hidden % 128 || s.hidden > 128 * kMaxGroups)
        bad("hidden must be a multiple of 128 in [128, " + std::to_string(128 * kMaxGroups) + "]");
    if (s.max_topk < 1 || s.max_topk > kMaxTopk) bad("max_topk must be in [1, 16]");
    if (!s.buf || !s.peer_base || !s.flag_expect || !s.workspace) bad("buffer/table pointers must be set");
    if (s.num_qps_per_peer < 1) bad("num_qps_per_peer must be >= 1");
    if (s.num_blocks < 1) bad("num_blocks must be >= 1");
    const uint32_t tail = lf_meta_bytes(s.hidden) > (uint32_t)kHeaderBytes ? lf_meta_bytes(s.hidden) : (uint32_t)kHeaderBytes;
    if (s.msg_bytes != (uint64_t)((tail + 2 * s.hidden + kMsgAlign - 1) / kMsgAlign * kMsgAlign))
        bad("msg_bytes does not match the hidden size (layout.py: 2H + max(16, LogFMT meta) rounded up to 128)");
    if (s.off_cack % 4 || s.off_cack < s.off_csig + 4ull * s.num_ranks || s.off_cack + 4ull * s.num_ranks > s.off_drecv)
        bad("off_cack must follow the combine flags inside the signal area (layout.py)");
    if ((s.half_bytes | s.off_drecv | s.off_crecv | s.msg_bytes) % kMsgAlign) bad("layout offsets must be 128-byte aligned");
    if ((int64_t)s.num_ranks * s.num_max_tokens >= (1ll << 31)) bad("R*T must fit in int32");
}

// The argument checks of one launch (launch_dispatch / launch_combine run them first; so does the CPU
// simulator): pointers the phases need, N, K and the buffer half.
namespace {

// What both calls share: the buffer, N, K and the half. `what`: "ll dispatch" / "ll combine".
void check_common(const LLStatic& s, int num_tokens, int num_topk, int half, const std::string& what) {
    check_static(s);
    if (num_tokens < 0 || num_tokens > s.num_max_tokens)
        throw std::invalid_argument(what + ": num_tokens " + std::to_string(num_tokens) + " outside [0, T]");
    if (num_topk < 1 || num_topk > s.max_topk || num_topk > kMaxTopk)
        throw std::invalid_argument(what + ": num_topk " + std::to_string(num_topk) + " outside [1, K_max]");
    if (half != 0 && half != 1) throw std::invalid_argument(what + ": half must be 0 or 1");
}

// A refused call (abort != 0) sends its abort marker and no payload: it has no tokens and needs no
// input or output pointer.
bool check_abort(int abort, int num_tokens, const std::string& what) {
    if (abort < 0 || abort > (int)kSigValue) throw std::invalid_argument(what + ": abort reason outside [0, 0x7fff]");
    if (abort && num_tokens != 0) throw std::invalid_argument(what + ": an abort call carries no tokens (num_tokens 0)");
    return abort != 0;
}

}  // namespace

void check_call(const LLStatic& s, const LLDispatchCall& c) {
    check_common(s, c.num_tokens, c.num_topk, c.half, "ll dispatch");
    if (!c.active) throw std::invalid_argument("ll dispatch: active pointer is null");
    if (!(c.phases & (kPhaseSend | kPhaseRecv))) throw std::invalid_argument("ll dispatch: no phase");
    if (check_abort(c.abort, c.num_tokens, "ll dispatch")) return;
    if ((c.phases & kPhaseSend) && c.num_tokens > 0 && (!c.x || !c.topk))
        throw std::invalid_argument("ll dispatch: x/topk pointers are null");
    if ((c.phases & kPhaseRecv) && (!c.recv_x || !c.src_info || !c.recv_slot || !c.layout_range || !c.recv_count ||
                                    (c.use_fp8 && !c.recv_scales)))
        throw std::invalid_argument("ll dispatch: an output pointer is null");
}

void check_call(const LLStatic& s, const LLCombineCall& c) {
    check_common(s, c.num_tokens, c.num_topk, c.half, "ll combine");
    if (!c.active || !c.layout_range || !c.src_info || !c.recv_slot)
        throw std::invalid_argument("ll combine: active/handle pointers are null");
    if (!(c.phases & (kPhaseSend | kPhaseRecv))) throw std::invalid_argument("ll combine: no phase");
    if (check_abort(c.abort, c.num_tokens, "ll combine")) return;
    if ((c.phases & kPhaseSend) && !c.x) throw std::invalid_argument("ll combine: x pointer is null");
    if ((c.phases & kPhaseRecv) && c.num_tokens > 0 && (!c.topk || !c.weights || !c.out))
        throw std::invalid_argument("ll combine: topk/weights/out pointers are null");
    if (c.use_logfmt && s.hidden % kLfRound != 0)
        throw std::invalid_argument("ll combine: use_logfmt needs hidden % 512 == 0, got " + std::to_string(s.hidden));
}

#if !defined(PYEP_LL_CPU_SIM)
// A CUDA runtime error as std::runtime_error naming the call (the launchers use it too).
void check_cuda(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

namespace {

void check(cudaError_t e, const std::string& what) { check_cuda(e, what.c_str()); }

}  // namespace

uint64_t device_alloc(uint64_t bytes) {
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), "cudaMalloc(" + std::to_string(bytes) + " bytes)");
    return reinterpret_cast<uint64_t>(p);
}

void device_free(uint64_t ptr) {
    if (ptr) check(cudaFree(reinterpret_cast<void*>(ptr)), "cudaFree");
}

uint64_t host_alloc_mapped(uint64_t bytes) {
    void* p = nullptr;
    check(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
          "cudaHostAlloc(" + std::to_string(bytes) + " bytes, mapped)");
    std::memset(p, 0, bytes);
    void* d = nullptr;
    const cudaError_t e = cudaHostGetDevicePointer(&d, p, 0);
    if (e != cudaSuccess || d != p) {
        cudaFreeHost(p);
        throw std::runtime_error(e != cudaSuccess ? std::string("cudaHostGetDevicePointer: ") + cudaGetErrorString(e)
                                                  : "mapped host memory has a different device address (no unified "
                                                    "addressing)");
    }
    return reinterpret_cast<uint64_t>(p);
}

void host_free(uint64_t ptr) {
    if (ptr) check(cudaFreeHost(reinterpret_cast<void*>(ptr)), "cudaFreeHost");
}

void memset_async(uint64_t ptr, int value, uint64_t bytes, uint64_t stream) {
    check(cudaMemsetAsync(reinterpret_cast<void*>(ptr), value, bytes, reinterpret_cast<cudaStream_t>(stream)),
          "cudaMemsetAsync");
}

uint64_t event_create() {
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    return reinterpret_cast<uint64_t>(e);
}

void event_destroy(uint64_t event) {
    if (event) check(cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event)), "cudaEventDestroy");
}

void event_record(uint64_t event, uint64_t stream) {
    check(cudaEventRecord(reinterpret_cast<cudaEvent_t>(event), reinterpret_cast<cudaStream_t>(stream)),
          "cudaEventRecord");
}

void stream_wait_event(uint64_t stream, uint64_t event) {
    check(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), reinterpret_cast<cudaEvent_t>(event), 0),
          "cudaStreamWaitEvent");
}

void memcpy_htod(uint64_t dst, const void* src, uint64_t bytes) {
    check(cudaMemcpy(reinterpret_cast<void*>(dst), src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
}

std::string ipc_get_handle(uint64_t ptr) {
    cudaIpcMemHandle_t h;
    check(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(ptr)), "cudaIpcGetMemHandle");
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

uint64_t ipc_open_handle(const std::string& handle) {
    if (handle.size() != sizeof(cudaIpcMemHandle_t))
        throw std::invalid_argument("IPC handle must be " + std::to_string(sizeof(cudaIpcMemHandle_t)) + " bytes, got " +
                                    std::to_string(handle.size()));
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
    return reinterpret_cast<uint64_t>(p);
}

void ipc_close_handle(uint64_t ptr) {
    if (ptr) check(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)), "cudaIpcCloseMemHandle");
}

std::string device_pci_bus_id(int device) {
    char buf[64] = {0};
    check(cudaDeviceGetPCIBusId(buf, sizeof(buf), device), "cudaDeviceGetPCIBusId");
    return std::string(buf);
}

bool can_access_peer(int device, int peer_device) {
    if (device == peer_device) return true;
    int ok = 0;
    check(cudaDeviceCanAccessPeer(&ok, device, peer_device), "cudaDeviceCanAccessPeer");
    return ok != 0;
}

int current_device() {
    int d = 0;
    check(cudaGetDevice(&d), "cudaGetDevice");
    return d;
}

int num_sms(int device) {
    int n = 0;
    check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute(SMs)");
    return n;
}

int max_smem_optin(int device) {
    int n = 0;
    check(cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
          "cudaDeviceGetAttribute(smem optin)");
    return n;
}

#endif  // !PYEP_LL_CPU_SIM

}  // namespace ll
}  // namespace pyep
