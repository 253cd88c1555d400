// The engine's own GPU kernels: WQE post-rate benchmark and the GPU posting self-test.
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/gda_kernels.h"
#include "mlx5gda/completion_sink.h"
#include "mlx5gda/qp.h"

namespace pyep {
namespace gda {
namespace {

void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

constexpr uint32_t kBfSize = 256;     // BlueFlame half size (mlx5 bf_size for a regular UAR)
constexpr uint32_t kMaxBatch = 8;

__global__ void post_rate_kernel(Qp* qps, int num_qps, int warps_per_qp, uint32_t posts_per_warp,
                                 uint32_t batch, uint64_t laddr, uint64_t raddr, int* status,
                                 unsigned long long* doorbells, uint64_t timeout_ns) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if ((threadIdx.x & 31) != 0) return;
    Qp* qp = &qps[(warp / warps_per_qp) % num_qps];
    WorkRequest wrs[kMaxBatch];
    for (uint32_t i = 0; i < batch; ++i) {
        wrs[i].opcode = prm::kOpRdmaWrite;
        wrs[i].laddr = laddr + 64 * i;
        wrs[i].lkey = 0x1234;
        wrs[i].raddr = raddr + 64 * i;
        wrs[i].rkey = 0x5678;
        wrs[i].length = 64;
    }
    int st = kOk;
    unsigned long long rung = 0;
    for (uint32_t done = 0; done < posts_per_warp && st == kOk; done += batch) {
        st = post_batch(qp, wrs, batch, timeout_ns);
        ++rung;
    }
    status[warp] = st;
    atomicAdd(doorbells, rung);
}

__global__ void post_writes_kernel(PostWritesArgs a) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if ((threadIdx.x & 31) != 0) return;
    const int total_warps = a.num_qps * a.warps_per_qp;
    if (warp >= total_warps) return;
    const int q = warp / a.warps_per_qp;
    const int j = warp % a.warps_per_qp;
    Qp* qp = reinterpret_cast<Qp*>(a.qp_ctx) + q;
    const uint64_t dst = reinterpret_cast<const uint64_t*>(a.dst_table)[q];
    const uint32_t rkey = reinterpret_cast<const uint32_t*>(a.rkey_table)[q];
    const uint64_t sig = reinterpret_cast<const uint64_t*>(a.sig_table)[q];
    const uint32_t sig_rkey = reinterpret_cast<const uint32_t*>(a.sig_rkey_table)[q];
    int st = kOk;
    for (uint32_t i = 0; i < a.msgs_per_warp && st == kOk; ++i) {
        const uint64_t m = (uint64_t)j * a.msgs_per_warp + i;
        const uint64_t off = m * a.msg_bytes;
        st = post_write_with_signal(qp, a.src + q * a.src_stride_qp + off, a.lkey, dst + off, rkey, a.msg_bytes,
                                    sig, sig_rkey, 1u, a.fetch + 8 * (uint64_t)warp, a.fetch_lkey,
                                    /*signaled=*/false, a.timeout_ns);
    }
    if (st == kOk) st = quiet(qp, a.timeout_ns);
    reinterpret_cast<int*>(a.status)[warp] = st;
}

}  // namespace

void launch_post_writes(const PostWritesArgs& a) {
    if (a.num_qps <= 0 || a.warps_per_qp <= 0) throw std::invalid_argument("num_qps and warps_per_qp must be > 0");
    const int warps = a.num_qps * a.warps_per_qp;
    const int warps_per_block = 4;
    const int blocks = (warps + warps_per_block - 1) / warps_per_block;
    post_writes_kernel<<<blocks, warps_per_block * 32, 0, reinterpret_cast<cudaStream_t>(a.stream)>>>(a);
    check(cudaGetLastError(), "post_writes_kernel launch");
}

