#include "mlx5gda/completion_sink.h"

#include "mlx5gda/portable.h"
#include "mlx5gda/wqe.h"

namespace pyep {
namespace gda {

CompletionSink::CompletionSink(std::vector<SinkQueue> queues) : queues_(std::move(queues)) {}

CompletionSink::~CompletionSink() { stop(); }

void CompletionSink::start() {
    if (running_.exchange(true)) return;
    thread_ = std::thread([this] {
        while (running_.load(std::memory_order_relaxed)) {
            if (progress_once() == 0) spin_pause();
        }
    });
}

void CompletionSink::stop() {
    if (!running_.exchange(false)) return;
    if (thread_.joinable()) thread_.join();
}

uint64_t CompletionSink::progress_once() {
    uint64_t written = 0;
    for (SinkQueue& q : queues_) {
        // The DBR holds the low 16 bits of the producer index, big-endian (MLX5_SND_DBR).
        const uint32_t raw = __atomic_load_n(&q.qp_dbrec[prm::kSendDbr], __ATOMIC_ACQUIRE);
        const uint16_t pi16 = (uint16_t)be32toh_(raw);
        const uint16_t delta = (uint16_t)(pi16 - (uint16_t)q.sq_pi);
        if (delta == 0) continue;
        q.sq_pi += delta;
        const uint32_t mask = (1u << q.log_cq) - 1;
        prm::Cqe64* cqe = &q.cqes[q.cq_pi & mask];
        DecodedCqe d{};
        d.opcode = prm::kCqeReq;
        d.wqe_counter = (uint16_t)(q.sq_pi - 1);
        d.qpn = q.qpn;
        d.wqe_opcode = prm::kOpRdmaWrite;
        encode_cqe_body(cqe, d);
        // Hand the entry over last: op_own carries the owner bit of this pass over the CQ ring.
        const uint8_t owner = (uint8_t)((q.cq_pi >> q.log_cq) & 1);
        __atomic_store_n(&cqe->op_own, cqe_op_own(prm::kCqeReq, owner), __ATOMIC_RELEASE);
        ++q.cq_pi;
        ++q.completions;
        ++written;
        wqes_.fetch_add(delta, std::memory_order_relaxed);
    }
    if (written) cqes_.fetch_add(written, std::memory_order_relaxed);
    return written;
}

}  // namespace gda
}  // namespace pyep

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "mlx5gda/qp.h"

namespace pyep {
namespace gda {

HostPostRateResult run_host_post_rate(int threads, int num_qps, int log_sq, uint32_t posts_per_thread,
                                      uint32_t batch, double timeout_s) {
    if (threads <= 0 || num_qps <= 0 || log_sq < 3 || log_sq > 15 || batch < 1 || batch > 8 ||
        posts_per_thread % batch)
        throw std::invalid_argument("run_host_post_rate: threads/num_qps > 0, log_sq in 3..15, batch 1..8 dividing posts");
    const size_t ring = (size_t)64 << log_sq;
    struct Mem {
        void* p;
        ~Mem() { std::free(p); }
    };
    const size_t per_qp = ring /*sq*/ + ring /*cq*/ + 64 /*dbr*/ + 64 /*cq dbr*/ + 512 /*bf*/;
    Mem mem{std::aligned_alloc(64, per_qp * num_qps)};
    std::memset(mem.p, 0, per_qp * num_qps);
    std::vector<Qp> qps(num_qps);
    std::vector<SinkQueue> queues;
    for (int q = 0; q < num_qps; ++q) {
        uint8_t* base = static_cast<uint8_t*>(mem.p) + per_qp * q;
        Qp& c = qps[q];
        std::memset(&c, 0, sizeof(c));
        c.qpn = 0x200 + q;
        c.log_sq = log_sq;
        c.sq = base;
        c.cq.cqes = reinterpret_cast<prm::Cqe64*>(base + ring);
        c.dbrec = reinterpret_cast<uint32_t*>(base + 2 * ring);
        c.cq.dbrec = reinterpret_cast<uint32_t*>(base + 2 * ring + 64);
        c.bf = base + 2 * ring + 128;
        c.bf_size = 256;
        c.cq.log_size = log_sq;
        for (uint32_t i = 0; i < (1u << log_sq); ++i) c.cq.cqes[i].op_own = (prm::kCqeInvalid << 4) | 1;
        SinkQueue sq{};
        sq.qpn = c.qpn;
        sq.qp_dbrec = c.dbrec;
        sq.cqes = c.cq.cqes;
        sq.log_cq = log_sq;
        queues.push_back(sq);
    }
    CompletionSink sink(queues);
    sink.start();
    std::atomic<int> errors{0};
    std::atomic<uint64_t> max_out{0};
    const uint64_t timeout_ns = (uint64_t)(timeout_s * 1e9);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
        workers.emplace_back([&, t] {
            Qp* qp = &qps[t % num_qps];
            WorkRequest wrs[8];
            for (uint32_t i = 0; i < batch; ++i) {
                wrs[i].opcode = prm::kOpRdmaWrite;
                wrs[i].length = 64;
                wrs[i].lkey = 1;
                wrs[i].rkey = 2;
            }
            for (uint32_t done = 0; done < posts_per_thread; done += batch) {
                if (post_batch(qp, wrs, batch, timeout_ns) != kOk) {
                    errors.fetch_add(1);
                    return;
                }
                const uint64_t out = load_acquire_u64(&qp->ready) - load_acquire_u64(&qp->cons);
                uint64_t prev = max_out.load();
                while (out > prev && !max_out.compare_exchange_weak(prev, out)) {}
            }
        });
    }
    for (auto& w : workers) w.join();
    const auto t1 = std::chrono::steady_clock::now();
    sink.stop();
    HostPostRateResult r;
    r.elapsed_s = std::chrono::duration<double>(t1 - t0).count();
    r.posts = (uint64_t)threads * posts_per_thread;
    r.sink_cqes = sink.cqes_written();
    r.errors = errors.load();
    r.max_outstanding = max_out.load();
    return r;
}

}  // namespace gda
}  // namespace pyep
