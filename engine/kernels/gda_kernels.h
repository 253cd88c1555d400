// Host entry points of the engine's own GPU kernels (post-rate benchmark, GPU posting self-test).
// Plain C++ types only, so the pybind11 layer needs no CUDA headers. Compiled in CUDA builds only.
#pragma once

#include <stdint.h>

#include <memory>
#include <string>
#include <vector>

namespace pyep {
namespace gda {

// Post-rate benchmark: QPs whose rings live in GPU memory, doorbell records / BlueFlame pages / CQs in
// host-mapped memory, consumed by a CompletionSink thread that completes everything it sees.
struct PostRateResult {
    double elapsed_ms = 0;
    uint64_t posts = 0;          // WQEs posted by the kernel
    uint64_t doorbells = 0;      // post_batch calls
    uint64_t sink_cqes = 0;      // CQEs the sink wrote
    int errors = 0;              // warps whose post returned an error
    std::string first_error;     // decoded first error, if any
};

class PostRateBench {
  public:
    PostRateBench(int device, int num_qps, int log_sq);
    ~PostRateBench();
    // `warps` posting warps (one lane each), spread over `blocks` blocks; warp w posts to QP
    // (w / warps_per_qp) % num_qps; each warp posts `posts_per_warp` RDMA-write WQEs of 64 B in
    // batches of `batch` per doorbell (1..8).
    PostRateResult run(int blocks, int warps_per_block, int warps_per_qp, uint32_t posts_per_warp, uint32_t batch,
                       double timeout_s);
    int num_qps() const;

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// GPU posting through QP contexts prepared by the host (e.g. softnic QPs with host-mapped rings):
// warp w posts to qp_ctx[w % num_qps] `msgs_per_warp` RDMA writes of `msg_bytes`, each followed (same
// doorbell) by a masked FA32 +1 on that QP's signal word, then quiet()s. Addresses are per QP.
struct PostWritesArgs {
    uint64_t qp_ctx = 0;        // device pointer to gda::Qp[num_qps]
    int num_qps = 0;
    int warps_per_qp = 1;
    uint64_t src = 0;           // local source buffer (registered; lkey)
    uint32_t lkey = 0;
    uint64_t src_stride_qp = 0; // bytes of source per QP
    uint64_t dst_table = 0;     // device pointer to uint64 remote base per QP
    uint64_t rkey_table = 0;    // device pointer to uint32 rkey per QP
    uint64_t sig_table = 0;     // device pointer to uint64 remote signal address per QP
    uint64_t sig_rkey_table = 0;// device pointer to uint32 signal rkey per QP
    uint64_t fetch = 0;         // local scratch for fetched values (registered; fetch_lkey)
    uint32_t fetch_lkey = 0;
    uint32_t msgs_per_warp = 0;
    uint32_t msg_bytes = 0;
    uint64_t status = 0;        // device pointer to int per warp (gda::Status)
    uint64_t timeout_ns = 0;
    uint64_t stream = 0;        // cudaStream_t as an integer
};
void launch_post_writes(const PostWritesArgs& args);

}  // namespace gda
}  // namespace pyep