struct PostRateBench::Impl {
    int device = 0;
    int num_qps = 0;
    int log_sq = 0;
    int log_cq = 0;
    Qp* d_qps = nullptr;            // device: QP contexts
    uint8_t* d_rings = nullptr;     // device: SQ rings (never executed: the sink does not read them)
    uint8_t* h_ctrl = nullptr;      // host-mapped: DBRs, BF pages, CQ DBRs, CQs
    size_t ctrl_bytes = 0;
    uint8_t* d_scratch = nullptr;

    uint32_t* dbrec(int q) const { return reinterpret_cast<uint32_t*>(h_ctrl + 64 * q); }
    uint32_t* cq_dbrec(int q) const { return reinterpret_cast<uint32_t*>(h_ctrl + 64 * (num_qps + q)); }
    uint8_t* bf(int q) const { return h_ctrl + 128 * num_qps + 2 * kBfSize * q; }
    prm::Cqe64* cq(int q) const {
        return reinterpret_cast<prm::Cqe64*>(h_ctrl + 128 * num_qps + 2 * kBfSize * num_qps +
                                             (size_t)q * (64u << log_cq));
    }
};

PostRateBench::PostRateBench(int device, int num_qps, int log_sq) : impl_(new Impl) {
    if (num_qps <= 0 || num_qps > 4096) throw std::invalid_argument("num_qps must be in 1..4096");
    if (log_sq < 3 || log_sq > 15) throw std::invalid_argument("log_sq must be in 3..15");
    Impl& m = *impl_;
    m.device = device;
    m.num_qps = num_qps;
    m.log_sq = log_sq;
    m.log_cq = log_sq;  // at most one CQE per unreclaimed WQE: a CQ as deep as the SQ never overruns
    check(cudaSetDevice(device), "cudaSetDevice");
    check(cudaMalloc(&m.d_qps, sizeof(Qp) * num_qps), "cudaMalloc qps");
    check(cudaMalloc(&m.d_rings, (size_t)num_qps * (64u << log_sq)), "cudaMalloc rings");
    check(cudaMalloc(&m.d_scratch, 64 * kMaxBatch), "cudaMalloc scratch");
    m.ctrl_bytes = 128 * (size_t)num_qps + 2 * kBfSize * (size_t)num_qps + (size_t)num_qps * (64u << m.log_cq);
    check(cudaHostAlloc(reinterpret_cast<void**>(&m.h_ctrl), m.ctrl_bytes, cudaHostAllocMapped | cudaHostAllocPortable),
          "cudaHostAlloc control memory");
}

PostRateBench::~PostRateBench() {
    Impl& m = *impl_;
    cudaSetDevice(m.device);
    cudaFree(m.d_qps);
    cudaFree(m.d_rings);
    cudaFree(m.d_scratch);
    cudaFreeHost(m.h_ctrl);
}

int PostRateBench::num_qps() const { return impl_->num_qps; }

