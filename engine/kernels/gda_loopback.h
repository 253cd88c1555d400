// Host entry points of the GPU-initiated loopback tests (`pyep qp loopback`) and a reader of memory the
// QP dump inspects. Plain C++ types only, so the pybind11 layer needs no CUDA headers. Compiled in
// CUDA builds only (host-only builds have no device memory to read: the binding copies directly).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <string>

namespace pyep {
namespace gda {

// One end of a loopback pair, as the GPU thread driving it sees it. Every address is one the GPU of
// this endpoint can use; keys come from the endpoint's own NIC (lkey) or the peer's (rkey).
struct LoopEndpoint {
    uint64_t qp = 0;          // device pointer to this endpoint's gda::Qp (connected to the peer's QP)
    uint64_t src = 0;         // local source buffer of the writes
    uint32_t lkey = 0;
    uint64_t dst = 0;         // the peer's receive buffer (remote address)
    uint32_t rkey = 0;
    uint64_t sig_remote = 0;  // the peer's 32-bit signal word (remote address)
    uint32_t sig_rkey = 0;
    uint64_t sig_local = 0;   // this endpoint's signal word, which the peer's signals add to
    uint64_t fetch = 0;       // local 8-byte scratch for the fetched value of each signal
    uint32_t fetch_lkey = 0;
    uint64_t samples = 0;     // device: uint64 per measured iteration (initiator: round-trip ns)
    uint64_t result = 0;      // device: LoopResult
};

// What the kernel reports per endpoint (all fields 64-bit so Python reads it as int64[6]).
struct LoopResult {
    uint64_t status;      // gda::Status of the first failure (0 = ok)
    uint64_t stage;       // LoopStage of that failure
    uint64_t iterations;  // iterations completed (warm-up included)
    uint64_t start_ns;    // %globaltimer when the measured part began
    uint64_t end_ns;      // ... and when it ended (after the last completion)
    uint64_t last_signal; // the endpoint's signal word when it stopped
};

enum LoopStage : uint64_t { kStageNone = 0, kStagePost = 1, kStageWaitSignal = 2, kStageQuiet = 3 };

// Ping-pong: endpoint 0 posts a write of `size` bytes + a +1 signal, endpoint 1 waits for the signal
// and answers the same way; `warmup + iters` rounds, the last `iters` timed. `num_here` endpoints run
// in this launch (2: both on this device, one block each; 1: endpoint `first_role` only, the other
// one runs in a launch on another device).
struct LoopLatencyArgs {
    LoopEndpoint ep[2];
    int num_here = 2;
    int first_role = 0;     // role of ep[0]: 0 = initiator (ping), 1 = responder (pong)
    int device = 0;
    uint32_t size = 0;
    uint32_t iters = 0;
    uint32_t warmup = 0;
    uint64_t timeout_ns = 0;  // bounds every wait (ring space, signal, quiet)
    uint64_t stream = 0;      // cudaStream_t as an integer
};
void launch_loop_latency(const LoopLatencyArgs& args);

// Streaming: `warmup` untimed writes, then `iters` writes of `size` bytes to the same remote buffer
// (at most a ring of them outstanding: qp.h's flow control is the window), the last one followed by
// a +1 signal on the peer, then quiet(). Runs ep[0] only.
struct LoopBandwidthArgs {
    LoopEndpoint ep;
    int device = 0;
    uint32_t size = 0;
    uint32_t iters = 0;
    uint32_t warmup = 0;
    uint64_t timeout_ns = 0;
    uint64_t stream = 0;
};
void launch_loop_bandwidth(const LoopBandwidthArgs& args);

// Copies `n` bytes at `addr` (host memory, pinned or not, or device memory of any GPU) into a string.
// Device memory is read on a fresh non-blocking stream, so kernels still running (even spinning ones)
// do not delay it; host memory is copied directly. The caller guarantees `addr` is mapped.
std::string read_memory(uint64_t addr, size_t n);

}  // namespace gda
}  // namespace pyep
