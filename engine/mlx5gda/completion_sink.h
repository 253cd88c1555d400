// A completion sink: the minimal "NIC" that consumes doorbells and completes everything at once.
//
// It watches each QP's doorbell record and, whenever the send counter moves, writes one REQ CQE for the
// newest WQE (wqe_counter = pi - 1). A poller treats that as completing every earlier WQE too (its
// `cons` jumps to pi), exactly how it treats a CQE after unsignaled WQEs. The sink never reads WQEs,
// so the rings may live in GPU memory that the host cannot touch cheaply; only the doorbell records and
// the CQs must be host-visible. Used by the post-rate benchmark to measure the GPU side's ceiling, and
// by CPU tests of the posting path.
#pragma once

#include <stdint.h>

#include <atomic>
#include <thread>
#include <vector>

#include "mlx5gda/prm.h"

namespace pyep {
namespace gda {

struct SinkQueue {
    uint32_t qpn;
    volatile uint32_t* qp_dbrec;  // host address of the QP doorbell record
    prm::Cqe64* cqes;             // host address of the CQ ring
    uint32_t log_cq;
    uint64_t sq_pi = 0;           // last producer index seen (64-bit, reconstructed from 16 bits)
    uint64_t cq_pi = 0;           // CQEs written
    uint64_t completions = 0;
};

class CompletionSink {
  public:
    explicit CompletionSink(std::vector<SinkQueue> queues);
    ~CompletionSink();
    CompletionSink(const CompletionSink&) = delete;
    CompletionSink& operator=(const CompletionSink&) = delete;

    void start();
    void stop();
    // One pass over all queues; returns CQEs written. Usable without the thread (deterministic tests).
    uint64_t progress_once();
    uint64_t cqes_written() const { return cqes_.load(std::memory_order_relaxed); }
    uint64_t wqes_seen() const { return wqes_.load(std::memory_order_relaxed); }

  private:
    std::vector<SinkQueue> queues_;
    std::atomic<bool> running_{false};
    std::atomic<uint64_t> cqes_{0}, wqes_{0};
    std::thread thread_;
};

}  // namespace gda
}  // namespace pyep

namespace pyep {
namespace gda {

// The post-rate measurement on the host: `threads` CPU threads post RDMA-write WQEs (64 B, never
// executed) through qp.h into rings in host memory, completed by a CompletionSink thread. The same
// posting code GPU warps run; used in CI to exercise concurrent posting and CQ flow control.
struct HostPostRateResult {
    double elapsed_s = 0;
    uint64_t posts = 0;
    uint64_t sink_cqes = 0;
    int errors = 0;
    uint64_t max_outstanding = 0;  // largest ready - cons seen by a poster (must be <= ring size)
};
HostPostRateResult run_host_post_rate(int threads, int num_qps, int log_sq, uint32_t posts_per_thread,
                                      uint32_t batch, double timeout_s);

}  // namespace gda
}  // namespace pyep