PostRateResult PostRateBench::run(int blocks, int warps_per_block, int warps_per_qp, uint32_t posts_per_warp,
                                  uint32_t batch, double timeout_s) {
    Impl& m = *impl_;
    if (blocks <= 0 || warps_per_block <= 0 || warps_per_block > 32) throw std::invalid_argument("bad grid");
    if (warps_per_qp <= 0) throw std::invalid_argument("warps_per_qp must be > 0");
    if (batch < 1 || batch > kMaxBatch || posts_per_warp % batch) throw std::invalid_argument("batch must be 1..8 and divide posts_per_warp");
    check(cudaSetDevice(m.device), "cudaSetDevice");
    // Fresh QP state for every run: counters at zero, every CQE invalid and owned by hardware.
    std::memset(m.h_ctrl, 0, m.ctrl_bytes);
    std::vector<Qp> ctx(m.num_qps);
    std::vector<SinkQueue> queues;
    uint8_t* d_ctrl = nullptr;
    check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_ctrl), m.h_ctrl, 0), "cudaHostGetDevicePointer");
    auto dev = [&](void* host) { return d_ctrl + (reinterpret_cast<uint8_t*>(host) - m.h_ctrl); };
    for (int q = 0; q < m.num_qps; ++q) {
        prm::Cqe64* cqes = m.cq(q);
        for (uint32_t i = 0; i < (1u << m.log_cq); ++i) cqes[i].op_own = (prm::kCqeInvalid << 4) | 1;
        Qp& c = ctx[q];
        std::memset(&c, 0, sizeof(c));
        c.qpn = 0x100 + q;
        c.log_sq = m.log_sq;
        c.sq = m.d_rings + (size_t)q * (64u << m.log_sq);
        c.dbrec = reinterpret_cast<uint32_t*>(dev(m.dbrec(q)));
        c.bf = dev(m.bf(q));
        c.bf_size = kBfSize;
        c.cq.cqes = reinterpret_cast<prm::Cqe64*>(dev(cqes));
        c.cq.dbrec = reinterpret_cast<uint32_t*>(dev(m.cq_dbrec(q)));
        c.cq.log_size = m.log_cq;
        SinkQueue sq{};
        sq.qpn = c.qpn;
        sq.qp_dbrec = m.dbrec(q);
        sq.cqes = cqes;
        sq.log_cq = m.log_cq;
        queues.push_back(sq);
    }
    check(cudaMemcpy(m.d_qps, ctx.data(), sizeof(Qp) * m.num_qps, cudaMemcpyHostToDevice), "copy qp contexts");
    const int warps = blocks * warps_per_block;
    int* d_status = nullptr;
    unsigned long long* d_doorbells = nullptr;
    check(cudaMalloc(&d_status, sizeof(int) * warps), "cudaMalloc status");
    check(cudaMalloc(&d_doorbells, sizeof(unsigned long long)), "cudaMalloc doorbells");
    check(cudaMemset(d_doorbells, 0, sizeof(unsigned long long)), "memset");
    CompletionSink sink(queues);
    sink.start();
    cudaEvent_t t0, t1;
    check(cudaEventCreate(&t0), "event");
    check(cudaEventCreate(&t1), "event");
    const uint64_t laddr = reinterpret_cast<uint64_t>(m.d_scratch);
    check(cudaEventRecord(t0), "record");
    post_rate_kernel<<<blocks, warps_per_block * 32>>>(m.d_qps, m.num_qps, warps_per_qp, posts_per_warp, batch, laddr,
                                                        0x10000000ull, d_status, d_doorbells,
                                                        (uint64_t)(timeout_s * 1e9));
    check(cudaGetLastError(), "post_rate_kernel launch");
    check(cudaEventRecord(t1), "record");
    const cudaError_t sync = cudaEventSynchronize(t1);
    sink.stop();
    check(sync, "post_rate_kernel");
    PostRateResult r;
    float ms = 0;
    check(cudaEventElapsedTime(&ms, t0, t1), "elapsed");
    r.elapsed_ms = ms;
    r.posts = (uint64_t)warps * posts_per_warp;
    std::vector<int> status(warps);
    check(cudaMemcpy(status.data(), d_status, sizeof(int) * warps, cudaMemcpyDeviceToHost), "copy status");
    unsigned long long rung = 0;
    check(cudaMemcpy(&rung, d_doorbells, sizeof(rung), cudaMemcpyDeviceToHost), "copy doorbells");
    r.doorbells = rung;
    r.sink_cqes = sink.cqes_written();
    for (int s : status) r.errors += (s != kOk);
    if (r.errors) {
        check(cudaMemcpy(ctx.data(), m.d_qps, sizeof(Qp) * m.num_qps, cudaMemcpyDeviceToHost), "copy qp contexts");
        for (const Qp& c : ctx) {
            if (c.err.valid) {
                r.first_error = "qpn " + std::to_string(c.qpn) + ": error kind " + std::to_string(c.err.kind) +
                                " syndrome " + std::to_string(c.err.syndrome);
                break;
            }
        }
    }
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
    cudaFree(d_status);
    cudaFree(d_doorbells);
    return r;
}

}  // namespace gda
}  // namespace pyep
